"""`speculators convert`: foreign EAGLE-3 checkpoints -> the speculators format vLLM serves.

Sources understood:
- the EAGLE-3 research layout (`midlayer.*` tensors, a Llama-style `config.json` with
  `draft_vocab_size`, weights in `pytorch_model.bin` or safetensors);
- checkpoints of the reference `speculators` library (possibly with `embed_tokens.weight`,
  `config.py`, `auto_map` and extra keys) and our own: re-emitted in the full explicit form;
- the parallel drafters (z-lab DFlash, the reference library's DFlash and P-EAGLE): the checkpoint's
  algorithm picks its converter in `speculators.checkpoint.convert_parallel`.

The research config cannot tell the aux layer ids or the norm placement; they come from flags,
defaulting to what the research code does (raw residual, no fc norm, un-normed output) and the
verifier's default aux ids. The command's settings come whole: `convert_checkpoint(ConvertSettings)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from speculators.atomic_io import atomic_directory
from speculators.checkpoint.convert_parallel import (
    VerifierFit,
    convert_parallel,
    parallel_algorithm_of,
    registered_reader,
    write_parallel,
)
from speculators.checkpoint.validation import check_against_verifier, validate_checkpoint
from speculators.errors import CheckpointFormatError, SpeculatorsError, shorten
from speculators.models.config import (
    Eagle3Config,
    ProposalMethod,
    SpeculatorsConfig,
    VerifierInfo,
    format_validation_error,
    parse_eagle3_config,
    read_json_object,
)
from speculators.models.eagle3 import TORCH_DTYPES, is_speculator_checkpoint
from speculators.models.weights import TRAINING_ONLY_TENSORS, nonfinite_problem, read_safetensors
from speculators.settings import ConvertSettings
from speculators.verifier.architectures import text_config_of
from speculators.verifier.loading import checkpoint_verifier_name, default_aux_layer_ids, load_verifier_config

if TYPE_CHECKING:
    import torch

RESEARCH_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
)


@dataclass
class ConversionResult:
    output: Path
    source_layout: str
    notes: list[str] = field(default_factory=list)
    checked: str = "validated"  # what was checked before writing (parallel drafters: names and shapes)


def read_source_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: safetensors (single or sharded) or pytorch_model.bin.

    A damaged file is one CheckpointFormatError naming it, and so are non-finite weights: a drafter
    with NaN or inf values is never converted (and so never written)."""

    # Safetensors when there are any (the pickles beside them are older copies), else the pickles.
    paths = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin")) + sorted(directory.glob("*.pt"))
    if not paths:
        raise SpeculatorsError(f"no weights (*.safetensors, *.bin, *.pt) in {directory}; pass a checkpoint directory")
    tensors: dict[str, torch.Tensor] = {}
    try:
        for path in paths:
            tensors.update(read_safetensors(path) if path.suffix == ".safetensors" else read_pickled_tensors(path))
    except CheckpointFormatError as error:
        raise CheckpointFormatError(error.problems, str(directory)) from None
    problem = nonfinite_problem(tensors)
    if problem:
        raise CheckpointFormatError([problem], str(directory))
    return tensors


def read_pickled_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A research checkpoint's pickled state dict; weights_only refuses anything but tensors."""
    import torch

    if not path.is_file() or path.stat().st_size == 0:
        raise CheckpointFormatError([f"{path.name} is empty or not a file; re-download the checkpoint"])
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated zip, a bad pickle, a refused object: torch raises many kinds
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointFormatError(
            [f"{path.name} is truncated or corrupt ({shorten(first, 160)}); re-download the checkpoint"]
        ) from None
    if not isinstance(loaded, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in loaded.items()
    ):
        raise CheckpointFormatError(
            [f"{path.name} holds {type(loaded).__name__}, not a mapping of tensor names to tensors"]
        )
    return loaded


def detect_layout(raw_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    if "speculators_model_type" in raw_config:
        return "speculators"
    if any(name.startswith(("midlayer.", "model.midlayer.")) for name in tensors):
        return "research-eagle3"
    if "fusion_fc.weight" in tensors or any(name.startswith("transformer.") for name in tensors):
        raise SpeculatorsError(
            "this looks like an EAGLE-1/HASS checkpoint (fusion_fc / transformer.*); only EAGLE-3 converts so far"
        )
    raise SpeculatorsError(
        "the source is neither a speculators checkpoint nor an EAGLE-3 research checkpoint (no midlayer.* tensors)"
    )


def research_tensor_name(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("midlayer."):
        name = "layers.0." + name.removeprefix("midlayer.")
    return name


def convert_checkpoint(settings: ConvertSettings) -> ConversionResult:
    """Convert `settings.source` to a validated speculators-format checkpoint at `settings.output` (an
    existing checkpoint there is replaced; any other non-empty folder only with `overwrite`)."""
    source = Path(settings.source)
    raw_config, tensors = read_source(source)
    algorithm = parallel_algorithm_of(raw_config) or "eagle3"
    if settings.algorithm is not None and settings.algorithm != algorithm:
        raise SpeculatorsError(
            f"{source} is a {algorithm} checkpoint, not {settings.algorithm}; drop --algorithm or pass the "
            f"{settings.algorithm} checkpoint meant"
        )
    verifier_config, verifier_location = load_verifier_config(settings.verifier)
    if algorithm != "eagle3":
        return convert_parallel_checkpoint(algorithm, raw_config, tensors, settings, verifier_config, verifier_location)
    layout = detect_layout(raw_config, tensors)
    notes: list[str] = []
    if layout == "speculators":
        values = speculators_config_values(raw_config, source, settings, notes)
    else:
        values = research_values(raw_config, tensors, settings, text_config_of(verifier_config).num_hidden_layers)
        tensors = {research_tensor_name(name): tensor for name, tensor in tensors.items()}
    values["speculators_config"]["verifier"] = {
        "name_or_path": checkpoint_verifier_name(settings.verifier, verifier_location, settings.verifier_name),
        "architectures": list(verifier_config.architectures or []),
    }
    if values.get("eagle_aux_hidden_state_layer_ids") is None:
        layers = text_config_of(verifier_config).num_hidden_layers
        values["eagle_aux_hidden_state_layer_ids"] = default_aux_layer_ids(layers)
        notes.append(f"aux layer ids set to the verifier default {values['eagle_aux_hidden_state_layer_ids']}")

    tensors = served_tensors(tensors, settings.keep_embeddings, notes)
    float_dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    values["dtype"] = settings.dtype or (float_dtypes.pop() if len(float_dtypes) == 1 else "bfloat16")
    config = converted_config(values, source)
    problems = check_against_verifier(config, verifier_config, "embed_tokens.weight" in tensors)
    if problems:
        raise SpeculatorsError(f"{source} does not fit verifier {settings.verifier}: {'; '.join(problems)}")
    output = Path(settings.output)
    write_converted(config, tensors, output, settings.overwrite, source)
    return ConversionResult(output=output, source_layout=layout, notes=notes)


def convert_parallel_checkpoint(
    algorithm: str,
    raw_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    settings: ConvertSettings,
    verifier_config: Any,
    verifier_location: str,
) -> ConversionResult:
    """A DFlash or P-EAGLE source converted by its algorithm's converter and written in our format."""
    source = Path(settings.source)
    name = checkpoint_verifier_name(settings.verifier, verifier_location, settings.verifier_name)
    conversion = convert_parallel(
        algorithm, raw_config, tensors, source, settings, VerifierFit.of(verifier_config, name, verifier_location)
    )
    output = Path(settings.output)
    write_parallel(conversion, output, settings.overwrite)
    layout = algorithm if "speculators_model_type" in raw_config else f"z-lab-{algorithm}"
    checked = "validated" if registered_reader(algorithm) else "tensor names and shapes checked"
    return ConversionResult(output, layout, conversion.notes, checked=checked)


def read_source(source: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The source checkpoint's config.json and tensors."""
    if not (source / "config.json").exists():
        raise SpeculatorsError(f"no config.json in {source}; pass the checkpoint directory to convert")
    try:
        raw_config = read_json_object(source / "config.json")
    except CheckpointFormatError as error:
        raise CheckpointFormatError(error.problems, str(source)) from None
    return raw_config, read_source_tensors(source)


def speculators_config_values(
    raw_config: dict[str, Any], source: Path, settings: ConvertSettings, notes: list[str]
) -> dict[str, Any]:
    """A speculators-format source's config values (parsed leniently, its notes kept), with the flags given
    over them."""
    config, parse_notes = parse_eagle3_config(raw_config, str(source / "config.json"))
    notes += parse_notes
    values = config.model_dump()
    values.update(settings.norm_overrides())
    if settings.aux_layer_ids is not None:
        values["eagle_aux_hidden_state_layer_ids"] = settings.aux_layer_ids
    if settings.speculative_tokens is not None:
        values["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = settings.speculative_tokens
    return values


def research_values(
    raw_config: dict[str, Any], tensors: dict[str, torch.Tensor], settings: ConvertSettings, verifier_layers: int
) -> dict[str, Any]:
    """A research source's config values with the flags given, its aux layer ids the flag's, else its
    `eagle_config`'s, else the verifier's default."""
    values = research_config_values(raw_config, tensors, settings.norm_overrides(), settings.speculative_tokens or 3)
    eagle_config = raw_config.get("eagle_config")
    values["eagle_aux_hidden_state_layer_ids"] = (
        settings.aux_layer_ids
        or (eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None)
        or default_aux_layer_ids(verifier_layers)
    )
    return values


def served_tensors(
    tensors: dict[str, torch.Tensor], keep_embeddings: bool, notes: list[str]
) -> dict[str, torch.Tensor]:
    """The tensors vLLM serves: training-only ones dropped, and the embeddings unless `keep_embeddings`."""
    training_only = sorted(name for name in tensors if name in TRAINING_ONLY_TENSORS)
    if training_only:
        tensors = {name: t for name, t in tensors.items() if name not in training_only}
        notes.append(f"training-only tensors dropped: {', '.join(training_only)}")
    embeddings = tensors.pop("embed_tokens.weight", None)
    if embeddings is not None:
        if keep_embeddings:
            tensors["embed_tokens.weight"] = embeddings
        else:
            notes.append(
                "embed_tokens.weight dropped (vLLM shares the verifier's embeddings); --keep-embeddings keeps it"
            )
    return tensors


def converted_config(values: dict[str, Any], source: Path) -> Eagle3Config:
    """The converted checkpoint's config; values the format refuses are one CheckpointFormatError."""
    try:
        return Eagle3Config(**values)
    except ValidationError as error:
        raise CheckpointFormatError(format_validation_error(error), str(source)) from None
    except Exception as error:  # anything else building the config raises
        raise CheckpointFormatError([str(error)], str(source)) from None


def write_converted(
    config: Eagle3Config, tensors: dict[str, torch.Tensor], output: Path, overwrite: bool, source: Path
) -> None:
    """The tensors in the config's dtype (the vocabulary maps as vLLM reads them) and the config, written
    and validated in a temporary folder that becomes `output` only when valid."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = TORCH_DTYPES[config.dtype]
    out_tensors = {
        name: (t.to(torch_dtype) if t.is_floating_point() else t).contiguous() for name, t in tensors.items()
    }
    if "d2t" in out_tensors:
        out_tensors["d2t"] = out_tensors["d2t"].to(torch.long)
    if "t2d" in out_tensors:
        out_tensors["t2d"] = out_tensors["t2d"].to(torch.bool)
    with atomic_directory(output, is_speculator_checkpoint, overwrite) as tmp:
        save_file(out_tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save(tmp)
        report = validate_checkpoint(tmp)
        if not report.ok:
            raise CheckpointFormatError(report.problems, str(source))


def research_config_values(
    raw: dict[str, Any], tensors: dict[str, torch.Tensor], overrides: Mapping[str, bool | None], speculative_tokens: int
) -> dict[str, Any]:
    """Speculators config values from a research EAGLE-3 config (Llama-style, with draft_vocab_size)."""
    names = {research_tensor_name(name) for name in tensors}
    lm_head = tensors.get("lm_head.weight")
    fc = tensors.get("fc.weight") if "fc.weight" in tensors else tensors.get("model.fc.weight")
    if lm_head is None or fc is None:
        raise SpeculatorsError("the research checkpoint lacks lm_head.weight or fc.weight")
    if lm_head.dim() != 2 or fc.dim() != 2:
        raise CheckpointFormatError(
            [f"lm_head.weight {list(lm_head.shape)} and fc.weight {list(fc.shape)} must be matrices"]
        )
    layer = {key: raw[key] for key in RESEARCH_LAYER_KEYS if key in raw}
    layer["model_type"] = raw.get("model_type", "llama") if raw.get("model_type") in ("llama", "qwen3") else "llama"
    if "layers.0.self_attn.q_norm.weight" in names:
        layer["model_type"] = "qwen3"
    layer["num_hidden_layers"] = len({name.split(".")[1] for name in names if name.startswith("layers.")}) or 1
    hidden = research_size(raw, "hidden_size", int(fc.shape[0]))
    if "head_dim" not in layer:
        layer["head_dim"] = hidden // research_size(raw, "num_attention_heads")
    verifier_hidden = int(fc.shape[1]) // 3
    # The research code feeds the raw fc output into the residual and has no fc-side norm.
    detected = {
        "norm_before_residual": False,
        "norm_before_fc": "input_norm.weight" in names,
        "fc_norm": any(n.startswith("fc_norm.") for n in names),
        "norm_output": False,
    }
    detected.update({k: v for k, v in overrides.items() if v is not None})
    return {
        "transformer_layer_config": layer,
        "draft_vocab_size": research_size(raw, "draft_vocab_size", int(lm_head.shape[0])),
        "target_hidden_size": raw.get("target_hidden_size") or (verifier_hidden if verifier_hidden != hidden else None),
        **detected,
        "speculators_config": SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[ProposalMethod(speculative_tokens=speculative_tokens)],
            verifier=VerifierInfo(),
        ).model_dump(),
    }


def research_size(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer of a research config (the config's own value, else `default` from a tensor)."""
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        found = "missing" if value is None else shorten(repr(value), 40)
        raise CheckpointFormatError(
            [f"the research config's {key} is {found}; it must be a positive integer: fix config.json"]
        )
    return value
