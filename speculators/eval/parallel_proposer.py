"""The offline evaluator's proposer for parallel drafters: K draft tokens from one drafter forward per verifier
step (P-EAGLE, as vLLM drafts with `parallel_drafting`; docs/peagle.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from speculators.eval.evaluate import DrafterProposer

if TYPE_CHECKING:
    import torch

    from speculators.models.peagle import PEagleDrafter


class PEagleProposer(DrafterProposer):
    """A P-EAGLE drafter with its own KV cache of the verified positions: each step feeds the positions the
    verifier has just verified, then the bonus slot and K-1 mask slots, in one forward (the mask slots' keys
    are never kept: the next step's tokens take their places)."""

    name = "peagle"
    drafter: PEagleDrafter

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        import torch

        assert self.cache is not None, "start() comes before propose()"
        assert new_aux is not None, "the drafter reads aux layers"
        seen = new_aux.shape[1]
        next_ids = torch.tensor([tokens[-seen:]])
        positions = self.position_ids(len(tokens) - 1 - seen, seen)
        past = [self.cache.get(i) for i in range(len(self.cache.layers))]
        drafted, new_kv = self.drafter.parallel_draft(
            new_aux.to(self.drafter.fc.weight.dtype), next_ids, num_tokens, positions, past
        )
        for layer, kv in enumerate(new_kv):
            self.cache.append(layer, kv)
        return drafted[0].tolist()
