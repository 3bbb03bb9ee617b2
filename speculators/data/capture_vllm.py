"""Hidden-state capture inside vLLM (the `vllm` datagen backend), CUDA or CPU build, any TP size.

vLLM's own EAGLE-3 support decides what is captured: every model class that implements
`SupportsEagle3` calls its base model's `_maybe_add_hidden_state(aux, layer_idx, hidden, residual)`
with layer_idx 0 for the embeddings and k + 1 after decoder layer k, and keeps `hidden + residual`
(vLLM defers the residual add) for the ids a drafter asked for. We wrap that call in every vLLM worker
(functions of this module run there through `LLM.collective_rpc`), with `embed_input_ids` for the token
ids, and record the ids we want,
with id N (after the last layer, before the final norm) included. So the states are exactly the
ones vLLM feeds a served drafter, for every family that supports EAGLE-3 (llama, qwen3, qwen3_moe,
gpt_oss, ...), whatever its embedding module is called. vLLM's DeepSeek-V2/V3 model (Mistral Large 3's
too) has no `_maybe_add_hidden_state`: it adds `hidden + residual` itself for the ids it is given in
`aux_hidden_state_layers` and returns them beside its output, so there we give it ours and take them
off. With tensor parallelism the residual stream is all-reduced after every layer, so each rank holds
the full hidden states; only TP rank 0 records them.

Each batch is prefilled once (one sampled token, prefix caching off, eager mode: the hooks record
tensors in Python) and the states come back through `collective_rpc`, already in the store's format: each
layer is cast (or fp8-quantized) where the model ran, before its one copy to the host (record_state), so
the copy and the transfer move the store's bytes, not fp32's. Rows are keyed by request and
position, never by submission order: CUDA vLLM 0.32 runs Model Runner V2, which orders each step's
requests by their scheduled token counts (`sort_batch_req_ids`), and any runner chunks a long prefill
over several steps. (Capture runs eager, so no step is padded for a CUDA graph; rows past a layout's
counts would be padding, and are skipped.) So every forward pass records its batch
layout beside its rows (which request each run of rows belongs to, and from which position), read
from the runner, told apart by class (model_runner_kind): V1 (vLLM 0.32's CPU build by default, CUDA's
fallback) keeps it in its persistent `input_batch` and `query_start_loc`; V2 (CUDA's default, the CPU
build with VLLM_USE_V2_MODEL_RUNNER=1, the only runner from vLLM 0.34) builds an `InputBatch` per step in
`prepare_inputs`, which a probe wraps. `assemble_states` puts the rows back together per request
and matches each request to its prompt by its token ids.

vLLM's own `extract_hidden_states` speculative method is not used: it runs on CUDA only (its KV
connector writes per-request safetensors files through CUDA streams), so no test here could run it;
it refuses MLA verifiers (`ExampleHiddenStatesConnector`) and multimodal inputs (its speculator sets
`supports_mm_inputs = False`), and it keeps states in the model's dtype and writes them to disk
before we read them back. These hooks serve every family on both builds with one code path.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from speculators.data.store import CapturedStates, Fp8States, quantize_fp8
from speculators.errors import SpeculatorsError
from speculators.precision import on_cpu_build
from speculators.serving.engine import shutdown_engine, verifier_engine_kwargs
from speculators.serving.multinode import start_offline_engine
from speculators.verifier.vision import collapse_placeholders, load_image

if TYPE_CHECKING:
    import torch

    from speculators.settings import MultiNode

# Worker-side state: collective_rpc functions run in vLLM's worker processes, where this module is
# imported once per process; each forward pass appends one record (on TP rank 0 only): "layout" (a
# BatchLayout as a dict), "input_ids" and the layer ids -> [rows, H] tensors.
_RECORDS: list[dict[str | int, Any]] = []
_RUNNER: Any = None  # the worker's model runner, whose batch layout each record takes
_V2_LAYOUT: dict[str, list] | None = None  # Model Runner V2: the layout of the step about to run


def record_state(
    record: dict[str | int, Any], layer_id: int, value: torch.Tensor, capture_ids: list[int], storage: str
) -> None:
    """Put one layer's states of a forward pass into its record, cast to the store's format `storage` on the
    device (where the model ran) before the one copy to the host: the copy, and collective_rpc's transfer
    after it, move the store's bytes (bf16: half of fp32's; fp8: values and per-row scales, quantize_fp8's)
    rather than fp32. Casting there or on the host rounds alike, so the shards are bitwise the same. The
    record's host buffer is layer-major ([len(capture_ids), rows, H]): each layer lands in one contiguous
    copy, and the rows of a request are views of it (no stacking on the host)."""
    import torch

    value = value.detach()
    if storage == "fp8_e4m3":
        values, scale = quantize_fp8(value)
    else:
        values, scale = value.to(torch.bfloat16 if storage == "bfloat16" else torch.float32), None
    if "states" not in record:
        record["states"] = torch.empty((len(capture_ids), *values.shape), dtype=values.dtype)
        if scale is not None:
            record["scales"] = torch.empty((len(capture_ids), *scale.shape), dtype=scale.dtype)
    for column, wanted in enumerate(capture_ids):
        if wanted == layer_id:
            record["states"][column].copy_(values)
            if scale is not None:
                record["scales"][column].copy_(scale)
    record["recorded"].append(layer_id)


def batch_layout(req_ids: Sequence[str], starts: Iterable[Any], counts: Iterable[Any]) -> dict[str, list]:
    """Which request each row of one forward pass belongs to: the requests in row order, the position
    of each one's first row this step, and its row count (rows past their sum are padding)."""
    return {"req_ids": list(req_ids), "starts": [int(x) for x in starts], "counts": [int(x) for x in counts]}


def v1_layout(runner: Any) -> dict[str, list]:
    """Model Runner V1's persistent batch: `input_batch` in row order, `query_start_loc` its row
    offsets, `num_computed_tokens_cpu` the positions computed before this step."""
    import numpy as np

    batch = runner.input_batch
    n = batch.num_reqs
    return batch_layout(
        batch.req_ids[:n], batch.num_computed_tokens_cpu[:n], np.diff(runner.query_start_loc.np[: n + 1])
    )


def install_v2_layout_probe(runner: Any) -> None:
    """Model Runner V2 builds each step's InputBatch in `prepare_inputs` (requests sorted by their
    scheduled tokens); keep its layout for the forward pass that follows."""
    import numpy as np

    def prepare_inputs(*args: Any, **kwargs: Any) -> Any:
        global _V2_LAYOUT
        batch = type(runner).prepare_inputs(runner, *args, **kwargs)
        n = batch.num_reqs
        counts = np.diff(batch.query_start_loc_np[: n + 1])
        _V2_LAYOUT = batch_layout(batch.req_ids[:n], batch.num_computed_tokens_np[:n], counts)
        return batch

    runner.prepare_inputs = prepare_inputs  # an instance attribute shadows the method execute_model calls


# vLLM's two model runners, by module: every platform's runner subclasses one of them (CPUModelRunner, XPU's,
# the multimodal encoder's). vLLM 0.32 has both (CUDA runs V2 by default and falls back to V1 with a log line;
# its CPU build runs V1 by default and V2 with VLLM_USE_V2_MODEL_RUNNER=1); 0.34 removed V1.
MODEL_RUNNER_MODULES = {"V2": "vllm.v1.worker.gpu.model_runner", "V1": "vllm.v1.worker.gpu_model_runner"}


@functools.cache
def model_runner_classes() -> dict[str, type | None]:
    """Each model runner's class in the installed vLLM; None for one it does not have."""
    found: dict[str, type | None] = {}
    for kind, module in MODEL_RUNNER_MODULES.items():
        try:
            found[kind] = importlib.import_module(module).GPUModelRunner
        except (ImportError, AttributeError):
            found[kind] = None
    return found


def model_runner_kind(runner: Any, classes: dict[str, type | None] | None = None) -> str:
    """ "V2" or "V1": which of vLLM's model runners `runner` is an instance of (V2 first: neither subclasses
    the other today, and a later V2 built on V1 is still V2). `classes`: model_runner_classes() by default."""
    for kind, cls in (classes or model_runner_classes()).items():
        if cls is not None and isinstance(runner, cls):
            return kind
    raise RuntimeError(
        f"vLLM's model runner {type(runner).__module__}.{type(runner).__name__} is neither Model Runner V1 nor "
        f"V2, whose batch layouts capture reads; capture with --backend transformers"
    )


def runner_is_v2(runner: Any) -> bool:
    return model_runner_kind(runner) == "V2"


def current_layout() -> dict[str, list] | None:
    """The layout of the forward pass now running; None for one the runner made up (a dummy batch)."""
    global _V2_LAYOUT
    if _RUNNER is None:
        return None
    if runner_is_v2(_RUNNER):
        layout, _V2_LAYOUT = _V2_LAYOUT, None
        return layout
    return v1_layout(_RUNNER)


def _tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def language_model_of(model: Any) -> Any:
    """The model whose `.model` is the decoder stack: a vision-language model's language model
    (vLLM: get_language_model()), otherwise the model itself."""
    return model.get_language_model() if hasattr(model, "get_language_model") else model


def install_capture_hooks(capture_ids: list[int], model: Any, storage: str = "float32") -> int:
    """Runs in each worker: records input ids and the requested residual-stream states (cast to `storage`,
    the store's format, on the device: record_state); returns N."""
    base = getattr(language_model_of(model), "model", None)
    needed = ("embed_input_ids", "layers")
    exposes = hasattr(base, "_maybe_add_hidden_state") or hasattr(base, "aux_hidden_state_layers")
    if base is None or not exposes or not all(hasattr(base, name) for name in needed):
        raise RuntimeError(
            f"vLLM's {type(model).__name__} does not expose EAGLE-3 aux hidden states (SupportsEagle3); "
            f"capture this verifier with --backend transformers"
        )
    remove_capture_hooks(model)
    wanted = set(capture_ids)
    recording = _tensor_parallel_rank() == 0

    returned_aux = not hasattr(base, "_maybe_add_hidden_state")

    def embed_input_ids(input_ids: torch.Tensor) -> torch.Tensor:
        # Every forward embeds its token ids first (the compiled-model wrapper skips module hooks).
        embeddings = type(base).embed_input_ids(base, input_ids)
        if recording:
            _RECORDS.append({"layout": current_layout(), "input_ids": input_ids.detach().cpu().clone(), "recorded": []})
            if returned_aux and 0 in wanted:  # id 0, the embeddings (see install_returned_aux_capture)
                record_state(_RECORDS[-1], 0, embeddings, capture_ids, storage)
        return embeddings

    base.embed_input_ids = embed_input_ids
    if returned_aux:
        return install_returned_aux_capture(base, capture_ids, recording, storage)
    original = type(base)._maybe_add_hidden_state

    def maybe_add_hidden_state(
        aux: list[torch.Tensor], layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> list[torch.Tensor]:
        if recording and layer_idx in wanted:
            value = hidden if residual is None else hidden + residual
            record_state(_RECORDS[-1], layer_idx, value, capture_ids, storage)
        return original(base, aux, layer_idx, hidden, residual)

    # Instance attributes shadow the class methods that the model's forward calls.
    base._maybe_add_hidden_state = maybe_add_hidden_state
    return len(base.layers)


def install_returned_aux_capture(base: Any, capture_ids: list[int], recording: bool, storage: str) -> int:
    """For models whose forward adds `hidden + residual` itself for the ids in `aux_hidden_state_layers`
    and returns them beside its output (vLLM's DeepseekV2Model: DeepSeek-V2/V3, Mistral Large 3): ask
    for our ids, record what comes back and return the output alone, as without EAGLE-3. Id 0 (the
    embeddings) is recorded where they are made: this forward adds `hidden + residual` with no residual
    yet there (a TypeError in vLLM; its drafters never ask for id 0)."""
    ids = tuple(sorted(set(capture_ids) - {0}))
    served = base.aux_hidden_state_layers

    def forward(*args: Any, **kwargs: Any) -> Any:
        output = type(base).forward(base, *args, **kwargs)
        if not isinstance(output, tuple):  # a pipeline stage's intermediate tensors
            return output
        hidden, aux = output
        if recording:  # one state per requested id, in increasing id order
            for layer_id, value in zip(ids, aux, strict=True):
                record_state(_RECORDS[-1], layer_id, value, capture_ids, storage)
        return hidden

    forward.served_aux_layers = served  # type: ignore[attr-defined]
    base.aux_hidden_state_layers = ids
    base.forward = forward
    return len(base.layers)


def install_capture(worker: Any, capture_ids: list[int], storage: str = "float32") -> int:
    """Runs in each worker (LLM.collective_rpc): the layout probe on its model runner, the hooks on its
    model (recording states in `storage`, the store's format); returns the verifier's layer count."""
    global _RUNNER
    runner = worker.model_runner
    if runner_is_v2(runner):
        install_v2_layout_probe(runner)
    _RUNNER = runner
    return install_capture_hooks(capture_ids, worker.get_model(), storage)


def model_runner_of(worker: Any) -> str:
    """Runs in each worker: which model runner vLLM chose ("V2", or "V1" where it fell back)."""
    return model_runner_kind(worker.model_runner)


def remove_capture(worker: Any) -> None:
    global _RUNNER, _V2_LAYOUT
    remove_capture_hooks(worker.get_model())
    worker.model_runner.__dict__.pop("prepare_inputs", None)
    _RUNNER, _V2_LAYOUT = None, None


def fetch_capture_records(worker: Any) -> list[dict[str | int, Any]] | None:
    return fetch_records(worker.get_model())


def remove_capture_hooks(model: Any) -> None:
    _RECORDS.clear()
    base = language_model_of(model).model
    for name in ("_maybe_add_hidden_state", "embed_input_ids"):
        base.__dict__.pop(name, None)
    forward = base.__dict__.get("forward")
    if hasattr(forward, "served_aux_layers"):  # ours (install_returned_aux_capture)
        base.aux_hidden_state_layers = forward.served_aux_layers
        del base.forward


def fetch_records(model: Any) -> list[dict[str | int, Any]] | None:
    """TP rank 0's records (None from the other ranks, which record nothing)."""
    records = list(_RECORDS)
    _RECORDS.clear()
    return records if _tensor_parallel_rank() == 0 else None


def assemble_states(
    records: list[dict[str | int, Any]], prompts: list[list[int]], capture_ids: list[int]
) -> list[CapturedStates]:
    """Each prompt's [T, len(capture_ids), H] states (Fp8States for an fp8 store) from the forward passes'
    records, in any row order and any chunking: rows are keyed by (request, position) through each record's
    layout (a position computed twice, as after a preemption, keeps its later row); each request's positions
    must run from 0 without a gap, and its token ids pick its prompt (identical prompts have identical
    states, so either may take either). A row past a prompt's end (a decode step) is ignored. A prompt
    prefilled in one step keeps its rows as views of the record's buffer (no copy on the host)."""
    import torch

    # request -> (start, ids, (states, scales?)), the states [rows, n, H] and scales [rows, n] of one step
    runs: dict[str, list[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]]] = {}
    for record in records:
        layout = record.get("layout")
        if layout is None:  # a batch the runner made up (profiling, a dummy run): no request's rows
            continue
        missing = sorted(set(capture_ids) - set(record["recorded"]))
        if missing:
            raise SpeculatorsError(
                f"a vLLM forward pass recorded no states at layer ids {missing}; this is a bug in capture: capture "
                f"the store with --backend transformers meanwhile"
            )
        columns = [record[name].transpose(0, 1) for name in ("states", "scales") if name in record]
        row = 0
        for req, start, count in zip(layout["req_ids"], layout["starts"], layout["counts"], strict=True):
            chunk = tuple(column[row : row + count] for column in columns)
            runs.setdefault(req, []).append((start, record["input_ids"][row : row + count], chunk))
            row += count
    states: dict[str, tuple[torch.Tensor, ...]] = {}
    by_tokens: dict[tuple[int, ...], list[str]] = {}  # a request's tokens from position 0 without a gap
    for req, parts in runs.items():
        length = max(start + len(ids) for start, ids, _ in parts)
        tokens = torch.full((length,), -1, dtype=parts[0][1].dtype)
        filled = torch.zeros(length, dtype=torch.bool)
        one_step = len(parts) == 1 and parts[0][0] == 0
        if one_step:
            states[req] = parts[0][2]
        else:
            states[req] = tuple(column.new_zeros((length, *column.shape[1:])) for column in parts[0][2])
        for start, ids, chunk in parts:  # in forward order: a recomputed position keeps its later row
            end = start + len(ids)
            tokens[start:end], filled[start:end] = ids, True
            if not one_step:
                for whole, piece in zip(states[req], chunk, strict=True):
                    whole[start:end] = piece
        complete = int(filled.long().cumprod(0).sum())
        by_tokens.setdefault(tuple(tokens[:complete].tolist()), []).append(req)
    out: list[CapturedStates] = []
    for index, prompt in enumerate(prompts):
        key = tuple(prompt)
        candidates = by_tokens.get(key)
        if not candidates:  # a request that ran a decode step after its prefill: one position more
            candidates = next(
                (reqs for seq, reqs in by_tokens.items() if reqs and len(seq) == len(key) + 1 and seq[:-1] == key), None
            )
        if not candidates:
            raise SpeculatorsError(
                f"vLLM's forward passes hold no complete run of prompt {index} ({len(prompt)} tokens); this is a "
                f"bug in capture: capture the store with --backend transformers meanwhile"
            )
        req = candidates.pop(0)
        found = [column[: len(prompt)] for column in states[req]]
        out.append(Fp8States(*found) if len(found) == 2 else found[0])
    return out


def capture_engine_kwargs(
    model_dir: str,
    dtype: str,
    max_model_len: int,
    max_batch_tokens: int = 16384,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    nodes: MultiNode | None = None,
) -> dict[str, Any]:
    """The capture engine's `LLM()` arguments on this node (serving.engine.verifier_engine_kwargs): seed 0,
    eager mode, no compilation (mode 0) and no prefix caching, since the hooks record every prompt's
    states in Python; and its batch limits."""

    return verifier_engine_kwargs(
        model_dir,
        dtype,
        quantization,
        seed=0,
        enforce_eager=True,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        nodes=nodes,
        compilation_config={"mode": 0},
        enable_prefix_caching=False,
        # Tokens per engine step; a longer batch, or a longer prompt, is prefilled in chunks (keyed rows).
        max_num_batched_tokens=max_batch_tokens,
        max_num_seqs=min(256, max_batch_tokens),  # vLLM: at most one sequence per batched token
    )


class VllmCapture:
    """Captures [T, len(capture_ids), H] states per prompt with a vLLM engine (TP over `tensor_parallel_size`;
    over several nodes, `nodes`, node rank 0's engine, whose arguments the others follow), in the store's
    format `storage` (cast on the device: record_state; fp8 as Fp8States; float32 keeps every bit of any
    model dtype, as before the cast moved to the device)."""

    def __init__(
        self,
        model_dir: str,
        capture_ids: list[int],
        dtype: str,
        max_model_len: int,
        max_batch_tokens: int = 16384,
        tensor_parallel_size: int = 1,
        image_token_id: int | None = None,
        quantization: str | None = None,
        nodes: MultiNode | None = None,
        storage: str = "float32",
    ):

        self.capture_ids = list(capture_ids)
        self.max_batch_tokens = max_batch_tokens
        self.image_token_id = image_token_id
        kwargs = capture_engine_kwargs(
            model_dir, dtype, max_model_len, max_batch_tokens, tensor_parallel_size, quantization, nodes
        )
        # collective_rpc pickles our functions (install_capture, ...) to the worker processes, which vLLM allows
        # only with this set (set before the plan, which carries it to the other nodes).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.llm = start_offline_engine(kwargs, nodes)
        self.host_threads: int | None = None  # this process's torch threads before the engine's start (close restores)
        if on_cpu_build():
            import torch

            self.host_threads = torch.get_num_threads()
            # vLLM's CPU workers hold this machine's cores (their OpenMP threads bound there; its processes
            # busy-wait on their shared-memory queues for a second after each call): a parallel region here,
            # assembling or writing shards, waits on a thread they deschedule (measured on 2 loaded cores:
            # shard writes 8x slower with two threads than with one).
            torch.set_num_threads(1)
        (num_layers,) = set(self.llm.collective_rpc(install_capture, args=(self.capture_ids, storage)))
        # vLLM falls back from V2 to V1 with only a log line; say which one captures (gpu_check reads it).
        self.model_runner: str = "/".join(sorted(set(self.llm.collective_rpc(model_runner_of))))
        print(f"capture: vLLM's Model Runner {self.model_runner}", flush=True)
        if max(self.capture_ids) > num_layers:
            raise SpeculatorsError(f"layer ids {self.capture_ids} exceed the verifier's {num_layers} layers")

    def record_as(self, storage: str) -> None:
        """Record the states of later prompts in another store format (the hooks installed again)."""
        self.llm.collective_rpc(install_capture, args=(self.capture_ids, storage))

    def close(self) -> None:
        """Stop vLLM's engine processes now rather than at interpreter exit (where its threads abort)."""
        import gc

        self.llm.collective_rpc(remove_capture)
        shutdown_engine(self.llm)
        del self.llm
        gc.collect()
        if self.host_threads is not None:
            import torch

            torch.set_num_threads(self.host_threads)

    def __call__(
        self, prompts: list[list[int]], images: list[list[dict[str, str]]] | None = None
    ) -> list[CapturedStates]:
        return self.capture(prompts, images)

    def capture(
        self, prompts: list[list[int]], images: list[list[dict[str, str]]] | None = None
    ) -> list[CapturedStates]:
        """States of each prompt; a prompt with images holds their expanded placeholders, which are
        collapsed to one per image for vLLM (its processor expands them again from the pixels)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests = []
        for prompt, parts in zip(prompts, images or [[] for _ in prompts], strict=True):
            if not parts:
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                continue
            assert self.image_token_id is not None, "a prompt with images for a text-only verifier"
            request = TokensPrompt(prompt_token_ids=collapse_placeholders(prompt, self.image_token_id))
            request["multi_modal_data"] = {"image": [load_image(part) for part in parts]}
            requests.append(request)
        self.llm.generate(requests, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        records = next(r for r in self.llm.collective_rpc(fetch_capture_records) if r is not None)
        return assemble_states(records, prompts, self.capture_ids)
