"""The speculators checkpoint format: `config.json` of an EAGLE-3 speculator.

Written exactly as vLLM and the reference `speculators` library read it: every norm flag explicit,
a complete Hugging Face decoder config for the draft layers, and the nested `speculators_config`
(proposal methods and verifier). Reading is lenient where the reference library's own files
differ (extra keys such as `auto_map`, flags it leaves out); writing is always the full form.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculators import SPECULATORS_FORMAT_VERSION
from speculators.errors import CheckpointFormatError, SpeculatorsError

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

SUPPORTED_ALGORITHMS = ("eagle3",)
# Other algorithms of the reference library, recognised so the error can say what they are.
KNOWN_UNSUPPORTED_ALGORITHMS = ("eagle", "mtp", "dflash", "peagle", "independent")
DraftLayerType = Literal["llama", "qwen3"]
DRAFT_LAYER_TYPES: tuple[DraftLayerType, ...] = get_args(DraftLayerType)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
DTYPE_NAMES = ("bfloat16", "float16", "float32")
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
                f"transformer_layer_config.{name} is {value!r} ({type(value).__name__}), not {KIND_NAMES[kind]}; "
                f"write it as {KIND_NAMES[kind]} in the speculator's config.json"
            )
    rope = layer.get("rope_parameters") or {}
    rope_type, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
    if not isinstance(rope_type, str) or isinstance(theta, bool) or not isinstance(theta, int | float):
        raise SpeculatorsError(
            f"transformer_layer_config.rope_parameters {rope!r} needs a string rope_type and a numeric rope_theta; "
            f"fix them in the speculator's config.json"
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
    from huggingface_hub.errors import StrictDataclassError
    from transformers import LlamaConfig, Qwen3Config

    config_class = LlamaConfig if model_type == "llama" else Qwen3Config
    values = {k: v for k, v in layer_config.items() if k not in ("transformers_version", "architectures")}
    if "torch_dtype" in values:  # transformers 4.x name
        values.setdefault("dtype", values.pop("torch_dtype"))
    values.setdefault("num_hidden_layers", 1)
    try:
        hf_config = config_class(**values)
    except StrictDataclassError as error:
        raise ValueError(
            f"transformer_layer_config is not a valid {config_class.__name__} ({' '.join(str(error).split())}); "
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
    settings = ", ".join(f"{k}={layer_config[k]}" for k in keys)
    return f"transformer_layer_config sets {settings} but no draft layer is sliding_attention: full attention, as vLLM"


class Eagle3Config(BaseModel):
    """Top level of an EAGLE-3 speculator `config.json`."""

    model_config = ConfigDict(extra="allow")

    speculators_model_type: str = "eagle3"
    architectures: list[str] = Field(default_factory=lambda: ["Eagle3Speculator"])
    transformer_layer_config: dict[str, Any]
    draft_vocab_size: int = Field(gt=0)
    target_hidden_size: int | None = None
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
        return value

    @field_validator("transformer_layer_config")
    @classmethod
    def _complete_layer(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            completed = complete_layer_config(value)
            DraftLayerConfig.from_dict(completed)  # the typed view the drafter reads must build
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
                f"eagle_aux_hidden_state_layer_ids {value} must be 3 distinct non-negative verifier "
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
        return self

    # Derived sizes, named for what they are.
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

    @property
    def draft_layer_type(self) -> DraftLayerType:
        return self.layer.model_type

    @property
    def num_aux_states(self) -> int:
        return 3

    @property
    def speculative_tokens(self) -> int:
        methods = self.speculators_config.proposal_methods
        default = [m for m in methods if m.proposal_type == self.speculators_config.default_proposal_method]
        return (default or methods)[0].speculative_tokens

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
        from speculators.atomic_io import write_text_atomic

        path = Path(directory) / "config.json"
        write_text_atomic(path, json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n")
        return path


def build_eagle3_config(
    *,
    verifier_name_or_path: str,
    verifier_architectures: list[str],
    verifier_hidden_size: int,
    verifier_vocab_size: int,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    rms_norm_eps: float = 1e-6,
    max_position_embeddings: int = 4096,
    rope_parameters: dict[str, Any] | None = None,
    draft_layer_type: DraftLayerType = "llama",
    num_draft_layers: int = 1,
    hidden_size: int | None = None,
    speculative_tokens: int = 3,
    norm_before_residual: bool = True,
    norm_before_fc: bool = True,
    fc_norm: bool = False,
    norm_output: bool = True,
    dtype: str = "bfloat16",
) -> Eagle3Config:
    """A new drafter's config; defaults follow the reference library's for new drafters."""
    hidden = hidden_size or verifier_hidden_size
    layer: dict[str, Any] = {
        "model_type": draft_layer_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_draft_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "max_position_embeddings": max_position_embeddings,
        "vocab_size": verifier_vocab_size,
    }
    if rope_parameters:
        layer["rope_parameters"] = dict(rope_parameters)
    return Eagle3Config(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=None if verifier_hidden_size == hidden else verifier_hidden_size,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        norm_before_residual=norm_before_residual,
        norm_before_fc=norm_before_fc,
        fc_norm=fc_norm,
        norm_output=norm_output,
        dtype=dtype,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[ProposalMethod(speculative_tokens=speculative_tokens)],
            verifier=VerifierInfo(name_or_path=verifier_name_or_path, architectures=verifier_architectures),
        ),
    )


def format_validation_error(error: ValidationError) -> list[str]:
    """pydantic's errors as short sentences: 'field.path: message'."""
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        problems.append(f"{where}: {message}")
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
        notes.append(f"reference-library keys ignored: {', '.join(ignored)}")
    try:
        config = Eagle3Config(**raw)
    except ValidationError as error:
        raise CheckpointFormatError(format_validation_error(error)) from None
    return config, notes


def load_eagle3_config(directory: str | Path) -> tuple[Eagle3Config, list[str]]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise SpeculatorsError(f"no config.json in {directory}; pass a speculator checkpoint directory")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise CheckpointFormatError([f"config.json is not valid JSON ({error})"], str(directory)) from None
    return parse_eagle3_config(raw, str(path))
