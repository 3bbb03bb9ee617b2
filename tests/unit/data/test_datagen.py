"""Hidden-state store: captured states equal a reference forward; kill-and-resume; incremental reuse;
checksum corruption; fp8 storage; validation errors; draft vocabulary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from speculators.atomic_io import write_jsonl_atomic
from speculators.data.capture import capture_samples
from speculators.data.store import HiddenStateStore
from speculators.data.tokenization import TokenizedSample, tokenize_conversation
from speculators.errors import SpeculatorsError
from speculators.train.vocab import build_store_vocab, load_draft_vocab, select_draft_vocab
from speculators.verifier.loading import load_verifier
from tests.paths import ROOT_DIR

AUX = [1, 4, 6]


def make_samples(tokenizer, n, offset=0):
    from speculators.data.demo_prompts import demo_prompts

    prompts = demo_prompts("train")[offset : offset + n]
    return [
        tokenize_conversation(
            tokenizer,
            f"s{offset + i}",
            [{"role": "user", "content": p}, {"role": "assistant", "content": p[::-1][: 20 + 7 * (i % 5)]}],
            256,
        )
        for i, p in enumerate(prompts)
    ]


@pytest.fixture(scope="module")
def llama(tiny_verifier_dir):
    return load_verifier(tiny_verifier_dir("llama"), dtype="float32")


def test_captured_states_equal_a_reference_forward(llama, tmp_path):
    samples = make_samples(llama.tokenizer, 6)
    report = capture_samples(
        samples, llama, tmp_path / "store", aux_layer_ids=AUX, batch_size=4, storage="float32", progress=False
    )
    assert report.computed == 6 and report.reused == 0
    store = HiddenStateStore(tmp_path / "store")
    manifest = store.manifest()
    assert manifest.aux_layer_ids == AUX and manifest.target_layer_id == 8
    assert manifest.verifier.fingerprint == llama.fingerprint
    for sample, entry in zip(samples, manifest.samples, strict=True):
        stored = store.read_sample(entry)
        assert stored.input_ids.tolist() == sample.input_ids and stored.loss_mask.int().tolist() == sample.loss_mask
        with torch.inference_mode():
            reference = llama.model(torch.tensor([sample.input_ids]), output_hidden_states=True).hidden_states
        for slot, layer in enumerate(AUX):
            torch.testing.assert_close(stored.aux_hidden_states[:, slot], reference[layer][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(llama.final_norm(stored.target_hidden_states), reference[8][0], atol=1e-5, rtol=1e-5)
    assert store.verify() == []


def test_incremental_run_computes_only_new_samples(llama, tmp_path):
    first = make_samples(llama.tokenizer, 18)
    new = make_samples(llama.tokenizer, 2, offset=18)
    capture_samples(first, llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    report = capture_samples(first + new, llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    assert report.reused == 18 and report.computed == 2
    assert report.computed_tokens == sum(len(s.input_ids) for s in new)
    again = capture_samples(first + new, llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    assert again.computed == 0
    # Other aux ids are other content: refused into this store (its manifest would be replaced), and with
    # overwrite nothing is reused.
    with pytest.raises(SpeculatorsError, match=r"holds the states of .* aux layers \[1, 4, 6\].*--overwrite"):
        capture_samples(first, llama, tmp_path / "store", aux_layer_ids=[2, 4, 6], progress=False)
    other = capture_samples(first, llama, tmp_path / "store", aux_layer_ids=[2, 4, 6], progress=False, overwrite=True)
    assert other.computed == 18


def test_corrupted_shard_is_named(llama, tmp_path):
    capture_samples(make_samples(llama.tokenizer, 3), llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    store = HiddenStateStore(tmp_path / "store")
    entry = store.manifest().samples[1]
    path = tmp_path / "store" / entry.shard
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SpeculatorsError, match=f"shard {path} of sample {entry.id} is corrupted"):
        store.read_sample(entry)
    problems = store.verify()
    assert len(problems) == 1 and entry.id in problems[0]


def test_fp8_storage_halves_bytes_and_stays_close(llama, tmp_path):
    samples = make_samples(llama.tokenizer, 4)
    bf16 = capture_samples(samples, llama, tmp_path / "bf16", aux_layer_ids=AUX, storage="bfloat16", progress=False)
    fp8 = capture_samples(samples, llama, tmp_path / "fp8", aux_layer_ids=AUX, storage="fp8_e4m3", progress=False)
    # Hidden states dominate: 4 x H x 2 bytes per token in bf16, 4 x H + 4 x 4 (scales) in fp8.
    assert fp8.bytes / fp8.tokens < 0.6 * bf16.bytes / bf16.tokens
    a = HiddenStateStore(tmp_path / "bf16").read_sample(HiddenStateStore(tmp_path / "bf16").manifest().samples[0])
    b = HiddenStateStore(tmp_path / "fp8").read_sample(HiddenStateStore(tmp_path / "fp8").manifest().samples[0])
    relative = (a.aux_hidden_states.float() - b.aux_hidden_states).norm() / a.aux_hidden_states.float().norm()
    assert relative < 0.06


def test_clear_errors(llama, tmp_path):
    samples = make_samples(llama.tokenizer, 2)
    with pytest.raises(SpeculatorsError, match=r"outside the verifier vocab 0\.\.511"):
        capture_samples([TokenizedSample("bad", [1, 2, 900], [0, 1, 1])], llama, tmp_path / "s", aux_layer_ids=AUX)
    with pytest.raises(SpeculatorsError, match=r"\[9\] are outside 0..8"):
        capture_samples(samples, llama, tmp_path / "s", aux_layer_ids=[1, 4, 9])
    with pytest.raises(SpeculatorsError, match="unknown datagen backend 'tpu'"):
        capture_samples(samples, llama, tmp_path / "s", aux_layer_ids=AUX, backend="tpu")
    with pytest.raises(SpeculatorsError, match="no samples"):
        capture_samples([], llama, tmp_path / "s")


def test_non_finite_states_are_refused(tiny_verifier_dir, tmp_path):
    broken = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    with torch.no_grad():
        broken.model.model.layers[2].mlp.down_proj.weight.fill_(float("nan"))
    broken._fingerprint = "broken"
    with pytest.raises(SpeculatorsError, match="sample s0 has non-finite hidden states"):
        capture_samples(make_samples(broken.tokenizer, 1), broken, tmp_path / "s", aux_layer_ids=AUX, progress=False)
    assert not list((tmp_path / "s").rglob("*.safetensors"))


DATAGEN_SCRIPT = """
import sys, time
import speculators.data.store as hss
from speculators.data.capture import capture_samples
from speculators.data.tokenization import read_samples
from speculators.verifier.loading import load_verifier
original = hss.HiddenStateStore.write_sample
def slow_write(self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    time.sleep(0.15)  # widen the window in which the test kills us
    return result
hss.HiddenStateStore.write_sample = slow_write
verifier = load_verifier(sys.argv[1], dtype="float32")
capture_samples(read_samples(sys.argv[2]), verifier, sys.argv[3], aux_layer_ids=[1, 4, 6], batch_size=2, progress=False)
"""


def test_sigkill_and_resume_equals_an_uninterrupted_run(llama, tiny_verifier_dir, tmp_path):
    samples = make_samples(llama.tokenizer, 30)
    write_jsonl_atomic(tmp_path / "samples.jsonl", samples)
    capture_samples(samples, llama, tmp_path / "reference", aux_layer_ids=AUX, batch_size=2, progress=False)

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT_DIR)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            DATAGEN_SCRIPT,
            str(tiny_verifier_dir("llama")),
            str(tmp_path / "samples.jsonl"),
            str(killed),
        ],
        env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list(killed.rglob("*.safetensors"))) < 8:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = len(list(killed.rglob("*.safetensors")))
    assert 8 <= done < 30, done  # killed mid-run
    assert not (killed / "manifest.json").exists()

    resumed = capture_samples(samples, llama, killed, aux_layer_ids=AUX, batch_size=2, progress=False)
    assert resumed.reused >= done - 1 and resumed.computed == 30 - resumed.reused
    reference_manifest = json.loads((tmp_path / "reference" / "manifest.json").read_text())
    assert json.loads((killed / "manifest.json").read_text()) == reference_manifest
    for entry in reference_manifest["samples"]:
        assert (killed / entry["shard"]).read_bytes() == (tmp_path / "reference" / entry["shard"]).read_bytes()
    assert not [p for p in killed.rglob("*") if p.name.endswith(".tmp")]


def test_draft_vocab_against_a_hand_computation():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 3, 5, 1]] = torch.tensor([5, 5, 2, 9])  # id 1: 9, ids 3 and 7 tie at 5, id 5: 2
    vocab = select_draft_vocab(counts, 3)
    assert vocab.selected.tolist() == [1, 3, 7]  # top 3 by count; the tie 3/7 both fit; 5 left out
    assert vocab.d2t.tolist() == [1 - 0, 3 - 1, 7 - 2]
    assert vocab.t2d.nonzero().flatten().tolist() == [1, 3, 7]
    assert vocab.coverage == pytest.approx(19 / 21)
    tie = select_draft_vocab(counts, 2)
    assert tie.selected.tolist() == [1, 3]  # ties broken by the smaller id
    padded = select_draft_vocab(counts, 6)
    assert padded.selected.tolist() == [0, 1, 2, 3, 5, 7]  # 4 seen + smallest unused ids 0 and 2
    with pytest.raises(SpeculatorsError, match="draft vocab size 11 exceeds the verifier vocab 10"):
        select_draft_vocab(counts, 11)


def test_store_vocab_leaves_out_validation_source_samples(llama, tmp_path):
    """Answers of a validation source are only scored: they must not pick the vocabulary they are scored with."""
    from dataclasses import replace

    from speculators.data.conversation import VALIDATION_PREFIX

    train, held = make_samples(llama.tokenizer, 3), make_samples(llama.tokenizer, 2, offset=3)
    held = [replace(s, id=VALIDATION_PREFIX + s.id) for s in held]
    capture_samples(train + held, llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    build_store_vocab(tmp_path / "store", 64)
    expected = torch.zeros(512, dtype=torch.long)
    for sample in train:
        for token, flag in zip(sample.input_ids, sample.loss_mask, strict=True):
            expected[token] += flag
    assert torch.equal(load_draft_vocab(tmp_path / "store")["counts"], expected)
    summary = json.loads((tmp_path / "store" / "draft_vocab.json").read_text())
    assert summary["supervised_tokens"] == sum(s.supervised_tokens for s in train)


def test_store_vocab_counts_supervised_tokens_only(llama, tmp_path):
    samples = make_samples(llama.tokenizer, 5)
    capture_samples(samples, llama, tmp_path / "store", aux_layer_ids=AUX, progress=False)
    vocab = build_store_vocab(tmp_path / "store", 64)
    expected = torch.zeros(512, dtype=torch.long)
    for sample in samples:
        for token, flag in zip(sample.input_ids, sample.loss_mask, strict=True):
            expected[token] += flag
    saved = load_draft_vocab(tmp_path / "store")
    assert torch.equal(saved["counts"], expected)
    assert torch.equal(saved["selected_ids"], vocab.selected) and torch.equal(saved["d2t"], vocab.d2t)
    summary = json.loads((tmp_path / "store" / "draft_vocab.json").read_text())
    assert summary["supervised_tokens"] == sum(s.supervised_tokens for s in samples)
    assert summary["coverage"] == pytest.approx(vocab.coverage, abs=1e-6)


def test_cli_prepare_datagen_vocab(tiny_verifier_dir, tmp_path):
    from speculators.cli import main

    verifier = str(tiny_verifier_dir("llama"))
    rows = [{"prompt": f"Question {i}?", "response": f"Answer number {i}."} for i in range(6)] + [{"oops": 1}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "prepare",
                "--source",
                str(tmp_path / "rows.jsonl"),
                "--output",
                str(tmp_path / "data"),
                "--verifier",
                verifier,
                "--max-length",
                "128",
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "data" / "prepare_report.json").read_text())
    assert report["prompts"]["kept"] == 6 and report["prompts"]["rejected_total"] == 1
    assert report["tokenization"]["statistics"]["samples"] == 6
    assert (
        main(
            [
                "datagen",
                "--data",
                str(tmp_path / "data" / "samples.jsonl"),
                "--verifier",
                verifier,
                "--output",
                str(tmp_path / "store"),
                "--aux-layer-ids",
                "1,4,6",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    manifest = HiddenStateStore(tmp_path / "store").manifest()
    assert manifest.data_version == report["prompts"]["data_version"]
    assert main(["vocab", "--store", str(tmp_path / "store"), "--draft-vocab-size", "32"]) == 0
    assert main(["verify-store", str(tmp_path / "store")]) == 0
    assert main(["prepare", "--source", str(tmp_path / "missing.jsonl"), "--output", str(tmp_path / "x")]) == 2
