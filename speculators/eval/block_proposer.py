"""Offline drafting with a parallel drafter: the whole block in one drafter forward per verifier step.

`DFlashProposer` implements the evaluator's Proposer (speculators.eval.evaluate): it keeps each draft layer's
context keys/values of the verified tokens (what vLLM writes into the draft KV cache), extends them with the
verifier states of the tokens verified since the last step, and drafts K tokens from one block
[bonus, mask x K] at the positions after the last verified token. Rejected drafts never enter the context:
only verified tokens have verifier states.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculators.errors import SpeculatorsError

if TYPE_CHECKING:
    import torch

    from speculators.models.dflash import DFlashDrafter, KeyValues


class DFlashProposer:
    """A DFlash drafter and its context keys/values, kept in step with the verified sequence."""

    name = "dflash"

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.aux_layer_ids = list(drafter.config.aux_hidden_state_layer_ids)
        self.context: list[KeyValues] | None = None
        self.positions: list[int] | None = None

    def start(self, prompt_ids: list[int], reference: list[int], positions: list[int] | None = None) -> None:
        self.context = None
        self.positions = positions

    def token_position(self, index: int) -> int:
        """The rotary position of token `index`: its index for text, the stored position with images (after
        the prompt, one more per token)."""
        if self.positions is None:
            return index
        prompt = self.positions
        return prompt[index] if index < len(prompt) else prompt[-1] + index - len(prompt) + 1

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        import torch

        if new_aux is None:
            raise SpeculatorsError("the DFlash drafter reads aux layers; the evaluator passed no verifier states")
        if num_tokens > self.drafter.config.speculative_tokens:
            raise SpeculatorsError(
                f"{num_tokens} draft tokens asked of a DFlash drafter whose block holds "
                f"{self.drafter.config.speculative_tokens}; pass --num-speculative-tokens "
                f"{self.drafter.config.speculative_tokens} or fewer"
            )
        last = len(tokens) - 1  # the bonus token: the verifier's newest output, not yet a context state
        first = last - new_aux.shape[1]
        positions = torch.tensor([self.token_position(u) for u in range(first, last)], device=self.drafter.d2t.device)
        with torch.no_grad():
            states = self.drafter.context_states(new_aux[0].to(self.drafter.fc.weight.dtype))
            new_context = self.drafter.context_key_values(states, positions)
        if self.context is None:
            self.context = new_context
        else:
            self.context = [
                (torch.cat([k, new_k], dim=2), torch.cat([v, new_v], dim=2))
                for (k, v), (new_k, new_v) in zip(self.context, new_context, strict=True)
            ]
        bonus_position = self.token_position(last - 1) + 1 if last else 0
        return self.drafter.draft_block(self.context, tokens[-1], bonus_position, num_tokens).tolist()
