"""The hidden-state store: one safetensors shard per sample plus a JSON manifest.

A shard holds `input_ids` [T], `loss_mask` [T], `aux_hidden_states` [T, n, H] (the manifest's n aux
layers: every layer the drafters trained on the store read, EAGLE-3 three of them) and
`target_hidden_states` [T, H] (aux id N, pre-norm), in bf16 or fp8 e4m3 with a per-token scale
(`aux_scale` [T, n], `target_scale` [T]); samples with images also `position_ids` [T], the
drafter's positions (the verifier's M-RoPE temporal row). Shards are content-addressed: the key hashes the verifier
fingerprint, the layer ids, the storage format, the token ids and the images' digests, so a rerun with new prompts only
computes what is new. Every shard is written under a temporary name and renamed, and the manifest
records its sha256, so a reader never sees a partial shard and a corrupted one is named.

A manifest names nothing outside its store: each entry's shard must be exactly the place of its key
(`shards/<key[:2]>/<key>.safetensors`, the key 32 hex digits), checked when the manifest is read, and
a shard is opened only where it resolves inside the store (a symlink out of it is refused).

An **index** (datagen --index-only) is a manifest whose entries may have no states yet (checksum None): a
streamed training run computes them into its spool. Their tokens, which the draft vocabulary and the
producers need, are kept in `index_tokens.safetensors` (each checked against its content key at read).

    <store>/manifest.json
    <store>/shards/<key[:2]>/<key>.safetensors
    <store>/index_tokens.safetensors      an index's: the tokens of the samples with no states
"""

from __future__ import annotations

import hashlib
import json
import re
import typing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from speculators.atomic_io import write_text_atomic, write_with
from speculators.errors import SpeculatorsError, shorten
from speculators.settings import StorageFormat
from speculators.verifier.quantization import FP8_MAX
from speculators.verifier.vision import images_digest

if TYPE_CHECKING:
    import torch

STORE_FORMAT = "speculators-hidden-states"
STORE_VERSION = 1
STORAGE_FORMATS: tuple[str, ...] = typing.get_args(StorageFormat)
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")  # sample_key's: the first 32 hex digits of a sha256
FRESH_STORE = "re-run 'speculators datagen' into a new --output (or into this one with --overwrite)"
INDEX_TOKENS = "index_tokens.safetensors"  # an index's tokens of its entries without states
INDEX_TOKENS_FORMAT = "speculators-index-tokens"


def shard_name(key: str) -> str:
    """Where the store keeps the shard of `key`, relative to the store (the only path a manifest may name)."""
    return f"shards/{key[:2]}/{key}.safetensors"


class StoreManifestPathError(SpeculatorsError):
    """A store manifest names a shard outside the store's own layout: it was altered, or is not datagen's.
    datagen --overwrite may replace such a manifest; every reader refuses it."""


class StoreRecord(BaseModel):
    """A part of manifest.json; keys it does not name (of older or newer stores) are kept, not refused."""

    model_config = ConfigDict(extra="allow")


class StoredVerifier(StoreRecord):
    """The verifier whose states the store holds."""

    fingerprint: str  # its weights' and config's fingerprint: a store of another verifier is refused
    quantization: str | None = None  # its quantization scheme, None for plain weights (absent in early stores)
    name_or_path: str  # where it was loaded from
    model_type: str  # its config's model_type
    num_layers: int  # its decoder layers (the target layer's id)
    hidden_size: int  # the width of the stored states
    vocab_size: int  # its vocabulary size (token ids are below it)
    dtype: str  # the dtype it ran in ("bfloat16", ...)


class StoreTotals(StoreRecord):
    """Sums over the store's samples."""

    samples: int  # how many samples
    tokens: int  # their tokens
    supervised_tokens: int  # their supervised (loss mask) tokens
    bytes: int  # their shards' bytes

    @classmethod
    def over(cls, entries: list[SampleEntry]) -> Self:
        return cls(
            samples=len(entries),
            tokens=sum(e.num_tokens for e in entries),
            supervised_tokens=sum(e.supervised_tokens for e in entries),
            bytes=sum(e.bytes for e in entries),
        )


class SampleEntry(StoreRecord):
    """One sample of the store and its shard."""

    id: str  # the sample's id (its prepared data's)
    key: str  # the content key of its states (sample_key); names its shard
    shard: str  # its shard's path, relative to the store
    num_tokens: int  # its tokens
    supervised_tokens: int  # its supervised (loss mask) tokens
    # its shard's sha256 and size; None and 0 in an index (datagen --index-only): the states are not computed,
    # a streamed training run computes them into its spool
    checksum: str | None = None
    bytes: int = 0

    @property
    def computed(self) -> bool:
        """Whether the store holds this sample's states (not an index-only entry)."""
        return self.checksum is not None


class StoreManifest(StoreRecord):
    """<store>/manifest.json: what the store holds and for which verifier; written by datagen."""

    format: str = STORE_FORMAT  # always STORE_FORMAT (a folder's other manifest.json is no store's)
    version: int = STORE_VERSION  # the store layout's version
    verifier: StoredVerifier  # the verifier the states are of
    aux_layer_ids: list[int]  # the layers of the aux states, in their order in each shard
    target_layer_id: int  # the layer of the target states (the verifier's last)
    storage: str  # the states' storage format (one of STORAGE_FORMATS)
    data_version: str | None = None  # the prepared data's version, None if unknown (absent in early stores)
    totals: StoreTotals  # sums over the samples
    samples: list[SampleEntry]  # the samples, in data order

    @classmethod
    def read(cls, path: Path) -> Self:
        """The manifest at `path`; one error if it is missing or not a store's manifest of this version."""
        if not path.is_file():
            raise SpeculatorsError(
                f"{path.parent} is not a hidden-state store (no manifest.json); run 'speculators datagen'"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            data = None
        manifest = None
        try:
            if isinstance(data, dict) and data.get("format") == STORE_FORMAT and data.get("version") == STORE_VERSION:
                manifest = cls.model_validate(data)
        except ValidationError:
            pass
        if manifest is None:
            raise SpeculatorsError(
                f"{path} is not a version-{STORE_VERSION} hidden-state store manifest; name a store "
                f"folder (or a new one for datagen)"
            )
        manifest.check_shard_paths(path)
        return manifest

    def check_shard_paths(self, path: Path) -> None:
        """Every entry's shard is the store's own place for its key: a manifest that names `../..`, an
        absolute path or another sample's shard gets no file opened, hashed or named for deletion."""
        for entry in self.samples:
            if KEY_PATTERN.fullmatch(entry.key) and entry.shard == shard_name(entry.key):
                continue
            place = (
                shard_name(entry.key)
                if KEY_PATTERN.fullmatch(entry.key)
                else f"none: its key '{shorten(entry.key, 80)}' is not 32 hex digits"
            )
            raise StoreManifestPathError(
                f"{path} names shard '{shorten(entry.shard, 120)}' for sample {shorten(entry.id, 80)}, not the "
                f"store's own place for its key ({place}): the manifest was altered and none of its shards is "
                f"opened; {FRESH_STORE}"
            )

    @property
    def uncomputed(self) -> list[SampleEntry]:
        """The entries whose states the store does not hold (an index's: datagen --index-only)."""
        return [entry for entry in self.samples if not entry.computed]

    @property
    def states_fingerprint(self) -> str:
        """What the sample keys hash for the verifier (VerifierFacts.states_fingerprint): its fingerprint
        and the FP8 scheme that quantized it."""
        quantization = self.verifier.quantization
        return self.verifier.fingerprint + (f"+{quantization}" if quantization else "")

    def entry_key(self, input_ids: list[int], images: list[dict[str, str]]) -> str:
        """The content key a sample of these tokens (and images) has in this store."""
        layers = [*self.aux_layer_ids, self.target_layer_id]
        return sample_key(self.states_fingerprint, layers, self.storage, input_ids, images_digest(images))

    def write(self, path: Path) -> Path:
        """Atomically, as one-space-indented JSON."""
        return write_text_atomic(path, json.dumps(self.model_dump(), indent=1) + "\n")


def index_refusal(manifest: StoreManifest, store: str | Path, entries: list[SampleEntry] | None = None) -> str | None:
    """The one line a reader of shards (stored-mode training) gives a store that holds no states for some of
    `entries` (default: all of its samples), or None when it holds them all. A streamed run does not ask: it
    computes those states into its spool."""
    needed = manifest.samples if entries is None else entries
    if all(entry.computed for entry in needed):
        return None
    return (
        f"store {store} is an index: {len(manifest.uncomputed)} of {len(manifest.samples)} samples have no computed "
        f"states (datagen --index-only); train it with --hidden-states streamed, or run datagen without --index-only"
    )


def sample_key(
    fingerprint: str, layer_ids: list[int], storage: str, input_ids: list[int], image_digests: str = ""
) -> str:
    """Content key of a sample's states; `image_digests` (vision.images_digest) for images in it."""
    digest = hashlib.sha256(f"{fingerprint}|{layer_ids}|{storage}|".encode())
    digest.update(json.dumps(input_ids, separators=(",", ":")).encode())
    if image_digests:  # text-only keys are unchanged
        digest.update(f"|images:{image_digests}".encode())
    return digest.hexdigest()[:32]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_tokens(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and loss_mask of the shard file at `path`, without reading its hidden states."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            return handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
    except Exception as error:
        raise SpeculatorsError(f"shard {path} cannot be read ({error}); delete it and re-run datagen") from None


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (last dim) absmax scaling to float8_e4m3fn."""
    import torch

    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (x32 / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.unsqueeze(-1)


class IndexTokens:
    """<store>/index_tokens.safetensors: the tokens of an index's samples without states, by content key.
    Tensors: `keys` [N, 16] uint8 (each key's 32 hex digits as bytes), `offsets` [N + 1] int64 into
    `input_ids` [sum T] int32 and `loss_mask` [sum T] bool; metadata `images`: JSON {key: image parts} of the
    samples with images. Opened once, memory-mapped: a sample's tokens are read as it is asked for."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        try:
            self.handle = safe_open(str(path), "pt")
            metadata = self.handle.metadata() or {}
            if metadata.get("format") != INDEX_TOKENS_FORMAT:
                raise ValueError(f"its metadata names no format {INDEX_TOKENS_FORMAT}")
            self.images: dict[str, list[dict[str, str]]] = json.loads(metadata.get("images", "{}"))
            keys = self.handle.get_tensor("keys")
            self.offsets = self.handle.get_tensor("offsets").tolist()
        except Exception as error:
            raise SpeculatorsError(
                f"{path} cannot be read as an index's tokens ({shorten(str(error), 200)}); re-run 'speculators "
                f"datagen --index-only' into this store"
            ) from None
        self.rows = {bytes(row).hex(): number for number, row in enumerate(keys.tolist())}

    @staticmethod
    def write(path: Path, samples: list[tuple[str, list[int], list[int], list[dict[str, str]]]]) -> Path:
        """Atomically, the (key, input_ids, loss_mask, images) of each sample."""
        import torch
        from safetensors.torch import save_file

        lengths = [len(ids) for _, ids, _, _ in samples]
        tensors = {
            "keys": torch.tensor([list(bytes.fromhex(key)) for key, _, _, _ in samples], dtype=torch.uint8).reshape(
                len(samples), 16
            ),
            "offsets": torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0),
            "input_ids": torch.tensor([t for _, ids, _, _ in samples for t in ids], dtype=torch.int32),
            "loss_mask": torch.tensor([m for _, _, mask, _ in samples for m in mask], dtype=torch.bool),
        }
        images = {key: parts for key, _, _, parts in samples if parts}
        metadata = {"format": INDEX_TOKENS_FORMAT, "images": json.dumps(images, separators=(",", ":"))}
        return write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))

    def tokens(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """input_ids [T] long and loss_mask [T] bool of the sample of `key`; None if the file holds none."""
        import torch

        row = self.rows.get(key)
        if row is None:
            return None
        start, end = self.offsets[row], self.offsets[row + 1]
        ids = self.handle.get_slice("input_ids")[start:end].to(torch.long)
        return ids, self.handle.get_slice("loss_mask")[start:end].to(torch.bool)


@dataclass
class StoredSample:
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    aux_hidden_states: torch.Tensor  # [T, n, H]: the manifest's aux layers
    target_hidden_states: torch.Tensor  # [T, H]
    # [T] long, where the drafter's positions are not 0..T-1: a vision-language verifier's M-RoPE
    # temporal row (vision.ImageInputs.drafter_positions); None for text.
    position_ids: torch.Tensor | None = None


class HiddenStateStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    @cached_property
    def resolved_root(self) -> Path:
        """The store folder with its links resolved, once (first asked when a shard is read, so the folder
        exists): every shard must resolve inside it."""
        return self.root.resolve()

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def index_tokens_path(self) -> Path:
        return self.root / INDEX_TOKENS

    @cached_property
    def index_tokens(self) -> IndexTokens:
        """The index's tokens file, opened once (one error if the index has none)."""
        if not self.index_tokens_path.is_file():
            raise SpeculatorsError(
                f"store {self.root} lists samples with no computed states but has no {INDEX_TOKENS} (their tokens); "
                f"re-run 'speculators datagen --index-only' into it"
            )
        return IndexTokens(self.index_tokens_path)

    @cached_property
    def keyed_manifest(self) -> StoreManifest:
        """The manifest whose verifier, layers and storage an index entry's tokens are checked against (read
        once: they never change without datagen --overwrite)."""
        return self.manifest()

    def index_sample(self, entry: SampleEntry) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, str]]]:
        """input_ids [T] long, loss_mask [T] bool and image parts of a sample without states (an index entry),
        from the index's tokens file; checked to be the entry's: its content key hashes these tokens."""
        index = self.index_tokens
        tokens = index.tokens(entry.key)
        if tokens is None:
            raise SpeculatorsError(
                f"{index.path} holds no tokens for sample {entry.id} (key {entry.key}); re-run 'speculators "
                f"datagen --index-only' into {self.root}"
            )
        ids, mask = tokens
        images = index.images.get(entry.key, [])
        if (
            self.keyed_manifest.entry_key(ids.tolist(), images) != entry.key
            or int(mask.sum()) != entry.supervised_tokens
        ):
            raise SpeculatorsError(
                f"the tokens of sample {entry.id} in {index.path} are not its entry's (key {entry.key}, "
                f"{entry.supervised_tokens} supervised tokens): the file was altered; re-run 'speculators datagen "
                f"--index-only' into {self.root}"
            )
        return ids, mask, images

    def shard_path(self, key: str) -> Path:
        return self.root / shard_name(key)

    def has(self, key: str) -> bool:
        return self.shard_path(key).is_file()

    # ----- writing ------------------------------------------------------------------------------

    def write_sample(
        self,
        key: str,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        target: torch.Tensor,
        storage: str,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[str, int]:
        """Write one shard atomically; returns (sha256, bytes). Refuses non-finite states."""
        import torch
        from safetensors.torch import save_file

        if not (torch.isfinite(aux).all() and torch.isfinite(target).all()):
            raise SpeculatorsError(
                f"sample {sample_id} has non-finite hidden states; the verifier overflows in this dtype "
                f"(try --dtype float32)"
            )
        tensors = {
            "input_ids": input_ids.to(torch.long).contiguous(),
            "loss_mask": loss_mask.to(torch.bool).contiguous(),
        }
        if storage == "fp8_e4m3":
            tensors["aux_hidden_states"], tensors["aux_scale"] = quantize_fp8(aux)
            tensors["target_hidden_states"], tensors["target_scale"] = quantize_fp8(target)
        else:
            dtype = torch.bfloat16 if storage == "bfloat16" else torch.float32
            tensors["aux_hidden_states"], tensors["target_hidden_states"] = aux.to(dtype), target.to(dtype)
        if position_ids is not None:
            tensors["position_ids"] = position_ids.to(torch.long)
        tensors = {name: tensor.contiguous().cpu() for name, tensor in tensors.items()}
        path = self.shard_path(key)
        write_with(path, lambda tmp: save_file(tensors, str(tmp), metadata={"key": key}))  # one entry: byte-stable
        return file_sha256(path), path.stat().st_size

    def write_manifest(self, manifest: StoreManifest) -> Path:
        return manifest.write(self.manifest_path)

    # ----- reading ------------------------------------------------------------------------------

    def manifest(self) -> StoreManifest:
        return StoreManifest.read(self.manifest_path)

    def previous_entries(self) -> dict[str, SampleEntry]:
        """key -> manifest entry of an earlier run (empty if none), to reuse checksums."""
        try:
            return {entry.key: entry for entry in self.manifest().samples}
        except SpeculatorsError:
            return {}

    def shard_file(self, shard: str, sample_id: str) -> Path:
        """The shard at `shard` (relative to the store), refused unless it is a file that resolves inside
        the store: a symlinked shard (or `shards` folder) is followed only within the store."""
        path = self.root / shard
        resolved = path.resolve()
        if not resolved.is_relative_to(self.resolved_root):
            raise SpeculatorsError(
                f"shard {path} of sample {sample_id} resolves to {resolved}, outside the store {self.root} (a "
                f"symlink out of it); nothing outside a store is read: {FRESH_STORE}, or link the whole store "
                f"folder rather than its shards"
            )
        if not resolved.is_file():
            raise SpeculatorsError(f"shard {path} of sample {sample_id} is missing; re-run 'speculators datagen'")
        return path

    def checked_shard_file(self, entry: SampleEntry) -> Path:
        """The entry's shard (shard_file), its sha256 checked against the manifest's."""
        path = self.shard_file(entry.shard, entry.id)
        if file_sha256(path) != entry.checksum:
            raise SpeculatorsError(
                f"shard {path} of sample {entry.id} is corrupted (checksum mismatch); delete it and re-run "
                f"'speculators datagen' to recompute it"
            )
        return path

    def read_sample(self, entry: SampleEntry, verify: bool = True, dtype: torch.dtype | None = None) -> StoredSample:
        """One sample's tensors (fp8 de-quantized); with `verify`, the checksum must match the manifest."""
        import torch
        from safetensors.torch import load_file

        if not entry.computed:
            raise SpeculatorsError(
                f"sample {entry.id} of store {self.root} has no computed states (an index entry: datagen "
                f"--index-only); train it with --hidden-states streamed, or run datagen without --index-only"
            )
        path = self.checked_shard_file(entry) if verify else self.shard_file(entry.shard, entry.id)
        try:
            tensors = load_file(str(path))
        except Exception as error:
            raise SpeculatorsError(f"shard {path} cannot be read ({error}); delete it and re-run datagen") from None
        aux, target = tensors["aux_hidden_states"], tensors["target_hidden_states"]
        if "aux_scale" in tensors:
            aux, target = dequantize_fp8(aux, tensors["aux_scale"]), dequantize_fp8(target, tensors["target_scale"])
        if dtype is not None:
            aux, target = aux.to(dtype), target.to(dtype)
        positions = tensors.get("position_ids")
        return StoredSample(tensors["input_ids"], tensors["loss_mask"].to(torch.bool), aux, target, positions)

    def read_tokens(self, entry: SampleEntry, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and loss_mask of the entry's shard, without reading the hidden states; with `verify`,
        the shard's checksum must match the manifest (hashing reads the whole shard once). An index entry's
        come from the index's tokens file, checked against its key."""
        if not entry.computed:
            ids, mask, _ = self.index_sample(entry)
            return ids, mask
        path = self.checked_shard_file(entry) if verify else self.shard_file(entry.shard, entry.id)
        return shard_tokens(path)

    def verify(self) -> list[str]:
        """Problems found by re-reading every shard: checksum, shapes, finiteness, token ids. An index's
        entries without states have no shard to re-read: their tokens are checked against their keys."""
        import torch

        manifest = self.manifest()
        hidden, aux_count = manifest.verifier.hidden_size, len(manifest.aux_layer_ids)
        problems = []
        for entry in manifest.samples:
            if not entry.computed:
                try:
                    self.index_sample(entry)
                except SpeculatorsError as error:
                    if str(error) not in problems:  # (a missing tokens file is one problem, not one per sample)
                        problems.append(str(error))
                continue
            try:
                sample = self.read_sample(entry)
            except SpeculatorsError as error:
                problems.append(str(error))
                continue
            length = entry.num_tokens
            if tuple(sample.aux_hidden_states.shape) != (length, aux_count, hidden) or tuple(
                sample.target_hidden_states.shape
            ) != (length, hidden):
                problems.append(f"sample {entry.id} has states of the wrong shape")
            if not (
                torch.isfinite(sample.aux_hidden_states).all() and torch.isfinite(sample.target_hidden_states).all()
            ):
                problems.append(f"sample {entry.id} has non-finite states")
        return problems
