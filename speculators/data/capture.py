"""`speculators datagen`: tokenized samples -> the hidden-state store, with the verifier.

Batches are formed from the data order alone (windows of 8 samples, sorted by length inside a
window, then cut into batches), so a sample is always computed in the same batch: a resumed or
incremental run writes exactly what an uninterrupted run would. A batch whose shards all exist is
skipped; new prompts appended to the data only cost their own batches.

Backends: `transformers` (padded batches, hooks on the decoder layers) and `vllm` (hooks inside
vLLM's worker, see vllm_capture.py); both write the same store layout.

`--index-only` writes an index instead (for `train --hidden-states streamed`): every sample's entry, with the
states of only a probe computed (the batches of every len/N-th sample), to measure the capture tokens/s, check
the values and estimate a full store's bytes; the other samples' tokens go to the index's tokens file. A later
datagen into the same folder computes exactly the samples the index has no states for.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import exclusive_lock, write_text_atomic
from speculators.data.capture_vllm import VllmCapture
from speculators.data.store import (
    STORAGE_FORMATS,
    CapturedStates,
    HiddenStateStore,
    IndexTokens,
    SampleEntry,
    StoredVerifier,
    StoreManifest,
    StoreManifestPathError,
    StoreTotals,
    file_sha256,
    sample_key,
    shard_name,
    shard_tokens,
)
from speculators.data.tokenization import TokenizedSample, read_samples
from speculators.errors import SpeculatorsError
from speculators.flags import to_argv
from speculators.precision import with_compute_dtype
from speculators.serving.engine import cpu_core_lists, gpu_count, vllm_log
from speculators.settings import CaptureSettings, MultiNode, aux_layer_ids_problem, node_group_of
from speculators.verifier.loading import Verifier, VerifierFacts, load_verifier
from speculators.verifier.vision import images_digest, load_image

if TYPE_CHECKING:
    import torch


# token id lists (and each one's image parts, for a vision-language verifier) -> states
# [T, len(capture ids), H] per prompt (the vllm backend's already in the store's format: Fp8States for fp8)
CaptureFn = Callable[[list[list[int]], list[list[dict[str, str]]]], Sequence[CapturedStates]]
WINDOW = 8  # small: appended data shares at most one window (re-batched) with old data


@dataclass
class CaptureReport:
    samples: int
    computed: int
    reused: int
    tokens: int
    computed_tokens: int
    seconds: float
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": "store",
            "samples": self.samples,
            "computed": self.computed,
            "reused": self.reused,
            "tokens": self.tokens,
            "computed_tokens": self.computed_tokens,
            "seconds": round(self.seconds, 2),
            "tokens_per_second": round(self.computed_tokens / self.seconds, 1) if self.seconds else None,
            "bytes": self.bytes,
            "bytes_per_token": round(self.bytes / self.tokens, 1) if self.tokens else None,
        }


@dataclass
class IndexReport(CaptureReport):
    """What `datagen --index-only` wrote: `computed` counts the probe samples computed now, `reused` the
    samples whose states the store already held, `bytes` their shards'."""

    probe_samples: int = 0  # samples of the probe's batches (computed now or already held)
    computed_samples: int = 0  # entries with states in the index
    computed_entry_tokens: int = 0  # their tokens
    index_samples: int = 0  # entries without (their tokens in the index's tokens file)

    def to_dict(self) -> dict[str, Any]:
        speed = round(self.computed_tokens / self.seconds, 1) if self.seconds and self.computed_tokens else None
        per_token = self.bytes / self.computed_entry_tokens if self.computed_entry_tokens else None
        report = super().to_dict()
        report.update(
            mode="index",
            tokens_per_second=speed,
            bytes_per_token=round(per_token, 1) if per_token is not None else None,
            probe_samples=self.probe_samples,
            probe_tokens_per_second=speed,
            computed_samples=self.computed_samples,
            index_samples=self.index_samples,
            # the shards held, plus the others' tokens at the held shards' bytes per token
            full_store_bytes_estimate=(
                round(self.bytes + per_token * (self.tokens - self.computed_entry_tokens))
                if per_token is not None
                else None
            ),
        )
        return report


def probe_indices(count: int, probe: int) -> list[int]:
    """The samples an index computes for real: every count/probe-th one (all of them when probe >= count)."""
    if probe >= count:
        return list(range(count))
    return [i * count // probe for i in range(probe)]


def sample_keys(fingerprint: str, capture_ids: list[int], storage: str, samples: list[TokenizedSample]) -> list[str]:
    """Each sample's shard key: its tokens and, for samples with images, the images' digests."""
    return [sample_key(fingerprint, capture_ids, storage, s.input_ids, images_digest(s.images)) for s in samples]


def plan_batches(samples: list[TokenizedSample], batch_size: int) -> list[list[int]]:
    """Sample indices per batch; depends only on the data order and the lengths."""
    batches = []
    for start in range(0, len(samples), WINDOW):
        window = sorted(range(start, min(start + WINDOW, len(samples))), key=lambda i: (len(samples[i].input_ids), i))
        batches += [window[i : i + batch_size] for i in range(0, len(window), batch_size)]
    return batches


def transformers_capture_fn(verifier: Verifier, capture_ids: list[int]) -> CaptureFn:
    import torch

    device = verifier.model.device
    pad = verifier.tokenizer.pad_token_id if verifier.tokenizer.pad_token_id is not None else 0

    def capture(prompts: list[list[int]], images: list[list[dict[str, str]]]) -> list[torch.Tensor]:

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # right padding: real tokens never attend to pads (causal)
            ids[row, : len(prompt)] = torch.tensor(prompt)
            attention[row, : len(prompt)] = 1
        vision: dict[str, torch.Tensor] = {}
        pictures = [load_image(part) for parts in images for part in parts]  # in token order, row by row
        if pictures:
            inputs = verifier.image_inputs
            vision = {k: v.to(device) for k, v in inputs.pixel_inputs(pictures).items()}
            vision["mm_token_type_ids"] = inputs.token_types(ids).to(device)
        states = verifier.capture(ids.to(device), capture_ids, attention_mask=attention.to(device), **vision)
        return [states[row, : len(prompt)] for row, prompt in enumerate(prompts)]

    return capture


def drafter_positions(verifier: VerifierFacts, sample: TokenizedSample) -> torch.Tensor | None:
    """The positions vLLM gives the drafter for a sample with images (None: 0..T-1)."""
    import torch

    if not sample.images:
        return None
    inputs = verifier.image_inputs
    grids = [inputs.grid(load_image(part)) for part in sample.images]
    return torch.tensor(inputs.drafter_positions(sample.input_ids, grids))


def make_capture_fn(
    backend: str,
    verifier: VerifierFacts,
    capture_ids: list[int],
    max_length: int,
    tensor_parallel_size: int = 1,
    batch_size: int = 4,
    nodes: MultiNode | None = None,
    storage: str = "float32",
) -> CaptureFn:
    """The capture function of `backend`. `storage`: the format of the store its states go to; vLLM's workers
    cast them to it before they leave the device (float32, the default, keeps every bit for any store)."""
    if backend == "transformers":
        if not isinstance(verifier, Verifier):
            raise SpeculatorsError("the transformers backend captures with a loaded verifier (load_verifier)")
        return transformers_capture_fn(verifier, capture_ids)
    if backend == "vllm":
        # A batch (at most a window: plan_batches) in one engine step where the activations allow; a
        # longer one is prefilled in chunks (rows keyed by request and position: vllm_capture).
        return VllmCapture(
            verifier.name_or_path,
            capture_ids,
            verifier.dtype,
            max_model_len=max_length + 1,
            max_batch_tokens=min(min(batch_size, WINDOW) * (max_length + 1), 65536),
            tensor_parallel_size=tensor_parallel_size,
            image_token_id=verifier.image_inputs.tokens.image_token_id if verifier.is_vision_language else None,
            quantization=verifier.quantization,
            nodes=nodes,
            storage=storage,
        )
    raise SpeculatorsError(f"unknown datagen backend '{backend}'; use transformers or vllm")


def check_store_holds(
    store: HiddenStateStore, verifier: VerifierFacts, aux_ids: list[int], storage: str, overwrite: bool
) -> None:
    """Refuse to capture into a store made for another verifier, aux layers or storage format (unless
    `overwrite`): its manifest would be rewritten to this run's samples and its states orphaned. A
    folder whose manifest.json is not a store's is refused in any case."""
    if not store.manifest_path.exists():
        return
    try:
        manifest = store.manifest()  # (one error if it is not a store manifest)
    except StoreManifestPathError:
        if overwrite:  # a store manifest naming paths outside the store: replaced, none of them read
            return
        raise
    held = manifest.verifier
    then = (held.fingerprint, held.quantization, manifest.aux_layer_ids, manifest.storage)
    now = (verifier.fingerprint, verifier.quantization, aux_ids, storage)
    if then == now or overwrite:
        return
    raise SpeculatorsError(
        f"store {store.root} holds the states of verifier {held.name_or_path} (fingerprint {then[0]}"
        f"{', ' + str(then[1]) if then[1] else ''}, aux layers {then[2]}, {then[3]}), not of {verifier.name_or_path} "
        f"(fingerprint {now[0]}{', ' + str(now[1]) if now[1] else ''}, aux layers {now[2]}, {now[3]}); write to "
        f"a new --output, or pass --overwrite to re-point this store (its shards stay, keyed by content)"
    )


def capture_samples(
    samples: list[TokenizedSample],
    verifier: VerifierFacts,
    store_dir: str | Path,
    aux_layer_ids: list[int] | None = None,
    batch_size: int = 4,
    storage: str = "bfloat16",
    backend: str = "transformers",
    data_version: str | None = None,
    progress: bool = True,
    tensor_parallel_size: int = 1,
    replica: tuple[int, int] | None = None,
    overwrite: bool = False,
    nodes: MultiNode | None = None,
) -> CaptureReport:
    """Capture the samples' states into the store and write its manifest. `verifier` is a loaded
    `Verifier` (transformers backend) or `VerifierFacts` (vllm backend: vLLM loads the weights).
    `replica=(i, n)`: compute only every n-th batch from the i-th and write no manifest (one of n
    data-parallel replicas; `run_capture_replicas` starts them and writes the manifest after).
    `nodes`: the vllm engine spans several nodes, this is node rank 0 (speculators/serving/multinode.py)."""
    capture_ids = checked_capture_ids(samples, verifier, aux_layer_ids, storage, backend)
    aux_ids = capture_ids[:-1]  # (then the last layer: the target states)
    store = HiddenStateStore(store_dir)
    check_store_holds(store, verifier, aux_ids, storage, overwrite)
    previous = store.previous_entries()
    fingerprint = verifier.states_fingerprint
    if not verifier.is_vision_language and any(s.images for s in samples):
        raise SpeculatorsError(
            f"the samples hold images but verifier {verifier.name_or_path} ({verifier.model_type}) takes none; "
            f"prepare them with this verifier"
        )
    keys = sample_keys(fingerprint, capture_ids, storage, samples)
    started = time.perf_counter()
    batches = plan_batches(samples, batch_size)
    if replica is not None:
        index, count = replica
        batches = batches[index::count]
    total_tokens = sum(len(s.input_ids) for s in samples)
    max_length = max(len(s.input_ids) for s in samples)

    def start_capture() -> CaptureFn:  # on first need: a fully reused store starts no engine
        return make_capture_fn(
            backend, verifier, capture_ids, max_length, tensor_parallel_size, batch_size, nodes, storage
        )

    written, computed, computed_tokens = capture_missing(
        samples, keys, batches, store, verifier, storage, start_capture, progress, started
    )
    seconds = time.perf_counter() - started
    if replica is not None:
        return CaptureReport(len(samples), computed, 0, total_tokens, computed_tokens, seconds, 0)

    entries = store_entries(samples, keys, written, previous, store)
    totals = write_store_manifest(store, verifier, aux_ids, storage, data_version, entries)
    return CaptureReport(
        len(samples), computed, len(samples) - computed, total_tokens, computed_tokens, seconds, totals.bytes
    )


def write_store_manifest(
    store: HiddenStateStore,
    verifier: VerifierFacts,
    aux_ids: list[int],
    storage: str,
    data_version: str | None,
    entries: list[SampleEntry],
) -> StoreTotals:
    """The store's manifest of `entries`; an index's tokens file goes when no entry needs it any more
    (a full datagen into an index)."""
    totals = StoreTotals.over(entries)
    store.write_manifest(
        StoreManifest(
            verifier=StoredVerifier(
                fingerprint=verifier.fingerprint,
                quantization=verifier.quantization,
                name_or_path=verifier.name_or_path,
                model_type=verifier.model_type,
                num_layers=verifier.num_layers,
                hidden_size=verifier.hidden_size,
                vocab_size=verifier.vocab_size,
                dtype=verifier.dtype,
            ),
            aux_layer_ids=aux_ids,
            target_layer_id=verifier.num_layers,
            storage=storage,
            data_version=data_version,
            totals=totals,
            samples=entries,
        )
    )
    if all(entry.computed for entry in entries):
        store.index_tokens_path.unlink(missing_ok=True)
    return totals


def index_samples(
    samples: list[TokenizedSample],
    verifier: VerifierFacts,
    store_dir: str | Path,
    aux_layer_ids: list[int] | None = None,
    batch_size: int = 4,
    storage: str = "bfloat16",
    backend: str = "transformers",
    data_version: str | None = None,
    probe: int = 16,
    progress: bool = True,
    tensor_parallel_size: int = 1,
    overwrite: bool = False,
    nodes: MultiNode | None = None,
) -> IndexReport:
    """`datagen --index-only`: the store's manifest lists every sample (its key, shard place and counts, as
    capture_samples would), with states only for the probe (every len/`probe`-th sample's datagen batch, computed
    now as capture_samples would) and the samples whose shards the store already holds (kept: nothing is lost);
    the other samples' tokens go to the index's tokens file, written before the manifest that needs it."""
    capture_ids = checked_capture_ids(samples, verifier, aux_layer_ids, storage, backend)
    aux_ids = capture_ids[:-1]
    store = HiddenStateStore(store_dir)
    check_store_holds(store, verifier, aux_ids, storage, overwrite)
    previous = store.previous_entries()
    if not verifier.is_vision_language and any(s.images for s in samples):
        raise SpeculatorsError(
            f"the samples hold images but verifier {verifier.name_or_path} ({verifier.model_type}) takes none; "
            f"prepare them with this verifier"
        )
    keys = sample_keys(verifier.states_fingerprint, capture_ids, storage, samples)
    written, computed, computed_tokens, seconds, probes = capture_probe(
        samples,
        keys,
        store,
        verifier,
        capture_ids,
        storage,
        backend,
        batch_size,
        probe,
        progress,
        tensor_parallel_size,
        nodes,
    )
    entries = store_entries(samples, keys, written, previous, store, index_missing=True)
    missing = [(entry.key, samples[i]) for i, entry in enumerate(entries) if not entry.computed]
    if missing:
        IndexTokens.write(store.index_tokens_path, [(key, s.input_ids, s.loss_mask, s.images) for key, s in missing])
    totals = write_store_manifest(store, verifier, aux_ids, storage, data_version, entries)
    held = [entry for entry in entries if entry.computed]
    return IndexReport(
        samples=len(samples),
        computed=computed,
        reused=len(held) - computed,
        tokens=totals.tokens,
        computed_tokens=computed_tokens,
        seconds=seconds,
        bytes=totals.bytes,
        probe_samples=len(probes),
        computed_samples=len(held),
        computed_entry_tokens=sum(entry.num_tokens for entry in held),
        index_samples=len(missing),
    )


def capture_probe(
    samples: list[TokenizedSample],
    keys: list[str],
    store: HiddenStateStore,
    verifier: VerifierFacts,
    capture_ids: list[int],
    storage: str,
    backend: str,
    batch_size: int,
    probe: int,
    progress: bool,
    tensor_parallel_size: int,
    nodes: MultiNode | None,
) -> tuple[dict[str, tuple[str, int]], int, int, float, list[int]]:
    """An index's probe, computed into the store: the shards written, how many samples were computed and their
    tokens, the capture seconds (the engine's start left out) and the probe's sample indices."""
    # The probe samples' datagen batches, whole: their states are then the bytes a full datagen writes (a
    # sample's states depend at rounding level on its batch), and nothing computed is thrown away.
    chosen = set(probe_indices(len(samples), probe))
    batches = [batch for batch in plan_batches(samples, batch_size) if chosen.intersection(batch)]
    probes = sorted(i for batch in batches for i in batch)
    max_length = max(len(s.input_ids) for s in samples)  # (datagen's: vLLM's chunking follows it)
    engines: list[CaptureFn] = []
    starting = 0.0  # seconds the engine took to start: not capture time

    def start_capture() -> CaptureFn:
        nonlocal starting
        began = time.perf_counter()
        engines.append(
            make_capture_fn(
                backend, verifier, capture_ids, max_length, tensor_parallel_size, batch_size, nodes, storage
            )
        )
        starting = time.perf_counter() - began
        return lambda prompts, images: engines[0](prompts, images)  # (closed below, outside the clock)

    started = time.perf_counter()
    try:
        place = {i: n for n, i in enumerate(probes)}  # (the probe alone: its progress bar ends at 100%)
        written, computed, computed_tokens = capture_missing(
            [samples[i] for i in probes],
            [keys[i] for i in probes],
            [[place[i] for i in batch] for batch in batches],
            store,
            verifier,
            storage,
            start_capture,
            progress,
            started,
        )
        seconds = time.perf_counter() - started - starting
    finally:
        close = getattr(engines[0], "close", None) if engines else None
        if close is not None:
            close()
    return written, computed, computed_tokens, seconds, probes


def checked_capture_ids(
    samples: list[TokenizedSample],
    verifier: VerifierFacts,
    aux_layer_ids: list[int] | None,
    storage: str,
    backend: str,
) -> list[int]:
    """The layers to capture (the aux layers, then the last), once the request is one that can run: a
    known storage format and backend, some samples, layers the verifier has, token ids in its vocab."""
    if storage not in STORAGE_FORMATS:
        raise SpeculatorsError(f"storage '{storage}' is not one of {', '.join(STORAGE_FORMATS)}")
    if not samples:
        raise SpeculatorsError("no samples to capture; the prepared data is empty")
    aux_ids = list(aux_layer_ids or verifier.default_aux_layer_ids)
    problem = aux_layer_ids_problem(aux_ids, None)  # (any number: each drafter reads its own among them)
    if problem:
        raise SpeculatorsError(problem)
    capture_ids = [*aux_ids, verifier.num_layers]
    verifier.check_layer_ids(capture_ids)
    vocab = verifier.vocab_size
    for sample in samples:
        if min(sample.input_ids) < 0 or max(sample.input_ids) >= vocab:
            raise SpeculatorsError(
                f"sample {sample.id} has token ids outside the verifier vocab 0..{vocab - 1}; "
                f"prepare the data with this verifier's tokenizer"
            )
    if backend not in ("transformers", "vllm"):
        raise SpeculatorsError(f"unknown datagen backend '{backend}'; use transformers or vllm")
    return capture_ids


def capture_missing(
    samples: list[TokenizedSample],
    keys: list[str],
    batches: list[list[int]],
    store: HiddenStateStore,
    verifier: VerifierFacts,
    storage: str,
    start_capture: Callable[[], CaptureFn],
    progress: bool,
    started: float,
) -> tuple[dict[str, tuple[str, int]], int, int]:
    """Computes and writes the states of the batches' samples the store lacks (a batch whose samples it
    all holds starts nothing); returns the shards written (key -> checksum, bytes), how many samples were
    computed and their tokens."""
    import torch
    from tqdm import tqdm

    capture: CaptureFn | None = None
    written: dict[str, tuple[str, int]] = {}
    computed = computed_tokens = 0
    total_tokens = sum(len(s.input_ids) for s in samples)
    with tqdm(total=total_tokens, desc="capturing hidden states", unit="tok", disable=not progress) as bar:
        for batch in batches:
            missing = [i for i in batch if not store.has(keys[i])]
            if not missing:
                bar.update(sum(len(samples[i].input_ids) for i in batch))
                continue
            if capture is None:
                capture = start_capture()
            states = capture([samples[i].input_ids for i in batch], [samples[i].images for i in batch])
            for row, i in enumerate(batch):
                if i not in missing:
                    continue
                sample = samples[i]
                written[keys[i]] = store.write_sample(
                    keys[i],
                    sample.id,
                    torch.tensor(sample.input_ids),
                    torch.tensor(sample.loss_mask),
                    states[row][:, :-1],
                    states[row][:, -1],
                    storage,
                    drafter_positions(verifier, sample),
                )
                computed += 1
                computed_tokens += len(sample.input_ids)
            bar.update(sum(len(samples[i].input_ids) for i in batch))
            bar.set_postfix(tok_s=f"{computed_tokens / max(time.perf_counter() - started, 1e-9):.0f}")
    close = getattr(capture, "close", None)  # a vLLM engine's
    if close is not None:
        close()
    return written, computed, computed_tokens


def store_entries(
    samples: list[TokenizedSample],
    keys: list[str],
    written: dict[str, tuple[str, int]],
    previous: dict[str, SampleEntry],
    store: HiddenStateStore,
    index_missing: bool = False,
) -> list[SampleEntry]:
    """The manifest's entry of each sample: a shard written now, or one reused (its tokens checked to be the
    sample's, its checksum kept from the previous manifest when its size still matches); with `index_missing`,
    an index entry (no checksum) for a sample whose shard the store lacks."""
    entries: list[SampleEntry] = []
    for sample, key in zip(samples, keys, strict=True):
        path = store.shard_path(key)
        if index_missing and key not in written and not store.has(key):
            entries.append(
                SampleEntry(
                    id=sample.id,
                    key=key,
                    shard=shard_name(key),
                    num_tokens=len(sample.input_ids),
                    supervised_tokens=sample.supervised_tokens,
                )
            )
            continue
        if key not in written:  # reused: its tokens must be this sample's (content addressing, checked)
            stored_ids, _ = shard_tokens(store.shard_file(shard_name(key), sample.id))  # (a symlink out refused)
            if stored_ids.tolist() != sample.input_ids:
                raise SpeculatorsError(f"shard {path} does not hold sample {sample.id}'s tokens; delete it and re-run")
        before = previous.get(key)
        if key in written:
            checksum, size = written[key]
        elif before is not None and before.checksum is not None and before.bytes == path.stat().st_size:
            checksum, size = before.checksum, before.bytes
        else:
            checksum, size = file_sha256(path), path.stat().st_size
        entries.append(
            SampleEntry(
                id=sample.id,
                key=key,
                shard=shard_name(key),
                num_tokens=len(sample.input_ids),
                supervised_tokens=sample.supervised_tokens,
                checksum=checksum,
                bytes=size,
            )
        )
    return entries


def replica_devices(replicas: int, tensor_parallel_size: int) -> list[dict[str, str]]:
    """Per replica, the environment that gives it its own GPUs (CUDA_VISIBLE_DEVICES) or, on a CPU,
    its own cores for vLLM's CPU build (VLLM_CPU_OMP_THREADS_BIND, one '|'-separated list per TP rank)."""

    need = replicas * tensor_parallel_size
    count = gpu_count()
    if count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ranks = visible.split(",") if visible else [str(i) for i in range(count)]
        if len(ranks) < need:
            raise SpeculatorsError(
                f"{replicas} replicas x tensor parallel {tensor_parallel_size} need {need} GPUs but {len(ranks)} are "
                f"visible; lower --data-parallel-size or --tensor-parallel-size"
            )
        variable, separator = "CUDA_VISIBLE_DEVICES", ","
    else:
        ranks, variable, separator = cpu_core_lists(need), "VLLM_CPU_OMP_THREADS_BIND", "|"
    groups = [ranks[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(replicas)]
    return [{variable: separator.join(group)} for group in groups]


Replica = tuple[int, Path, subprocess.Popen[bytes]]  # (index, log, process)


def start_replica(label: str, index: int, command: list[str], env: dict[str, str], log: Path) -> Replica:
    """One replica process with its own devices (`env`), its output in `log`."""
    print(f"{label} {index}: {' '.join(f'{k}={v}' for k, v in env.items())}, log {log}", flush=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env={**os.environ, **env})
    return index, log, process


def raise_for_failed_replicas(what: str, processes: list[Replica]) -> None:
    """One error for the first failed replica: its `error:` line (or last line) and its log."""
    failed = [(index, log) for index, log, process in processes if process.returncode != 0]
    if failed:
        index, log = failed[0]
        lines = log.read_text(errors="replace").strip().splitlines() or ["(empty log)"]
        reason = next((line for line in reversed(lines) if line.startswith("error: ")), lines[-1])
        raise SpeculatorsError(f"{what} replica {index} failed ({reason}); see {log}, then run again to resume")


def run_capture_replicas(
    settings: CaptureSettings, samples: list[TokenizedSample], verifier: VerifierFacts, data_version: str | None = None
) -> CaptureReport:
    """`data_parallel_size` vLLM replicas of the verifier, each a `speculators datagen --replica i/n`
    process on its own GPUs (tensor parallel inside it) computing every n-th batch, then the manifest
    pass here (every shard present: no engine starts). Replicas share nothing but the store, whose
    shards are content-addressed and renamed into place, so a failed replica is simply run again."""
    import sys

    from tqdm import tqdm

    store_dir, replicas = Path(settings.output), settings.data_parallel_size
    tensor_parallel_size, batch_size, storage = settings.tensor_parallel_size, settings.batch_size, settings.storage
    store_dir.mkdir(parents=True, exist_ok=True)
    aux_ids = list(settings.aux_layer_ids or verifier.default_aux_layer_ids)
    capture_ids = [*aux_ids, verifier.num_layers]
    verifier.check_layer_ids(capture_ids)
    store = HiddenStateStore(store_dir)
    check_store_holds(store, verifier, aux_ids, storage, settings.overwrite)
    keys = sample_keys(verifier.states_fingerprint, capture_ids, storage, samples)
    started = time.perf_counter()
    missing = [i for i, key in enumerate(keys) if not store.has(key)]
    missing_before, missing_tokens = len(missing), sum(len(samples[i].input_ids) for i in missing)
    processes: list[Replica] = []
    one_replica = settings.model_copy(
        update={
            "backend": "vllm",
            "aux_layer_ids": aux_ids,
            "data_parallel_size": 1,
            "dtype": verifier.dtype,
            "output": str(store_dir),
        }
    )
    for index, env in enumerate(replica_devices(replicas, tensor_parallel_size) if missing else []):
        command = [
            sys.executable,
            "-m",
            "speculators.cli",
            "datagen",
            *to_argv(one_replica),
            "--replica",
            f"{index}/{replicas}",
        ]
        processes.append(start_replica("replica", index, command, env, store_dir / f"replica-{index}.log"))
    with tqdm(total=missing_before, desc=f"capturing with {replicas} replicas", unit="sample") as bar:
        while any(process.poll() is None for _, _, process in processes):
            time.sleep(2)
            bar.n = missing_before - sum(1 for key in keys if not store.has(key))
            bar.refresh()
    raise_for_failed_replicas("datagen", processes)
    seconds = time.perf_counter() - started
    report = capture_samples(
        samples,
        verifier,
        store_dir,
        aux_layer_ids=aux_ids,
        batch_size=batch_size,
        storage=storage,
        backend="vllm",
        data_version=data_version,
        progress=False,
        overwrite=settings.overwrite,
    )
    report.computed, report.reused, report.seconds = missing_before, len(samples) - missing_before, seconds
    report.computed_tokens = missing_tokens
    return report


def run_capture(settings: CaptureSettings, replica: tuple[int, int] | None = None) -> CaptureReport:
    """`speculators datagen`: the samples' hidden states into the store, datagen_report.json beside
    them (the last run's counts). `replica` (INDEX, COUNT): one of run_capture_replicas' processes.

    The store's lock is held throughout: a second datagen into the same store waits, then finds every
    shard written and computes none (replicas run under their parent's lock)."""

    settings = with_compute_dtype(settings, on_vllm=settings.backend == "vllm")  # (the CLI resolved it already)
    if replica is not None:
        return capture_into_store(settings, replica)
    with exclusive_lock(settings.output, "hidden-state store"):
        return capture_into_store(settings, None)


def capture_into_store(settings: CaptureSettings, replica: tuple[int, int] | None) -> CaptureReport:
    import json

    s = settings
    if s.backend != "vllm" and (s.tensor_parallel_size > 1 or s.data_parallel_size > 1 or replica or s.multi_node):
        raise SpeculatorsError(
            "--tensor-parallel-size, --data-parallel-size, --nnodes and --replica need --backend vllm"
        )
    if s.multi_node and s.data_parallel_size > 1:
        raise SpeculatorsError(
            f"--data-parallel-size {s.data_parallel_size} with --nnodes {s.nnodes}: capture replicas are one engine "
            f"each on this node's GPUs, and an engine over several nodes is one verifier over all of them; use "
            f"--data-parallel-size 1"
        )
    if s.index_only and replica is not None:
        raise SpeculatorsError("--index-only computes its probe in one process; run it without --replica")
    samples = read_samples(s.data)
    prepared = Path(s.data).with_name("prepare_report.json")
    data_version = json.loads(prepared.read_text())["prompts"].get("data_version") if prepared.is_file() else None
    common: dict[str, Any] = dict(
        aux_layer_ids=s.aux_layer_ids,
        batch_size=s.batch_size,
        storage=s.storage,
        data_version=data_version,
        overwrite=s.overwrite,
    )
    # --index-only: a probe of a few samples, one engine whatever --data-parallel-size says
    capture_into: Callable[..., CaptureReport] = (
        partial(index_samples, probe=s.probe, **common) if s.index_only else partial(capture_samples, **common)
    )
    report: CaptureReport
    if s.backend == "transformers":
        verifier = load_verifier(s.verifier, dtype=s.dtype, device=s.device, quantization=s.quantization)
        report = capture_into(samples, verifier, s.output, backend="transformers")
    else:  # vLLM loads the weights; here only the config and the files' fingerprint
        facts = VerifierFacts.from_source(s.verifier, dtype=s.dtype, quantization=s.quantization)
        store = Path(s.output).resolve()
        with vllm_log(store.with_name(store.name + "-vllm.log"), replica is None):  # (replicas inherit it)
            if s.data_parallel_size > 1 and not s.index_only:
                report = run_capture_replicas(s, samples, facts, data_version)
            else:
                one_process: dict[str, Any] = {} if s.index_only else {"replica": replica}  # (an index: no replica)
                report = capture_into(
                    samples,
                    facts,
                    s.output,
                    backend="vllm",
                    tensor_parallel_size=s.tensor_parallel_size,
                    progress=replica is None,
                    nodes=node_group_of(s),
                    **one_process,
                )
    if replica is None:
        write_text_atomic(Path(s.output) / "datagen_report.json", json.dumps(report.to_dict(), indent=2) + "\n")
    return report
