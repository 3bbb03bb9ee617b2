"""The speculators checkpoint format: `config.json` of an EAGLE-3 speculator.

Written exactly as vLLM and the reference `speculators` library read it: every norm flag explicit,
a complete Hugging Face decoder config for the draft layers, and the nested `speculators_config`
(proposal methods and verifier). Reading is lenient where the reference library's own files
differ (extra keys such as `auto_map`, flags it leaves out); writing is always the full form.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculators import SPECULATORS_FORMAT_VERSION
from speculators.atomic_io import write_text_atomic
from speculators.errors import CheckpointFormatError, SpeculatorsError, name_some, shorten
from speculators.settings import (
    MAX_DRAFT_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB_SIZE,
    MAX_WIDTH,
    CheckpointDtype,
    DrafterShape,
    DraftLayerType,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

SUPPORTED_ALGORITHMS = ("eagle3", "peagle", "dflash")
# Other algorithms of the reference library, recognised so the error can say what they are.
KNOWN_UNSUPPORTED_ALGORITHMS = ("eagle", "mtp", "independent")
# The algorithms whose config is EAGLE-3's (P-EAGLE's adds its mask token to it).
EAGLE3_FAMILY = ("eagle3", "peagle")
DRAFT_LAYER_TYPES: tuple[DraftLayerType, ...] = get_args(DraftLayerType)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
DTYPE_NAMES: tuple[str, ...] = get_args(CheckpointDtype)
# Keys that only make sense for the reference library's own classes; never written by us.
REFERENCE_ONLY_KEYS = (
    "auto_map",
    "model_type",
    "has_no_defaults_at_init",
    "base_model_ep_plan",
    "torch_dtype",
    "embed_requires_grad",
    "enable_sp_ulysses",
    "transformers_version",
)

# Bounds on the sizes a config may ask for, checked before anything is built from them: far above any
# real drafter (Llama 3.1 405B is 16384 wide, the largest vocabularies hold ~262k tokens), far below
# what would exhaust time or memory on a corrupt or hostile config.json. The layers, widths, vocabularies
# and positions are the settings' own bounds (speculators/settings.py), so a flag or a variant that asks
# for a drafter asks for one this format can hold.
MAX_DRAFTER_PARAMETERS = 2**36  # ~69 billion (~137 GB in bf16): no speculator file is larger
MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KB
MAX_REPORTED_ERRORS = 5  # of pydantic's errors for one config (a list of a million bad entries gives a million)
# transformer_layer_config's integer sizes -> their upper bound (each at least 1).
LAYER_SIZE_LIMITS = {
    "hidden_size": MAX_WIDTH,
    "intermediate_size": MAX_WIDTH,
    "num_hidden_layers": MAX_DRAFT_LAYERS,
    "num_attention_heads": MAX_WIDTH,
    "num_key_value_heads": MAX_WIDTH,
    "head_dim": MAX_WIDTH,
    "vocab_size": MAX_VOCAB_SIZE,
    "max_position_embeddings": MAX_POSITIONS,
}


class ProposalMethod(BaseModel):
    model_config = ConfigDict(extra="allow")

    proposal_type: str = "greedy"
    speculative_tokens: int = Field(ge=1, description="draft tokens per verifier step (K)")
    verifier_accept_k: int = 1
    accept_tolerance: float = 0.0


class VerifierInfo(BaseModel):
    model_config = ConfigDict(extra="allow")

    name_or_path: str | None = None
    architectures: list[str] = Field(default_factory=list)


class SpeculatorsConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    algorithm: str
    proposal_methods: list[ProposalMethod] = Field(min_length=1)
    default_proposal_method: str = "greedy"
    verifier: VerifierInfo

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, value: str) -> str:
        check_algorithm(value)
        return value


def check_algorithm(name: str) -> None:
    if name in SUPPORTED_ALGORITHMS:
        return
    if name in KNOWN_UNSUPPORTED_ALGORITHMS:
        raise ValueError(
            f"algorithm '{name}' is a reference-library speculator this project does not load yet; "
            f"convert or retrain it as eagle3"
        )
    raise ValueError(f"unknown algorithm '{name}'; this project reads {', '.join(SUPPORTED_ALGORITHMS)}")


@dataclass(frozen=True)
class DraftLayerConfig:
    """The draft decoder layers' settings, typed: a view of `transformer_layer_config`.

    config.json keeps the dict (a complete Hugging Face decoder config, as vLLM reads it); the modelling
    code reads these fields instead of looking keys up in it. Build it with `from_dict`.
    """

    model_type: DraftLayerType
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int
    rope_parameters: dict[str, Any] = field(hash=False)  # rope_type, rope_theta and the type's own keys
    attention_bias: bool = False
    mlp_bias: bool = False

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters.get("rope_theta", 10000.0)

    @classmethod
    def from_dict(cls, layer: Mapping[str, Any]) -> DraftLayerConfig:
        """The typed view of a complete layer config; a SpeculatorsError names a missing or mistyped field."""
        check_layer_value_types(layer)
        missing = [name for name in REQUIRED_LAYER_FIELDS if layer.get(name) is None]
        if missing:
            raise missing_layer_fields(missing)
        check_layer_sizes(layer)
        if layer["model_type"] not in DRAFT_LAYER_TYPES:
            raise SpeculatorsError(
                f"transformer_layer_config.model_type '{layer['model_type']}' is not a draft layer type; "
                f"use one of {', '.join(DRAFT_LAYER_TYPES)}"
            )
        values = {f.name: layer[f.name] for f in fields(cls) if layer.get(f.name) is not None}
        values["rope_parameters"] = dict(values["rope_parameters"])
        return cls(**values)


KIND_NAMES = {int: "an integer", float: "a float", bool: "true or false", str: "a string", dict: "an object"}


def _field_kind(hint: Any) -> type:
    kind = get_origin(hint) or hint  # dict[str, Any] -> dict
    return str if kind is Literal else kind  # model_type's values are checked in from_dict


# DraftLayerConfig field -> the JSON kind of its value; the fields without a default must be present.
LAYER_FIELD_KINDS = {name: _field_kind(hint) for name, hint in get_type_hints(DraftLayerConfig).items()}
REQUIRED_LAYER_FIELDS = tuple(f.name for f in fields(DraftLayerConfig) if f.default is MISSING)


def missing_layer_fields(names: list[str]) -> SpeculatorsError:
    described = ", ".join(f"{name} ({KIND_NAMES[LAYER_FIELD_KINDS[name]]})" for name in names)
    return SpeculatorsError(
        f"transformer_layer_config lacks {described}; add {'it' if len(names) == 1 else 'them'} to the "
        f"speculator's config.json (the draft layers' Hugging Face decoder config)"
    )


def check_layer_value_types(layer: Mapping[str, Any]) -> None:
    """Raise a SpeculatorsError for the first DraftLayerConfig field whose (non-null) value has the wrong kind.

    As strict as the transformers config classes: no bool for an integer, no integer for a float.
    """
    for name, kind in LAYER_FIELD_KINDS.items():
        value = layer.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise SpeculatorsError(
                f"transformer_layer_config.{name} is {shorten(repr(value), 80)} ({type(value).__name__}), not "
                f"{KIND_NAMES[kind]}; write it as {KIND_NAMES[kind]} in the speculator's config.json"
            )
    rope = layer.get("rope_parameters") or {}
    rope_type, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
    if (
        not isinstance(rope_type, str)
        or isinstance(theta, bool)
        or not isinstance(theta, int | float)
        or not math.isfinite(theta)
        or theta <= 0
    ):
        raise SpeculatorsError(
            f"transformer_layer_config.rope_parameters {shorten(repr(rope), 120)} needs a string rope_type and a "
            f"positive rope_theta; fix them in the speculator's config.json"
        )
    check_rope_values(rope)
    eps = layer.get("rms_norm_eps")
    if isinstance(eps, float) and not (math.isfinite(eps) and 0 <= eps <= 1):
        raise SpeculatorsError(
            f"transformer_layer_config.rms_norm_eps {eps} is not a small non-negative number; write the draft "
            f"layers' norm epsilon (e.g. 1e-06) in the speculator's config.json"
        )


ROPE_LIST_KEYS = ("short_factor", "long_factor", "mrope_section")  # per-dimension lists (longrope, M-RoPE)
ROPE_BOOL_KEYS = ("truncate", "mrope_interleaved")


def check_rope_values(rope: Mapping[str, Any]) -> None:
    """Every rope parameter a finite number (a few are true/false or lists of numbers): transformers'
    rope functions compute with whatever the file holds, and log a bad value whole."""
    for key, value in rope.items():
        if key in ("rope_type", "type") or value is None:
            continue
        if key in ROPE_BOOL_KEYS:
            ok = isinstance(value, bool)
        elif key in ROPE_LIST_KEYS:
            ok = isinstance(value, list) and len(value) <= MAX_WIDTH and all(is_finite_number(v) for v in value)
        else:
            ok = is_finite_number(value) and (key != "factor" or value >= 1)  # (a scaling factor stretches)
        if not ok:
            expected = "true or false" if key in ROPE_BOOL_KEYS else "a finite number"
            if key == "factor":
                expected = "a number >= 1"
            if key in ROPE_LIST_KEYS:
                expected = "a list of finite numbers"
            raise SpeculatorsError(
                f"transformer_layer_config.rope_parameters.{shorten(str(key), 60)} is {shorten(repr(value), 60)}, "
                f"not {expected}; fix it in the speculator's config.json"
            )


def is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def rotary_frequencies(layer: DraftLayerConfig) -> tuple[torch.Tensor, float]:
    """The draft layers' rotary inverse frequencies and attention scaling, computed as the drafter's
    RotaryEmbedding computes them (transformers' init function for a non-default rope type)."""
    import torch

    if layer.rope_type == "default":
        exponents = torch.arange(0, layer.head_dim, 2, dtype=torch.int64).float() / layer.head_dim
        return 1.0 / (layer.rope_theta**exponents), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(
        hidden_size=layer.hidden_size,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=layer.num_key_value_heads,
        head_dim=layer.head_dim,
        max_position_embeddings=layer.max_position_embeddings,
        rope_parameters=dict(layer.rope_parameters),
    )
    return ROPE_INIT_FUNCTIONS[layer.rope_type](hf_config, None)


def check_rope_type(rope_type: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = ("default", *ROPE_INIT_FUNCTIONS)
    if rope_type not in known:
        raise SpeculatorsError(
            f"transformer_layer_config.rope_parameters.rope_type {shorten(repr(rope_type), 60)} is not one of "
            f"{', '.join(known)}; use the verifier's rope type in the speculator's config.json"
        )


def check_draft_layer(layer: DraftLayerConfig) -> None:
    """Raise a SpeculatorsError where the drafter could not be built from `layer`: an activation
    transformers does not know, a rope type or parameters its rotary tables cannot be computed from
    (or are not finite with). Found when the config is read, not as a traceback when a model is built."""
    import torch
    from transformers.activations import ACT2FN

    if layer.hidden_act not in ACT2FN:
        raise SpeculatorsError(
            f"transformer_layer_config.hidden_act {shorten(repr(layer.hidden_act), 60)} is not an activation "
            f"transformers knows; use silu (the verifier's, usually) in the speculator's config.json"
        )
    check_rope_type(layer.rope_type)
    rope = shorten(repr(layer.rope_parameters), 160)
    try:
        inv_freq, scaling = rotary_frequencies(layer)
    except Exception as error:  # transformers' rope functions divide and index by the file's values
        raise SpeculatorsError(
            f"transformer_layer_config.rope_parameters {rope} cannot make rotary embeddings "
            f"({type(error).__name__}: {shorten(str(error), 100)}); use the verifier's rope parameters"
        ) from None
    if not (bool(torch.isfinite(inv_freq).all()) and math.isfinite(float(scaling))):
        raise SpeculatorsError(
            f"transformer_layer_config.rope_parameters {rope} make non-finite rotary embeddings; use the "
            f"verifier's rope parameters"
        )


def check_layer_sizes(layer: Mapping[str, Any]) -> None:
    """Raise a SpeculatorsError for a size outside 1..its limit (LAYER_SIZE_LIMITS), or attention heads
    the drafter cannot group: checked before a transformers config or a tensor table is built from them,
    so an absurd config.json costs milliseconds, not minutes and gigabytes."""
    for name, limit in LAYER_SIZE_LIMITS.items():
        value = layer.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= limit:
            why = " (far more than any drafter has)" if value > limit else ""
            raise SpeculatorsError(
                f"transformer_layer_config.{name} is {shorten(str(value), 40)}, outside 1..{limit:,}{why}; "
                f"fix it in the speculator's config.json"
            )
    heads, kv_heads, head_dim = (layer.get(k) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise SpeculatorsError(
            f"transformer_layer_config.num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}; each key/value head serves a whole group of query heads: fix them in config.json"
        )
    if isinstance(head_dim, int) and head_dim % 2:
        raise SpeculatorsError(
            f"transformer_layer_config.head_dim {head_dim} is odd; rotary embeddings rotate pairs of "
            f"dimensions: fix it in the speculator's config.json"
        )


def complete_layer_config(layer_config: dict[str, Any]) -> dict[str, Any]:
    """A complete, explicit Hugging Face decoder config dict for the draft layers.

    Goes through the transformers config class so defaults (rope, eps, activation) are resolved
    the way vLLM's loader resolves them, then writes the keys older readers need explicitly.
    """
    model_type = layer_config.get("model_type", "llama")
    if model_type not in DRAFT_LAYER_TYPES:
        raise ValueError(
            f"transformer_layer_config.model_type '{model_type}' is not a draft layer type vLLM "
            f"loads; use one of {', '.join(DRAFT_LAYER_TYPES)}"
        )
    required = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [key for key in required if layer_config.get(key) is None]
    if missing:
        raise missing_layer_fields(missing)
    check_layer_value_types(layer_config)  # named here before the transformers class's own, terser check
    check_layer_sizes(layer_config)  # before transformers builds per-layer lists from them
    for rope in (layer_config.get("rope_parameters"), layer_config.get("rope_scaling")):
        if isinstance(rope, dict):  # (the class reads either; a legacy rope_scaling is checked the same way)
            check_rope_values(rope)
            check_rope_type(str(rope.get("rope_type", rope.get("type", "default"))))
    from huggingface_hub.errors import StrictDataclassError
    from transformers import LlamaConfig, Qwen3Config

    config_class = LlamaConfig if model_type == "llama" else Qwen3Config
    values = {k: v for k, v in layer_config.items() if k not in ("transformers_version", "architectures")}
    if "torch_dtype" in values:  # transformers 4.x name
        values.setdefault("dtype", values.pop("torch_dtype"))
    values.setdefault("num_hidden_layers", 1)
    try:
        hf_config = config_class(**values)
    # The class's own checks of values this file supplies (rope parameters, layer types, ...) raise more
    # than one kind of error; each is the file's mistake, said in one sentence.
    except (StrictDataclassError, ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as error:
        raise ValueError(
            f"transformer_layer_config is not a valid {config_class.__name__} ({shorten(str(error), 200)}); "
            f"fix that key in the speculator's config.json"
        ) from None
    check_full_attention(hf_config)
    out = hf_config.to_diff_dict()
    # Token ids of the config class's defaults mean nothing for draft layers (the verifier's
    # tokenizer decides them); leaving them out avoids recording wrong ones.
    for key in ("transformers_version", "bos_token_id", "eos_token_id", "pad_token_id"):
        out.pop(key, None)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    explicit = {
        "model_type": model_type,
        "num_hidden_layers": hf_config.num_hidden_layers,
        "num_key_value_heads": hf_config.num_key_value_heads or hf_config.num_attention_heads,
        "head_dim": head_dim,
        "hidden_act": hf_config.hidden_act,
        "rms_norm_eps": hf_config.rms_norm_eps,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "tie_word_embeddings": False,
    }
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    if rope:
        out["rope_parameters"] = rope
        # transformers 4.x readers (vLLM before transformers 5) look for these names.
        explicit["rope_theta"] = rope.get("rope_theta", 10000.0)
        if rope.get("rope_type", "default") != "default":
            explicit["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.update(explicit)
    return dict(sorted(out.items()))


def check_full_attention(hf_config: PreTrainedConfig) -> None:
    """Refuse draft layers that vLLM would run with sliding-window attention: it honours `layer_types`
    (which Qwen3's `use_sliding_window` + `max_window_layers` resolve to), but this project's drafter
    attends over the whole context, so training, evaluation and the checks would disagree with the
    served drafter once a context passes the window."""
    layers = hf_config.num_hidden_layers
    types = list(getattr(hf_config, "layer_types", None) or [])[:layers]
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    if sliding:
        raise ValueError(
            f"transformer_layer_config gives draft layer(s) {sliding} sliding-window attention (sliding_window "
            f"{hf_config.sliding_window}), which this project's drafter does not implement: its outputs would "
            f"differ from vLLM's past {hf_config.sliding_window} tokens; retrain the drafter with full attention"
        )


def ignored_sliding_window(layer_config: dict[str, Any]) -> str | None:
    """A note for a layer config that names a sliding window its layer types do not use."""
    keys = [k for k in ("sliding_window", "use_sliding_window") if layer_config.get(k)]
    if not keys:
        return None
    settings = ", ".join(f"{k}={shorten(str(layer_config[k]), 40)}" for k in keys)
    return f"transformer_layer_config sets {settings} but no draft layer is sliding_attention: full attention, as vLLM"


class DraftLayerSizes:
    """The sizes every drafter config derives from its transformer_layer_config and target_hidden_size
    (EAGLE-3's, P-EAGLE's, DFlash's), named for what they are."""

    transformer_layer_config: dict[str, Any]
    target_hidden_size: int | None

    @property
    def layer(self) -> DraftLayerConfig:
        """The draft layers' settings, typed (read from transformer_layer_config on each access)."""
        return DraftLayerConfig.from_dict(self.transformer_layer_config)

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def verifier_hidden_size(self) -> int:
        return int(self.target_hidden_size or self.hidden_size)

    @property
    def verifier_vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def num_draft_layers(self) -> int:
        return self.layer.num_hidden_layers


class Eagle3Config(DraftLayerSizes, BaseModel):
    """Top level of an EAGLE-3 speculator `config.json`."""

    model_config = ConfigDict(extra="allow")

    speculators_model_type: str = "eagle3"
    architectures: list[str] = Field(default_factory=lambda: ["Eagle3Speculator"])
    transformer_layer_config: dict[str, Any]
    draft_vocab_size: int = Field(gt=0, le=MAX_VOCAB_SIZE)
    target_hidden_size: int | None = Field(None, ge=1, le=MAX_WIDTH)
    eagle_aux_hidden_state_layer_ids: list[int] | None = None
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    speculators_version: str = SPECULATORS_FORMAT_VERSION
    dtype: str = "bfloat16"
    speculators_config: SpeculatorsConfig

    @field_validator("speculators_model_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        check_algorithm(value)
        if value not in EAGLE3_FAMILY:
            raise ValueError(f"speculators_model_type '{value}' is not an EAGLE-3 checkpoint; load it as {value}")
        return value

    @field_validator("transformer_layer_config")
    @classmethod
    def _complete_layer(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            completed = complete_layer_config(value)
            # The typed view the drafter reads must build, and so must its activation and rotary tables.
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

    @field_validator("eagle_aux_hidden_state_layer_ids")
    @classmethod
    def _three_aux_layers(cls, value: list[int] | None) -> list[int] | None:
        if value is None:
            return None
        if len(value) != 3 or len(set(value)) != 3 or min(value) < 0:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {shorten(str(value), 80)} must be 3 distinct non-negative verifier "
                f"layer ids (vLLM's EAGLE-3 fc reads exactly 3 states)"
            )
        return list(value)

    @model_validator(mode="after")
    def _consistent(self) -> Eagle3Config:
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are exclusive; set at most one of them")
        if self.speculators_config.algorithm != self.speculators_model_type:
            raise ValueError(
                f"speculators_config.algorithm '{self.speculators_config.algorithm}' differs from "
                f"speculators_model_type '{self.speculators_model_type}'"
            )
        if self.draft_vocab_size > self.verifier_vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} exceeds the verifier vocab "
                f"{self.verifier_vocab_size} (transformer_layer_config.vocab_size)"
            )
        if self.parameter_count > MAX_DRAFTER_PARAMETERS:
            raise ValueError(
                f"the sizes in this config make a drafter of {self.parameter_count:.2e} parameters, more than "
                f"any speculator file holds (at most {MAX_DRAFTER_PARAMETERS:.2e}); check hidden_size, "
                f"intermediate_size, vocab_size and target_hidden_size"
            )
        return self

    @property
    def draft_layer_type(self) -> DraftLayerType:
        return self.layer.model_type

    @property
    def num_aux_states(self) -> int:
        return 3

    @property
    def parameter_count(self) -> int:
        """Parameters of the checkpoint this config describes, saved embeddings included (an upper bound
        for the file: counted from the sizes, without building the tensor table)."""
        layer, hidden, verifier_hidden = self.layer, self.hidden_size, self.verifier_hidden_size
        query, key_value = layer.num_attention_heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
        total = self.num_aux_states * verifier_hidden * (hidden + 2)  # fc, input_norm or fc_norm
        for index in range(layer.num_hidden_layers):
            width = 2 * hidden if index == 0 else hidden
            attention = (query + 2 * key_value) * (width + 1) + hidden * (query + 1) + 2 * layer.head_dim
            total += attention + 3 * layer.intermediate_size * (hidden + 1) + 4 * hidden
        vocab = self.verifier_vocab_size
        return total + hidden + self.draft_vocab_size * (hidden + 1) + vocab * (hidden + 1)

    @property
    def speculative_tokens(self) -> int:
        methods = self.speculators_config.proposal_methods
        default = [m for m in methods if m.proposal_type == self.speculators_config.default_proposal_method]
        return (default or methods)[0].speculative_tokens

    def vllm_method(self) -> dict[str, Any]:
        """The method keys of vLLM's --speculative-config that serve this checkpoint (vLLM's own mapping of
        speculators_model_type, transformers_utils/configs/speculators/base.py)."""
        return {"method": self.speculators_model_type}

    def extra_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Tensors an algorithm adds to the EAGLE-3 set, name -> (shape, kind) (P-EAGLE: mask_hidden)."""
        return {}

    def to_json_dict(self) -> dict[str, Any]:
        """The full, explicit config.json content (reference-library-only keys dropped)."""
        return {
            "architectures": list(self.architectures),
            "draft_vocab_size": self.draft_vocab_size,
            "dtype": self.dtype,
            "eagle_aux_hidden_state_layer_ids": self.eagle_aux_hidden_state_layer_ids,
            "fc_norm": self.fc_norm,
            "norm_before_fc": self.norm_before_fc,
            "norm_before_residual": self.norm_before_residual,
            "norm_output": self.norm_output,
            "speculators_config": {
                "algorithm": self.speculators_config.algorithm,
                "default_proposal_method": self.speculators_config.default_proposal_method,
                "proposal_methods": [
                    {
                        "accept_tolerance": m.accept_tolerance,
                        "proposal_type": m.proposal_type,
                        "speculative_tokens": m.speculative_tokens,
                        "verifier_accept_k": m.verifier_accept_k,
                    }
                    for m in self.speculators_config.proposal_methods
                ],
                "verifier": {
                    "architectures": list(self.speculators_config.verifier.architectures),
                    "name_or_path": self.speculators_config.verifier.name_or_path,
                },
            },
            "speculators_model_type": self.speculators_model_type,
            "speculators_version": self.speculators_version,
            "target_hidden_size": self.target_hidden_size,
            "transformer_layer_config": dict(self.transformer_layer_config),
        }

    def save(self, directory: str | Path) -> Path:

        path = Path(directory) / "config.json"
        write_text_atomic(path, json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")
        return path


@dataclass(frozen=True)
class VerifierShape:
    """What a new drafter copies from its verifier: the name and architectures its checkpoint records, the
    verifier's width and vocabulary, and the draft layers' MLP width, attention shape, norm epsilon,
    positions and rope (speculators.verifier.loading.draft_config_for_verifier reads them from the
    verifier's config)."""

    name_or_path: str
    architectures: list[str] = field(hash=False)
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_parameters: dict[str, Any] | None = field(default=None, hash=False)


# A new drafter's norm placements where its shape leaves them open: the reference library's for new drafters.
NEW_DRAFTER_NORMS = {"norm_before_residual": True, "norm_before_fc": True, "fc_norm": False, "norm_output": True}


def draft_layer_settings(verifier: VerifierShape, num_layers: int, hidden_size: int) -> dict[str, Any]:
    """A new drafter's decoder layers sized from its verifier (transformer_layer_config without its
    model_type): the verifier's attention shape, MLP width, positions, rope and vocabulary."""
    layer: dict[str, Any] = {
        "hidden_size": hidden_size,
        "intermediate_size": verifier.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": verifier.num_attention_heads,
        "num_key_value_heads": verifier.num_key_value_heads,
        "head_dim": verifier.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": verifier.rms_norm_eps,
        "max_position_embeddings": verifier.max_position_embeddings,
        "vocab_size": verifier.vocab_size,
    }
    if verifier.rope_parameters:
        layer["rope_parameters"] = dict(verifier.rope_parameters)
    return layer


def build_eagle3_config(verifier: VerifierShape, shape: DrafterShape) -> Eagle3Config:
    """A new drafter's config: `shape` over the sizes it copies from `verifier`. The shape names its aux
    layer ids (draft_config_for_verifier gives the verifier's default); its draft vocabulary defaults to
    the verifier's whole vocabulary, its layer type to llama, its width to the verifier's."""
    hidden = shape.hidden_size or verifier.hidden_size
    layer: dict[str, Any] = {
        "model_type": shape.draft_layer_type or "llama",
        **draft_layer_settings(verifier, shape.num_draft_layers, hidden),
    }
    norms: dict[str, Any] = {
        flag: default if (given := getattr(shape, flag)) is None else given
        for flag, default in NEW_DRAFTER_NORMS.items()
    }
    return Eagle3Config(
        transformer_layer_config=layer,
        draft_vocab_size=shape.draft_vocab_size or verifier.vocab_size,
        target_hidden_size=None if verifier.hidden_size == hidden else verifier.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(shape.aux_layer_ids or []),
        **norms,
        dtype=shape.dtype,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[ProposalMethod(speculative_tokens=shape.speculative_tokens)],
            verifier=VerifierInfo(name_or_path=verifier.name_or_path, architectures=list(verifier.architectures)),
        ),
    )


def format_validation_error(error: ValidationError) -> list[str]:
    """pydantic's errors as short sentences: 'field.path: message' (the first few, each bounded)."""
    problems = []
    items = error.errors()
    for item in items[:MAX_REPORTED_ERRORS]:
        where = ".".join(shorten(str(part), 60) for part in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        # Our validators' sentences already start with the field they name.
        problems.append(shorten(message if message.startswith(where) else f"{where}: {message}"))
    if len(items) > MAX_REPORTED_ERRORS:
        problems.append(f"and {len(items) - MAX_REPORTED_ERRORS} more invalid values in the config")
    return problems


def parse_eagle3_config(raw: dict[str, Any], source: str = "config.json") -> tuple[Eagle3Config, list[str]]:
    """Parse a speculators-format config dict; returns the config and notes on what was normalised.

    Accepts the reference library's files: flags it leaves out take vLLM's reading (the server that
    serves the checkpoint), `auto_map` and other class-loading keys are noted and dropped.
    """
    if not isinstance(raw, dict):
        raise CheckpointFormatError([f"{source} holds {type(raw).__name__}, not a JSON object"])
    model_type = raw.get("speculators_model_type")
    if model_type is None:
        raise CheckpointFormatError(
            [
                f"{source} has no speculators_model_type; for a research EAGLE-3 checkpoint run "
                f"'speculators convert' first"
            ]
        )
    notes = []
    if "dtype" not in raw and "torch_dtype" in raw:
        raw = {**raw, "dtype": raw["torch_dtype"]}  # transformers 4.x name
    for flag in NORM_FLAGS:
        if flag not in raw:
            # vLLM reads a missing norm_before_residual as true and the other flags as false.
            notes.append(f"{flag} missing; read as {flag == 'norm_before_residual'} as vLLM does")
    layer = raw.get("transformer_layer_config")
    sliding_note = ignored_sliding_window(layer) if isinstance(layer, dict) else None
    if sliding_note:
        notes.append(sliding_note)
    ignored = sorted(k for k in raw if k in REFERENCE_ONLY_KEYS)
    if ignored:
        notes.append(f"reference-library keys ignored: {name_some(ignored, len(REFERENCE_ONLY_KEYS))}")
    try:
        config = config_class_of(model_type)(**raw)
    except ValidationError as error:
        raise CheckpointFormatError(format_validation_error(error)) from None
    return config, notes


def config_class_of(model_type: Any) -> type[Eagle3Config]:
    """The config class of a registered algorithm's checkpoints (its drafter's `config_class`); EAGLE-3's for
    any other name, whose validation then says what the name is."""
    from speculators.models.algorithms import ALGORITHMS

    if not isinstance(model_type, str) or model_type not in ALGORITHMS:
        return Eagle3Config
    return getattr(ALGORITHMS[model_type].part("drafter"), "config_class", Eagle3Config)


# The fix for a damaged file: nothing in it can be trusted.
RECOVER = "re-download or re-convert the checkpoint"


def reject_json_constant(name: str) -> Any:
    """For json.loads(parse_constant=...): NaN, Infinity and -Infinity are not JSON."""
    raise ValueError(f"{name} is not a JSON value; write a finite number")


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in a checkpoint's `config.json`, or a CheckpointFormatError saying what is wrong
    with the file (missing, a directory, empty, too large, not UTF-8, not JSON, not an object).

    Strict JSON: NaN and Infinity (which Python's json accepts) would make a non-finite drafter.
    """
    if not path.exists():
        raise CheckpointFormatError([f"no {path.name}; pass a speculator checkpoint directory"], str(path.parent))
    if not path.is_file():
        raise CheckpointFormatError([f"{path.name} is not a file; {RECOVER}"], str(path.parent))
    size = path.stat().st_size
    if size == 0 or size > MAX_CONFIG_BYTES:
        what = "empty" if size == 0 else f"{size:,} bytes, more than any speculator config ({MAX_CONFIG_BYTES:,})"
        raise CheckpointFormatError([f"{path.name} is {what}; {RECOVER}"], str(path.parent))
    try:
        raw = json.loads(path.read_bytes().decode("utf-8-sig"), parse_constant=reject_json_constant)
    except OSError as error:
        raise CheckpointFormatError([f"{path.name} cannot be read ({error.strerror})"], str(path.parent)) from None
    except UnicodeDecodeError:
        raise CheckpointFormatError([f"{path.name} is not UTF-8 text; {RECOVER}"], str(path.parent)) from None
    except (ValueError, RecursionError) as error:  # JSONDecodeError, a huge integer, nesting too deep
        detail = "nested too deeply" if isinstance(error, RecursionError) else shorten(str(error), 120)
        if "integer string conversion" in detail:
            detail = "an integer with thousands of digits"
        raise CheckpointFormatError(
            [f"{path.name} is not valid JSON ({detail}); {RECOVER}"], str(path.parent)
        ) from None
    if not isinstance(raw, dict):
        raise CheckpointFormatError(
            [f"{path.name} holds a JSON {type(raw).__name__}, not an object; {RECOVER}"], str(path.parent)
        )
    return raw


def load_eagle3_config(directory: str | Path) -> tuple[Eagle3Config, list[str]]:
    path = Path(directory) / "config.json"
    return parse_eagle3_config(read_json_object(path), str(path))
