"""vLLM capture casts to the store's format in the worker (speculators/data/capture_vllm.py, record_state):
the shards it writes are bitwise the ones the old path wrote (fp32 out of the worker, cast on the host),
for a bf16 store and an fp8 one, with the worker handing over the store's dtype. One engine (vLLM's CPU
build) serves both paths, in a process of its own (tests/capture_paths_probe.py), which runs one torch
thread while the engine's workers hold the cores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from speculators.atomic_io import write_jsonl_atomic
from speculators.verifier.loading import load_tokenizer
from tests.unit.data.test_datagen import make_samples

pytestmark = pytest.mark.slow


def test_shards_written_from_states_cast_in_the_worker_equal_the_old_paths_bitwise(tiny_verifier_dir, tmp_path):
    verifier = tiny_verifier_dir("llama")
    write_jsonl_atomic(tmp_path / "samples.jsonl", make_samples(load_tokenizer(verifier), 7))
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, "-m", "tests.capture_paths_probe", str(verifier), str(tmp_path / "samples.jsonl")]
    done = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert json.loads((out / "dtypes.json").read_text()) == {
        "old-bfloat16": "torch.float32",
        "new-bfloat16": "torch.bfloat16",  # half the bytes out of the worker
        "old-fp8_e4m3": "torch.float32",
        "new-fp8_e4m3": "torch.float8_e4m3fn",  # (and one fp32 scale per token and layer)
    }
    threads = json.loads((out / "threads.json").read_text())  # (pytest runs with OMP_NUM_THREADS set or not)
    assert threads["engine up"] == 1 and threads["engine closed"] == threads["before"]  # vLLM's workers own the cores
    for storage in ("bfloat16", "fp8_e4m3"):
        old, new = out / f"old-{storage}", out / f"new-{storage}"
        shards = sorted(p.relative_to(old) for p in old.rglob("*.safetensors"))
        assert len(shards) == 7 and shards == sorted(p.relative_to(new) for p in new.rglob("*.safetensors"))
        for shard in shards:
            assert (old / shard).read_bytes() == (new / shard).read_bytes(), (storage, shard)
        tensors = load_file(new / shards[0])
        stored = {
            name: (t.dtype, tuple(t.shape[1:])) for name, t in tensors.items() if "hidden" in name or "scale" in name
        }
        dtype = torch.bfloat16 if storage == "bfloat16" else torch.float8_e4m3fn
        scales = (
            {"aux_scale": (torch.float32, (3,)), "target_scale": (torch.float32, ())} if storage != "bfloat16" else {}
        )
        assert stored == {"aux_hidden_states": (dtype, (3, 64)), "target_hidden_states": (dtype, (64,)), **scales}
