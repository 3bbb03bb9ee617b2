"""Validation during training: each rank's share of the validation packs, the verifier's greedy token
in the draft vocabulary (what decoding can accept), and the metrics of a pass over them, with decoding
replayed, through the run's objective."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speculators.models.ttt import row_chunks, summarize
from speculators.settings import TrainConfig
from speculators.train.data import PackedStore, to_device
from speculators.train.distributed import all_reduce_sums, autocast_context

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators.train.objectives import Objective
    from speculators.verifier.loading import VerifierHead


def validation_share_of(plan: list[list[int]], rank: int, world: int) -> list[int | None]:
    """The validation packs this rank scores, round by round: every rank runs the same number of
    forwards (FSDP2 gathers parameters in each); None marks a repeat of pack 0 that is not counted."""
    return [start + rank if start + rank < len(plan) else None for start in range(0, len(plan), world)]


def greedy_in_draft_vocab(
    packs: PackedStore, verifier: VerifierHead, selected_ids: torch.Tensor, device: torch.device, rank: int, world: int
) -> dict[int, torch.Tensor]:
    """Per validation pack this rank scores, bool [1, T]: the verifier's greedy token over its whole
    vocabulary (at each supervised position) is in the draft vocabulary. Decoding rejects the other
    drafts however well the draft distribution matches; computed once, the full lm_head is not kept."""
    import torch

    plan = packs.pack_plan(0) if packs.entries else []
    norm, lm_head = verifier.final_norm.float().to(device), verifier.lm_head_weight.to(device)
    in_draft = torch.zeros(verifier.vocab_size, dtype=torch.bool, device=device)
    in_draft[selected_ids.to(device)] = True
    result: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for index in validation_share_of(plan, rank, world):
            if index is None:
                continue
            pack = packs.load_pack(plan[index])
            states = pack.target_hidden_states[pack.loss_mask].to(device)
            greedy = torch.empty(states.shape[0], dtype=torch.long, device=device)
            for rows in row_chunks(states.shape[0]):
                greedy[rows] = (norm(states[rows].float()).to(lm_head.dtype) @ lm_head.T).argmax(-1)
            flags = torch.zeros(pack.loss_mask.shape, dtype=torch.bool, device=device)
            flags[pack.loss_mask.to(device)] = in_draft[greedy]
            result[index] = flags
    return result


def run_validation(
    model: nn.Module,
    objective: Objective,
    packs: PackedStore,
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
    in_vocab: dict[int, torch.Tensor],
) -> dict[str, Any] | None:
    """Validation metrics, with decoding replayed at the drafter's K; every rank scores its share of
    the packs (collective)."""
    import torch

    plan = packs.pack_plan(0) if packs.entries else []
    if not plan:
        return None
    # DDP's forward broadcasts buffers (a collective); validation needs none, so use the inner module.
    forward = getattr(model, "module", model)
    sums = objective.validation_sums(device)
    model.eval()
    with torch.no_grad(), autocast_context(config, device):
        for index in validation_share_of(plan, rank, world):
            pack = to_device(packs.load_pack(plan[index if index is not None else 0]), device)
            step_sums = objective.validate_pack(forward, pack, in_vocab[index] if index is not None else None)
            if index is not None:
                sums = {k: sums[k] + v.to(device) for k, v in step_sums.items()}
    model.train()
    return summarize(all_reduce_sums(sums, world))
