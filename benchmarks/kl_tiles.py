"""The TTT loss over row tiles against the same loss over whole [n x draft vocab] tensors.

Forward + backward of the draft-vocab head and the KL for 3 TTT steps at the shapes of a 2,048-token
SmolLM2 pack (hidden 576, draft vocab 8,192, ~1,500 scored positions per step), bf16 autocast,
interleaved repetitions in one process; prints the median seconds of each and their ratio.

    python benchmarks/kl_tiles.py [--rows 1500] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from speculators.models.ttt import KLFromLogits, target_distribution


class WholeKL(torch.autograd.Function):
    """The previous KLFromLogits: the same math and in-place gradient over whole [n, D] tensors."""

    @staticmethod
    def forward(ctx, logits, target_p, neg_entropy):
        x = logits.to(target_p.dtype)
        lse = torch.logsumexp(x, dim=-1)
        cross = (target_p.unsqueeze(1) @ x.unsqueeze(2)).flatten()
        ctx.save_for_backward(logits, target_p, lse)
        return neg_entropy - cross + lse

    @staticmethod
    def backward(ctx, grad):
        logits, target_p, lse = ctx.saved_tensors
        q = logits.to(target_p.dtype, copy=True).sub_(lse.unsqueeze(-1)).exp_()
        return q.sub_(target_p).mul_(grad.unsqueeze(-1)).to(logits.dtype), None, None


def untiled_step_loss(hidden, head, target_logits):
    """The previous ttt_loss inner loop: whole-tensor passes, target rows gathered as [n, D] copies."""
    target_logp = F.log_softmax(target_logits.float(), dim=-1)
    target_p = target_logp.exp()
    neg_entropy = (target_p * target_logp).sum(-1)
    target_ids = target_logp.argmax(-1)
    rows = torch.arange(target_p.shape[0])
    total = 0.0
    for h in hidden:
        logits = head(h)
        kl = WholeKL.apply(logits, target_p[rows], neg_entropy[rows])
        total = total + kl.mean()
        _ = (logits.argmax(-1) == target_ids[rows]).sum()
    return total


def tiled_step_loss(hidden, head, target_logits):
    target_p, neg_entropy, target_ids = target_distribution(target_logits)
    rows = torch.arange(target_p.shape[0])
    total = 0.0
    for h in hidden:
        kl, predicted = KLFromLogits.apply(head(h), target_p, neg_entropy, rows)
        total = total + kl.mean()
        _ = (predicted == target_ids).sum()
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    head = torch.nn.Linear(576, 8192, bias=False).to(torch.bfloat16).requires_grad_(False)
    target_logits = torch.randn(args.rows, 8192) * 4
    times: dict[str, list[float]] = {"untiled": [], "tiled": []}
    for repeat in range(args.repeats + 1):
        for name, loss_fn in (("untiled", untiled_step_loss), ("tiled", tiled_step_loss)):
            hidden = [torch.randn(args.rows, 576, requires_grad=True) for _ in range(3)]
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(hidden, head, target_logits)
            loss.backward()
            if repeat:  # the first round warms up
                times[name].append(time.perf_counter() - started)
    untiled, tiled = statistics.median(times["untiled"]), statistics.median(times["tiled"])
    print(
        f"TTT loss, 3 steps x {args.rows} scored rows x 8,192 draft vocab, forward + backward, bf16 autocast; "
        f"median of {args.repeats} interleaved repetitions"
    )
    print("| implementation | seconds |\n|---|---|")
    print(f"| whole tensors | {untiled:.3f} |\n| row tiles | {tiled:.3f} |")
    print(f"| ratio whole / tiles | {untiled / tiled:.2f} |")


if __name__ == "__main__":
    main()
