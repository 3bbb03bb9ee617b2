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

import json
import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from speculators.errors import SpeculatorsError
from speculators.precision import on_cpu_build
from speculators.verifier.architectures import text_config_of
from speculators.verifier.loading import load_verifier_config
from speculators.verifier.mistral_format import vllm_format_kwargs
from speculators.verifier.quantization import vllm_dtype, vllm_quantization_args
from speculators.verifier.vision import MAX_IMAGES_PER_PROMPT, is_vision_language

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from speculators.settings import MultiNode


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


def verifier_engine_kwargs(
    model_dir: str,
    dtype: str,
    quantization: str | None,
    seed: int,
    enforce_eager: bool,
    max_model_len: int,
    tensor_parallel_size: int,
    nodes: MultiNode | None = None,
    compilation_config: dict[str, Any] | None = None,
    **stage: Any,
) -> dict[str, Any]:
    """An offline engine's `LLM()` arguments for the verifier in `model_dir` on this node, the one place
    what every such engine (regeneration's, capture's) names alike is built: the dtype vLLM runs it in
    (vllm_dtype) and its quantization (a scheme this build cannot run fails here, before any engine
    starts), seed, eager mode, maximum length and tensor-parallel size; on vLLM's CPU build an MLA
    verifier's rotary workaround (merged into the stage's `compilation_config`; the key is left out
    when both are empty) and attention backend; a vision-language verifier's image limits and a
    Mistral-format verifier's formats; then `stage`, the stage's own engine arguments, and over
    several nodes offline_engine_kwargs' additions. The other nodes of a multi-node engine start its
    headless workers with the same arguments (speculators/serving/multinode.py)."""

    vllm_quantization_args(quantization)
    config, _ = load_verifier_config(model_dir)  # (read once for the family-specific options below)
    compilation = {**(compilation_config or {}), **cpu_rotary_workaround(config)}
    kwargs = {
        "model": model_dir,
        "dtype": vllm_dtype(dtype, quantization),
        "quantization": quantization,
        "seed": seed,
        "enforce_eager": enforce_eager,
        "max_model_len": max_model_len,
        "tensor_parallel_size": tensor_parallel_size,
        **({"compilation_config": compilation} if compilation else {}),
        **stage,
        **cpu_mla_backend(config),
        **vllm_image_limits(config),
        **vllm_format_kwargs(model_dir),  # a Mistral-format verifier: its config, weights and tokenizer
    }
    return offline_engine_kwargs(kwargs, nodes)


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


def cpu_core_lists(ranks: int, cores: list[int] | None = None) -> list[str]:
    """Disjoint core lists ("0,1") for `ranks` CPU workers, as VLLM_CPU_OMP_THREADS_BIND takes them."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    if len(cores) < ranks:
        raise SpeculatorsError(
            f"{ranks} vLLM CPU workers need {ranks} cores but {len(cores)} are available; lower the tensor or "
            f"data parallel size"
        )
    share = len(cores) // ranks
    return [",".join(map(str, cores[r * share : (r + 1) * share])) for r in range(ranks)]


def cpu_build_defaults(environment: MutableMapping[str, str], kv_cache_gib: int) -> None:
    """vLLM CPU-build settings every engine and server of ours starts with unless set: a KV cache of
    `kv_cache_gib` (vLLM otherwise reserves most of the memory and refuses to start when another
    process holds some) and every core for the model (vLLM keeps one for its scheduler and API server
    otherwise: offline batches 1.7x faster on 2 cores, one served request at a time 1.21x; BENCHMARKS.md) and
    no AOT compile cache: vllm-cpu 0.32 writes it under torch 2.13 but cannot read it back ("'function' object
    has no attribute 'finalize_loading'": its CPU compile mode hands back a plain function) and, while it is on,
    points inductor at a folder of its own, so every server recompiled. Without it torch.compile keeps its own
    caches (inductor's FX graph cache under /tmp/torchinductor_<user>), which serve any graph compiled before:
    an engine of such a configuration starts in 34 s instead of 87 (K = 3 EAGLE-3 on SmolLM2-135M, 2 EPYC cores)."""
    environment.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    environment.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    environment.setdefault("VLLM_USE_AOT_COMPILE", "0")


def configure_cpu_build(tensor_parallel_size: int = 1) -> None:
    """Defaults for vLLM's CPU build: a small KV cache (it otherwise reserves most of the memory and
    refuses to start when another process holds some), every core for the model (offline batches
    need no scheduler core: 1.7x faster on 2 cores, BENCHMARKS.md) and, with tensor parallelism, a
    core set per rank (its automatic binding wants a NUMA node per rank). On the CUDA build: the spawn
    method for its workers (vllm_engine). Explicit settings win; nothing here touches CUDA."""
    prepare_engine_environment()
    if on_cpu_build():
        cpu_build_defaults(os.environ, 2)
        if tensor_parallel_size > 1:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(cpu_core_lists(tensor_parallel_size)))


def config_of(verifier: str | Path | PretrainedConfig) -> PretrainedConfig:
    """A verifier's config: read from its directory, file or hub id, or the config itself."""
    return load_verifier_config(verifier)[0] if isinstance(verifier, str | Path) else verifier


def cpu_rotary_workaround(verifier: str | PretrainedConfig) -> dict[str, Any]:
    """compilation_config entries vLLM's CPU build needs for an MLA verifier (DeepSeek-V2/V3, Mistral
    Large 3): its rotary kernel (`RotaryEmbedding.forward_cpu`, the C++ `rotary_embedding` op) rotates a
    query given as [tokens, heads, rope dims] wrongly when it has more than one head (right for the
    flattened [tokens, heads * head_dim] other models pass), and MLA passes exactly that 3-D view.
    vLLM's PyTorch rotary (`forward_native`) is right, so the kernel is switched off. Measured on the
    tiny DeepSeek-V3: about 1% relative error at every aux id with the kernel, 3e-7 without
    (tests/families/test_deepseek_v3.py). Nothing for CUDA builds or other families."""
    return {"custom_ops": ["-rotary_embedding"]} if cpu_mla(verifier) else {}


def cpu_mla_backend(verifier: str | PretrainedConfig) -> dict[str, str]:
    """The engine argument that keeps an MLA verifier on vLLM's reference CPU MLA backend: on a CPU with
    AMX tiles vLLM otherwise picks its AMX MLA backend (vllm/platforms/cpu.py), whose weight packing
    takes bf16 and fp16 only (an fp32 engine fails at load: "expect weight to be bfloat16, float16,
    ..."), and whose numbers no test here has measured. Nothing for CUDA builds or other families."""
    return {"attention_backend": "CPU_MLA"} if cpu_mla(verifier) else {}


def cpu_mla(verifier: str | PretrainedConfig) -> bool:
    """An MLA verifier (DeepSeek-V2/V3, Mistral Large 3) on vLLM's CPU build."""

    if not on_cpu_build():
        return False
    return getattr(text_config_of(config_of(verifier)), "kv_lora_rank", None) is not None


@contextmanager
def vllm_log_file(path: str | Path) -> Iterator[Path | None]:
    """While inside, vLLM's own log lines, from every process of an engine started here, go to `path`
    (appended) rather than the terminal, so a long step shows its progress and results. Yields the
    path, or None when the user configured vLLM's logging (VLLM_LOGGING_CONFIG_PATH,
    VLLM_CONFIGURE_LOGGING=0), which wins. Engine processes read the config from the environment
    when they import vLLM; an already imported vLLM here gets the file handler directly. What the
    engine's processes write to stderr beside their log (Python warnings, C++ warnings such as the
    CPU build's NUMA notice) goes to the same file (`stderr_to`). The environment is restored on
    exit (later servers keep logging to their own files)."""
    import json
    import logging

    if "VLLM_LOGGING_CONFIG_PATH" in os.environ or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        yield None
        return
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    formatter = {"format": "%(levelname)s %(asctime)s %(process)d [%(filename)s:%(lineno)d] %(message)s"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": formatter},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "vllm"}},
        "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
    }
    config_path = path.with_name(path.name + ".config.json")
    config_path.write_text(json.dumps(config))
    # Here the handler goes on now: vLLM logs a few lines while importing, before it reads the config
    # (they would reach the terminal through logging's last-resort handler).
    logger = logging.getLogger("vllm")
    saved, propagate = list(logger.handlers), logger.propagate
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(formatter["format"]))
    for old in saved:
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.propagate = False
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    try:
        with stderr_to(path):
            yield path
    finally:
        os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        for current in list(logger.handlers):
            logger.removeHandler(current)
            current.close()
        for old in saved:
            logger.addHandler(old)
        logger.propagate = propagate


@contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """While inside, file descriptor 2 (what processes started here inherit) and this process's
    Python warnings go to `path`; this process's own `sys.stderr` (progress bars, messages) stays
    where it was."""
    import sys
    import warnings

    sys.stderr.flush()
    saved = os.dup(2)
    log = open(path, "a", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115 (closed below)
    os.dup2(log.fileno(), 2)
    terminal = sys.stderr
    sys.stderr = open(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # noqa: SIM115

    def warning_to_log(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        log.write(warnings.formatwarning(message, category, filename, lineno, line))

    try:
        with warnings.catch_warnings():
            warnings.showwarning = warning_to_log
            yield
    finally:
        sys.stderr.flush()
        sys.stderr.close()
        sys.stderr = terminal
        os.dup2(saved, 2)
        os.close(saved)
        log.close()


@contextmanager
def vllm_log(path: Path, active: bool) -> Iterator[None]:
    """vLLM's log lines to `path` while an offline engine works here (see vllm_log_file), saying where."""
    if not active:
        yield
        return
    with vllm_log_file(path) as written:
        if written:
            print(f"vLLM's log: {written}", flush=True)
        yield


def shutdown_engine(llm: Any) -> None:
    """Stop an offline engine's processes now rather than at interpreter exit (where its threads
    abort and vLLM force-kills the processes, printing to the terminal)."""
    engine = getattr(llm.llm_engine, "engine_core", None)
    if engine is not None and hasattr(engine, "shutdown"):
        engine.shutdown()


def vllm_image_limits(verifier: str | PretrainedConfig) -> dict[str, Any]:
    """vLLM engine options for a vision-language verifier: images only (no video profiling)."""

    if not is_vision_language(config_of(verifier).model_type):
        return {}
    return {"limit_mm_per_prompt": {"image": MAX_IMAGES_PER_PROMPT, "video": 0}}
