"""Shared fixtures: tiny random verifiers of each family, built once per test session, offline."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# pytest-xdist workers share the machine's cores: each worker's PyTorch (and every process it starts
# that does not set its own count, as vLLM's CPU workers do) gets its share of them. With the default
# (every core per worker) two workers' OpenMP threads wait on each other: test_train.py and
# test_evaluate.py side by side took 174 s with 2 threads each on 2 cores, 46 s with 1.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, share)))

# No test may reach a model hub; quiet transformers' progress bars.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

CAPTURE_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")
PEAKED_AUX = [1, 4, 6]
PEAKED_PROMPTS = 8


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread inside, as a process pinned to one core runs: on some CPUs (2 AMD EPYC cores with
    AVX-512 BF16) a 2-thread matmul sums in another order, so runs compared bitwise must match thread counts."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def peaked_prompts() -> list[str]:
    """The prompts the `store` fixture (and so `trained_drafter`) is built from."""
    from speculators.data.demo_prompts import demo_prompts

    return demo_prompts()[:PEAKED_PROMPTS]


def write_peaked_prompts(path: Path) -> Path:
    """Those prompts as a prompt JSONL file (the drafter's training prompts: acceptance well above 1)."""
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in peaked_prompts()))
    return path


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory):
    """family -> directory of a tiny random verifier (8 layers, hidden 64, vocab 512), cached."""
    from speculators.verifier.tiny import make_tiny_verifier

    built: dict[str, object] = {}

    def get(family: str = "llama"):
        if family not in built:
            built[family] = make_tiny_verifier(family, tmp_path_factory.mktemp(f"verifier-{family}"))
        return built[family]

    return get


@pytest.fixture(scope="session")
def speculators_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculators-cache")
    os.environ["SPECULATORS_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def peaked_verifier(tmp_path_factory):
    """A tiny Llama whose next-token distributions are peaked, like a trained model's."""
    from speculators.verifier.tiny import make_tiny_verifier

    return make_tiny_verifier("llama", tmp_path_factory.mktemp("peaked-llama"), seed=1, initializer_range=0.3)


def build_peaked_store(
    verifier_dir: Path,
    directory: Path,
    dtype: str = "float32",
    quantization: str | None = None,
    aux_layer_ids: list[int] = PEAKED_AUX,
) -> Path:
    """A small on-policy store from a peaked tiny verifier: 8 regenerated answers, draft vocab of 128;
    with `quantization`, the FP8 verifier's own answers and states; the states of `aux_layer_ids`."""
    from speculators.data.capture import capture_samples
    from speculators.data.conversation import Conversation
    from speculators.data.regenerate import regenerate, transformers_generate_fn
    from speculators.train.vocab import build_store_vocab
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(verifier_dir, dtype=dtype, quantization=quantization)
    conversations = [Conversation(f"s{i}", [{"role": "user", "content": p}]) for i, p in enumerate(peaked_prompts())]
    generate = transformers_generate_fn(verifier.model, verifier.tokenizer, 48, temperature=0.0, seed=0)
    samples, _ = regenerate(
        conversations, verifier.tokenizer, generate, directory / "partial.jsonl", 512, progress=False
    )
    capture_samples(samples, verifier, directory, aux_layer_ids=aux_layer_ids, storage="float32", progress=False)
    build_store_vocab(directory, 128)
    return directory


def train_peaked_drafter(store: Path, verifier_dir: Path, output: Path, epochs: int = 80) -> Path:
    """A tiny drafter trained to overfit a peaked verifier's answers to the first demo prompts."""
    from speculators.train.trainer import TrainConfig, train

    train(
        TrainConfig(
            store=str(store),
            verifier=str(verifier_dir),
            output=str(output),
            epochs=epochs,
            lr=1e-2,
            warmup=0.05,
            validation_share=0.0,
            token_budget=512,
            precision="fp32",
            log_every=50,
            eval_every=1000,
            checkpoint_every=1000,
            progress=False,
        )
    )
    return output / "drafter"


@pytest.fixture(scope="session")
def store(peaked_verifier, tmp_path_factory):
    """A small on-policy store from the peaked tiny Llama: 8 regenerated answers, draft vocab of 128."""
    return build_peaked_store(peaked_verifier, tmp_path_factory.mktemp("train-store"))


@pytest.fixture(scope="session")
def trained_drafter(store, peaked_verifier, tmp_path_factory):
    """A tiny drafter trained to overfit the peaked verifier's answers to the first demo prompts."""
    return train_peaked_drafter(store, peaked_verifier, tmp_path_factory.mktemp("trained-drafter"))


def write_tiny_variant(folder: Path, verifier: Path, prompts: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiny_llama.yaml").write_text(f"""
description: tiny random Llama (tests)
verifier: {verifier}
family: llama
prompts: {{sources: ["{prompts}"], eval_source: "{prompts}"}}
datagen: {{regenerate: true, backend: transformers, max_length: 256, max_new_tokens: 48, batch_size: 8,
          storage: float32, dtype: float32}}
drafter: {{draft_vocab_size: 128, aux_layer_ids: [1, 4, 6], speculative_tokens: 3}}
training: {{epochs: 40, lr: 0.01, token_budget: 512, validation_share: 0.0, precision: fp32}}
benchmark: {{requests: 4, output_tokens: 16, natural_max_tokens: 48, concurrency: [2], dtype: float32,
            max_model_len: 512, enforce_eager: true, kv_cache_gib: 1, mt_bench: 2, sweep_k: [1]}}
gates: {{min_acceptance_length: 1.5, min_vocab_coverage: 0.5}}
""")


def write_tiny_streamed_variant(folder: Path) -> None:
    """`tiny_llama_streamed`: tiny_llama's data and recipe (its file in `folder`) with streamed hidden states:
    its own index with one probe shard, one transformers producer at batch 1 (fp32) and the trainer beside
    it, nothing kept; a lighter benchmark (the lineage's own is tiny_llama's)."""
    import yaml

    settings = yaml.safe_load((folder / "tiny_llama.yaml").read_text())
    settings["description"] = "tiny random Llama with streamed hidden states (tests)"
    settings["hidden_states"] = {"mode": "streamed", "probe": 1, "batch_size": 1, "spool_gib": 1, "keep": "none"}
    settings["benchmark"] = {
        **settings["benchmark"],
        **{"concurrency": [], "mt_bench": 0, "sweep_k": [], "fixed_length": False},
    }
    (folder / "tiny_llama_streamed.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))


@pytest.fixture(scope="session")
def lineage(peaked_verifier, tmp_path_factory):
    """The whole lineage for `tiny_llama`, materialized in-process with real Pipes subprocesses, once per
    session: the Dagster tests and the UI test share it (a test that changes its inputs restores them)."""
    base = tmp_path_factory.mktemp("lineage")
    prompts = write_peaked_prompts(base / "prompts.jsonl")
    write_tiny_variant(base / "variants", peaked_verifier, prompts)
    env = {"SPECULATORS_VARIANTS_DIR": str(base / "variants"), "SPECULATORS_STORAGE_ROOT": str(base / "storage")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import dagster as dg

        from speculators_assets.definitions import build_defs

        defs = build_defs()
        (base / "dagster-home").mkdir()
        instance = dg.DagsterInstance.local_temp(str(base / "dagster-home"))  # persistent: schedules read it
        first = dg.materialize(
            list(defs.assets),
            partition_key="tiny_llama",
            resources=defs.resources,
            instance=instance,
            raise_on_error=False,
        )
        yield {"defs": defs, "instance": instance, "first": first, "base": base, "prompts": prompts, "env": env}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Modules that take minutes: `make test` runs two pytest-xdist workers that take whole modules
# (`--dist loadfile`) in collection order, a worker getting the next module once its current one has two
# tests left. These start first, the others follow by file name, so that while one worker waits on a
# vLLM server the other mostly runs quick modules (on 2 cores, two vLLM-heavy modules at once slow each
# other down: with every slow module first the suite took over 30 minutes instead of about 22).
SLOWEST_MODULES = (
    "test_lineage.py",
    "test_serve_bench.py",
    "test_vision_language.py",
    "test_regenerate.py",
    "test_vllm_capture.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> tuple[int, str]:
        name = item.path.name
        return (SLOWEST_MODULES.index(name) if name in SLOWEST_MODULES else len(SLOWEST_MODULES), name)

    items.sort(key=rank)  # stable: the order inside each module is kept


def built_node_pods(runner, variant, step: str, root: str) -> list:
    """A multi-node step's pods as the k8s runner renders them (`node_pods`), each built into the pod
    dagster-k8s would create and checked: a V1Pod with 8 GPUs, named `<group>-<rank>` under the group's
    headless Service. Returns (rendered dict, V1Pod) per node rank."""
    import kubernetes
    from dagster_k8s.pipes import build_pod_body

    from speculators_assets.variants import node_group_name

    group = node_group_name(variant.name, step)
    pods = runner.node_pods(variant, step, root)
    assert [p["metadata"]["name"] for p in pods] == [f"{group}-0", f"{group}-1"]
    built = []
    for rank, rendered in enumerate(pods):
        spec = rendered["spec"]
        command = spec["containers"][0].get("command") or runner.workload_command()
        pod = build_pod_body(
            rendered["metadata"]["name"], None, command, {}, {"labels": rendered["metadata"]["labels"]}, spec
        )
        assert isinstance(pod, kubernetes.client.V1Pod)
        assert pod.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"  # each node's 8 of the 16
        assert (pod.spec.hostname, pod.spec.subdomain) == (f"{group}-{rank}", group)
        built.append((rendered, pod))
    return built
