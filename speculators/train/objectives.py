"""What a drafter trains on, per pack: the seam between the loop and the drafting algorithm.

The loop, validation and checkpoints are shared by every drafter; what differs is the forward a pack
goes through, the loss on its outputs, and how validation replays decoding. One object holds those
three (`Objective`), built from the drafter's algorithm (`objective_for`), and the run reaches the
algorithm only through it. EAGLE-3's is the training-time test (`TTTObjective`, models/ttt.py). Sums
are in the shared vocabulary `models.ttt.summarize` reads (kl, count, correct, cond_correct, cond_count
per draft position; replay_rounds, replay_accepted), so the log, the validation metrics and the
summary read alike for every drafter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from speculators.models.ttt import replay_decoding, ttt_loss, verifier_target_logits
from speculators.settings import TrainConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from speculators.models.eagle3 import Eagle3Drafter
    from speculators.train.data import Pack


class Objective(Protocol):
    """The forward, loss and validation replay of one drafting algorithm."""

    def forward_module(self, drafter: Eagle3Drafter) -> nn.Module:
        """The module the loop calls (before DDP / FSDP2 wrapping); it holds the drafter as `.drafter`
        (checkpoints name the drafter's parameters by that prefix)."""
        ...

    def loss(self, model: nn.Module, pack: Pack, draw: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A training pack's loss (to backpropagate) and its metric sums, through the wrapped `model`; `draw` is
        the pack's place in the run (a seed for what the objective draws at random: a resumed run draws alike)."""
        ...

    def validation_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Zero sums of every metric validation reports (a rank with no pack to count reduces these)."""
        ...

    def validate_pack(self, model: nn.Module, pack: Pack, in_vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A validation pack's metric sums, decoding replayed where `in_vocab` is given (None: a
        repeated pack, run for the collectives, whose sums are not counted)."""
        ...


class TTTObjective:
    """EAGLE-3's training-time test: `ttt_steps` chained draft steps per pack, their `loss` to the verifier's
    distribution (forward KL by default) weighted `step_decay`^s per step or by D-PACE, and decoding replayed at
    the drafter's K."""

    def __init__(self, config: TrainConfig, drafter: Eagle3Drafter, head: tuple[nn.Module, torch.Tensor]):
        self.steps, self.decay = config.ttt_steps, config.step_decay
        self.objective = (config.loss, config.position_weights, config.lk_eta)  # (models/draft_losses.py)
        # first-step: step 0 (computed on every position anyway) scores them all; later steps the answers
        self.first_step_everywhere = config.loss_positions == "first-step"
        self.lm_head = drafter.lm_head  # applied only where the loss looks
        self.head = head  # the verifier's final norm and lm_head rows of the draft vocab: the targets
        self.num_tokens = drafter.config.speculative_tokens  # the K validation replays at

    def forward_module(self, drafter: Eagle3Drafter) -> nn.Module:
        import torch

        class TTTForward(torch.nn.Module):
            def __init__(self, drafter: Eagle3Drafter):
                super().__init__()
                self.drafter = drafter

            def forward(
                self,
                input_ids: torch.Tensor,
                aux: torch.Tensor,
                steps: int,
                positions: torch.Tensor,
                documents: torch.Tensor,
                loss_mask: torch.Tensor,
            ) -> list[torch.Tensor]:
                return self.drafter.ttt_forward(input_ids, aux, steps, positions, documents, True, loss_mask)

        return TTTForward(drafter)

    def forward_pack(self, model: nn.Module, pack: Pack) -> list[torch.Tensor]:
        """The TTT forward (normed outputs of every step) of one pack, through the wrapped model."""
        return model(
            pack.input_ids, pack.aux_hidden_states, self.steps, pack.position_ids, pack.document_ids, pack.loss_mask
        )

    def loss(self, model: nn.Module, pack: Pack, draw: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        normed = self.forward_pack(model, pack)
        first = torch.ones_like(pack.loss_mask) if self.first_step_everywhere else None
        needed = pack.loss_mask if first is None else first
        targets = verifier_target_logits(pack.target_hidden_states[needed], *self.head)
        return ttt_loss(
            normed,
            targets,
            pack.loss_mask,
            pack.document_ids,
            self.decay,
            lm_head=self.lm_head,
            first_step_mask=first,
            objective=self.objective,
        )

    def validation_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        import torch

        sums = {
            k: torch.zeros(self.steps, dtype=torch.float64, device=device)
            for k in ("kl", "count", "correct", "cond_correct", "cond_count")
        }
        sums["replay_rounds"] = torch.zeros(1, dtype=torch.float64, device=device)
        sums["replay_accepted"] = torch.zeros(self.num_tokens, dtype=torch.float64, device=device)
        return sums

    def validate_pack(self, model: nn.Module, pack: Pack, in_vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
        normed = self.forward_pack(model, pack)
        targets = verifier_target_logits(pack.target_hidden_states[pack.loss_mask], *self.head)
        hits: list[torch.Tensor] = []
        _, step_sums = ttt_loss(
            normed,
            targets,
            pack.loss_mask,
            pack.document_ids,
            self.decay,
            lm_head=self.lm_head,
            hits=hits,
            objective=self.objective,
        )
        if in_vocab is not None:
            step_sums.update(replay_decoding(hits, pack.loss_mask, pack.document_ids, self.num_tokens, in_vocab))
        return step_sums


def objective_for(config: TrainConfig, drafter: Eagle3Drafter, head: tuple[nn.Module, torch.Tensor]) -> Objective:
    """The objective that trains `drafter`, by its algorithm (speculators.models.algorithms)."""
    from speculators.models.algorithms import algorithm_named

    objective_class: Callable[..., Objective] = algorithm_named(drafter.config.speculators_model_type).part("objective")
    return objective_class(config, drafter, head)
