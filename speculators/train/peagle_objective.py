"""P-EAGLE's training objective (docs/peagle.md): COD-sampled depths, each scored against the verifier.

Per pack: depth 0 is EAGLE-3's first step at every position; depth d >= 1 holds the mask slots (a, d) that
`cod_sample` keeps (max(r^d, r_min) of the scored positions, each chain continuing one kept at depth d-1).
Every element is scored against the verifier's distribution at a + d over the draft vocabulary by `--loss`
(forward KL by default, models/draft_losses.py), each depth's mean loss weighted alike, or by D-PACE per
anchor's chain (`--position-weights dpace`). Sums are in models/ttt.py's vocabulary (per depth: kl, count,
correct, and the conditional pair: given every earlier depth of the chain agreed), so logs and summaries
read as EAGLE-3's. Validation keeps every chain and replays parallel decoding: one forward drafts K, the
leading drafts that agree are accepted, the next round starts after the verifier's token (models/ttt.py
replay_decoding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from speculators.models.draft_losses import dpace_total, row_loss
from speculators.models.ttt import replay_decoding, target_distribution, verifier_target_logits
from speculators.settings import TrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators.models.eagle3 import Eagle3Drafter
    from speculators.models.peagle import PEagleDrafter
    from speculators.train.data import Pack

METRICS = ("kl", "count", "correct", "cond_correct", "cond_count")


class PEagleObjective:
    """P-EAGLE: `ttt_steps` depths per pack (COD-sampled by `cod_ratio` / `cod_ratio_min`), equal or D-PACE weights,
    and parallel decoding replayed at the drafter's K."""

    def __init__(self, config: TrainConfig, drafter: Eagle3Drafter, head: tuple[nn.Module, torch.Tensor]):
        self.depths, self.ratio, self.ratio_min, self.seed = (
            config.ttt_steps,
            config.cod_ratio,
            config.cod_ratio_min,
            config.seed,
        )
        self.first_step_everywhere = config.loss_positions == "first-step"
        self.loss_kind, self.position_weights, self.eta = config.loss, config.position_weights, config.lk_eta
        self.lm_head = drafter.lm_head
        self.head = head  # the verifier's final norm and lm_head rows of the draft vocab: the targets
        self.num_tokens = drafter.config.speculative_tokens

    def forward_module(self, drafter: Eagle3Drafter) -> nn.Module:
        import torch

        class PEagleForward(torch.nn.Module):
            def __init__(self, drafter: PEagleDrafter):
                super().__init__()
                self.drafter = drafter

            def forward(
                self,
                input_ids: torch.Tensor,
                aux: torch.Tensor,
                chains: list[torch.Tensor],
                positions: torch.Tensor,
                documents: torch.Tensor,
            ) -> list[torch.Tensor]:
                return self.drafter.cod_forward(input_ids, aux, chains, positions, documents)

        return PEagleForward(cast("PEagleDrafter", drafter))

    def chains(self, pack: Pack, every_chain: bool, draw: int = 0) -> list[torch.Tensor]:
        """The COD-sampled chains of a pack; seeded by the run's seed and `draw` (the pack's place in the run,
        as DFlash's anchors), so a resumed run draws what an uninterrupted one drew and each epoch draws anew."""
        import torch

        from speculators.models.peagle import cod_sample

        ratio, ratio_min = (1.0, 1.0) if every_chain else (self.ratio, self.ratio_min)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + draw)
        return cod_sample(pack.loss_mask, pack.document_ids, self.depths, ratio, ratio_min, generator)

    def scored(
        self, model: nn.Module, pack: Pack, every_chain: bool, first: torch.Tensor | None = None, draw: int = 0
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
        """The loss, the per-depth sums, and per depth the bool [1, T - d] of anchors whose depth-d draft
        is scored and agrees (for the replay)."""
        import torch

        chains = self.chains(pack, every_chain, draw)
        normed = model(pack.input_ids, pack.aux_hidden_states, chains, pack.position_ids, pack.document_ids)
        mask = pack.loss_mask[0].bool()
        depth0 = mask if first is None else first[0].bool()
        needed = mask | depth0
        targets = verifier_target_logits(pack.target_hidden_states[0][needed], *self.head)
        target_p, neg_entropy, target_ids = target_distribution(targets)
        row_of = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
        row_of[needed] = torch.arange(target_p.shape[0], device=needed.device)
        length = mask.numel()
        anchors_of = [depth0.nonzero().flatten(), *chains]
        outputs = [normed[0][0, anchors_of[0]], *(out[0] for out in normed[1:])]
        chain_ok = torch.ones(length, dtype=torch.bool, device=mask.device)
        losses, cross_entropies = [], []
        sums: dict[str, list[torch.Tensor]] = {k: [] for k in METRICS}
        hits = []
        for depth, (anchors, output) in enumerate(zip(anchors_of, outputs, strict=True)):
            rows = row_of[anchors + depth]
            per_row, predicted, cross_entropy = row_loss(
                self.loss_kind, self.lm_head(output), target_p, neg_entropy, target_ids, rows, self.eta
            )
            losses.append(per_row)
            cross_entropies.append(cross_entropy)
            hit = predicted == target_ids[rows]
            count = torch.tensor(anchors.numel(), device=mask.device)
            sums["kl"].append(per_row.sum().detach())  # (named kl before the other losses: the objective's loss)
            sums["count"].append(count)
            sums["correct"].append(hit.sum())
            sums["cond_correct"].append((hit & chain_ok[anchors]).sum())
            sums["cond_count"].append(chain_ok[anchors].sum())
            correct = torch.zeros(length, dtype=torch.bool, device=mask.device)
            correct[anchors] = hit
            chain_ok = chain_ok & correct  # an unscored depth breaks the chain
            hits.append(correct[: length - depth][None])
        if self.position_weights == "dpace":
            total = dpace_total(anchors_of, losses, cross_entropies, num_chains=length)
        else:  # each depth's mean alike
            total = sum((per_row.sum() / max(per_row.numel(), 1) for per_row in losses), target_p.new_zeros(()))
        return total, {k: torch.stack(v).double() for k, v in sums.items()}, hits

    def loss(self, model: nn.Module, pack: Pack, draw: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        first = torch.ones_like(pack.loss_mask) if self.first_step_everywhere else None
        total, sums, _ = self.scored(model, pack, every_chain=False, first=first, draw=draw)
        return total, sums

    def validation_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        import torch

        sums = {k: torch.zeros(self.depths, dtype=torch.float64, device=device) for k in METRICS}
        sums["replay_rounds"] = torch.zeros(1, dtype=torch.float64, device=device)
        sums["replay_accepted"] = torch.zeros(self.num_tokens, dtype=torch.float64, device=device)
        return sums

    def validate_pack(self, model: nn.Module, pack: Pack, in_vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
        _, sums, hits = self.scored(model, pack, every_chain=True)
        if in_vocab is not None:
            sums.update(replay_decoding(hits, pack.loss_mask, pack.document_ids, self.num_tokens, in_vocab))
        return sums
