"""An independent, plain EAGLE-3 forward written from docs/eagle3.md, for numerical checks.

Functional torch over a dict of checkpoint tensors; shares no code with speculators.models.
"""

from __future__ import annotations

import math

import torch


def rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x, positions, theta):
    # x [heads, T, d]; rotate pairs (i, i + d/2) by position * theta^(-2i/d)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype), torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def causal_attention(w, prefix, x, *, heads, kv_heads, head_dim, eps, theta, qk_norm):
    T = x.shape[0]
    q = (x @ w[prefix + "q_proj.weight"].T).view(T, heads, head_dim)
    k = (x @ w[prefix + "k_proj.weight"].T).view(T, kv_heads, head_dim)
    v = (x @ w[prefix + "v_proj.weight"].T).view(T, kv_heads, head_dim).transpose(0, 1)
    if qk_norm:  # Qwen3: per-head RMSNorm of queries and keys, before rope
        q, k = rms(q, w[prefix + "q_norm.weight"], eps), rms(k, w[prefix + "k_norm.weight"], eps)
    positions = torch.arange(T)
    q, k = rope(q.transpose(0, 1), positions, theta), rope(k.transpose(0, 1), positions, theta)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    outs = []
    for head in range(heads):
        kv = head // (heads // kv_heads)
        scores = (q[head] @ k[kv].T) / math.sqrt(head_dim)
        outs.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[kv])
    return torch.cat(outs, -1) @ w[prefix + "o_proj.weight"].T


def mlp(w, prefix, x):
    gate, up = x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def reference_draft_logits(
    w,
    aux,
    embeds,
    *,
    heads,
    kv_heads,
    head_dim,
    eps,
    theta,
    norm_before_residual,
    norm_before_fc=False,
    fc_norm=False,
    norm_output=False,
    qk_norm=False,
    num_layers=1,
):
    """One causal draft step over a single sequence. aux [T, 3*Ht], embeds [T, H] -> (logits, next hidden)."""
    shape = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps, theta=theta, qk_norm=qk_norm)
    if norm_before_fc:
        aux = rms(aux, w["input_norm.weight"], eps)
    if fc_norm:
        parts = aux.chunk(3, -1)
        aux = torch.cat([rms(p, w[f"fc_norm.{i}.weight"], eps) for i, p in enumerate(parts)], -1)
    h = aux @ w["fc.weight"].T
    p = "layers.0."
    normed_h = rms(h, w[p + "hidden_norm.weight"], eps)
    residual = normed_h if norm_before_residual else h
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"], eps), normed_h], -1)
    h = residual + causal_attention(w, p + "self_attn.", x, **shape)
    h = h + mlp(w, p + "mlp.", rms(h, w[p + "post_attention_layernorm.weight"], eps))
    for index in range(1, num_layers):  # plain pre-norm decoder layers
        p = f"layers.{index}."
        h = h + causal_attention(w, p + "self_attn.", rms(h, w[p + "input_layernorm.weight"], eps), **shape)
        h = h + mlp(w, p + "mlp.", rms(h, w[p + "post_attention_layernorm.weight"], eps))
    out = rms(h, w["norm.weight"], eps)
    return out @ w["lm_head.weight"].T, (out if norm_output else h)
