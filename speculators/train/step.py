"""One optimizer step of a training run: the packs each rank takes at the step (aux noise added), their
loss through the run's objective, the gradient clipped and applied at the step's learning rate, and the
stop at a step whose loss or gradient is not finite."""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

from speculators.errors import SpeculatorsError
from speculators.train.data import to_device, with_aux_noise
from speculators.train.distributed import autocast_context
from speculators.train.optim import lr_at, set_lr

if TYPE_CHECKING:
    import torch

    from speculators.train.data import Pack
    from speculators.train.metrics import LogWindow
    from speculators.train.run import Run


def optimizer_step(run: Run, step: int, window: LogWindow) -> None:
    """`grad_accumulation` packs per rank, their gradients clipped and applied at step `step`'s lr."""
    import torch

    config, world, model = run.config, run.world, run.model
    set_lr(run.optimizers, lr_at(step, run.total_steps, config))
    losses: list[tuple[torch.Tensor, list[int], Pack]] = []
    for micro in range(config.grad_accumulation):
        entries = run.plan.pack_of(step, run.rank, micro)  # (speculators.train.plan: the pack-index rule)
        pack = to_device(run.train_packs.load_pack(entries), run.device)
        draw = (step * config.grad_accumulation + micro) * world + run.rank  # the pack's place in the run
        if config.aux_noise:  # seeded by the draw: a resumed run draws the same
            pack = with_aux_noise(pack, config.aux_noise, config.seed, draw)
        sync = micro == config.grad_accumulation - 1 or world == 1
        no_sync = getattr(model, "no_sync", None)  # DDP's
        with nullcontext() if sync or no_sync is None else no_sync(), autocast_context(config, run.device):
            loss, sums = run.objective.loss(model, pack, draw)
            (loss / config.grad_accumulation).backward()
        window.add(sums, pack.num_tokens)
        losses.append((loss.detach(), entries, pack))
    norm = torch.nn.utils.clip_grad_norm_([p for p in run.drafter.parameters() if p.requires_grad], config.grad_clip)
    stop_if_not_finite(run, step, norm, losses)
    for optimizer in run.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def stop_if_not_finite(
    run: Run, step: int, norm: torch.Tensor, losses: list[tuple[torch.Tensor, list[int], Pack]]
) -> None:
    """Stop at the first step whose loss or gradient is not finite, before the optimizer applies it:
    one NaN would otherwise spread through every weight and train a drafter of NaNs. Every rank
    decides alike (one flag all-reduced: one synchronisation per step), and the error names the
    samples whose stored states are not finite, or says that the weights diverged."""
    import torch

    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # (an FSDP2 DTensor)
    finite = torch.isfinite(norm) & torch.stack([torch.isfinite(loss) for loss, _, _ in losses]).all()
    bad = (~finite).to(torch.float32).reshape(1)
    if run.world > 1:
        import torch.distributed as dist

        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    entries = run.train_packs.entries
    broken = [
        entries[index].id
        for _, indices, pack in losses
        for document, index in enumerate(indices)
        if not pack_document_finite(pack, document)
    ]
    where = f"training stopped at step {step + 1}: the loss or its gradient is not finite (gradient norm {norm.item()})"
    if broken:
        raise SpeculatorsError(
            f"{where}; the stored hidden states of sample(s) {', '.join(broken[:5])} are not finite: check the store "
            f"with 'speculators verify-store {run.config.store}' and re-run datagen for them"
        )
    samples = ", ".join(entries[index].id for _, indices, _ in losses for index in indices[:5])
    raise SpeculatorsError(
        f"{where} on samples whose stored states are finite ({samples}): the weights diverged; lower --lr "
        f"(now {run.config.lr:g}) or --grad-clip (now {run.config.grad_clip:g})"
    )


def pack_document_finite(pack: Pack, document: int) -> bool:
    import torch

    rows = pack.document_ids[0] == document
    return bool(
        torch.isfinite(pack.aux_hidden_states[0, rows]).all()
        and torch.isfinite(pack.target_hidden_states[0, rows]).all()
    )
