"""The index (datagen --index-only): every sample's entry as a full datagen writes it, the states of a probe only;
the draft vocabulary from its tokens file; readers of shards refuse it in one line; a later datagen completes it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from speculators.atomic_io import write_jsonl_atomic
from speculators.data.capture import capture_samples, index_samples, plan_batches, probe_indices
from speculators.data.store import INDEX_TOKENS, HiddenStateStore, index_refusal
from speculators.errors import SpeculatorsError
from speculators.train.data import STREAM_SPOOL_ENV, PackedStore
from speculators.train.resume import store_content
from speculators.train.vocab import build_store_vocab
from speculators.verifier.loading import load_verifier
from tests.unit.data.test_datagen import AUX, make_samples

SAMPLES = 10
PROBE = 3  # samples 0, 3 and 6, with the rest of their datagen batches
# float32 states: their bytes differ at rounding level with the batch a sample is computed in (tested below), so
# equal bytes show the probe was computed in datagen's own batches
STORE = {"aux_layer_ids": AUX, "batch_size": 2, "storage": "float32", "progress": False}
ENTRY_FIELDS = ("id", "key", "shard", "num_tokens", "supervised_tokens")


@pytest.fixture(scope="module")
def llama(tiny_verifier_dir):
    return load_verifier(tiny_verifier_dir("llama"), dtype="float32")


@pytest.fixture(scope="module")
def samples(llama):
    return make_samples(llama.tokenizer, SAMPLES)


@pytest.fixture(scope="module")
def full_store(llama, samples, tmp_path_factory):
    """A full datagen of the samples, with its draft vocabulary (read only)."""
    store = tmp_path_factory.mktemp("full") / "store"
    capture_samples(samples, llama, store, **STORE)
    build_store_vocab(store, 64)
    return store


@pytest.fixture(scope="module")
def probe(samples):
    """The samples the index computes: the datagen batches of samples 0, 3 and 6."""
    batches = [batch for batch in plan_batches(samples, 2) if {0, 3, 6}.intersection(batch)]
    assert len(batches) == 3
    return sorted(i for batch in batches for i in batch)


@pytest.fixture
def index(llama, samples, tmp_path):
    store = tmp_path / "index"
    report = index_samples(samples, llama, store, probe=PROBE, **STORE)
    return store, report


def entry_fields(store):
    return [
        {name: getattr(entry, name) for name in ENTRY_FIELDS} for entry in HiddenStateStore(store).manifest().samples
    ]


def test_probe_indices_spread_over_the_data():
    assert probe_indices(10, 3) == [0, 3, 6]
    assert probe_indices(10, 4) == [0, 2, 5, 7]
    assert probe_indices(100, 16) == [0, 6, 12, 18, 25, 31, 37, 43, 50, 56, 62, 68, 75, 81, 87, 93]
    assert probe_indices(3, 16) == [0, 1, 2]
    assert probe_indices(5, 0) == []


def test_index_entries_equal_a_full_datagens(index, full_store, probe):
    store, report = index
    assert entry_fields(store) == entry_fields(full_store)
    full = HiddenStateStore(full_store).manifest().samples
    manifest = HiddenStateStore(store).manifest()
    assert [entry.computed for entry in manifest.samples] == [i in probe for i in range(SAMPLES)]
    for i in probe:  # the probe's shards: the full store's bytes
        assert (manifest.samples[i].checksum, manifest.samples[i].bytes) == (full[i].checksum, full[i].bytes)
        assert (store / full[i].shard).read_bytes() == (full_store / full[i].shard).read_bytes()
    assert sorted(p.name for p in (store / "shards").rglob("*.safetensors")) == sorted(
        f"{full[i].key}.safetensors" for i in probe
    )
    assert manifest.totals.bytes == sum(full[i].bytes for i in probe)
    assert manifest.totals.tokens == HiddenStateStore(full_store).manifest().totals.tokens
    assert (report.computed, report.reused, report.computed_samples, report.index_samples) == (
        len(probe),
        0,
        len(probe),
        SAMPLES - len(probe),
    )


def test_a_sample_computed_in_another_batch_has_other_bytes(llama, samples, full_store, tmp_path):
    """Why the probe computes whole datagen batches: float32 states of another batch differ in their bytes."""
    alone = HiddenStateStore(tmp_path / "alone")
    capture_samples(samples, llama, alone.root, **{**STORE, "batch_size": 1})
    pairs = zip(alone.manifest().samples, HiddenStateStore(full_store).manifest().samples, strict=True)
    assert any(one.checksum != batched.checksum for one, batched in pairs)


def test_draft_vocab_of_the_index_equals_the_full_stores(index, full_store):
    store, _ = index
    build_store_vocab(store, 64)
    assert (store / "draft_vocab.safetensors").read_bytes() == (full_store / "draft_vocab.safetensors").read_bytes()
    assert (store / "draft_vocab.json").read_text() == (full_store / "draft_vocab.json").read_text()
    # An index has an identity of its own (a resume across stored and streamed modes is refused).
    assert store_content(store) != store_content(full_store)


def test_readers_of_shards_refuse_an_index_in_one_line(index, probe, monkeypatch, capsys):
    from speculators.cli import main

    store, _ = index
    assert len(probe) == 6
    refusal = (
        f"store {store} is an index: 4 of 10 samples have no computed states (datagen --index-only); train it with "
        f"--hidden-states streamed, or run datagen without --index-only"
    )
    manifest = HiddenStateStore(store).manifest()
    assert index_refusal(manifest, store) == refusal
    assert index_refusal(manifest, store, [manifest.samples[i] for i in probe]) is None
    with pytest.raises(SpeculatorsError) as error:
        PackedStore(store, 512, "train", validation_share=0.0)
    assert str(error.value) == refusal
    entry = manifest.uncomputed[0]
    with pytest.raises(SpeculatorsError) as error:
        HiddenStateStore(store).read_sample(entry)
    assert str(error.value) == (
        f"sample {entry.id} of store {store} has no computed states (an index entry: datagen --index-only); train it "
        f"with --hidden-states streamed, or run datagen without --index-only"
    )
    monkeypatch.setenv(STREAM_SPOOL_ENV, str(store / "spool"))  # a streamed run's trainer reads its spool
    assert len(PackedStore(store, 512, "train", validation_share=0.0).entries) == SAMPLES

    capsys.readouterr()
    assert main(["verify-store", str(store)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "store: valid (an index: 6 samples' states checked, 4 samples without states, their tokens checked)"
    )


def test_an_altered_tokens_file_is_named(index, samples, capsys):
    from speculators.cli import main
    from speculators.data.store import IndexTokens

    store, _ = index
    manifest = HiddenStateStore(store).manifest()
    rows = [(e.key, samples[i].input_ids, samples[i].loss_mask, []) for i, e in enumerate(manifest.samples)]
    changed = manifest.samples.index(manifest.uncomputed[0])
    key, ids, mask, _ = rows[changed]
    rows[changed] = (key, [*ids[:-1], (ids[-1] + 1) % 512], mask, [])  # one token changed
    IndexTokens.write(store / INDEX_TOKENS, rows)
    entry = manifest.samples[changed]
    expected = (
        f"the tokens of sample {entry.id} in {store / INDEX_TOKENS} are not its entry's (key {entry.key}, "
        f"{entry.supervised_tokens} supervised tokens): the file was altered; re-run 'speculators datagen "
        f"--index-only' into {store}"
    )
    with pytest.raises(SpeculatorsError) as error:
        build_store_vocab(store, 64)
    assert str(error.value) == expected
    assert main(["verify-store", str(store)]) == 1
    assert capsys.readouterr().out.splitlines()[0] == f"PROBLEM: {expected}"
    (store / INDEX_TOKENS).unlink()
    with pytest.raises(SpeculatorsError, match=f"has no {INDEX_TOKENS} .*re-run 'speculators datagen --index-only'"):
        build_store_vocab(store, 64)


def test_datagen_after_the_index_computes_exactly_the_rest(llama, samples, index, full_store, probe):
    store, _ = index
    build_store_vocab(store, 64)
    report = capture_samples(samples, llama, store, **STORE)
    assert (report.computed, report.reused) == (SAMPLES - len(probe), len(probe))
    assert report.computed_tokens == sum(len(samples[i].input_ids) for i in range(SAMPLES) if i not in probe)
    assert (store / "manifest.json").read_text() == (full_store / "manifest.json").read_text()
    assert not (store / INDEX_TOKENS).exists()  # no entry needs it now
    assert store_content(store) == store_content(full_store)  # the same store as a datagen from scratch


def test_an_index_over_a_complete_store_keeps_every_entry_computed(llama, samples, full_store, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(full_store, store)
    report = index_samples(samples, llama, store, probe=PROBE, **STORE)
    assert (report.computed, report.reused, report.index_samples) == (0, SAMPLES, 0)
    assert (store / "manifest.json").read_text() == (full_store / "manifest.json").read_text()
    assert not (store / INDEX_TOKENS).exists()
    assert report.to_dict()["probe_tokens_per_second"] is None  # nothing computed: nothing measured


def test_cli_index_only_writes_its_report(tiny_verifier_dir, samples, full_store, tmp_path, capsys):
    from speculators.cli import main

    write_jsonl_atomic(tmp_path / "samples.jsonl", samples)
    store = tmp_path / "index"
    argv = ["datagen", "--data", str(tmp_path / "samples.jsonl"), "--verifier", str(tiny_verifier_dir("llama"))]
    argv += ["--output", str(store), "--aux-layer-ids", "1,4,6", "--dtype", "float32", "--storage", "float32"]
    assert main([*argv, "--batch-size", "2", "--index-only", "--probe", "4"]) == 0
    report = json.loads((store / "datagen_report.json").read_text())
    assert json.loads(capsys.readouterr().out) == report  # (the command prints the report it wrote)
    probe = sorted(i for batch in plan_batches(samples, 2) if {0, 2, 5, 7}.intersection(batch) for i in batch)
    full = HiddenStateStore(full_store).manifest().samples
    probe_bytes, probe_tokens = sum(full[i].bytes for i in probe), sum(full[i].num_tokens for i in probe)
    all_tokens = sum(e.num_tokens for e in full)
    per_token = probe_bytes / probe_tokens
    assert report["probe_tokens_per_second"] > 0 and report["tokens_per_second"] == report["probe_tokens_per_second"]
    timings = ("seconds", "tokens_per_second", "probe_tokens_per_second")
    assert {k: v for k, v in report.items() if k not in timings} == {
        "mode": "index",
        "samples": SAMPLES,
        "computed": len(probe),
        "reused": 0,
        "tokens": all_tokens,
        "computed_tokens": probe_tokens,
        "bytes": probe_bytes,
        "bytes_per_token": round(per_token, 1),
        "probe_samples": len(probe),
        "computed_samples": len(probe),
        "index_samples": SAMPLES - len(probe),
        "full_store_bytes_estimate": round(probe_bytes + per_token * (all_tokens - probe_tokens)),
    }
    actual = sum(e.bytes for e in full)
    assert abs(report["full_store_bytes_estimate"] - actual) < 0.05 * actual


def test_the_tokens_file_keeps_tokens_and_image_parts_by_key(tmp_path):
    from speculators.data.store import IndexTokens

    parts = [{"type": "image", "path": "cat.png", "sha256": "ab" * 32}]
    rows = [("0f" * 16, [5, 6, 7], [0, 1, 1], []), ("a1" * 16, [9, 8], [1, 0], parts)]
    IndexTokens.write(tmp_path / INDEX_TOKENS, rows)
    index = IndexTokens(tmp_path / INDEX_TOKENS)
    ids, mask = index.tokens("a1" * 16)
    assert ids.dtype == torch.long and ids.tolist() == [9, 8] and mask.tolist() == [True, False]
    assert index.tokens("0f" * 16)[0].tolist() == [5, 6, 7] and index.tokens("00" * 16) is None
    assert index.images == {"a1" * 16: parts}
    (tmp_path / "other.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SpeculatorsError, match=r"cannot be read as an index's tokens .*re-run 'speculators datagen"):
        IndexTokens(tmp_path / "other.safetensors")
