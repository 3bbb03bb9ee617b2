"""The optimizers of a training run (AdamW, or Muon on the hidden layers' matrices) and the learning-rate
schedule they step at."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from speculators.settings import TrainConfig
from speculators.train.distributed import uses_bf16

if TYPE_CHECKING:
    import torch
    from torch import nn


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup, then linear decay to zero."""
    warmup = max(1, math.ceil(config.warmup * total))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    return config.lr * max(0.0, (total - step) / max(1, total - warmup))


def set_lr(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for optimizer in optimizers:
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> list[torch.optim.Optimizer]:
    import torch

    from speculators.train.muon import Muon

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if config.optimizer == "muon":
        # Muon orthogonalises the hidden layers' matrices only; the output head (lm_head, trained under
        # --train-lm-head) is not a hidden layer (Muon's own guidance) and goes with the norms to AdamW.
        is_hidden_matrix = {n: p.dim() == 2 and not f".{n}".endswith(".lm_head.weight") for n, p in trainable}
        matrices = [p for n, p in trainable if is_hidden_matrix[n]]
        others = [p for n, p in trainable if not is_hidden_matrix[n]]
        # Muon scales its orthogonalised step to AdamW's update size, so one --lr serves both (PyTorch's default
        # scaling gives the drafter's matrices 5-7x smaller steps at the same lr); its iteration runs in the
        # dtype training computes in (bf16 on CPUs without it is ~130x slower than fp32).
        ns_dtype = torch.bfloat16 if uses_bf16(config, device) else torch.float32
        return [
            Muon(matrices, lr=config.lr, weight_decay=config.weight_decay, ns_dtype=ns_dtype),
            adamw(others, config),  # the head, norms and biases train as under --optimizer adamw
        ]
    return [adamw([p for _, p in trainable], config)]


def adamw(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True)
