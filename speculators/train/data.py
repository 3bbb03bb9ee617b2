"""Training data from a hidden-state store: shifted samples packed into fixed token budgets.

Per sample (docs/eagle3.md): input_ids = x[1:], aux = g[:-1], target states = y[1:],
loss_mask = mask[1:], positions 1..T-1 (with images: the stored drafter positions of x[:-1], plus
one). Samples are packed in a seeded, per-epoch order into
sequences of at most `token_budget` tokens (batch dimension 1); document ids keep attention and
step targets inside their own sample. The train/validation split is a hash of the sample id, so
it never changes when the store grows. A pack is moved to its device, and noised for training
(--aux-noise), by the functions beside its record.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from speculators.data.conversation import VALIDATION_PREFIX
from speculators.data.spool import STREAM_SPOOL_ENV, Spool, UnitSample, wait_for_unit
from speculators.data.store import HiddenStateStore, SampleEntry, index_refusal
from speculators.errors import SpeculatorsError
from speculators.settings import aux_layers_missing_problem
from speculators.train.plan import pack_plan

if TYPE_CHECKING:
    import torch

    from speculators.data.store import StoredSample


@dataclass
class Pack:
    input_ids: torch.Tensor  # [1, T] long
    aux_hidden_states: torch.Tensor  # [1, T, n, H]: the drafter's n aux layers (EAGLE-3: 3)
    target_hidden_states: torch.Tensor  # [1, T, H]
    loss_mask: torch.Tensor  # [1, T] bool
    position_ids: torch.Tensor  # [1, T] long, restarting at 1 per document
    document_ids: torch.Tensor  # [1, T] long

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def with_aux_noise(pack: Pack, scale: float, seed: int, draw: int) -> Pack:
    """The pack with Gaussian noise on its aux states, `scale` x each state's RMS (per token and layer:
    the layers' scales differ by orders of magnitude). Seeded per draw, so a resumed run adds the same."""
    from dataclasses import replace

    import torch

    aux = pack.aux_hidden_states.float()
    generator = torch.Generator(device=aux.device).manual_seed(seed * 1_000_003 + draw)
    noise = torch.randn(aux.shape, generator=generator, device=aux.device, dtype=aux.dtype)
    rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = aux + noise.mul_(rms * scale)
    return replace(pack, aux_hidden_states=noisy.to(pack.aux_hidden_states.dtype))


def to_device(pack: Pack, device: torch.device) -> Pack:
    from dataclasses import fields, replace

    return replace(pack, **{f.name: getattr(pack, f.name).to(device) for f in fields(pack)})


def is_validation(sample_id: str, share: float) -> bool:
    """Samples from validation sources always; the others by a hash of their id, a `share` of them."""

    if sample_id.startswith(VALIDATION_PREFIX):
        return True
    bucket = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < share


class PackedStore:
    """Packs of a store's training or validation samples, deterministic per (seed, epoch). The states are read
    from the store, or, with `spool` (a streamed run, speculators/train/stream.py), from the spool's unit of the
    step being trained (`open_unit`), which names for each sample its shard in the unit or in the store."""

    def __init__(
        self,
        store_dir: str | Path,
        token_budget: int,
        split: str = "train",
        validation_share: float = 0.05,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        loss_positions: str = "answers",
        spool: str | Path | None = None,
    ):
        self.store = HiddenStateStore(store_dir)
        self.manifest = self.store.manifest()
        self.token_budget = token_budget
        self.seed = seed
        self.dtype = dtype
        self.score_all = loss_positions == "all"
        entries = [e for e in self.manifest.samples if e.num_tokens >= 3 and e.supervised_tokens > 0]
        self.entries = [e for e in entries if is_validation(e.id, validation_share) == (split == "validation")]
        self.verified: set[str] = set()  # shards whose checksum this run has checked
        self.aux_index: list[int] | None = None  # the store's aux states the packs hold (None: all of them)
        self.spool = Spool(spool) if spool is not None else None
        self.unit_samples: dict[int, tuple[HiddenStateStore, UnitSample]] = {}  # index -> where the open unit has it
        self.wait_seconds = 0.0  # waited for units
        if split == "train" and not self.entries:
            raise SpeculatorsError(
                f"the store {store_dir} has no training samples with supervised tokens; run datagen on more data"
            )
        # A streamed run (its trainer, fed by the spool, and its producers) reads the states the store lacks from
        # the spool.
        streamed = spool is not None or os.environ.get(STREAM_SPOOL_ENV)
        refusal = None if streamed else index_refusal(self.manifest, store_dir, self.entries)
        if refusal:
            raise SpeculatorsError(refusal)

    def read_aux_layers(self, layer_ids: list[int]) -> None:
        """Packs hold the aux states of `layer_ids` (the drafter's, in its order) of the store's layers: a store
        keeps every layer its variant's drafters read, each drafter reads its own."""
        stored = self.manifest.aux_layer_ids
        problem = aux_layers_missing_problem(layer_ids, stored)
        if problem:
            raise SpeculatorsError(f"store {self.store.root}: {problem}")
        index = [stored.index(i) for i in layer_ids]
        self.aux_index = None if index == list(range(len(stored))) else index

    def open_unit(self, unit: int, timeout: float) -> None:
        """Read the samples of spool unit `unit` from now on (waiting for it); the earlier unit is let go."""
        assert self.spool is not None
        self.wait_seconds += wait_for_unit(self.spool, unit, timeout)
        record = self.spool.unit_record(unit)
        here = HiddenStateStore(self.spool.unit_dir(unit))
        self.unit_samples = {s.index: (here if s.place == "unit" else self.store, s) for s in record.samples}

    def read_sample(self, index: int, entry: SampleEntry) -> StoredSample:
        """The sample's states from the store, or from where the open spool unit says (its checksum checked)."""
        if self.spool is None:
            # Each shard's checksum is checked at its first read in a run (a bit flip is named, never
            # trained on); later epochs re-read it without hashing it again.
            sample = self.store.read_sample(entry, verify=entry.key not in self.verified, dtype=self.dtype)
            self.verified.add(entry.key)
            return sample
        if index not in self.unit_samples:
            raise SpeculatorsError(
                f"sample {entry.id} is not in the spool unit the trainer reads ({self.spool.root}): the producers "
                f"follow another plan; run the streamed training again with the same settings"
            )
        store, placed = self.unit_samples[index]
        located = entry.model_copy(update={"checksum": placed.checksum, "bytes": placed.bytes})
        return store.read_sample(located, verify=True, dtype=self.dtype)  # (a unit's shard is read once)

    @property
    def lengths(self) -> tuple[int, ...]:
        """The entries' tokens, in the store's order (what the training plan packs)."""
        return tuple(e.num_tokens for e in self.entries)

    def pack_plan(self, epoch: int) -> list[list[int]]:
        """Entry indices per pack; the order is shuffled per epoch (not for validation: seed < 0)."""
        return pack_plan(self.lengths, self.token_budget, self.seed, epoch)

    def load_pack(self, indices: list[int]) -> Pack:
        import torch

        parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("ids", "aux", "target", "mask", "pos", "doc")}
        room = self.token_budget
        for doc, index in enumerate(indices):
            sample = self.read_sample(index, self.entries[index])
            length = min(sample.input_ids.numel() - 1, room)
            room -= length
            parts["ids"].append(sample.input_ids[1 : length + 1])
            aux = sample.aux_hidden_states[:length]
            parts["aux"].append(aux if self.aux_index is None else aux[:, self.aux_index])
            parts["target"].append(sample.target_hidden_states[1 : length + 1])
            mask = sample.loss_mask[1 : length + 1]
            # Every position's target is the verifier's own distribution, so prompt positions teach
            # the drafter the verifier too, at the cost of scoring them.
            parts["mask"].append(torch.ones_like(mask) if self.score_all else mask)
            # Position of pack index u: the drafter position of token u, plus one (text: u + 1).
            positions = sample.position_ids if sample.position_ids is not None else torch.arange(length)
            parts["pos"].append(positions[:length] + 1)
            parts["doc"].append(torch.full((length,), doc))
        return Pack(
            input_ids=torch.cat(parts["ids"])[None],
            aux_hidden_states=torch.cat(parts["aux"])[None],
            target_hidden_states=torch.cat(parts["target"])[None],
            loss_mask=torch.cat(parts["mask"])[None],
            position_ids=torch.cat(parts["pos"])[None],
            document_ids=torch.cat(parts["doc"])[None],
        )
