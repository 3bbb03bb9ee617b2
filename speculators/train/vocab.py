"""`speculators vocab`: the draft vocabulary from token frequencies over supervised tokens.

Top D token ids by count (ties by smaller id), padded with the smallest unused ids when fewer than
D distinct tokens occur, sorted ascending; d2t = selected - arange(D) (offsets), t2d marks the
selection over the verifier vocab. Saved beside the store as `draft_vocab.safetensors` with a JSON
summary including coverage (share of supervised tokens inside the draft vocab).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators.atomic_io import exclusive_lock, write_text_atomic, write_with
from speculators.data.conversation import VALIDATION_PREFIX
from speculators.data.store import HiddenStateStore, StoreManifest
from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.weights import read_safetensors

if TYPE_CHECKING:
    import torch

VOCAB_FILE = "draft_vocab.safetensors"
VOCAB_SUMMARY = "draft_vocab.json"


@dataclass
class DraftVocab:
    selected: torch.Tensor  # [D] ascending target ids
    d2t: torch.Tensor  # [D] int64 offsets
    t2d: torch.Tensor  # [V] bool
    coverage: float
    distinct_tokens: int
    supervised_tokens: int


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """counts: [V] int64 frequencies of supervised tokens."""
    import torch

    vocab = counts.numel()
    if draft_vocab_size > vocab:
        raise SpeculatorsError(
            f"draft vocab size {draft_vocab_size} exceeds the verifier vocab {vocab}; choose at most {vocab}"
        )
    if draft_vocab_size < 1:
        raise SpeculatorsError(f"draft vocab size {draft_vocab_size} must be positive")
    ids = torch.arange(vocab)
    # Sort by count descending, then id ascending: a stable sort on -count over ascending ids does both.
    order = torch.sort(-counts, stable=True).indices
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.numel() < draft_vocab_size:
        unused = ids[~torch.isin(ids, seen)][: draft_vocab_size - seen.numel()]
        seen = torch.cat([seen, unused])
    selected = torch.sort(seen).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[selected] = True
    total = int(counts.sum())
    covered = int(counts[selected].sum())
    return DraftVocab(
        selected=selected,
        d2t=selected - torch.arange(draft_vocab_size),
        t2d=t2d,
        coverage=covered / total if total else 0.0,
        distinct_tokens=int((counts > 0).sum()),
        supervised_tokens=total,
    )


def count_supervised_tokens(store_dir: str | Path) -> tuple[torch.Tensor, StoreManifest]:
    """Token counts over the supervised tokens of the samples training may learn from: samples of a
    validation source are left out (their answers must not shape the vocabulary they are scored with).
    Each shard's checksum is checked first, as train checks it: a corrupted shard is named, never counted.
    An index's samples without states are counted from its tokens file (each checked against its key)."""
    import torch

    store = HiddenStateStore(store_dir)
    manifest = store.manifest()
    vocab = manifest.verifier.vocab_size
    counts = torch.zeros(vocab, dtype=torch.long)
    for entry in manifest.samples:
        if entry.id.startswith(VALIDATION_PREFIX):
            continue
        ids, mask = store.read_tokens(entry)
        counts += torch.bincount(ids[mask.bool()], minlength=vocab)
    return counts, manifest


def build_store_vocab(store_dir: str | Path, draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary of a store, written beside it under the store's lock (a datagen writing the
    store meanwhile is waited for)."""

    HiddenStateStore(store_dir).manifest()  # (one error, before a lock file is made, if it is no store)
    with exclusive_lock(store_dir, "hidden-state store"):
        return write_store_vocab(store_dir, draft_vocab_size)


def write_store_vocab(store_dir: str | Path, draft_vocab_size: int) -> DraftVocab:
    from safetensors.torch import save_file

    counts, manifest = count_supervised_tokens(store_dir)
    if not int(counts.sum()):  # a vocabulary of the smallest ids, chosen from nothing, is no result
        validation = sum(entry.id.startswith(VALIDATION_PREFIX) for entry in manifest.samples)
        raise SpeculatorsError(
            f"the store {store_dir} has no supervised tokens to count ({len(manifest.samples)} samples, {validation} "
            f"of them validation-only, {manifest.totals.supervised_tokens} supervised tokens in all); run datagen on "
            f"prompts with answers outside the validation sources"
        )
    vocab = select_draft_vocab(counts, draft_vocab_size)
    root = Path(store_dir)
    tensors = {"selected_ids": vocab.selected, "d2t": vocab.d2t, "t2d": vocab.t2d, "counts": counts}
    write_with(root / VOCAB_FILE, lambda tmp: save_file(tensors, str(tmp)))
    summary = {
        "draft_vocab_size": draft_vocab_size,
        "verifier_vocab_size": counts.numel(),
        "supervised_tokens": vocab.supervised_tokens,
        "distinct_supervised_tokens": vocab.distinct_tokens,
        "coverage": round(vocab.coverage, 6),
        "verifier_fingerprint": manifest.verifier.fingerprint,
        "data_version": manifest.data_version,
    }
    write_text_atomic(root / VOCAB_SUMMARY, json.dumps(summary, indent=2) + "\n")
    return vocab


def load_draft_vocab(store_dir: str | Path) -> dict[str, torch.Tensor]:
    """selected_ids [D], d2t [D], t2d [V] and counts [V], as `build_store_vocab` saved them."""

    path = Path(store_dir) / VOCAB_FILE
    if not path.is_file():
        raise SpeculatorsError(f"no {VOCAB_FILE} in {store_dir}; run 'speculators vocab --store {store_dir}' first")
    try:
        tensors = read_safetensors(path)
    except CheckpointFormatError:  # (a truncated or overwritten file: named below like one without the tensors)
        tensors = {}
    missing = [name for name in ("selected_ids", "d2t", "t2d", "counts") if name not in tensors]
    if missing:
        raise SpeculatorsError(
            f"{path} is damaged or not a draft vocabulary (no {', '.join(missing)}); run 'speculators vocab --store "
            f"{store_dir}' again"
        )
    return tensors
