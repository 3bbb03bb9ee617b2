"""A function vLLM's workers run on the model (`LLM.apply_model`): it must live in an importable module."""

from __future__ import annotations

from typing import Any


def qkv_of_first_layer(model: Any) -> list[list]:
    """The first decoder layer's fused qkv_proj: its fp8 weight and scales (as floats) and its output for a
    fixed bf16 input, as lists (what crosses back from the worker)."""
    import torch

    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, qkv.input_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = qkv(x)
    out = out[0] if isinstance(out, tuple) else out
    weight = qkv.weight.float()
    weight = weight if weight.shape[0] == qkv.output_size_per_partition else weight.t()  # vLLM keeps [K, N]
    return [t.tolist() for t in (weight, qkv.weight_scale.float(), x.float(), out.float())]
