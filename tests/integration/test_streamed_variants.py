"""Streamed hidden states in the Dagster code location: the variant's `hidden_states:` section, the commands
its steps build, its keys and metadata, and the k8s runner's spool volume (the lineage itself: test_lineage.py)."""

from __future__ import annotations

import json
import re

import pytest

from speculators.data.records import DatagenReport
from speculators.data.store import SampleEntry, StoredVerifier, StoreManifest, StoreTotals
from speculators.train.records import TrainingSummary
from speculators_assets.environment import K8S_STORAGE_ROOT, Settings
from speculators_assets.resources import PipelineRunner
from speculators_assets.steps import NAMES, TRAINED_DRAFTER
from speculators_assets.variants import Variant, VariantError, load_variant, load_variants
from speculators_assets.workload import (
    StepFailed,
    hidden_state_commands,
    hidden_states_key,
    index_metadata,
    stream_metadata,
    torchrun_gpus,
    train_command,
    trained_drafter_key,
)

BASE = {
    "description": "d",
    "verifier": "v",
    "family": "llama",
    "prompts": {"sources": ["demo:train"]},
    "drafter": {"draft_vocab_size": 64},
}
GPU_STREAMED = {
    **BASE,
    "datagen": {"backend": "vllm", "batch_size": 64},
    "hidden_states": {"mode": "streamed", "spool": "/spool", "spool_gib": 64, "replicas": 3, "tensor_parallel_size": 2},
    "compute": {"trained_drafter": {"gpus": 8}},
}


@pytest.fixture(autouse=True)
def shipped_variants_only(monkeypatch):
    monkeypatch.delenv("SPECULATORS_VARIANTS_DIR", raising=False)


def variant(settings: dict, name: str = "v1") -> Variant:
    return Variant.model_validate({"name": name, **settings})


def test_the_streamed_demo_is_the_demo_with_streamed_hidden_states_and_every_other_variant_is_stored():
    variants = load_variants()
    streamed, demo = variants["smollm2_135m_streamed"], variants["smollm2_135m"]
    assert [name for name, v in variants.items() if v.hidden_states.streamed] == ["smollm2_135m_streamed"]
    hidden = streamed.hidden_states
    assert (hidden.mode, hidden.keep, hidden.spool, hidden.spool_gib) == ("streamed", "none", None, 2)
    assert (hidden.batch_size, hidden.probe) == (8, 4)
    assert streamed.data_from is None and not streamed.needs_gpu and streamed.trainer_processes == 1
    left_out = {"name", "description", "hidden_states"}
    assert streamed.model_dump(exclude=left_out) == demo.model_dump(exclude=left_out)


@pytest.mark.parametrize(
    ("keep", "canonical"), [("none", "none"), ("ALL", "all"), (20, "20"), ("2.50", "2.5"), (0.5, "0.5")]
)
def test_keep_is_none_all_or_gib_in_the_form_train_takes(keep, canonical):
    assert variant({**BASE, "hidden_states": {"mode": "streamed", "keep": keep}}).hidden_states.keep == canonical


@pytest.mark.parametrize(
    ("hidden_states", "compute", "message"),
    [
        (
            {"mode": "online"},
            {},
            "hidden_states.mode: Input should be 'stored' or 'streamed' (found 'online')",
        ),
        (
            {"mode": "streamed", "keep": "some"},
            {},
            "hidden_states.keep: 'some' is not none, all, or a number of GiB above 0 (e.g. 20)",
        ),
        (
            {"mode": "streamed", "keep": 0},
            {},
            "hidden_states.keep: 0 GiB is not none, all, or a number of GiB above 0 (e.g. 20); to keep nothing "
            "write none",
        ),
        (
            {"mode": "streamed", "keep": True},
            {},
            "hidden_states.keep: True is not none, all, or a number of GiB above 0 (e.g. 20)",
        ),
        (
            {"mode": "streamed", "spool": "spool"},
            {},
            "hidden_states.spool: 'spool' is not an absolute path; name a tmpfs or local NVMe folder such as "
            "/dev/shm/speculators-spool, or leave spool out (the training run's folder)",
        ),
        (
            {"mode": "streamed", "spool_gib": 0},
            {},
            "hidden_states.spool_gib: Input should be greater than 0 (found 0)",
        ),
        (
            {"keep": "all", "spool_gib": 4},
            {},
            "hidden_states: keep, spool_gib apply to streamed hidden states and mode is stored; set mode: streamed "
            "or leave them out",
        ),
        (
            {"mode": "streamed", "replicas": 2, "tensor_parallel_size": 2},
            {"trained_drafter": {"gpus": 4}},
            "compute.trained_drafter.gpus 4 leaves no GPU for the trainer beside the verifier's hidden_states.replicas "
            "2 x tensor_parallel_size 2; give the step more GPUs or the verifier fewer",
        ),
        (
            {"mode": "streamed"},
            {"trained_drafter": {"gpus": 8, "nodes": 2, "tensor_parallel_size": 16}},
            "compute.trained_drafter.nodes 2: streamed hidden states run the verifier replicas and the trainer in one "
            "pod; give the step one node, or use hidden_states mode stored",
        ),
    ],
)
def test_a_bad_hidden_states_section_is_one_clear_error(tmp_path, hidden_states, compute, message):
    path = tmp_path / "broken.yaml"
    path.write_text(json.dumps({**BASE, "hidden_states": hidden_states, "compute": compute}))
    with pytest.raises(VariantError) as error:
        load_variant(path)
    hint = "fix that value (see speculators_assets/variants/*.yaml)"
    assert str(error.value) == f"variant file {path}: {message}; {hint}"


def test_a_data_from_variant_shares_its_partitions_mode(tmp_path, monkeypatch):
    """The two share verifier_hidden_states (a store when stored, an index when streamed): a sharer takes the
    owner's mode when it leaves it out, keeps its own spool settings, and is refused a different mode."""
    (tmp_path / "owner.yaml").write_text(json.dumps({**BASE, "hidden_states": {"mode": "streamed"}}))
    sharer = {"description": "d", "data_from": "owner", "drafter": {"algorithm": "dflash"}}
    (tmp_path / "sharer.yaml").write_text(json.dumps(sharer))
    (tmp_path / "spooled.yaml").write_text(json.dumps({**sharer, "hidden_states": {"spool_gib": 3}}))
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path))
    variants = load_variants(Settings.from_env())
    assert variants["sharer"].hidden_states.mode == "streamed"
    assert (variants["spooled"].hidden_states.mode, variants["spooled"].hidden_states.spool_gib) == ("streamed", 3)
    (tmp_path / "sharer.yaml").write_text(json.dumps({**sharer, "hidden_states": {"mode": "stored"}}))
    with pytest.raises(VariantError) as error:
        load_variants(Settings.from_env())
    assert str(error.value) == (
        f"variant file {tmp_path / 'sharer.yaml'}: hidden_states.mode 'stored' differs from data_from 'owner' "
        f"(streamed), whose verifier_hidden_states it shares; leave mode out (it is taken from there) or drop data_from"
    )
    # the shipped sharers of the (stored) demo store stay stored
    monkeypatch.delenv("SPECULATORS_VARIANTS_DIR")
    shipped = load_variants()
    assert not shipped["smollm2_135m_peagle"].hidden_states.streamed


def test_a_streamed_variants_store_is_an_index_with_a_probe(tmp_path):
    streamed = load_variants()["smollm2_135m_streamed"]
    demo = load_variants()["smollm2_135m"]
    prepare, datagen, vocab = hidden_state_commands(streamed, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")
    stored = hidden_state_commands(demo, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")
    assert prepare == stored[0] and vocab == stored[2]  # the same tokenization and vocabulary command
    # the probe runs at the producers' batch (8), not the demo's regeneration-sized capture batch (256)
    at = stored[1].index("--batch-size")
    assert stored[1][at : at + 2] == ["--batch-size", "256"]
    assert datagen == [*stored[1][: at + 1], "8", *stored[1][at + 2 :], "--index-only", "--probe", "4"]
    # transformers: datagen's capture batch (4) unless hidden_states.batch_size says otherwise
    tiny = variant({**BASE, "hidden_states": {"mode": "streamed", "batch_size": 1, "probe": 1}})
    _, index, _ = hidden_state_commands(tiny, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")
    assert index[-6:] == ["--batch-size", "1", "--overwrite", "--index-only", "--probe", "1"]


def test_a_streamed_variant_trains_with_the_streamed_flags(tmp_path):
    streamed, demo = load_variants()["smollm2_135m_streamed"], load_variants()["smollm2_135m"]
    out = tmp_path / "trained_drafter" / "0123456789ab"
    command = train_command(streamed, tmp_path / "store", out, None)
    stored = train_command(demo, tmp_path / "store", out, None)
    assert "--hidden-states" not in stored
    assert command == [
        *stored,
        *("--hidden-states", "streamed", "--spool-gib", "2", "--lookahead-steps", "4", "--keep", "none"),
        *("--stream-backend", "vllm", "--stream-replicas", "1", "--stream-tensor-parallel-size", "1"),
        *("--stream-batch-size", "8", "--stream-dtype", "auto", "--trainer-processes", "1"),
    ]
    # On 8 GPUs: 3 verifier replicas of TP 2 take 6, the trainer the other 2 (the supervisor starts its torchrun),
    # in a spool folder of the run's own under hidden_states.spool.
    gpu = variant(GPU_STREAMED)
    flags = train_command(gpu, tmp_path / "store", out, None)
    assert flags[flags.index("--hidden-states") :] == [
        *("--hidden-states", "streamed", "--spool", "/spool/v1-0123456789ab", "--spool-gib", "64"),
        *("--lookahead-steps", "4", "--keep", "none", "--stream-backend", "vllm", "--stream-replicas", "3"),
        *("--stream-tensor-parallel-size", "2", "--stream-batch-size", "64", "--stream-dtype", "auto"),
        *("--trainer-processes", "2"),
    ]
    assert torchrun_gpus(gpu) == 0 and torchrun_gpus(variant({**GPU_STREAMED, "hidden_states": {}})) == 8
    transformers = variant({**BASE, "hidden_states": {"mode": "streamed", "backend": "transformers", "keep": 1.5}})
    flags = train_command(transformers, tmp_path / "store", out, None)
    assert flags[flags.index("--keep") :][:10] == [
        *("--keep", "1.5", "--stream-backend", "transformers", "--stream-replicas", "1"),
        *("--stream-tensor-parallel-size", "1", "--stream-batch-size", "4"),  # (datagen's capture batch)
    ]


def test_a_stored_variant_keeps_its_keys_and_a_streamed_one_keys_what_changes_its_states():
    stored = variant(BASE)
    assert hidden_states_key(stored, "c", "v") == hidden_states_key(variant({**BASE, "hidden_states": {}}), "c", "v")
    streamed = variant({**BASE, "hidden_states": {"mode": "streamed"}})
    assert hidden_states_key(streamed, "c", "v") != hidden_states_key(stored, "c", "v")
    probed = variant({**BASE, "hidden_states": {"mode": "streamed", "probe": 4}})
    assert hidden_states_key(probed, "c", "v") != hidden_states_key(streamed, "c", "v")

    key = trained_drafter_key(streamed, "0123456789ab")
    assert key != trained_drafter_key(stored, "0123456789ab")
    same = {"spool": "/dev/shm/s", "spool_gib": 3, "lookahead_steps": 9, "keep": "all", "replicas": 2}
    for name, value in same.items():  # where and how fast the states are computed: the same drafter
        other = variant({**BASE, "hidden_states": {"mode": "streamed", name: value}})
        assert trained_drafter_key(other, "0123456789ab") == key, name
    changed = {"backend": "vllm", "tensor_parallel_size": 2, "batch_size": 1}
    for name, value in changed.items():  # the verifier's arithmetic: another drafter
        other = variant({**BASE, "hidden_states": {"mode": "streamed", name: value}})
        assert trained_drafter_key(other, "0123456789ab") != key, name


def test_the_index_and_the_streamed_run_report_their_metadata(tmp_path):
    verifier = StoredVerifier(
        fingerprint="f", name_or_path="v", model_type="llama", num_layers=8, hidden_size=64, vocab_size=512, dtype="f"
    )
    entries = [
        SampleEntry(id=f"s{i}", key=f"k{i}", shard=f"shards/k{i}", num_tokens=10, supervised_tokens=5) for i in range(5)
    ]
    entries[2] = entries[2].model_copy(update={"checksum": "c" * 64, "bytes": 2560})
    manifest = StoreManifest(
        verifier=verifier,
        aux_layer_ids=[1, 4, 6],
        target_layer_id=8,
        storage="float32",
        totals=StoreTotals.over(entries),
        samples=entries,
    )
    report = DatagenReport(samples=5, computed=1, reused=0, tokens_per_second=812.5, bytes_per_token=256.0)
    assert index_metadata(manifest, report, 50) == {
        "computed_samples": 1,
        "index_samples": 4,
        "probe_tokens_per_second": 812.5,
        "full_store_bytes_estimate": 12800,
    }
    measured = {"probe_tokens_per_second": 900.0, "full_store_bytes_estimate": 12000}  # (datagen --index-only's)
    indexed = DatagenReport.model_validate({**report.model_dump(), "mode": "index", **measured})
    assert index_metadata(manifest, indexed, 50) == {"computed_samples": 1, "index_samples": 4, **measured}

    summary = {
        "steps": 4, "epochs": 1.0, "train_tokens": 40, "train_seconds": 1.0, "tokens_per_second": 40.0,
        "world_size": 1, "final_train": {}, "drafter": "d", "config": {},
    }  # fmt: skip
    stream = {
        "mode": "streamed", "backend": "transformers", "replicas": 1, "trainer_processes": 1, "units_computed": 4,
        "samples_computed": 8, "tokens_computed": 80, "samples_from_store": 0, "verifier_passes": 1.0,
        "capture_tokens_per_second": 95.5, "trainer_wait_share": 0.25, "producer_wait_share": 0.5,
        "spool_peak_bytes": 4096, "spool_cap_bytes": 8192, "kept_samples": 0, "kept_bytes": 0,
        "producer_restarts": 0, "store_bytes_written": 0,
    }  # fmt: skip
    streamed = variant({**BASE, "hidden_states": {"mode": "streamed"}})
    assert stream_metadata(streamed, TrainingSummary.model_validate({**summary, "stream": stream}), tmp_path) == {
        "mode": "streamed",
        "verifier_passes": 1.0,
        "trainer_wait_share": 0.25,
        "producer_wait_share": 0.5,
        "spool_peak_bytes": 4096,
        "kept_bytes": 0,
        "capture_tokens_per_second": 95.5,
    }
    from_store = {**stream, "capture_tokens_per_second": None, "verifier_passes": 0.0}  # (nothing computed)
    metadata = stream_metadata(streamed, TrainingSummary.model_validate({**summary, "stream": from_store}), tmp_path)
    assert (metadata["capture_tokens_per_second"], metadata["verifier_passes"]) == (0, 0.0)
    assert stream_metadata(variant(BASE), TrainingSummary.model_validate(summary), tmp_path) == {"mode": "stored"}
    with pytest.raises(StepFailed, match=re.escape(f"{tmp_path / 'summary.json'} records no `stream` section")):
        stream_metadata(streamed, TrainingSummary.model_validate(summary), tmp_path)


def built_pod(runner: PipelineRunner, v: Variant, step: str):
    import kubernetes
    from dagster_k8s.pipes import build_pod_body

    spec = runner.pod_spec(v, step, K8S_STORAGE_ROOT)
    pod = build_pod_body("speculators-step", None, runner.workload_command(), {}, {"labels": {}}, spec)
    assert isinstance(pod, kubernetes.client.V1Pod)
    return pod


def test_the_k8s_trainer_pod_mounts_a_memory_spool_of_the_cap_where_it_is_off_the_storage_volume():
    runner = PipelineRunner(mode="k8s", workload_image="registry.example/speculators-gpu:1.0")
    pod = built_pod(runner, variant(GPU_STREAMED), TRAINED_DRAFTER)
    (spool,) = [volume for volume in pod.spec.volumes if volume.name == "spool"]
    assert (spool.empty_dir.medium, spool.empty_dir.size_limit) == ("Memory", "64Gi")
    mounts = {m.name: m.mount_path for m in pod.spec.containers[0].volume_mounts}
    assert mounts == {"storage": K8S_STORAGE_ROOT, "dshm": "/dev/shm", "spool": "/spool"}
    assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"  # verifier and trainer GPUs together
    half = variant({**GPU_STREAMED, "hidden_states": {**GPU_STREAMED["hidden_states"], "spool_gib": 2.5}})
    (spool,) = [volume for volume in built_pod(runner, half, TRAINED_DRAFTER).spec.volumes if volume.name == "spool"]
    assert spool.empty_dir.size_limit == "2560Mi"
    # No volume of its own: the other steps, a stored variant, a spool on the storage volume or left out.
    on_storage = {**GPU_STREAMED["hidden_states"], "spool": f"{K8S_STORAGE_ROOT}/spools"}
    left_out = {key: value for key, value in GPU_STREAMED["hidden_states"].items() if key != "spool"}
    cases = [(variant(GPU_STREAMED), step) for step in NAMES if step != TRAINED_DRAFTER]
    cases += [(variant({**GPU_STREAMED, "hidden_states": {}}), TRAINED_DRAFTER)]
    cases += [(variant({**GPU_STREAMED, "hidden_states": h}), TRAINED_DRAFTER) for h in (on_storage, left_out)]
    for v, step in cases:
        assert [volume.name for volume in built_pod(runner, v, step).spec.volumes] == ["storage", "dshm"], step


def test_the_demo_headline_shows_the_index_and_the_streamed_run():
    from speculators_assets.demo import headline

    hidden = {
        "mode": "streamed", "samples": 720, "tokens": 200_000, "computed_samples": 16, "probe_tokens_per_second": 812.4,
        "full_store_bytes_estimate": 943_718_400, "store_bytes": 3 * 2**20,
    }  # fmt: skip
    drafter = {
        "steps": 300, "tokens_per_second": 5000.0, "full_accuracy_per_step": [0.5, 0.25], "acceptance_length": 1.5,
        "acceptance_length_source": "replayed on validation samples", "mode": "streamed", "verifier_passes": 3.0,
        "capture_tokens_per_second": 1500.0, "trainer_wait_share": 0.125, "producer_wait_share": 0.5,
        "spool_peak_bytes": 2**29, "kept_bytes": 0,
    }  # fmt: skip
    lines = headline({"verifier_hidden_states": hidden, "trained_drafter": drafter}, {})
    assert lines[0] == (
        "hidden states: streamed; an index of 720 samples, 200000 tokens (16 probe shards: capture 812 tokens/s; a "
        "full store would take 900.0 MiB, the index takes 3.0)"
    )
    assert lines[2] == (
        "streamed states: 3.00 verifier passes over the training split at 1500 tokens/s; the trainer waited 12% of "
        "its time, the producers 50%; spool peak 512.0 MiB, kept 0.0 MiB"
    )
