"""Where each process of a training run computes: the process group under torchrun, its device and
compute dtype (bf16 autocast where the device has it), the model wrapped for DDP or FSDP2, and sums
all-reduced over the ranks."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from speculators.errors import SpeculatorsError
from speculators.precision import check_cuda_device, native_bf16
from speculators.settings import TrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators.models.eagle3 import Eagle3Drafter


def init_distributed(config: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun."""
    import torch
    import torch.distributed as dist

    world = world_size()
    rank = int(os.environ.get("RANK", "0"))
    device = training_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if config.fsdp and world == 1:
        raise SpeculatorsError("--fsdp shards over several processes; launch with torchrun --nproc-per-node N")
    return rank, world, device


def end_distributed(world: int) -> None:
    """The process group ended, once every rank is done."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    """The processes of the run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def training_device(config: TrainConfig) -> torch.device:
    """This process's device: --device, with auto and cuda meaning cuda:LOCAL_RANK where CUDA is present."""
    import torch

    if config.device == "auto":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    check_cuda_device(config.device)
    # --device cuda: this process's GPU (set_device needs an index)
    return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if config.device == "cuda" else config.device)


def wrap_model(forward: nn.Module, drafter: Eagle3Drafter, world: int, device: torch.device, fsdp: bool) -> nn.Module:
    """The module the loop calls: the objective's `forward` over `drafter`, wrapped for DDP or FSDP2.

    Under FSDP2 each decoder layer and the lm_head are their own units (the lm_head is applied
    outside the forward, where the loss looks) and the forward module is the root, so the fc and
    norms stay gathered for the whole forward.
    """
    if world == 1:
        return forward
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(drafter.lm_head, mesh=mesh)
        fully_shard(forward, mesh=mesh)  # in place: the same module, now an FSDPModule too
        return forward
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sums(sums: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    if world == 1:
        return sums
    import torch.distributed as dist

    for value in sums.values():
        dist.all_reduce(value)
    return sums


def uses_bf16(config: TrainConfig, device: torch.device) -> bool:

    if config.precision != "auto":
        return config.precision == "bf16"
    return device.type in ("cpu", "cuda") and native_bf16(device.type)


def autocast_context(config: TrainConfig, device: torch.device) -> AbstractContextManager[None]:
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(config, device) else nullcontext()
