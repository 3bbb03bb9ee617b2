"""Muon for the drafter's hidden matrices: momentum whose update is orthogonalised by a Newton-Schulz
iteration (Keller Jordan's quintic), the step scaled to AdamW's update size.

The update is `torch.optim.Muon`'s with `adjust_lr_fn="match_rms_adamw"` (Nesterov momentum 0.95, five
iterations with the same coefficients, decoupled weight decay), written out here because torch always
iterates in bf16, which a CPU without bf16 arithmetic (AVX2 only) computes ~130x slower than fp32; here the
caller picks the dtype (the one training computes in). Under FSDP2 the gradients are DTensors and the
iteration's products run on the whole matrix through DTensor's own redistribution.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import overload

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # (a, b, c) of a x + b (x x^T) x + c (x x^T)^2 x
NS_STEPS = 5
NORM_EPS = 1e-7


def orthogonalize(matrix: torch.Tensor, dtype: torch.dtype, steps: int = NS_STEPS) -> torch.Tensor:
    """An approximately orthogonal matrix with `matrix`'s singular vectors (singular values ~0.7-1.2), in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller square
        x = x.T
    x = x.div(x.norm().clamp(min=NORM_EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Muon on 2-D parameters; `ns_dtype` is the Newton-Schulz iteration's dtype (bf16 where training computes
    in bf16, as torch's own Muon always does; fp32 where the hardware has no fast bf16)."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        super().__init__(params, {**defaults, "ns_steps": ns_steps})
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, got a parameter of shape {tuple(param.shape)}")
        # An attribute, not a group setting: a checkpoint resumed on another machine iterates in that one's dtype.
        self.ns_dtype = ns_dtype

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = orthogonalize(update, self.ns_dtype, group["ns_steps"])
                # match_rms_adamw: an orthogonal [A, B] matrix has RMS 1/sqrt(max(A, B)); AdamW's updates ~0.2
                scale = 0.2 * math.sqrt(max(param.shape[0], param.shape[1]))
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update.to(param.dtype), alpha=-lr * scale)
        return loss
