"""vLLM as the capture engine (its CPU build here): every family's states equal the transformers
capture, with tensor parallel 2 and with data-parallel replicas as with a single engine.

Each test runs `speculators datagen --backend vllm` as a user would (a process of its own, since
vLLM's engine and its worker processes are not to outlive a test)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from speculators.atomic_io import write_jsonl_atomic
from speculators.data.capture import capture_samples
from speculators.data.store import HiddenStateStore
from speculators.verifier.loading import load_verifier
from tests.conftest import CAPTURE_FAMILIES
from tests.unit.data.test_datagen import make_samples

pytestmark = pytest.mark.slow
AUX = [0, 4, 6]  # id 0 (the embeddings), two middle layers, and id 8 (pre-norm output of the last layer) follows
# GPT-OSS: vLLM's CPU attention kernel runs the attention-sink path in bf16 (vllm/v1/attention/backends/
# cpu_attn.py, "executes attention sinks natively in bf16"), so its states differ from the fp32 reference by
# bf16 rounding (~1.5% of a state's norm, measured), and the random tiny model's MoE router then flips an
# expert at a near tie for a few tokens (2 of 545 at id 2; with the experts zeroed every id stays within
# 1.1%). So GPT-OSS is compared at ids 0-2: id 0 exact, ids 1 and 2 within bf16 rounding at 98% of the tokens
# (median under 2%); the deeper ids (where flips compound) are left out of the comparison.
GPT_OSS_AUX = [0, 1, 2]
# DeepSeek-V3: ids 1 and 2 follow its two dense layers (2 enters the first MoE layer), 5 follows MoE layers
# (tests/families/test_deepseek_v3.py says what vLLM records there).
DEEPSEEK_V3_AUX = [1, 2, 5]
# Qwen3-MoE: a store of five aux layers, as one that serves an EAGLE-3 drafter (three) and a DFlash one
# (five) keeps (capture once, train several): every id is recorded, in the order asked, beside id N.
QWEN3_MOE_AUX = [0, 1, 3, 4, 6]


def aux_ids(family: str) -> list[int]:
    return {"gpt_oss": GPT_OSS_AUX, "deepseek_v3": DEEPSEEK_V3_AUX, "qwen3_moe": QWEN3_MOE_AUX}.get(family, AUX)


def vllm_datagen(verifier, samples_path, store, *extra: str, aux: list[int] = AUX) -> None:
    command = [
        sys.executable,
        "-m",
        "speculators.cli",
        "datagen",
        "--data",
        str(samples_path),
        "--verifier",
        str(verifier),
        "--output",
        str(store),
        "--backend",
        "vllm",
        "--dtype",
        "float32",
        "--storage",
        "float32",
        "--batch-size",
        "3",
        "--aux-layer-ids",
        ",".join(map(str, aux)),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def relative_errors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token error relative to the reference state's norm."""
    return (x.float() - y.float()).norm(dim=-1) / y.float().norm(dim=-1).clamp(min=1e-12)


def assert_same_store(a, b, atol: float = 1e-4, bf16_rounding: bool = False) -> None:
    left, right = HiddenStateStore(a), HiddenStateStore(b)
    assert left.verify() == [] and right.verify() == []
    first, second = left.manifest().samples, right.manifest().samples
    assert [e.key for e in first] == [e.key for e in second] and len(first) > 0
    errors = []
    for x_entry, y_entry in zip(first, second, strict=True):
        x, y = left.read_sample(x_entry), right.read_sample(y_entry)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        if bf16_rounding:
            assert torch.equal(x.aux_hidden_states[:, 0], y.aux_hidden_states[:, 0])  # id 0: the embeddings
            errors.append(relative_errors(x.aux_hidden_states, y.aux_hidden_states))
            continue
        torch.testing.assert_close(x.aux_hidden_states, y.aux_hidden_states, atol=atol, rtol=atol)
        torch.testing.assert_close(x.target_hidden_states, y.target_hidden_states, atol=atol, rtol=atol)
    if bf16_rounding:
        errors = torch.cat(errors)  # [tokens, 3]
        # Ids 1 and 2 follow MoE layers: bf16 rounding almost everywhere, a router flip at a near tie for a
        # token or two (which tokens depends on the prompts).
        assert (errors[:, 1:].median(dim=0).values < 0.02).all(), errors.median(dim=0).values
        assert ((errors[:, 1:] < 0.03).float().mean(dim=0) >= 0.98).all(), (errors[:, 1:] >= 0.03).sum(dim=0)


@pytest.fixture(scope="module")
def prepared(tiny_verifier_dir, tmp_path_factory):
    """family -> (verifier dir, samples.jsonl, the transformers store), built once per family."""
    built = {}

    def get(family: str):
        if family not in built:
            directory = tmp_path_factory.mktemp(f"capture-{family}")
            verifier = load_verifier(tiny_verifier_dir(family), dtype="float32")
            samples = make_samples(verifier.tokenizer, 7)  # 40-90 tokens: past gpt_oss's 16-token window
            write_jsonl_atomic(directory / "samples.jsonl", samples)
            capture_samples(
                samples, verifier, directory / "hf", aux_layer_ids=aux_ids(family), storage="float32", progress=False
            )
            built[family] = (tiny_verifier_dir(family), directory / "samples.jsonl", directory / "hf")
        return built[family]

    return get


# Each family once through vLLM; two of them with parallelism, so TP=2 and two data-parallel replicas
# are each held to the same transformers reference as the single-engine runs (no engine started twice).
PARALLEL = {"llama": ("--tensor-parallel-size", "2"), "qwen3": ("--data-parallel-size", "2")}


@pytest.mark.parametrize("family", CAPTURE_FAMILIES)
def test_vllm_capture_equals_the_transformers_capture(family, prepared, tmp_path):
    """Same layout and keys; every aux state and the pre-norm last state within fp32 rounding (vLLM's
    fused kernels and MoE routing round differently from transformers'). llama runs with tensor
    parallel 2 (vLLM's CPU build: ranks as processes with its shared-memory all-reduce, each on its own
    core), qwen3 as two data-parallel replicas (each its own engine on its own core, computing every
    other batch; the manifest pass after them starts no engine and lists every sample in data order)."""
    verifier, samples, hf_store = prepared(family)
    vllm_datagen(verifier, samples, tmp_path / "vllm", *PARALLEL.get(family, ()), aux=aux_ids(family))
    assert_same_store(tmp_path / "vllm", hf_store, bf16_rounding=family == "gpt_oss")
    assert HiddenStateStore(tmp_path / "vllm").manifest().aux_layer_ids == aux_ids(family)
    logs = sorted(p.name for p in (tmp_path / "vllm").glob("replica-*.log"))
    if family == "qwen3":
        assert logs == ["replica-0.log", "replica-1.log"]
        for index in (0, 1):
            assert f"replica {index}/2: computed" in (tmp_path / "vllm" / f"replica-{index}.log").read_text()
    else:
        assert logs == []


def test_a_batch_prefilled_in_chunks_equals_transformers_at_every_id_with_cuda_untouched(tiny_verifier_dir, tmp_path):
    """A 48-token step budget splits this batch's prefill over several steps, the 100- and 90-token
    prompts each over three: every prompt's states at every aux id (and id N) equal transformers'. The
    engines (capture, then regeneration) start in a process whose torch.cuda entry points raise
    (tests/engine_probe.py): the start paths decide the platform and dtype without touching CUDA."""
    import json
    import random

    from safetensors.torch import load_file

    verifier_dir = tiny_verifier_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (100, 30, 70, 90, 45)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "states.safetensors"
    command = [sys.executable, "-m", "tests.engine_probe", str(verifier_dir), str(tmp_path / "prompts.json"), str(out)]
    done = subprocess.run([*command, "48"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "started with torch.cuda forbidden" in done.stdout
    states = load_file(out)
    verifier = load_verifier(verifier_dir, dtype="float32")
    for index, prompt in enumerate(prompts):
        reference = verifier.capture(torch.tensor([prompt]), [0, 2, 4, 8])[0]
        assert states[f"prompt{index}"].shape == reference.shape == (len(prompt), 4, 64)
        torch.testing.assert_close(states[f"prompt{index}"], reference, atol=1e-4, rtol=1e-4)
