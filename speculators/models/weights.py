"""Reading and checking speculator checkpoints against the speculators format.

The tensor table (names, shapes, dtypes) is derived from the config, so a checkpoint is checked
the same way whether we wrote it, the reference library wrote it, or a converter produced it.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.errors import CheckpointFormatError, SpeculatorsError, name_some, shorten
from speculators.models.config import RECOVER, Eagle3Config, load_eagle3_config, reject_json_constant

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
    table.update(config.extra_tensors())
    return table


OPTIONAL_TENSORS = ("embed_tokens.weight",)
# Training-time copies of the verifier's head that some reference-library versions saved; vLLM does
# not expect them. Loading drops them with a note, `validate` flags them, `convert` removes them.
TRAINING_ONLY_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight")


MAX_TENSOR_PROBLEMS = 8  # shape and dtype problems listed one by one; the rest are counted


def check_tensor_layout(config: Eagle3Config, layout: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
    """Problems with names, shapes and dtypes; `layout` maps name -> (shape, safetensors dtype).

    Bounded: lists of names give a few examples, and past MAX_TENSOR_PROBLEMS wrong tensors one line
    counts the rest (a drafter of the wrong size has every tensor wrong)."""
    problems = []
    table = expected_tensors(config)
    table["embed_tokens.weight"] = ((config.verifier_vocab_size, config.hidden_size), "float")
    missing = [name for name in table if name not in layout and name not in OPTIONAL_TENSORS]
    if missing:
        problems.append(f"missing tensors: {name_some(missing)}")
    unexpected = sorted(name for name in layout if name not in table)
    if unexpected:
        problems.append(f"unexpected tensors (not in the format for this config): {name_some(unexpected)}")
    wrong: list[str] = []
    float_dtypes = set()
    for name, (shape, kind) in table.items():
        if name not in layout:
            continue
        actual_shape, dtype = layout[name]
        if tuple(actual_shape) != shape:
            wrong.append(f"{name} has shape {shorten(str(list(actual_shape)), 60)}, expected {list(shape)}")
        if kind == "float":
            float_dtypes.add(dtype)
            if dtype not in FLOAT_DTYPES:
                wrong.append(f"{name} has dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        elif kind == "int64" and dtype != "I64":
            wrong.append(f"{name} has dtype {dtype}, expected I64 (int64 offsets)")
        elif kind == "bool" and dtype != "BOOL":
            wrong.append(f"{name} has dtype {dtype}, expected BOOL")
    problems += wrong[:MAX_TENSOR_PROBLEMS]
    if len(wrong) > MAX_TENSOR_PROBLEMS:
        problems.append(f"and {len(wrong) - MAX_TENSOR_PROBLEMS} more tensors with a wrong shape or dtype")
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
    if path.exists() and not path.is_file():
        raise CheckpointFormatError([f"{WEIGHTS_FILE} is not a file; {RECOVER}"], str(directory))
    if not path.is_file():
        found = sorted(p.name for p in Path(directory).glob("*.safetensors")) + sorted(
            p.name for p in Path(directory).glob("*.bin")
        )
        hint = f" (found {name_some(found)}; run 'speculators convert')" if found else ""
        raise CheckpointFormatError([f"no {WEIGHTS_FILE}{hint}"], str(directory))
    return path


# safetensors dtype -> bits per element (the format's full list, as the installed reader accepts it)
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# A speculator's header (a few hundred tensors) is tens of KB; safetensors itself refuses 100 MB.
MAX_HEADER_BYTES = 16 * 2**20


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the safetensors header describes it (offsets are into the data after the header)."""

    shape: tuple[int, ...]
    dtype: str
    begin: int
    end: int


def corrupt(path: Path, detail: str) -> CheckpointFormatError:
    """The one problem a damaged weights file is: nothing in it can be trusted."""
    return CheckpointFormatError([f"{path.name} is truncated or corrupt ({shorten(detail, 160)}); {RECOVER}"])


def read_header_bytes(path: Path) -> tuple[bytes, int]:
    """The JSON header of a safetensors file and the size of the data after it, bounds checked."""
    if path.exists() and not path.is_file():
        raise corrupt(path, "a directory or special file, not a file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if size < 8 or len(prefix) != 8:
                raise corrupt(path, "empty file" if size == 0 else f"{size} bytes, too short for a header")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(size - 8, MAX_HEADER_BYTES):
                limit = "the file" if header_size > size - 8 else f"any speculator's ({MAX_HEADER_BYTES:,} bytes)"
                raise corrupt(path, f"its header claims {header_size:,} bytes, more than {limit}")
            header = handle.read(header_size)
    except OSError as error:
        raise CheckpointFormatError([f"{path.name} cannot be read ({error.strerror})"]) from None
    if len(header) != header_size:
        raise corrupt(path, "the file ended inside the header")
    return header, size - 8 - header_size


def parse_header(path: Path, header: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(header.decode("utf-8"), parse_constant=reject_json_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise corrupt(path, "its header is not JSON") from None
    if not isinstance(parsed, dict):
        raise corrupt(path, "its header is not a JSON object")
    metadata = parsed.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise corrupt(path, "its __metadata__ is not a mapping of strings")
    return parsed


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def tensor_entry(path: Path, name: str, info: Any) -> TensorEntry:
    """One header entry, checked the way the safetensors reader checks it."""
    where = f"tensor {shorten(name, 80)!r}"
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise corrupt(path, f"{where} has no dtype")
    dtype, shape, offsets = info["dtype"], info.get("shape"), info.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise corrupt(path, f"{where} has dtype {shorten(dtype, 20)!r}, which safetensors does not define")
    if not isinstance(shape, list) or not all(is_count(n) for n in shape):
        raise corrupt(path, f"{where} has no valid shape")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_count(n) for n in offsets):
        raise corrupt(path, f"{where} has no valid data_offsets")
    bits = math.prod(shape) * SAFETENSORS_DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise corrupt(path, f"{where} of shape {shorten(str(shape), 60)} {dtype} does not match its data size")
    return TensorEntry(tuple(shape), dtype, offsets[0], offsets[1])


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry in a safetensors file, checked before a byte of data is read: the header
    length inside the file (and sane), JSON, every dtype, shape and data offsets valid, the tensors
    tiling the data exactly. A file passing this loads with safetensors; one failing it (truncated,
    overwritten, not safetensors) is one CheckpointFormatError, never a reader's traceback or a
    header length that asks for exabytes of memory."""
    header, data_size = read_header_bytes(path)
    entries = {name: tensor_entry(path, name, info) for name, info in parse_header(path, header).items()}
    position = 0
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise corrupt(path, f"tensor {shorten(name, 80)!r} overlaps another or leaves a gap")
        position = entry.end
    if position != data_size:
        detail = "the file ends before its last tensor" if position > data_size else "bytes follow its last tensor"
        raise corrupt(path, f"{detail}: {data_size:,} bytes of data for {position:,} declared")
    return entries


def read_tensor_layout(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes from the safetensors header (validated), without reading the data."""
    return {name: (entry.shape, entry.dtype) for name, entry in read_safetensors_header(path).items()}


def load_tensors(path: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file whose header `read_safetensors_header` checked."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, RuntimeError, ValueError, TypeError) as error:  # changed under us
        raise corrupt(path, str(error)) from None


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, or one CheckpointFormatError for a damaged file."""
    return load_tensors(path, read_safetensors_header(path))


def nonfinite_problem(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Which floating-point tensors hold NaN or inf, and how many values each (one pass over each).

    A drafter with one NaN weight proposes garbage (or NaN logits) for every token; it must never be
    validated, loaded or published."""
    import torch

    counts = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            bad = tensor.numel() - int(torch.isfinite(tensor).sum())
            if bad:
                counts[name] = bad
    if not counts:
        return None
    named = name_some(f"{name} ({count:,} of {tensors[name].numel():,})" for name, count in counts.items())
    return (
        f"non-finite weights (NaN or inf) in {named}; the training diverged or the file was damaged: retrain "
        f"(a lower learning rate) or re-convert from a finite source"
    )


def read_checkpoint(directory: str | Path, drop_training_only: bool = True) -> Checkpoint:
    """Config + tensors of a speculators-format checkpoint, or one CheckpointFormatError listing problems.

    What every loading path uses (Eagle3Drafter.from_pretrained, serve, bench, evaluate, validate):
    nothing a file can hold raises anything else, and a checkpoint with non-finite weights is refused.
    `drop_training_only=False` keeps the verifier-head copies in the check, so `validate` flags them.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise SpeculatorsError(f"checkpoint directory {directory} does not exist")
    try:
        config, notes = load_eagle3_config(directory)  # sizes bounded before a tensor table is built
        path = weights_path(directory)
        layout = read_tensor_layout(path)
    except CheckpointFormatError as error:  # (named with the directory, as the problems below are)
        raise CheckpointFormatError(error.problems, str(directory)) from None
    dropped = sorted(name for name in layout if name in TRAINING_ONLY_TENSORS)
    if dropped and drop_training_only:
        notes.append(f"training-only tensors ignored: {name_some(dropped)}")
        layout = {name: info for name, info in layout.items() if name not in dropped}
    elif dropped:
        notes.append("'speculators convert' writes a copy without the training-only tensors")
    problems = check_tensor_layout(config, layout)
    if problems:
        raise CheckpointFormatError(problems, str(directory))
    try:
        tensors = load_tensors(path, layout)
    except CheckpointFormatError as error:
        raise CheckpointFormatError(error.problems, str(directory)) from None
    problems = check_vocab_mapping(config, tensors["d2t"], tensors["t2d"])
    nonfinite = nonfinite_problem(tensors)
    if nonfinite:
        problems.append(nonfinite)
    if problems:
        raise CheckpointFormatError(problems, str(directory))
    if (directory / "config.py").exists():
        notes.append("config.py (reference-library class code) ignored; it is never executed")
    return Checkpoint(directory=directory, config=config, tensors=tensors, notes=notes)
