"""Hidden-state capture inside vLLM (the `vllm` datagen backend), CUDA or CPU build.

Forward hooks are installed in vLLM's worker through `LLM.apply_model`; each prompt is prefilled
once (one sampled token, prefix caching off, eager mode so hooks fire) and the states come back
through `apply_model` again. vLLM's decoder layers return (hidden, residual) with the residual add
deferred, so the residual stream after layer k is their sum: the same vLLM semantics as the
transformers backend (id k < N enters layer k, id N is the last layer's output before the final
norm), and the same store layout.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

from speculators.errors import SpeculatorsError

# Worker-side buffer: apply_model functions run in vLLM's worker process, where this module is
# imported once; each forward pass appends one record.
_RECORDS: list[dict[Any, Any]] = []
_HANDLES: list[Any] = []


def _residual_stream(output: Any) -> Any:
    if isinstance(output, tuple):
        hidden, residual = output[0], (output[1] if len(output) > 1 else None)
        return hidden if residual is None else hidden + residual
    return output


def install_capture_hooks(layer_ids: list[int], model: Any) -> int:
    """Runs in the worker: hooks recording input ids and the requested residual-stream states."""
    base = model.model
    layers = base.layers
    num_layers = len(layers)

    def on_embed(module, args, output):
        _RECORDS.append({"input_ids": args[0].detach().cpu().clone()})
        if 0 in layer_ids:
            _RECORDS[-1][0] = output.detach().float().cpu().clone()

    def after_layer(index: int):
        def hook(module, args, output):
            _RECORDS[-1][index + 1] = _residual_stream(output).detach().float().cpu().clone()

        return hook

    for handle in _HANDLES:
        handle.remove()
    _HANDLES.clear()
    _HANDLES.append(base.embed_tokens.register_forward_hook(on_embed))
    for layer_id in layer_ids:
        if layer_id > 0:
            _HANDLES.append(layers[layer_id - 1].register_forward_hook(after_layer(layer_id - 1)))
    return num_layers


def remove_capture_hooks(model: Any) -> None:
    for handle in _HANDLES:
        handle.remove()
    _HANDLES.clear()
    _RECORDS.clear()


def fetch_records(model: Any) -> list[dict[Any, Any]]:
    records = list(_RECORDS)
    _RECORDS.clear()
    return records


class VllmCapture:
    """Captures [T, len(layer_ids), H] states per prompt with a vLLM engine."""

    def __init__(self, model_dir: str, layer_ids: list[int], dtype: str, max_model_len: int,
                 max_batch_tokens: int = 16384):  # fmt: skip
        try:
            from vllm import LLM
        except ImportError:
            raise SpeculatorsError(
                "the vllm backend needs vLLM; install the project with the 'gpu' extra (CUDA) or 'cpu' extra"
            ) from None
        import torch

        # apply_model ships our hook functions to the worker by reference.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        self.layer_ids = list(layer_ids)
        self.max_batch_tokens = max(max_batch_tokens, max_model_len)
        self.llm = LLM(
            model=model_dir, dtype=dtype, seed=0, enforce_eager=True, enable_prefix_caching=False,
            compilation_config={"mode": 0}, max_model_len=max_model_len,
            max_num_batched_tokens=self.max_batch_tokens, max_num_seqs=256,
        )  # fmt: skip
        (num_layers,) = set(self.llm.apply_model(partial(install_capture_hooks, self.layer_ids)))
        if max(self.layer_ids) > num_layers:
            raise SpeculatorsError(f"aux layer ids {self.layer_ids} exceed the verifier's {num_layers} layers")

    def close(self) -> None:
        """Stop vLLM's engine processes now rather than at interpreter exit (where its threads abort)."""
        import gc

        self.llm.apply_model(remove_capture_hooks)
        engine = getattr(self.llm.llm_engine, "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        del self.llm
        gc.collect()

    def __call__(self, prompts: list[list[int]]) -> list[Any]:
        return self.capture(prompts)

    def capture(self, prompts: list[list[int]]) -> list[Any]:
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if sum(len(p) for p in prompts) > self.max_batch_tokens:
            raise SpeculatorsError(
                f"a datagen batch holds more than {self.max_batch_tokens} tokens; lower --batch-size"
            )
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                          SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # fmt: skip
        records = self.llm.apply_model(fetch_records)[0]
        # One prefill forward (plus none for the single sampled token): ids in submission order.
        ids = torch.cat([r["input_ids"] for r in records])
        expected = torch.tensor([t for p in prompts for t in p])
        if not torch.equal(ids, expected):
            raise SpeculatorsError("vLLM did not prefill the batch in one pass in submission order; lower --batch-size")
        states = torch.stack([torch.cat([r[i] for r in records]) for i in self.layer_ids], dim=1)
        return list(states.split([len(p) for p in prompts]))
