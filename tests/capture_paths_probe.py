"""Captures the same samples with one vLLM engine through both capture paths and writes their shards:

  python -m tests.capture_paths_probe VERIFIER SAMPLES.jsonl OUT

- old: the worker copies fp32 states out and the host casts (or quantizes) them when it writes the shard,
  as capture did before the cast moved to the device (VllmCapture with storage float32);
- new: the worker casts each layer to the store's format before the copy (storage = the store's).

For each store format (bfloat16, fp8_e4m3) each path writes OUT/<path>-<format>/ through datagen's own
capture_missing; OUT/dtypes.json says what each path handed the host (the dtype of the first prompt's states),
OUT/threads.json this process's torch threads before, while and after the engine runs.
The verifier runs in fp32, so the bf16 cast and the fp8 quantization are real work on either side.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from speculators.data.capture import capture_missing, plan_batches, sample_keys
from speculators.data.capture_vllm import VllmCapture
from speculators.data.store import Fp8States, HiddenStateStore
from speculators.data.tokenization import read_samples
from speculators.verifier.loading import VerifierFacts

AUX = [0, 2, 4]


def main(verifier: str, samples_path: str, out: str) -> None:
    threads_before = torch.get_num_threads()
    facts = VerifierFacts.from_source(verifier, dtype="float32")
    samples = read_samples(samples_path)
    capture_ids = [*AUX, facts.num_layers]
    longest = max(len(s.input_ids) for s in samples)
    capture = VllmCapture(verifier, capture_ids, "float32", max_model_len=longest + 1, max_batch_tokens=3 * longest)
    batches = plan_batches(samples, 3)
    dtypes = {}
    for storage in ("bfloat16", "fp8_e4m3"):
        keys = sample_keys(facts.states_fingerprint, capture_ids, storage, samples)
        for path, recorded in (("old", "float32"), ("new", storage)):
            capture.record_as(recorded)
            first = capture([samples[0].input_ids])[0]
            dtypes[f"{path}-{storage}"] = str((first.values if isinstance(first, Fp8States) else first).dtype)
            store = HiddenStateStore(Path(out) / f"{path}-{storage}")
            # (a plain function: capture_missing closes a capture that has close(), and this engine serves four)
            written, _, _ = capture_missing(
                samples, keys, batches, store, facts, storage, lambda: capture.capture, False, time.perf_counter()
            )
            assert len(written) == len(samples), written
    threads = {"engine up": torch.get_num_threads()}
    capture.close()
    threads["engine closed"] = torch.get_num_threads()
    (Path(out) / "dtypes.json").write_text(json.dumps(dtypes))
    (Path(out) / "threads.json").write_text(json.dumps({"before": threads_before, **threads}))
    print("capture paths probe: 4 stores written", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
