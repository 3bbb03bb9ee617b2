"""Mistral's own checkpoint format in Hugging Face terms: `params.json` -> config dict, tensor names.

Mistral ships some models (Mistral Large 3 among them) as `params.json`, `consolidated*.safetensors`
with Mistral's tensor names and a `tekken.json` tokenizer, and no `config.json`. vLLM reads them with
`--config-format mistral --load-format mistral`. This module gives the same reading without vLLM, so
the steps that read a verifier's config and tensors by Hugging Face names can read such a checkpoint:

- `hf_config_from_params`: the Hugging Face config dict vLLM derives from a `params.json`
  (vllm-project/vllm `vllm/transformers_utils/configs/mistral.py`, `adapt_config_dict`, as in the
  vLLM 0.32 this project runs). Two architectures are mapped: a MoE with shared experts (Mistral
  Large 3: `model_type` deepseek_v3, `MistralLarge3ForCausalLM`, MLA attention) and a dense Mistral
  (`MistralForCausalLM`).
- `hf_tensor_name` (and its table `MISTRAL_TO_HF_TENSORS`): a Mistral tensor name -> the Hugging Face
  checkpoint name of the same tensor (vLLM's `MistralLarge3ForCausalLM.hf_to_vllm_mapper` in
  `vllm/model_executor/models/mistral_large_3.py`, and `MistralForCausalLM.mistral_mapping` /
  `maybe_remap_mistral` in `vllm/model_executor/models/mistral.py`, which older vLLM kept in `llama.py`).
- `needs_rotary_permutation` / `to_hf_rotary_layout`: a dense Mistral's `wq` and `wk` keep each head's
  rotary pairs interleaved, Hugging Face's Mistral rotates halves; `maybe_remap_mistral` reorders
  their rows on load, and so must any other reader. MLA checkpoints need no such reordering: vLLM's
  DeepSeek attention (`deepseek_v2.py`) and transformers' DeepSeek-V3 (`rope_interleave`, default
  true) both apply the rotary embedding to interleaved pairs.

Library code: no Dagster, and torch is never imported here (`to_hf_rotary_layout` only calls the
tensor's own methods).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.errors import SpeculatorsError, shorten

if TYPE_CHECKING:
    import torch

PARAMS_FILE = "params.json"
MISTRAL_LARGE_3_ARCHITECTURE = "MistralLarge3ForCausalLM"
DENSE_ARCHITECTURE = "MistralForCausalLM"
VISION_ARCHITECTURE = "PixtralForConditionalGeneration"

# Mistral key -> Hugging Face key, each a positive integer (`_remap_general_mistral_args`)
GENERAL_INTEGER_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "hidden_dim": "intermediate_size",
    "vocab_size": "vocab_size",
}
DEFAULT_MAX_POSITION_EMBEDDINGS = 128_000  # vLLM's default when params.json names none
# The MLA attention's sizes, the same key in both formats; q_lora_rank may be null (q_proj, no LoRA)
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# `moe` key -> Hugging Face (DeepSeek-V3) key (`_remap_moe_args`)
MOE_KEYS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "expert_hidden_dim": "moe_intermediate_size",
    "num_shared_experts": "n_shared_experts",
    "first_k_dense_replace": "first_k_dense_replace",
    "route_every_n": "moe_layer_freq",
    "num_expert_groups": "n_group",
    "num_expert_groups_per_tok": "topk_group",
}
# `yarn` key -> rope_parameters key, and its type (`_remap_mistral_yarn_args`)
YARN_KEYS: dict[str, tuple[str, type]] = {
    "factor": ("factor", float),
    "original_max_position_embeddings": ("original_max_position_embeddings", int),
    "beta": ("beta_fast", float),
    "alpha": ("beta_slow", float),
}
LLAMA_4_SCALING_KEYS = ("original_max_position_embeddings", "beta")


class _Params:
    """Typed reads of one params.json dict (or one of its sections), each failure one sentence."""

    def __init__(self, values: Mapping[str, Any], source: str, prefix: str = ""):
        self.values, self.source, self.prefix = values, source, prefix

    def fail(self, key: str, problem: str, wanted: str) -> SpeculatorsError:
        return SpeculatorsError(
            f"{shorten(self.source, 200)}: `{self.prefix}{key}` {problem}; a Mistral params.json gives it as "
            f"{wanted} (use the file as the checkpoint ships it)"
        )

    def has(self, key: str) -> bool:
        return self.values.get(key) is not None

    def _get(self, key: str, wanted: str) -> Any:
        if key not in self.values or self.values[key] is None:
            raise self.fail(key, "is missing", wanted)
        return self.values[key]

    def integer(self, key: str, minimum: int = 1) -> int:
        wanted = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        value = self._get(key, wanted)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(key, f"is {shorten(repr(value), 80)}", wanted)
        return value

    def number(self, key: str) -> float:
        value = self._get(key, "a positive number")
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.fail(key, f"is {shorten(repr(value), 80)}", "a positive number")
        return float(value)

    def boolean(self, key: str) -> bool:
        value = self._get(key, "true or false")
        if not isinstance(value, bool):
            raise self.fail(key, f"is {shorten(repr(value), 80)}", "true or false")
        return value

    def text(self, key: str) -> str:
        value = self._get(key, "a string")
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"is {shorten(repr(value), 80)}", "a string")
        return value

    def section(self, key: str) -> _Params:
        value = self._get(key, "an object")
        if not isinstance(value, Mapping):
            raise self.fail(key, f"is {shorten(repr(value), 80)}", "an object")
        return _Params(value, self.source, f"{self.prefix}{key}.")

    def unsupported(self, key: str, what: str) -> SpeculatorsError:
        return SpeculatorsError(
            f"{shorten(self.source, 200)}: `{self.prefix}{key}` says {what}, which this reading of Mistral's "
            f"format does not map (only a dense Mistral and a MoE with shared experts, Mistral Large 3, are)"
        )


def read_params(path: str | Path) -> dict[str, Any]:
    """A checkpoint's params.json (the file, or the folder holding it) as a dict."""
    path = Path(path)
    file = path / PARAMS_FILE if path.is_dir() else path
    try:
        params = json.loads(file.read_text())
    except FileNotFoundError:
        raise SpeculatorsError(
            f"{file} does not exist; give a Mistral-format checkpoint's folder or its params.json"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SpeculatorsError(f"{file} is not readable JSON ({shorten(str(error), 120)}); restore the file") from error
    if not isinstance(params, dict):
        raise SpeculatorsError(f"{file} holds {type(params).__name__}, not a JSON object of Mistral params")
    return params


def hf_config_from_file(path: str | Path) -> dict[str, Any]:
    """`hf_config_from_params` of the params.json at `path` (the file, or the folder holding it)."""
    path = Path(path)
    file = path / PARAMS_FILE if path.is_dir() else path
    return hf_config_from_params(read_params(file), str(file))


def hf_config_from_params(params: Mapping[str, Any], source: str = PARAMS_FILE) -> dict[str, Any]:
    """The Hugging Face config dict vLLM derives from Mistral's `params.json` for the same model.

    Read from vllm-project/vllm `vllm/transformers_utils/configs/mistral.py` (`adapt_config_dict` and its
    `_remap_*` helpers). `source` names the file in error messages; a missing or ill-typed key raises one
    `SpeculatorsError` sentence naming the key and the file.

    - General keys: dim -> hidden_size, n_layers -> num_hidden_layers, n_heads / n_kv_heads ->
      num_attention_heads / num_key_value_heads, hidden_dim -> intermediate_size, norm_eps ->
      rms_norm_eps, activation -> hidden_act (default silu), tied_embeddings -> tie_word_embeddings
      (default false), max_position_embeddings (default 128000) and max_seq_len (default: the former);
      vocab_size, dtype and (a dense model's) head_dim as they are.
    - MoE with shared experts (Mistral Large 3): model_type deepseek_v3, architectures
      [MistralLarge3ForCausalLM]; the `moe` section's keys become DeepSeek-V3's (num_experts ->
      n_routed_experts, expert_hidden_dim -> moe_intermediate_size, num_shared_experts -> n_shared_experts,
      route_every_n -> moe_layer_freq, routed_scale -> routed_scaling_factor, num_expert_groups(_per_tok)
      -> n_group / topk_group; num_experts_per_tok, first_k_dense_replace as they are) and vLLM sets
      scoring_func softmax, norm_topk_prob true, topk_method null. MLA sizes (q_lora_rank, kv_lora_rank,
      qk_nope_head_dim, qk_rope_head_dim, v_head_dim) keep their names, and head_dim, which must be
      qk_nope + qk_rope, is left out (vLLM keeps it unread; transformers' DeepseekV3Config would take it for
      the rotary width, which it derives from qk_rope_head_dim); llama_4_scaling (beta,
      original_max_position_embeddings) is required and kept as is. An MLA model without `moe` gets the
      one-shared-expert, all-layers-dense MoE section vLLM writes for it.
    - Dense Mistral (no `moe`, no MLA): architectures [MistralForCausalLM], model_type mistral (vLLM leaves
      its placeholder "transformer" in a generic config; "mistral" is the type of transformers'
      MistralConfig). A `sliding_window` list becomes layer_types plus one window, as vLLM does.
    - `yarn` -> rope_parameters {rope_type yarn, mscale_all_dim 1, rope_theta, factor,
      original_max_position_embeddings, beta -> beta_fast, alpha -> beta_slow; apply_scale false ->
      attention_factor 1.0}; without yarn, rope_theta stays a top-level key.
    - `quantization_config` passes through; the older `quantization` section becomes one (fp8_e4m3 ->
      quant_method fp8; compressed-tensors passes through).
    - A vision encoder (`vision_encoder`, or `multimodal.vision_encoder_args`) wraps the language model's
      config: model_type pixtral, [PixtralForConditionalGeneration], `text_config` (the dict above) and
      `vision_config` (the encoder's own keys, as vLLM keeps them).

    Unlike vLLM, the Mistral sections that were mapped (`moe`, `yarn`) are not carried into the result.
    """
    if not isinstance(params, Mapping):
        raise SpeculatorsError(f"{shorten(source, 200)} holds {type(params).__name__}, not a JSON object of params")
    p = _Params(params, source)
    multimodal = _supported_multimodal(p)
    config = _general(p)
    _add_architecture(p, config)
    _add_rope_and_quantization(p, config)
    vision_key = "multimodal" if multimodal.get("vision_encoder_args") else "vision_encoder"
    if p.has(vision_key):
        return _with_vision_encoder(config, p.section(vision_key).values)
    return {"model_type": config.pop("model_type"), "architectures": config.pop("architectures"), **config}


def _supported_multimodal(p: _Params) -> Mapping[str, Any]:
    """The `multimodal` section (or {}), once the model is one this reading maps: a language model with an
    optional vision encoder, not another model_type or an audio encoder (Voxtral)."""
    model_type = p.values.get("model_type", "transformer")
    if model_type not in ("transformer", "mistral"):
        raise p.unsupported("model_type", f"{shorten(repr(model_type), 40)}")
    multimodal = p.values.get("multimodal") or {}
    if not isinstance(multimodal, Mapping):
        raise p.fail("multimodal", f"is {shorten(repr(multimodal), 80)}", "an object")
    if (multimodal.get("whisper_model_args") or {}).get("encoder_args"):
        raise p.unsupported("multimodal.whisper_model_args", "an audio encoder (Voxtral)")
    return multimodal


def _general(p: _Params) -> dict[str, Any]:
    """`_remap_general_mistral_args`: sizes, norm epsilon, activation, tied embeddings, positions, head_dim,
    dtype and a sliding window, in Hugging Face's keys."""
    config: dict[str, Any] = {key: p.integer(mistral) for mistral, key in GENERAL_INTEGER_KEYS.items()}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise p.fail("n_kv_heads", f"is {kv_heads}, which does not divide n_heads {heads}", "a divisor of n_heads")
    config["rms_norm_eps"] = p.number("norm_eps")
    config["hidden_act"] = p.text("activation") if p.has("activation") else "silu"
    config["tie_word_embeddings"] = p.boolean("tied_embeddings") if p.has("tied_embeddings") else False
    positions = p.integer("max_position_embeddings") if p.has("max_position_embeddings") else None
    config["max_position_embeddings"] = positions or DEFAULT_MAX_POSITION_EMBEDDINGS
    config["max_seq_len"] = p.integer("max_seq_len") if p.has("max_seq_len") else config["max_position_embeddings"]
    if p.has("head_dim"):
        config["head_dim"] = p.integer("head_dim")
    if p.has("dtype"):
        config["dtype"] = p.text("dtype")
    if p.has("sliding_window"):
        config.update(_sliding_window(p, config["num_hidden_layers"]))
    return config


def _add_architecture(p: _Params, config: dict[str, Any]) -> None:
    """Into `config`: a MoE with shared experts and MLA attention (Mistral Large 3, as DeepSeek-V3), or a
    dense Mistral; its model_type and architectures."""
    mla = bool(p.values.get("qk_nope_head_dim"))
    if mla:
        config.update({key: p.integer(key) for key in MLA_KEYS})
        config["q_lora_rank"] = p.integer("q_lora_rank") if p.has("q_lora_rank") else None
        # head_dim is the query/key width (nope + rope): checked, then left to transformers, whose
        # DeepseekV3Config derives its own head_dim (the rotary width); vLLM's DeepSeek code reads none
        query_key = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        if config.pop("head_dim", query_key) != query_key:
            raise p.fail("head_dim", f"is not qk_nope_head_dim + qk_rope_head_dim = {query_key}", "their sum")
    if p.has("moe") or mla:
        moe = p.section("moe") if p.has("moe") else _Params(_mla_dense_moe(config), p.source, "moe.")
        if moe.integer("num_shared_experts", minimum=0) == 0:
            raise moe.unsupported("num_shared_experts", "0: a MoE without shared experts (Mixtral)")
        config.update(_moe(moe, config["num_hidden_layers"]))
        config["model_type"] = "deepseek_v3"
        config["architectures"] = [MISTRAL_LARGE_3_ARCHITECTURE]
        if not p.has("llama_4_scaling"):
            raise p.fail("llama_4_scaling", "is missing", "an object with beta and original_max_position_embeddings")
    else:
        config["model_type"] = "mistral"
        config["architectures"] = [DENSE_ARCHITECTURE]


def _add_rope_and_quantization(p: _Params, config: dict[str, Any]) -> None:
    """Into `config`: YaRN's rope_parameters or a plain rope_theta, llama_4_scaling, the quantization config."""
    if p.has("yarn"):
        config["rope_parameters"] = _yarn(p, p.values.get("rope_theta"))
    elif p.has("rope_theta"):
        config["rope_theta"] = p.number("rope_theta")
    if p.has("llama_4_scaling"):
        scaling = p.section("llama_4_scaling")
        config["llama_4_scaling"] = {
            "original_max_position_embeddings": scaling.integer("original_max_position_embeddings"),
            "beta": scaling.number("beta"),
        }
    if p.has("quantization"):
        config["quantization_config"] = _quantization(p)
    elif p.has("quantization_config"):
        config["quantization_config"] = dict(p.section("quantization_config").values)


def _with_vision_encoder(config: dict[str, Any], vision: Mapping[str, Any]) -> dict[str, Any]:
    """A vision-language model's config: the language model's `config` as its text_config, the encoder's own
    keys as its vision_config (as vLLM keeps them)."""
    wrapped: dict[str, Any] = {
        "model_type": "pixtral",
        "architectures": [VISION_ARCHITECTURE],
        "text_config": {
            "model_type": config.pop("model_type"),
            "architectures": config.pop("architectures"),
            **config,
        },
        "vision_config": dict(vision),
    }
    if "quantization_config" in config:
        wrapped["quantization_config"] = config["quantization_config"]
    return wrapped


def _sliding_window(p: _Params, layers: int) -> dict[str, Any]:
    """`_remap_mistral_sliding_window`: a per-layer list (null: full attention) repeated over the layers,
    or one window for every layer."""
    window = p.values["sliding_window"]
    if isinstance(window, list) and window:
        sizes = {size for size in window if size is not None}
        if len(sizes) > 1 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
            raise p.fail("sliding_window", f"is {shorten(repr(window), 80)}", "one window size, or null per layer")
        pattern = window * (layers // len(window))
        return {
            "layer_types": ["full_attention" if size is None else "sliding_attention" for size in pattern],
            "sliding_window": next(iter(sizes), None),
        }
    return {"sliding_window": p.integer("sliding_window"), "layer_types": ["sliding_attention"] * layers}


def _mla_dense_moe(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE section vLLM writes for an MLA model without one (`_remap_mistral_mla_args`): every layer
    dense, one shared expert of the dense width."""
    return {
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "expert_hidden_dim": config["intermediate_size"],
        "num_shared_experts": 1,
        "first_k_dense_replace": config["num_hidden_layers"],
        "route_every_n": 1,
        "routed_scale": 1.0,
        "num_expert_groups": 1,
        "num_expert_groups_per_tok": 1,
    }


def _moe(moe: _Params, layers: int) -> dict[str, Any]:
    """`_remap_moe_args`: the `moe` section in DeepSeek-V3's keys, and the routing vLLM sets for it."""
    config: dict[str, Any] = {
        key: moe.integer(mistral, minimum=0 if mistral == "first_k_dense_replace" else 1)
        for mistral, key in MOE_KEYS.items()
    }
    if config["first_k_dense_replace"] > layers:
        raise moe.fail(
            "first_k_dense_replace", f"is {config['first_k_dense_replace']}, over n_layers {layers}", "at most n_layers"
        )
    if config["num_experts_per_tok"] > config["n_routed_experts"]:
        raise moe.fail("num_experts_per_tok", "is over num_experts", "at most num_experts")
    if config["topk_group"] > config["n_group"]:
        raise moe.fail("num_expert_groups_per_tok", "is over num_expert_groups", "at most num_expert_groups")
    config["routed_scaling_factor"] = moe.number("routed_scale")
    config["topk_method"] = None
    config["norm_topk_prob"] = True
    config["scoring_func"] = "softmax"
    return config


def _yarn(p: _Params, rope_theta: Any) -> dict[str, Any]:
    yarn = p.section("yarn")
    rope: dict[str, Any] = {"rope_type": "yarn", "mscale_all_dim": 1}
    if rope_theta:
        rope["rope_theta"] = p.number("rope_theta")
    for mistral, (key, kind) in YARN_KEYS.items():
        if yarn.has(mistral):
            rope[key] = yarn.integer(mistral) if kind is int else yarn.number(mistral)
    if yarn.has("apply_scale") and not yarn.boolean("apply_scale"):
        rope["attention_factor"] = 1.0  # no magnitude correction (transformers' spelling of it)
    unknown = sorted(set(yarn.values) - {*YARN_KEYS, "apply_scale"})
    if unknown:
        raise yarn.fail(
            unknown[0],
            "is no YaRN setting vLLM reads",
            "one of factor, original_max_position_embeddings, beta, alpha, apply_scale",
        )
    return rope


def _quantization(p: _Params) -> dict[str, Any]:
    """`_remap_mistral_quantization_args`: Mistral's own fp8 spelling, or compressed-tensors as is."""
    quantization = p.section("quantization")
    values = dict(quantization.values)
    if values.get("qformat_weight") == "fp8_e4m3":
        scheme = values.get("qscheme_act")
        if scheme not in ("NO_SCALES", "TENSOR", None):
            raise quantization.fail("qscheme_act", f"is {shorten(repr(scheme), 40)}", "NO_SCALES or TENSOR")
        return {"quant_method": "fp8", "activation_scheme": "dynamic" if scheme == "NO_SCALES" else "static"}
    if str(values.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors":
        return {**values, "quant_method": "compressed-tensors"}
    raise quantization.unsupported("qformat_weight", "a quantization that is neither fp8_e4m3 nor compressed-tensors")


# --- tensor names -------------------------------------------------------------------------------------

# Per-layer linear projections: Mistral module -> Hugging Face module, under `layers.{layer}.` and
# `model.layers.{layer}.`. Dense attention: mistral.py's `mistral_mapping` (attention -> self_attn,
# wq/wk/wv/wo -> q/k/v/o_proj); MLA attention, MLPs, shared experts: mistral_large_3.py's mapper.
LAYER_LINEARS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "shared_experts.w1": "mlp.shared_experts.gate_proj",
    "shared_experts.w2": "mlp.shared_experts.down_proj",
    "shared_experts.w3": "mlp.shared_experts.up_proj",
    "experts.{expert}.w1": "mlp.experts.{expert}.gate_proj",
    "experts.{expert}.w2": "mlp.experts.{expert}.down_proj",
    "experts.{expert}.w3": "mlp.experts.{expert}.up_proj",
}
# Per-layer tensors with a weight alone: the norms and the router
LAYER_WEIGHTS = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm",
    "gate": "mlp.gate",
}
MISTRAL_TO_HF_TENSORS: dict[str, str] = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{
        f"layers.{{layer}}.{mistral}.weight": f"model.layers.{{layer}}.{hf}.weight"
        for mistral, hf in {**LAYER_WEIGHTS, **LAYER_LINEARS}.items()
    },
}
"""Mistral tensor name -> Hugging Face checkpoint name; `{layer}` and `{expert}` stand for indices."""

# A linear's quantization scales: Mistral's own names and compressed-tensors' (both vLLM mappers'
# `qscale_*` suffixes) -> the Hugging Face checkpoint's
SCALE_SUFFIXES = {
    "qscale_weight": "weight_scale",
    "qscale_act": "input_scale",
    "weight_scale": "weight_scale",
    "input_scale": "input_scale",
}
# Tensors of the vision encoder of a vision-language checkpoint (vLLM's pixtral.py loads them apart)
VISION_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.", "pre_mm_projector_norm.")


def _pattern(template: str) -> re.Pattern[str]:
    escaped = re.escape(template).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
    return re.compile(escaped)


_TENSOR_PATTERNS = [(_pattern(mistral), hf) for mistral, hf in MISTRAL_TO_HF_TENSORS.items()]
_LINEAR_TEMPLATES = {f"layers.{{layer}}.{mistral}.weight" for mistral in LAYER_LINEARS}


def hf_tensor_name(mistral_name: str) -> str:
    """The Hugging Face checkpoint name of a Mistral-format tensor of the language model.

    Every tensor of a dense Mistral and of a DeepSeek-V3-style Mistral (Mistral Large 3) maps
    (`MISTRAL_TO_HF_TENSORS`; per-expert names, as DeepSeek-V3's own checkpoints have them: transformers
    fuses the experts on load), and so do a linear's quantization scales (`SCALE_SUFFIXES`). A vision
    encoder's tensor (`is_vision_tensor`) or any other name raises a `SpeculatorsError`.
    """
    stem, _, suffix = mistral_name.rpartition(".")
    candidates: list[tuple[str, str | None]] = [(mistral_name, None)]
    if suffix in SCALE_SUFFIXES and stem:
        candidates.append((f"{stem}.weight", SCALE_SUFFIXES[suffix]))
    for name, scale in candidates:
        for (pattern, hf), template in zip(_TENSOR_PATTERNS, MISTRAL_TO_HF_TENSORS, strict=True):
            match = pattern.fullmatch(name)
            if match is None or (scale is not None and template not in _LINEAR_TEMPLATES):
                continue
            mapped = hf.format(**match.groupdict())
            return mapped if scale is None else f"{mapped.removesuffix('.weight')}.{scale}"
    where = "a vision encoder's tensor, not the language model's" if is_vision_tensor(mistral_name) else "unknown"
    raise SpeculatorsError(
        f"tensor {shorten(mistral_name, 120)!r} is {where}: no Hugging Face name maps to it from a dense Mistral "
        f"or a Mistral Large 3 checkpoint"
    )


def is_vision_tensor(mistral_name: str) -> bool:
    """Whether a Mistral-format tensor belongs to a vision-language checkpoint's vision encoder."""
    return mistral_name.startswith(VISION_PREFIXES)


_ROTARY_PERMUTED = re.compile(r"layers\.\d+\.attention\.w[qk]\.weight")


def needs_rotary_permutation(mistral_name: str) -> bool:
    """Whether a tensor's rows must be reordered into Hugging Face's rotary layout (`to_hf_rotary_layout`):
    a dense Mistral's `wq` and `wk` weights (vLLM's `maybe_remap_mistral` permutes exactly these)."""
    return _ROTARY_PERMUTED.fullmatch(mistral_name) is not None


def to_hf_rotary_layout(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A dense Mistral `wq` / `wk` weight ([heads x head_dim, in]) with each head's rows reordered from
    Mistral's interleaved rotary pairs (0, 1), (2, 3), ... to Hugging Face's halves (the first of every
    pair, then the second): what `maybe_remap_mistral` does (`heads`: n_heads for wq, n_kv_heads for wk)."""
    rows, columns = weight.shape
    if rows % (2 * heads):
        raise SpeculatorsError(f"a rotary weight of {rows} rows does not split into {heads} heads of whole pairs")
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


# --- reading a Mistral-format checkpoint -----------------------------------------------------------

CONSOLIDATED_PATTERN = "consolidated*.safetensors"
# The tokenizer files vLLM's `tokenizer_mode auto` takes as mistral-common's (vllm/tokenizers/registry.py)
MISTRAL_TOKENIZER_PATTERNS = ("tekken.json", "tokenizer.model.v*")
MISTRAL4_ARCHITECTURE = "Mistral4ForCausalLM"
# The keys transformers' Mistral4Config takes from the DeepSeek-V3-style dict hf_config_from_params makes
MISTRAL4_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_shared_experts",
    "n_routed_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "norm_topk_prob",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
)


def is_mistral_checkpoint(directory: str | Path) -> bool:
    """A folder in Mistral's format as vLLM decides it (`config_format` / `load_format` auto:
    vllm/transformers_utils/config.py and model_loader/default_loader.py): a params.json beside
    consolidated*.safetensors, whether or not a Hugging Face config.json is there too."""
    path = Path(directory)
    return path.is_dir() and (path / PARAMS_FILE).is_file() and any(path.glob(CONSOLIDATED_PATTERN))


def has_mistral_tokenizer(directory: str | Path) -> bool:
    """Whether a Mistral-format folder has mistral-common's tokenizer (tekken.json, tokenizer.model.v*),
    which vLLM then uses (its `tokenizer_mode auto`) and so do we."""
    path = Path(directory)
    return is_mistral_checkpoint(path) and any(any(path.glob(p)) for p in MISTRAL_TOKENIZER_PATTERNS)


def vllm_format_kwargs(directory: str | Path, with_drafter: bool = False) -> dict[str, str]:
    """vLLM engine arguments naming a Mistral-format verifier's formats (none for any other folder).

    With a drafter in the same engine only the tokenizer mode is named: vLLM gives the draft model the
    target's `config_format` (vllm/config/speculative.py) and both models one LoadConfig, so
    `mistral` there would send our speculators checkpoint (config.json, model.safetensors) through
    Mistral's parser and loader; `auto` reads each folder as what it is (params.json beside
    consolidated*.safetensors: Mistral's)."""
    if not is_mistral_checkpoint(directory):
        return {}
    kwargs = {"tokenizer_mode": "mistral"} if has_mistral_tokenizer(directory) else {}
    if not with_drafter:
        kwargs.update(config_format="mistral", load_format="mistral")
    return kwargs


def transformers_config_dict(facts: Mapping[str, Any], source: str = PARAMS_FILE) -> dict[str, Any]:
    """The transformers config that computes what vLLM computes for a Mistral-format checkpoint, from the
    dict `hf_config_from_params` derives (vLLM's view of it).

    A dense Mistral is transformers' MistralConfig as it is. Mistral Large 3 (vLLM's
    MistralLarge3ForCausalLM, a DeepSeek-V3 model) is transformers' `mistral4` model, not its
    DeepSeek-V3: transformers' DeepSeek-V3 routes experts by sigmoid scores with a correction bias that
    this checkpoint has none of, while Mistral4 routes by softmax (vLLM's `scoring_func softmax`) and
    scales queries by position as vLLM's `llama_4_scaling` does. Two keys are adapted: with YaRN's
    `attention_factor` 1.0 (params.json `apply_scale: false`) vLLM uses its `deepseek_llama_scaling`
    rotary, which leaves the softmax scale alone, so `mscale_all_dim` becomes 0 (transformers would
    multiply the scale by mscale(factor)**2 otherwise: vllm/model_executor/models/deepseek_v2.py);
    and the llama-4 beta joins rope_parameters, where transformers reads it, with YaRN's original
    length as its period, which must be llama_4_scaling's own."""
    model_type = facts.get("model_type")
    if model_type == "mistral":
        return dict(facts)
    if model_type != "deepseek_v3":
        raise SpeculatorsError(
            f"{shorten(source, 200)} describes a {model_type} model, which is read by vLLM only here (transformers "
            f"loads a dense Mistral or Mistral Large 3 from Mistral's format); use --backend vllm"
        )
    rope = dict(facts.get("rope_parameters") or {})
    scaling = facts.get("llama_4_scaling") or {}
    if rope.get("rope_type") != "yarn":
        raise SpeculatorsError(
            f"{shorten(source, 200)} has no `yarn` section, which transformers' Mistral 4 model needs for the llama-4 "
            f"query scaling; load this checkpoint with vLLM (--backend vllm)"
        )
    if scaling.get("original_max_position_embeddings") != rope.get("original_max_position_embeddings"):
        raise SpeculatorsError(
            f"{shorten(source, 200)}: llama_4_scaling's original_max_position_embeddings differs from yarn's, which "
            f"transformers' Mistral 4 model cannot express; load this checkpoint with vLLM (--backend vllm)"
        )
    if (facts.get("moe_layer_freq") or 1) != 1:
        raise SpeculatorsError(
            f"{shorten(source, 200)}: `moe.route_every_n` is {facts['moe_layer_freq']}; transformers' Mistral 4 model "
            f"routes every layer after the dense ones: load this checkpoint with vLLM (--backend vllm)"
        )
    if rope.get("attention_factor") == 1.0:
        rope["mscale_all_dim"] = 0
    rope["llama_4_scaling_beta"] = scaling["beta"]
    config = {key: facts[key] for key in MISTRAL4_KEYS if key in facts}
    config.update(
        model_type="mistral4", architectures=[MISTRAL4_ARCHITECTURE], rope_parameters=rope, rope_interleave=True
    )
    return config


def hf_state_dict(directory: str | Path, facts: Mapping[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Mistral-format checkpoint's weights under the names (and in the layout) of the transformers model
    `transformers_config_dict` configures: every consolidated*.safetensors tensor renamed
    (`hf_tensor_name`), a dense model's wq / wk rows in Hugging Face's rotary order, and Mistral 4's
    experts fused as transformers keeps them (gate_up_proj [experts, 2 x width, hidden]: w1 then w3;
    down_proj [experts, hidden, width]: w2). Quantized checkpoints (scales) are vLLM's to read."""
    import torch
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    expert_name = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    fuse = facts.get("model_type") == "deepseek_v3"
    for file in sorted(Path(directory).glob(CONSOLIDATED_PATTERN)):
        with safe_open(str(file), framework="pt") as handle:
            for name in sorted(handle.keys()):
                if is_vision_tensor(name):
                    continue  # (a vision-language checkpoint is refused by transformers_config_dict)
                hf = hf_tensor_name(name)
                if not hf.endswith(".weight"):
                    raise SpeculatorsError(
                        f"{file.name} holds quantization scales ({name}); transformers does not load a quantized "
                        f"Mistral-format checkpoint here: use --backend vllm"
                    )
                tensor = handle.get_tensor(name).to(dtype)
                if needs_rotary_permutation(name):
                    heads = facts["num_attention_heads"] if ".wq." in name else facts["num_key_value_heads"]
                    tensor = to_hf_rotary_layout(tensor, heads)
                match = expert_name.fullmatch(hf) if fuse else None
                if match is None:
                    state[hf] = tensor
                    continue
                prefix, expert, projection = match.groups()
                experts.setdefault(f"{prefix}.{projection}", {})[int(expert)] = tensor
    count = facts.get("n_routed_experts", 0)
    for prefix in sorted({key.rpartition(".")[0] for key in experts}):
        parts = {p: experts.get(f"{prefix}.{p}", {}) for p in ("gate_proj", "up_proj", "down_proj")}
        missing = [f"{prefix}.{e}.{p}" for p, got in parts.items() for e in range(count) if e not in got]
        if missing:
            raise SpeculatorsError(f"{Path(directory)} lacks expert weights ({missing[0]} and {len(missing) - 1} more)")
        state[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in range(count)]
        )
        state[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(count)])
    return state


def transformers_model(config_dict: Mapping[str, Any], dtype: torch.dtype) -> Any:
    """A freshly initialised transformers model of `transformers_config_dict`'s dict (Mistral 4 has no
    AutoModelForCausalLM entry in transformers 5.19, so its class is named here)."""
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    if config.model_type == "mistral4":
        return transformers.Mistral4ForCausalLM._from_config(config, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


_HF_PATTERNS = [(_pattern(hf), mistral) for mistral, hf in MISTRAL_TO_HF_TENSORS.items()]


def mistral_tensor_name(hf_name: str) -> str:
    """The Mistral-format name of a Hugging Face checkpoint tensor (`hf_tensor_name`'s inverse, weights
    only; per-expert names)."""
    for pattern, mistral in _HF_PATTERNS:
        match = pattern.fullmatch(hf_name)
        if match is not None:
            return mistral.format(**match.groupdict())
    raise SpeculatorsError(f"tensor {shorten(hf_name, 120)!r} has no Mistral-format name")


HEAD_TENSORS = {"embedding": "tok_embeddings.weight", "lm_head": "output.weight", "norm": "norm.weight"}
"""A Mistral-format checkpoint's input embeddings, lm_head and final norm (what training reads)."""
