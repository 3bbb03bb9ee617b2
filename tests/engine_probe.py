"""Starts vLLM's offline engines as the library does, with torch.cuda's entry points made to raise in this
(the parent) process, and captures one batch whose prefill is forced into several chunks.

  python -m tests.engine_probe VERIFIER PROMPTS.json OUT.safetensors MAX_BATCH_TOKENS

CUDA vLLM forks its engine processes unless CUDA is initialised; a parent that merely asked
torch.cuda.is_available() has poisoned fork (speculators/serving/engine.py). On this CPU nothing can fail
that way, so the probe makes every such call fail loudly instead: an engine start path that still asks
torch.cuda stops here. Two calls stay allowed once PYTORCH_NVML_BASED_CUDA_CHECK=1 is set (`import vllm`
sets it, vllm/env_override.py): is_available() and device_count() then ask NVML and poison nothing,
which is how vLLM's own imports (xgrammar's tvm_ffi) ask. vLLM's own processes (forked children) are
left alone.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CUDA_ENTRY_POINTS = (
    "is_available",
    "device_count",
    "is_bf16_supported",
    "init",
    "_lazy_init",
    "current_device",
    "set_device",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "mem_get_info",
)

NVML_SAFE = ("is_available", "device_count")


def forbid_cuda_in_this_process(set_attribute: Callable[[Any, str, Any], None] = setattr) -> None:
    """`set_attribute`: pytest's monkeypatch.setattr in a test (undone after it)."""
    parent = os.getpid()
    for name in CUDA_ENTRY_POINTS:
        original = getattr(torch.cuda, name)

        def guarded(*args, _name=name, _original=original, **kwargs):
            nvml = _name in NVML_SAFE and os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
            if os.getpid() == parent and not nvml:
                raise AssertionError(f"torch.cuda.{_name}() called in the process that starts vLLM")
            return _original(*args, **kwargs)

        set_attribute(torch.cuda, name, guarded)


def main(verifier: str, prompts_path: str, out: str, max_batch_tokens: int) -> None:
    from safetensors.torch import save_file

    from speculators.data.capture_vllm import VllmCapture
    from speculators.data.regenerate import VllmGenerate
    from speculators.precision import resolve_dtype

    forbid_cuda_in_this_process()
    prompts = json.loads(Path(prompts_path).read_text())
    dtype = resolve_dtype("float32", "vllm")
    capture = VllmCapture(
        verifier, [0, 2, 4, 8], dtype, max_model_len=128, max_batch_tokens=max_batch_tokens, tensor_parallel_size=1
    )
    states = capture(prompts)
    capture.close()
    generate = VllmGenerate(verifier, 4, 0.0, 0, dtype, set(), max_model_len=128)
    answers = generate(prompts[:2])
    generate.close()
    assert all(len(a) == 4 for a in answers), answers
    save_file({f"prompt{i}": s.contiguous() for i, s in enumerate(states)}, out)
    print("engine probe: capture and generation started with torch.cuda forbidden", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
