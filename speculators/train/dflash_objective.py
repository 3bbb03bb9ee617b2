"""DFlash's training objective: blocks at random anchors of a pack, each mask slot scored against the verifier.

Per pack (docs/dflash.md): up to `--max-anchors` anchors, drawn uniformly (a seeded generator per draw, so a
resumed run draws the same) among the pack indices whose block has a scored target. The block at anchor a
starts with the real token input_ids[a] and sees its document's context up to a; mask slot k (1..K) drafts
the token k after the anchor, whose verifier distribution is the target at pack index a + k - 1 (the same
targets EAGLE-3's step k - 1 scores from chain start a). The loss (`--loss`, forward KL by default:
models/draft_losses.py) compares the drafter with the verifier over the draft vocabulary, weighted per slot
by the published decay exp(-(k-1)/gamma) or by D-PACE (arXiv 2605.18810: the detached suffix sum of the
block's smoothed-confidence prefix products).

Validation anchors a block at every pack index, so the slot outputs line up with EAGLE-3's step outputs and
the shared `ttt_loss` / `replay_decoding` give the same metrics and the replayed acceptance.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from speculators.models.draft_losses import dpace_weights, row_loss
from speculators.models.ttt import replay_decoding, target_distribution, ttt_loss, verifier_target_logits
from speculators.settings import TrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators.models.dflash import DFlashDrafter
    from speculators.train.data import Pack

VALIDATION_ANCHORS_PER_FORWARD = 256  # blocks per validation forward (at most): bounds its activations


def scorable_anchors(loss_mask: torch.Tensor, document_ids: torch.Tensor, num_slots: int) -> torch.Tensor:
    """bool [T]: pack indices a whose block has a scored target (some a + k - 1, k = 1..K, in the loss mask
    and in a's document)."""
    import torch

    mask, documents = loss_mask[0].bool(), document_ids[0]
    length = mask.numel()
    scorable = torch.zeros(length, dtype=torch.bool, device=mask.device)
    for slot in range(num_slots):
        span = length - slot
        scorable[:span] |= mask[slot:] & (documents[slot:] == documents[:span])
    return scorable


def draw_anchors(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, num_slots: int, max_anchors: int, seed: int
) -> torch.Tensor:
    """Ascending anchors [N <= max_anchors], uniform among the scorable pack indices, drawn with `seed`."""
    import torch

    candidates = scorable_anchors(loss_mask, document_ids, num_slots).nonzero().flatten()
    if candidates.numel() <= max_anchors:
        return candidates
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(candidates.numel(), generator=generator)[:max_anchors].to(candidates.device)
    return candidates[chosen].sort().values


def slot_weights(cross_entropy: torch.Tensor, scored: torch.Tensor, kind: str, gamma: float) -> torch.Tensor:
    """[N, K] loss weights of the mask slots: exp(-(k-1)/gamma), or D-PACE's (detached, from the soft
    cross-entropy [N, K] of the scored slots)."""
    import torch

    slots = torch.arange(scored.shape[1], device=scored.device, dtype=torch.float32)
    if kind == "decay":
        return torch.exp(-slots / gamma).expand(scored.shape) * scored
    return dpace_weights(cross_entropy, scored)


class DFlashObjective:
    """Blocks at random anchors per pack, their loss to the verifier weighted per slot; validation at every anchor."""

    def __init__(self, config: TrainConfig, drafter: DFlashDrafter, head: tuple[nn.Module, torch.Tensor]):
        self.num_tokens = drafter.config.speculative_tokens  # K mask slots per block
        self.max_anchors, self.seed = config.max_anchors, config.seed
        self.loss_kind, self.gamma = config.weighting, config.dflash_gamma  # the slot weights
        self.loss_name, self.eta = config.loss, config.lk_eta  # the loss per slot (models/draft_losses.py)
        self.lm_head = drafter.lm_head
        self.head = head  # the verifier's final norm and lm_head rows of the draft vocab: the targets
        # Validation forwards per pack: the same number on every rank whatever its pack's length (under FSDP2
        # each forward gathers the layers' weights, so the ranks must run forwards in lockstep).
        self.validation_forwards = math.ceil(config.token_budget / VALIDATION_ANCHORS_PER_FORWARD)

    def forward_module(self, drafter: DFlashDrafter) -> nn.Module:
        import torch

        class DFlashForward(torch.nn.Module):
            def __init__(self, drafter: DFlashDrafter):
                super().__init__()
                self.drafter = drafter

            def forward(
                self,
                input_ids: torch.Tensor,
                aux: torch.Tensor,
                positions: torch.Tensor,
                documents: torch.Tensor,
                anchors: torch.Tensor,
            ) -> torch.Tensor:
                return self.drafter.training_forward(input_ids, aux, positions, documents, anchors)

        return DFlashForward(drafter)

    def loss(self, model: nn.Module, pack: Pack, draw: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The weighted loss of the mask slots of blocks at anchors drawn for `draw` (the pack's place in the run)."""
        import torch

        anchors = draw_anchors(
            pack.loss_mask, pack.document_ids, self.num_tokens, self.max_anchors, self.seed * 1_000_003 + draw
        )
        normed = model(pack.input_ids, pack.aux_hidden_states, pack.position_ids, pack.document_ids, anchors)
        mask, documents = pack.loss_mask[0].bool(), pack.document_ids[0]
        length = mask.numel()
        targets_at = anchors[:, None] + torch.arange(self.num_tokens, device=anchors.device)  # [N, K]
        inside = targets_at < length
        clamped = targets_at.clamp(max=length - 1)
        scored = inside & mask[clamped] & (documents[clamped] == documents[anchors, None])
        target_p, neg_entropy, target_ids = target_distribution(
            verifier_target_logits(pack.target_hidden_states[0][mask], *self.head)
        )
        row_of = torch.full((length,), -1, dtype=torch.long, device=mask.device)
        row_of[mask] = torch.arange(target_p.shape[0], device=mask.device)
        rows = scored.nonzero(as_tuple=True)
        target_rows = row_of[clamped[rows]]
        kl, predicted, row_cross_entropy = row_loss(
            self.loss_name, self.lm_head(normed[rows]), target_p, neg_entropy, target_ids, target_rows, self.eta
        )
        kl_grid = normed.new_zeros(scored.shape, dtype=kl.dtype).index_put(rows, kl)  # (kl: whichever --loss)
        cross_entropy = normed.new_zeros(scored.shape, dtype=kl.dtype).index_put(rows, row_cross_entropy)
        weights = slot_weights(cross_entropy, scored, self.loss_kind, self.gamma)
        counts = scored.sum(0)
        total = ((weights * kl_grid).sum(0) / counts.clamp(min=1)).sum()
        hit = torch.zeros_like(scored).index_put(rows, predicted == target_ids[target_rows])
        return total, slot_sums(kl_grid, scored, hit)

    def validation_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        import torch

        sums = {
            k: torch.zeros(self.num_tokens, dtype=torch.float64, device=device)
            for k in ("kl", "count", "correct", "cond_correct", "cond_count")
        }
        sums["replay_rounds"] = torch.zeros(1, dtype=torch.float64, device=device)
        sums["replay_accepted"] = torch.zeros(self.num_tokens, dtype=torch.float64, device=device)
        return sums

    def validate_pack(self, model: nn.Module, pack: Pack, in_vocab: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """A block at every pack index: slot k's outputs are EAGLE-3's step k - 1 outputs, scored and replayed alike."""
        import torch

        every_index = torch.arange(pack.num_tokens, device=pack.input_ids.device)
        chunks = [
            model(pack.input_ids, pack.aux_hidden_states, pack.position_ids, pack.document_ids, anchors)
            for anchors in every_index.tensor_split(self.validation_forwards)  # (some empty: still a forward)
        ]
        normed = torch.cat(chunks)  # [T, K, H]
        slot_outputs = [normed[:, slot][None] for slot in range(self.num_tokens)]
        targets = verifier_target_logits(pack.target_hidden_states[pack.loss_mask], *self.head)
        decay = math.exp(-1 / self.gamma)
        hits: list[torch.Tensor] = []
        _, sums = ttt_loss(
            slot_outputs,
            targets,
            pack.loss_mask,
            pack.document_ids,
            decay,
            lm_head=self.lm_head,
            hits=hits,
            objective=(self.loss_name, "decay", self.eta),
        )
        if in_vocab is not None:
            sums.update(replay_decoding(hits, pack.loss_mask, pack.document_ids, self.num_tokens, in_vocab))
        return sums


def slot_sums(kl: torch.Tensor, scored: torch.Tensor, hit: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot count sums [K] in the shared vocabulary (models.ttt.summarize): conditional accuracy counts a
    slot whose earlier slots of the same block were all scored and right."""
    import torch

    earlier_ok = torch.cumprod(torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1]], dim=1).int(), dim=1).bool()
    return {
        "kl": kl.detach().sum(0).double(),
        "count": scored.sum(0).double(),
        "correct": hit.sum(0).double(),
        "cond_correct": (hit & earlier_ok).sum(0).double(),
        "cond_count": (scored & earlier_ok).sum(0).double(),
    }
