"""EAGLE-3 drafter: one (or more) decoder layers fed with three of the verifier's hidden states.

Forward of one draft step (see docs/eagle3.md), verifier hidden size Ht, draft hidden size H:

    aux [T, 3*Ht] --(input_norm | fc_norm)--> fc --> h [T, H]
    e = verifier embedding of the next token
    layer 0:  attention over concat(input_layernorm(e), hidden_norm(h))  (width 2H), residual h
    layers 1..: plain pre-norm decoder layers
    logits = lm_head(norm(out)) over the draft vocab; draft id i means target id i + d2t[i]

The tensor names match the speculators checkpoint format exactly (`fc.weight`, `layers.0.*`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`, optional `embed_tokens.weight`).
"""

from __future__ import annotations

import itertools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from speculators.atomic_io import atomic_directory, holds_json_key
from speculators.errors import SpeculatorsError
from speculators.models.config import DraftLayerConfig, Eagle3Config, rotary_frequencies
from speculators.models.ttt import later_steps_needed
from speculators.models.weights import read_checkpoint
from speculators.settings import CheckpointDtype

# (torch names the dtypes as the checkpoints do: torch.bfloat16, torch.float16, torch.float32)
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in typing.get_args(CheckpointDtype)}


def is_speculator_checkpoint(folder: Path) -> bool:
    """A folder holding a speculators checkpoint (config.json with speculators_model_type): what an
    output may replace without --overwrite."""
    return holds_json_key(folder, "config.json", "speculators_model_type")


class RMSNorm(nn.Module):
    """Llama RMSNorm: statistics in fp32, weight applied in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables from the layer config's rope parameters (default, llama3, yarn, ...)."""

    inv_freq: torch.Tensor  # a buffer

    def __init__(self, config: DraftLayerConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rotary_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, hd]


KeyValues = tuple[torch.Tensor, torch.Tensor]  # [B, kv_heads, T, head_dim] each


def append_kv(past: KeyValues | None, new: KeyValues) -> KeyValues:
    """Keys and values of earlier positions followed by `new` ones (along the position axis)."""
    if past is None:
        return new
    return torch.cat([past[0], new[0]], dim=2), torch.cat([past[1], new[1]], dim=2)


class DraftAttention(nn.Module):
    def __init__(self, config: DraftLayerConfig, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.model_type == "qwen3":  # per-head RMSNorm of queries and keys before rotary
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | TTTMask | None,
        past: KeyValues | None,
    ) -> tuple[torch.Tensor, KeyValues]:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:  # (set together)
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = rotary
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        new_kv = (k, v)
        k, v = append_kv(past, new_kv)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if isinstance(mask, TTTMask):
            out = ttt_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.o_proj(out), new_kv


class DraftMLP(nn.Module):
    def __init__(self, config: DraftLayerConfig):
        super().__init__()
        from transformers.activations import ACT2FN

        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act: nn.Module = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    """Layer 0 attends over [embedding ; hidden] (width 2H); later layers are plain pre-norm layers."""

    def __init__(self, config: DraftLayerConfig, layer_idx: int, norm_before_residual: bool):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_first = layer_idx == 0
        self.norm_before_residual = norm_before_residual
        self.self_attn = DraftAttention(config, 2 * hidden if self.is_first else hidden)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        if self.is_first:
            self.hidden_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | TTTMask | None,
        past: KeyValues | None,
    ) -> tuple[torch.Tensor, KeyValues]:
        if self.is_first:
            normed_hidden = self.hidden_norm(hidden)
            residual = normed_hidden if self.norm_before_residual else hidden
            attn_input = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)
        else:
            residual = hidden
            attn_input = self.input_layernorm(hidden)
        attn_out, new_kv = self.self_attn(attn_input, rotary, mask, past)
        hidden = residual + attn_out
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, new_kv


class DraftKVCache:
    """Per-layer keys/values of the positions the drafter has processed, [B, kv_heads, T, hd]."""

    def __init__(self, num_layers: int):
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    @property
    def length(self) -> int:
        first = self.layers[0]
        return 0 if first is None else first[0].shape[2]

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers[layer_idx]

    def append(self, layer_idx: int, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.layers[layer_idx] = append_kv(self.layers[layer_idx], kv)

    def crop(self, length: int) -> None:
        """Forget positions from `length` on (drafted positions the verifier rejected)."""
        self.layers = [None if kv is None else (kv[0][:, :, :length], kv[1][:, :, :length]) for kv in self.layers]


@dataclass
class DraftOutput:
    logits: torch.Tensor | None  # [B, T, draft_vocab] (None when not asked for)
    normed: torch.Tensor  # [B, T, H], final-norm output: logits = lm_head(normed)
    hidden_states: torch.Tensor  # [B, T, H], fed to the next draft step
    new_key_values: list[tuple[torch.Tensor, torch.Tensor]]  # this call's keys/values per layer


def causal_mask(query_length: int, past_length: int, device: torch.device) -> torch.Tensor:
    """bool [1, 1, Tq, past + Tq]: query i sees every past key and keys up to itself."""
    keys = torch.arange(past_length + query_length, device=device)
    queries = torch.arange(query_length, device=device) + past_length
    return (keys[None, :] <= queries[:, None])[None, None]


@dataclass
class TTTMask:
    """The training-time-test mask in structured form: contiguous document segments of a packed
    sequence (batch 1) plus `step` diagonal key blocks. Same semantics as `ttt_attention_mask`,
    computed in O(sum of squared document lengths) instead of O(T x (step + 1) T). With `queries`,
    the query rows are only those positions (ascending); the step-0 keys still cover every position."""

    segments: list[tuple[int, int]]
    step: int
    queries: torch.Tensor | None = None
    query_spans: list[tuple[int, int]] | None = None  # each segment's query rows (with `queries`)

    @classmethod
    def from_document_ids(cls, document_ids: torch.Tensor, step: int, queries: torch.Tensor | None = None) -> TTTMask:
        if document_ids.shape[0] != 1:
            raise SpeculatorsError("structured TTT attention packs one sequence per batch (batch size 1)")
        ids = document_ids[0]
        starts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist()]
        ends = [*starts[1:], ids.numel()]
        segments = list(zip(starts, ends, strict=True))
        if queries is None:
            return cls(segments, step)
        bounds = torch.searchsorted(queries, torch.tensor(starts + ends[-1:], device=queries.device)).tolist()
        return cls(segments, step, queries, list(itertools.pairwise(bounds)))


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: TTTMask) -> torch.Tensor:
    """Attention of step `mask.step`: causal over step-0 keys inside each document, plus the
    diagonal of every later step's keys. q [B, h, Tq, d] (every position, or `mask.queries`);
    k, v [B, h, T + step x Tq, d]: the step-0 keys of all T positions, then Tq per later step."""
    queries, head_dim = q.shape[2], q.shape[3]
    length = k.shape[2] - mask.step * queries
    scale = head_dim**-0.5
    k0, v0 = k[:, :, :length], v[:, :, :length]
    diag_k = k[:, :, length:].unflatten(2, (mask.step, queries))  # [B, h, step, Tq, d]
    diag_v = v[:, :, length:].unflatten(2, (mask.step, queries))
    diag_scores = (q.unsqueeze(2) * diag_k).sum(-1) * scale  # [B, h, step, Tq]
    outputs = []
    for index, (start, end) in enumerate(mask.segments):
        first, last = (start, end) if mask.query_spans is None else mask.query_spans[index]
        if first == last:
            continue
        if not mask.step and mask.query_spans is None:
            # Step 0 is plain causal attention inside the document: SDPA's fused kernel never
            # materialises the [L, L] scores (2 CPU cores, a 2,048-token pack: 83 -> 47 ms with backward).
            q_doc, k_doc, v_doc = q[:, :, start:end], k0[:, :, start:end], v0[:, :, start:end]
            outputs.append(F.scaled_dot_product_attention(q_doc, k_doc, v_doc, is_causal=True))
            continue
        scores = (q[:, :, first:last] @ k0[:, :, start:end].transpose(-1, -2)) * scale
        if mask.queries is None:
            future = torch.ones(end - start, end - start, dtype=torch.bool, device=q.device).triu(1)
        else:
            keys = torch.arange(start, end, device=q.device)
            future = keys[None, :] > mask.queries[first:last, None]
        scores = scores.masked_fill(future, float("-inf"))
        if mask.step:
            scores = torch.cat([scores, diag_scores[:, :, :, first:last].transpose(-1, -2)], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = probs[..., : end - start] @ v0[:, :, start:end]
        if mask.step:
            weights = probs[..., end - start :].transpose(-1, -2).unsqueeze(-1)  # [B, h, step, L, 1]
            out = out + (weights * diag_v[:, :, :, first:last]).sum(2)
        outputs.append(out)
    return torch.cat(outputs, dim=2) if outputs else torch.zeros_like(q)  # no query rows at all


def ttt_attention_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Training-time-test mask for draft step `step` over a packed batch.

    Keys are [step 0 | step 1 | ... | step `step`], T each. Step-0 keys are causal within a
    document; every later step's block is diagonal (query i sees key i of that step).
    Returns bool [B, 1, T, (step + 1) * T].
    """
    length = document_ids.shape[-1]
    positions = torch.arange(length, device=document_ids.device)
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = positions[None, :] <= positions[:, None]
    blocks = [same_doc & causal[None]]
    diagonal = torch.eye(length, dtype=torch.bool, device=document_ids.device)
    blocks += [diagonal[None].expand_as(blocks[0])] * step
    return torch.cat(blocks, dim=-1)[:, None]


def layer_config_as_saved(layer: dict[str, Any]) -> dict[str, Any]:
    """transformer_layer_config as save_pretrained has always written it: a non-default rope's legacy
    `rope_scaling` also carries rope_theta. (The rotary tables were once built from a transformers config
    made of this dict, which added the key to it in place.) Kept so checkpoints stay byte-for-byte the same;
    readers take rope_theta from rope_parameters or the top level."""
    scaling = layer.get("rope_scaling")
    if not isinstance(scaling, dict) or "rope_theta" in scaling or "rope_theta" not in layer:
        return layer
    return {**layer, "rope_scaling": {**scaling, "rope_theta": layer["rope_theta"]}}


class DraftVocabulary:
    """What every drafter over a draft vocabulary shares (EAGLE-3's, P-EAGLE's, DFlash's): the d2t / t2d
    mapping, lm_head started from the verifier's rows, and the initial weights. Needs `config`
    (draft_vocab_size, verifier_vocab_size), the buffers `d2t` and `t2d`, and `lm_head`."""

    config: Any
    d2t: torch.Tensor
    t2d: torch.Tensor
    lm_head: nn.Linear

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None) -> None:
        """Linear weights drawn N(0, std) (biases zero), norms at one."""
        for module in cast(nn.Module, self).modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def set_vocab_mapping(self, selected_target_ids: torch.Tensor) -> None:
        """Draft vocab = ascending target ids; d2t[i] = target_id - i, t2d marks the selection."""
        ids = torch.as_tensor(selected_target_ids, dtype=torch.long).flatten()
        if ids.numel() != self.config.draft_vocab_size:
            raise SpeculatorsError(
                f"{ids.numel()} selected token ids for a draft vocab of {self.config.draft_vocab_size}; "
                f"select exactly draft_vocab_size ids"
            )
        if (ids[1:] <= ids[:-1]).any() or ids.min() < 0 or ids.max() >= self.config.verifier_vocab_size:
            raise SpeculatorsError("selected token ids must be strictly ascending ids inside the verifier vocab")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    @torch.no_grad()
    def init_draft_vocab(self, selected_target_ids: torch.Tensor, verifier_lm_head: torch.Tensor) -> None:
        """Set the draft vocab and start lm_head from the verifier's rows at those ids (tied: embeddings)."""
        self.set_vocab_mapping(selected_target_ids)
        self.lm_head.weight.copy_(verifier_lm_head[torch.as_tensor(selected_target_ids)].to(self.lm_head.weight.dtype))


class Eagle3Drafter(DraftVocabulary, nn.Module):
    d2t: torch.Tensor  # buffers: [draft vocab] int64 offsets, [verifier vocab] bool selection
    t2d: torch.Tensor
    config_class: type[Eagle3Config] = Eagle3Config  # the config.json this algorithm's checkpoints hold

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        layer = config.layer  # the draft layers' settings, typed (transformer_layer_config stays the saved form)
        hidden, verifier_hidden, eps = layer.hidden_size, config.verifier_hidden_size, layer.rms_norm_eps
        fc_input = config.num_aux_states * verifier_hidden
        if config.norm_before_fc:
            self.input_norm = RMSNorm(fc_input, eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(verifier_hidden, eps) for _ in range(config.num_aux_states)])
        self.fc = nn.Linear(fc_input, hidden, bias=False)
        self.layers = nn.ModuleList(
            [DraftDecoderLayer(layer, i, config.norm_before_residual) for i in range(layer.num_hidden_layers)]
        )
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(layer)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.verifier_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        # Frozen verifier embeddings, supplied at run time; saved only when asked.
        self.embed_tokens: nn.Embedding | None = None
        self.save_embeddings = False
        self.reset_parameters()

    # ----- construction -------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        self.init_weights(std, None if seed is None else torch.Generator().manual_seed(seed))

    def attach_verifier_embeddings(self, weight: torch.Tensor, save: bool = False) -> None:
        """Use the verifier's (frozen) input embeddings; `save=True` writes them into the checkpoint."""
        expected = (self.config.verifier_vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise SpeculatorsError(
                f"verifier embeddings of shape {tuple(weight.shape)} do not fit this drafter, which "
                f"expects {expected} (verifier vocab, draft hidden); pass the drafter's own verifier"
            )
        self.embed_tokens = nn.Embedding.from_pretrained(weight.detach(), freeze=True)
        self.save_embeddings = save

    # ----- forward ------------------------------------------------------------------------------

    def project_aux(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, T, 3, Ht] or [B, T, 3*Ht] aux states -> fc output [B, T, H]."""
        if aux_hidden_states.dim() == 4:
            aux_hidden_states = aux_hidden_states.flatten(-2)
        if self.config.fc_norm:
            chunks = aux_hidden_states.chunk(self.config.num_aux_states, dim=-1)
            aux_hidden_states = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], -1)
        elif self.config.norm_before_fc:
            aux_hidden_states = self.input_norm(aux_hidden_states)
        return self.fc(aux_hidden_states)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is None:
            raise SpeculatorsError(
                "the drafter has no token embeddings; call attach_verifier_embeddings() with the "
                "verifier's input embedding matrix"
            )
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        compute_logits: bool = True,
    ) -> DraftOutput:
        """One draft step over T positions.

        input_ids [B, T]: the token after each position (the sequence shifted left by one);
        hidden_states [B, T, H]: fc output of the aux states, or the previous step's output;
        attention_mask: bool [B|1, 1, T, past + T], True = attend (default: causal);
        past_key_values: per layer (k, v) of earlier positions, or None.
        """
        if inputs_embeds is None:
            if input_ids is None:
                raise SpeculatorsError("a draft step needs input_ids or inputs_embeds")
            inputs_embeds = self.embed(input_ids)
        embeds = inputs_embeds.to(hidden_states.dtype)
        batch, length, _ = hidden_states.shape
        past = past_key_values or [None] * len(self.layers)
        past_length = 0 if past[0] is None else past[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=hidden_states.device)[None]
        if attention_mask is None and (length > 1 or past_length == 0):
            attention_mask = causal_mask(length, past_length, hidden_states.device)
        rotary = self.rotary(position_ids.expand(batch, -1), hidden_states.dtype)
        new_kv = []
        for layer, layer_past in zip(self.layers, past, strict=True):
            hidden_states, kv = layer(hidden_states, embeds, rotary, attention_mask, layer_past)
            new_kv.append(kv)
        normed = self.norm(hidden_states)
        logits = self.lm_head(normed) if compute_logits else None
        next_hidden = normed if self.config.norm_output else hidden_states
        return DraftOutput(logits=logits, normed=normed, hidden_states=next_hidden, new_key_values=new_kv)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def ttt_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        num_steps: int,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        return_normed: bool = False,
        loss_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Training-time test: logits [B, T, D] for each of `num_steps` draft steps (or, with
        `return_normed`, the final-norm outputs [B, T, H], so a trainer can apply lm_head only
        where the loss looks).

        input_ids [B, T] are the shifted tokens (token t+1 at position t), aux states those of
        position t. Step s feeds the tokens shifted by s more (teacher forcing) with the drafter's
        own hidden output of step s-1, at positions + s; its queries see step-0 keys causally
        within their document and the diagonal of every later step.

        With `loss_mask` (packed batch of one), steps after the first run only on the positions
        some later step scores (a later step's chain feeds nothing but itself); the other
        positions' outputs of those steps are zeros and must not be scored.
        """
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(1, length + 1, device=input_ids.device)[None].expand(batch, -1)
        if document_ids is None:
            document_ids = torch.zeros(batch, length, dtype=torch.long, device=input_ids.device)
        rows = None  # positions computed after step 0 (None: every position)
        if loss_mask is not None and batch == 1 and num_steps > 1:
            rows = later_steps_needed(loss_mask, document_ids, num_steps)[0].nonzero().flatten()
        hidden = self.project_aux(aux_hidden_states)
        past: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        all_outputs = []
        for step in range(num_steps):
            step_ids = F.pad(input_ids[:, step:], (0, step))  # tokens past the end are never scored
            step_positions = position_ids + step
            if step and rows is not None:  # (every rank still runs each layer: FSDP gathers in lockstep)
                step_ids, step_positions = step_ids[:, rows], step_positions[:, rows]
                if step == 1:
                    hidden = hidden[:, rows]
            mask: TTTMask | torch.Tensor
            if batch == 1:
                mask = TTTMask.from_document_ids(document_ids, step, rows if step else None)
            else:
                mask = ttt_attention_mask(document_ids, step)
            out = self(step_ids, hidden, step_positions, mask, past, compute_logits=not return_normed)
            past = [append_kv(old, kv) for old, kv in zip(past, out.new_key_values, strict=True)]
            result = out.normed if return_normed else out.logits
            if step and rows is not None:
                result = result.new_zeros(batch, length, result.shape[-1]).index_copy(1, rows, result)
            all_outputs.append(result)
            hidden = out.hidden_states
        return all_outputs

    @torch.no_grad()
    def propose(
        self,
        aux_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        cache: DraftKVCache,
        num_tokens: int,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Draft `num_tokens` target token ids [B, K] (greedy, chain).

        aux_hidden_states [B, T, 3*Ht] are the verifier's states of the T positions not yet seen by
        the drafter, next_token_ids [B, T] the token after each of them (the last one is the token
        the verifier just produced). The cache grows by T + K - 1 positions; after verification the
        caller crops it back to the verified length. `position_ids` [B, T]: the T positions' rotary
        positions when they are not the cache indices (a verifier with images); drafts follow the last.
        """
        hidden = self.project_aux(aux_hidden_states)
        token_ids = next_token_ids
        drafted = []
        for _ in range(num_tokens):
            past = [cache.get(i) for i in range(len(self.layers))]
            out = self(token_ids, hidden, position_ids, past_key_values=past)
            if position_ids is not None:
                position_ids = position_ids[:, -1:] + 1
            for i, kv in enumerate(out.new_key_values):
                cache.append(i, kv)
            draft_ids = out.logits[:, -1].argmax(-1)
            target_ids = self.draft_to_target(draft_ids)
            drafted.append(target_ids)
            token_ids, hidden = target_ids[:, None], out.hidden_states[:, -1:]
        # The last drafted token was never fed back; nothing of it is in the cache.
        return torch.stack(drafted, dim=1)

    # ----- checkpoint ---------------------------------------------------------------------------

    def checkpoint_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Tensors under their checkpoint names; floats cast to `dtype`, d2t int64, t2d bool."""
        tensors = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("embed_tokens.") and not self.save_embeddings:
                continue
            if tensor.is_floating_point() and dtype is not None:
                tensor = tensor.to(dtype)
            tensors[name] = tensor.detach().contiguous().cpu()
        return tensors

    def save_pretrained(self, directory: str | Path, dtype: str | None = None, overwrite: bool = False) -> Path:
        """Write config.json + model.safetensors as one folder, swapped into place whole
        (atomic_io.atomic_directory: an existing checkpoint is replaced, a user's other folder refused)."""
        from safetensors.torch import save_file

        dtype_name = dtype or self.config.dtype
        if dtype_name not in TORCH_DTYPES:
            raise SpeculatorsError(f"dtype '{dtype_name}' is not one of {', '.join(TORCH_DTYPES)}")
        tensors = self.checkpoint_tensors(TORCH_DTYPES[dtype_name])
        layer = layer_config_as_saved(self.config.transformer_layer_config)
        config = self.config.model_copy(update={"dtype": dtype_name, "transformer_layer_config": layer})
        with atomic_directory(directory, is_speculator_checkpoint, overwrite) as tmp:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config.save(tmp)
        return Path(directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        verifier_embeddings: torch.Tensor | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> Eagle3Drafter:
        """Load our checkpoints and the reference library's (validated; clear error on a problem)."""

        checkpoint = read_checkpoint(directory)
        model = cls(checkpoint.config)
        tensors = dict(checkpoint.tensors)
        embeddings = tensors.pop("embed_tokens.weight", None)
        model.load_state_dict(tensors, strict=True, assign=False)
        if embeddings is not None:
            model.attach_verifier_embeddings(embeddings, save=True)
        elif verifier_embeddings is not None:
            model.attach_verifier_embeddings(verifier_embeddings)
        if isinstance(dtype, str):
            dtype = TORCH_DTYPES[dtype]
        return model.to(dtype or TORCH_DTYPES[checkpoint.config.dtype])
