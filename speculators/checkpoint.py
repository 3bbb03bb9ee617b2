"""Reading and checking speculator checkpoints against the speculators format.

The tensor table (names, shapes, dtypes) is derived from the config, so a checkpoint is checked
the same way whether we wrote it, the reference library wrote it, or a converter produced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from speculators.config import Eagle3Config, load_eagle3_config
from speculators.errors import CheckpointFormatError, SpeculatorsError

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = ("BF16", "F16", "F32")
WEIGHTS_FILE = "model.safetensors"


def expected_tensors(config: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) where kind is 'float', 'int64' or 'bool'; the spec's table."""
    layer = config.layer
    hidden, verifier_hidden = config.hidden_size, config.verifier_hidden_size
    heads, kv_heads, head_dim = layer.num_attention_heads, layer.num_key_value_heads, layer.head_dim
    inner = layer.intermediate_size
    aux = config.num_aux_states
    table: dict[str, tuple[tuple[int, ...], str]] = {"fc.weight": ((hidden, aux * verifier_hidden), "float")}
    if config.norm_before_fc:
        table["input_norm.weight"] = ((aux * verifier_hidden,), "float")
    if config.fc_norm:
        for i in range(aux):
            table[f"fc_norm.{i}.weight"] = ((verifier_hidden,), "float")
    for index in range(config.num_draft_layers):
        prefix = f"layers.{index}."
        width = 2 * hidden if index == 0 else hidden
        table[prefix + "self_attn.q_proj.weight"] = ((heads * head_dim, width), "float")
        table[prefix + "self_attn.k_proj.weight"] = ((kv_heads * head_dim, width), "float")
        table[prefix + "self_attn.v_proj.weight"] = ((kv_heads * head_dim, width), "float")
        table[prefix + "self_attn.o_proj.weight"] = ((hidden, heads * head_dim), "float")
        if layer.attention_bias:
            table[prefix + "self_attn.q_proj.bias"] = ((heads * head_dim,), "float")
            table[prefix + "self_attn.k_proj.bias"] = ((kv_heads * head_dim,), "float")
            table[prefix + "self_attn.v_proj.bias"] = ((kv_heads * head_dim,), "float")
            table[prefix + "self_attn.o_proj.bias"] = ((hidden,), "float")
        if layer.model_type == "qwen3":
            table[prefix + "self_attn.q_norm.weight"] = ((head_dim,), "float")
            table[prefix + "self_attn.k_norm.weight"] = ((head_dim,), "float")
        table[prefix + "input_layernorm.weight"] = ((hidden,), "float")
        if index == 0:
            table[prefix + "hidden_norm.weight"] = ((hidden,), "float")
        table[prefix + "post_attention_layernorm.weight"] = ((hidden,), "float")
        table[prefix + "mlp.gate_proj.weight"] = ((inner, hidden), "float")
        table[prefix + "mlp.up_proj.weight"] = ((inner, hidden), "float")
        table[prefix + "mlp.down_proj.weight"] = ((hidden, inner), "float")
        if layer.mlp_bias:
            for proj, size in (("gate_proj", inner), ("up_proj", inner), ("down_proj", hidden)):
                table[prefix + f"mlp.{proj}.bias"] = ((size,), "float")
    table["norm.weight"] = ((hidden,), "float")
    table["lm_head.weight"] = ((config.draft_vocab_size, hidden), "float")
    table["d2t"] = ((config.draft_vocab_size,), "int64")
    table["t2d"] = ((config.verifier_vocab_size,), "bool")
    return table


OPTIONAL_TENSORS = ("embed_tokens.weight",)
# Training-time copies of the verifier's head that some reference-library versions saved; vLLM does
# not expect them. Loading drops them with a note, `validate` flags them, `convert` removes them.
TRAINING_ONLY_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight")


def check_tensor_layout(config: Eagle3Config, layout: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Problems with names, shapes and dtypes; `layout` maps name -> (shape, safetensors dtype)."""
    problems = []
    table = expected_tensors(config)
    table["embed_tokens.weight"] = ((config.verifier_vocab_size, config.hidden_size), "float")
    missing = [name for name in table if name not in layout and name not in OPTIONAL_TENSORS]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    unexpected = sorted(name for name in layout if name not in table)
    if unexpected:
        problems.append(f"unexpected tensors (not in the format for this config): {', '.join(unexpected)}")
    float_dtypes = set()
    for name, (shape, kind) in table.items():
        if name not in layout:
            continue
        actual_shape, dtype = layout[name]
        if tuple(actual_shape) != shape:
            problems.append(f"{name} has shape {list(actual_shape)}, expected {list(shape)}")
        if kind == "float":
            float_dtypes.add(dtype)
            if dtype not in FLOAT_DTYPES:
                problems.append(f"{name} has dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        elif kind == "int64" and dtype != "I64":
            problems.append(f"{name} has dtype {dtype}, expected I64 (int64 offsets)")
        elif kind == "bool" and dtype != "BOOL":
            problems.append(f"{name} has dtype {dtype}, expected BOOL")
    if len(float_dtypes & set(FLOAT_DTYPES)) > 1:
        problems.append(f"weights mix dtypes {', '.join(sorted(float_dtypes))}; save them in one dtype")
    return problems


def check_vocab_mapping(config: Eagle3Config, d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    """d2t offsets must land inside the verifier vocab, ascending, and agree with t2d."""
    import torch

    problems = []
    vocab = config.verifier_vocab_size
    targets = torch.arange(d2t.numel()) + d2t.long()
    outside = ((targets < 0) | (targets >= vocab)).nonzero().flatten()
    if outside.numel():
        first = int(outside[0])
        problems.append(
            f"d2t sends {outside.numel()} draft ids outside the verifier vocab of {vocab} "
            f"(draft id {first} -> target id {int(targets[first])})"
        )
        return problems
    if targets.numel() > 1 and (targets[1:] <= targets[:-1]).any():
        problems.append("d2t target ids are not strictly ascending (lm_head rows must follow target id order)")
    if t2d.numel() == vocab:
        expected_t2d = torch.zeros(vocab, dtype=torch.bool)
        expected_t2d[targets] = True
        if not torch.equal(expected_t2d, t2d.bool()):
            mismatched = int((expected_t2d != t2d.bool()).sum())
            problems.append(f"t2d disagrees with d2t at {mismatched} verifier token ids")
    return problems


@dataclass
class Checkpoint:
    directory: Path
    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)


def weights_path(directory: str | Path) -> Path:
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        found = sorted(p.name for p in Path(directory).glob("*.safetensors")) + sorted(
            p.name for p in Path(directory).glob("*.bin")
        )
        hint = f" (found {', '.join(found)}; run 'speculators convert')" if found else ""
        raise CheckpointFormatError([f"no {WEIGHTS_FILE}{hint}"], str(directory))
    return path


def read_tensor_layout(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes from the safetensors header, without reading the data."""
    import json
    import struct

    with open(path, "rb") as handle:
        header_size_bytes = handle.read(8)
        if len(header_size_bytes) != 8:
            raise CheckpointFormatError([f"{path.name} is truncated (no safetensors header)"])
        (header_size,) = struct.unpack("<Q", header_size_bytes)
        header_bytes = handle.read(header_size)
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointFormatError([f"{path.name} has a corrupt safetensors header"]) from None
    header.pop("__metadata__", None)
    return {name: (tuple(info["shape"]), info["dtype"]) for name, info in header.items()}


def read_checkpoint(directory: str | Path, drop_training_only: bool = True) -> Checkpoint:
    """Config + tensors of a speculators-format checkpoint, or one CheckpointFormatError listing problems.

    `drop_training_only=False` keeps the verifier-head copies in the check, so `validate` flags them.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SpeculatorsError(f"checkpoint directory {directory} does not exist")
    config, notes = load_eagle3_config(directory)
    path = weights_path(directory)
    layout = read_tensor_layout(path)
    dropped = sorted(name for name in layout if name in TRAINING_ONLY_TENSORS)
    if dropped and drop_training_only:
        notes.append(f"training-only tensors ignored: {', '.join(dropped)}")
        layout = {name: info for name, info in layout.items() if name not in dropped}
    elif dropped:
        notes.append("'speculators convert' writes a copy without the training-only tensors")
    problems = check_tensor_layout(config, layout)
    if problems:
        raise CheckpointFormatError(problems, str(directory))
    from safetensors.torch import load_file

    tensors = {name: tensor for name, tensor in load_file(str(path)).items() if name in layout}
    problems = check_vocab_mapping(config, tensors["d2t"], tensors["t2d"])
    if problems:
        raise CheckpointFormatError(problems, str(directory))
    if (directory / "config.py").exists():
        notes.append("config.py (reference-library class code) ignored; it is never executed")
    return Checkpoint(directory=directory, config=config, tensors=tensors, notes=notes)
