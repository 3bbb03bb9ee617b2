"""FP8 verifiers: vLLM's online FP8 (`--quantization fp8_per_channel`) and the same arithmetic in
transformers (speculators/verifier/quantization.py), through capture, serving with a drafter, the lossless
judge, evaluation and the Dagster variant.

vLLM's CPU build runs fp8_per_channel here (torch._scaled_mm; no AMX needed) in bfloat16 only, and
cannot run fp8_per_tensor (a test asserts its own reason, so it fails when vLLM fixes that)."""

from __future__ import annotations

import os

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.verifier.quantization import (
    FP8_MAX,
    cpu_build_refusal,
    fp8_linear,
    fp8_tokens,
    quantize_verifier,
    row_scales,
    vllm_dtype,
    vllm_quantization_args,
)
from tests.conftest import PEAKED_AUX, write_peaked_prompts

SCHEME = "fp8_per_channel"


@pytest.fixture(scope="module")
def fp8_drafter(peaked_verifier, tmp_path_factory):
    """A drafter trained on the FP8 verifier's own answers and hidden states (transformers, fp32 around
    the FP8 projections). The tiny peaked verifier is chaotic: FP8 changes its greedy answers within a
    few tokens, so a drafter trained on the unquantized verifier accepts next to nothing under FP8
    (measured: 1.00 on all 8 prompts). A real model's answers move far less (BENCHMARKS.md: SmolLM2)."""
    from tests.conftest import build_peaked_store, train_peaked_drafter

    base = tmp_path_factory.mktemp("fp8-drafter")
    store = build_peaked_store(peaked_verifier, base / "store", quantization=SCHEME)
    return train_peaked_drafter(store, peaked_verifier, base / "train")


def test_fp8_linear_computes_vllms_fp8_gemm_exactly():
    """Per-row weight scales (amax / 448), per-token activation scales, fp8 x fp8 summed in fp32: equal
    to torch._scaled_mm, the GEMM vLLM's FP8 kernel (ChannelWiseTorchFP8ScaledMMLinearKernel) calls."""
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=g) * 0.05, torch.randn(48, generator=g)
    x = torch.randn(2, 7, 64, generator=g)
    scale = row_scales(weight)
    assert torch.equal(scale, weight.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    layer = fp8_linear(weight, scale, bias)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight.element_size() == 1
    quantized, token_scale = fp8_tokens(x.reshape(-1, 64))
    assert torch.equal(token_scale, x.reshape(-1, 64).abs().amax(dim=1, keepdim=True) / FP8_MAX)
    one = torch.ones(1)
    gemm = torch._scaled_mm(quantized, layer.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    exact = (quantized.double() @ layer.weight.double().t()).float()  # fp8 x fp8 sums: exact in float64
    assert torch.allclose(gemm, exact, rtol=1e-6, atol=0)  # vLLM's GEMM sums in fp32: equal to rounding
    expected = (exact * token_scale * scale.t() + bias).reshape(2, 7, 48)
    assert torch.equal(layer(x), expected)
    # An fp32 model holds the same fp8 values in fp32 (no conversion per call): the same outputs.
    assert torch.equal(fp8_linear(weight, scale, bias, hold=torch.float32)(x), expected)
    # Batch-invariant: a row's output does not depend on the other rows of the call.
    assert torch.equal(layer(x[:1, 3:4]), expected[:1, 3:4])
    # And it is FP8: within e4m3's 2^-4 relative step of the exact product, but not equal to it.
    unquantized = torch.nn.functional.linear(x, weight, bias)
    error = (layer(x) - unquantized).norm() / unquantized.norm()
    assert 1e-3 < error < 0.0625


def test_quantizing_a_verifier_swaps_every_decoder_projection(tiny_verifier_dir):
    from speculators.verifier.loading import load_verifier
    from speculators.verifier.quantization import DENSE_FAMILIES

    plain = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    fp8 = load_verifier(tiny_verifier_dir("llama"), dtype="float32", quantization=SCHEME)
    per_tensor = load_verifier(tiny_verifier_dir("llama"), dtype="float32", quantization="fp8_per_tensor")
    layer = fp8.model.model.layers[0]
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert all(type(getattr(layer.self_attn, n)).__name__ == "Fp8Linear" for n in names)
    assert type(fp8.model.lm_head) is torch.nn.Linear  # as vLLM: lm_head and embeddings stay unquantized
    assert fp8.describe()["quantization"] == SCHEME and fp8.states_fingerprint == plain.fingerprint + "+" + SCHEME
    # fp8_per_tensor: one scale per vLLM layer, which fuses q, k, v (and gate, up) into one weight.
    attention, mlp = per_tensor.model.model.layers[0].self_attn, per_tensor.model.model.layers[0].mlp
    assert attention.q_proj.weight_scale.numel() == 1
    assert attention.q_proj.weight_scale == attention.k_proj.weight_scale == attention.v_proj.weight_scale
    assert mlp.gate_proj.weight_scale == mlp.up_proj.weight_scale != mlp.down_proj.weight_scale
    ids = torch.randint(0, plain.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = plain.model(ids).logits, fp8.model(ids).logits
    assert 1e-3 < ((a - b).norm() / a.norm()).item() < 0.2  # FP8 noise: changed, but the same model

    moe = load_verifier(tiny_verifier_dir("qwen3_moe"), dtype="float32")
    with pytest.raises(SpeculatorsError, match=r"not qwen3_moe; quantize qwen3_moe verifiers with the vllm backend"):
        quantize_verifier(moe.model, "qwen3_moe", SCHEME)
    assert "llama" in DENSE_FAMILIES


def test_vllm_settings_for_an_fp8_verifier():
    assert vllm_dtype("auto", SCHEME) == "bfloat16"  # vLLM's online FP8 computes in bf16 or fp16 only
    assert vllm_dtype("float16", SCHEME) == "float16"
    with pytest.raises(SpeculatorsError, match=r"--dtype float32 with --quantization fp8_per_channel: .* bfloat16"):
        vllm_dtype("float32", SCHEME)
    assert vllm_quantization_args(SCHEME) == ["--quantization", SCHEME] and vllm_quantization_args(None) == []
    with pytest.raises(SpeculatorsError, match="'fp8' is not one of fp8_per_channel, fp8_per_tensor"):
        vllm_quantization_args("fp8")
    if not torch.cuda.is_available():
        assert "cannot run fp8_per_tensor" in cpu_build_refusal("fp8_per_tensor")
        with pytest.raises(SpeculatorsError, match="use fp8_per_channel on CPU"):
            vllm_quantization_args("fp8_per_tensor")
    assert cpu_build_refusal(SCHEME) is None


def test_the_cli_takes_the_quantization_and_refuses_it_after_the_double_dash(tmp_path, fp8_drafter):
    from speculators.cli import build_parser
    from speculators.eval.bench import run_bench
    from speculators.settings import BenchSettings

    args = build_parser().parse_args(["serve", "--verifier", "v", "--quantization", SCHEME])
    assert args.quantization == SCHEME
    args = build_parser().parse_args(["evaluate", "--verifier", "v", "--quantization", SCHEME])
    assert args.quantization == SCHEME
    settings = BenchSettings(
        verifier="v", speculator=str(fp8_drafter), output=str(tmp_path), vllm_args=["--quantization=fp8"]
    )
    with pytest.raises(SpeculatorsError, match="pass the verifier's quantization as bench's own --quantization"):
        run_bench(settings)


def test_the_fp8_variant_puts_the_quantization_into_every_verifier_command(tmp_path):
    from speculators_assets.variants import PACKAGE_VARIANTS, load_variant
    from speculators_assets.workload import bench_command, hidden_state_commands

    fp8 = load_variant(PACKAGE_VARIANTS / "llama3_3_70b_fp8.yaml")
    prepare, datagen, vocab = hidden_state_commands(fp8, tmp_path / "c.jsonl", tmp_path / "data", tmp_path / "store")
    bench = bench_command(fp8, tmp_path / "ckpt", tmp_path / "report")
    for command in (prepare, datagen, bench):
        assert command[command.index("--quantization") + 1] == SCHEME
    assert "--quantization" not in vocab
    plain = load_variant(PACKAGE_VARIANTS / "llama3_3_70b.yaml")
    commands = [
        *hidden_state_commands(plain, tmp_path / "c", tmp_path / "d", tmp_path / "s"),
        bench_command(plain, tmp_path, tmp_path),
    ]
    assert not any("--quantization" in c for c in commands)


def test_evaluate_decodes_losslessly_against_the_same_fp8_verifier(peaked_verifier, fp8_drafter, tmp_path):
    """Both decoders run the same FP8 verifier, so the speculative tokens are its greedy tokens up to
    its own noise: where they part, the two candidates lie within the most the decoders' logits
    differed where they agreed (evaluate.order_noise), a near-tie, never a divergence. The drafter
    trained on that verifier's states accepts as one trained on an unquantized verifier does."""
    from speculators.eval.evaluate import run_evaluation
    from speculators.settings import EvaluateSettings

    prompts = str(write_peaked_prompts(tmp_path / "p.jsonl"))
    common = dict(speculator=str(fp8_drafter), max_new_tokens=32, stop_at_eos=False, max_prompts=8)
    settings = EvaluateSettings(
        verifier=str(peaked_verifier), prompts=prompts, quantization=SCHEME, output=tmp_path / "r.json", **common
    )
    report = run_evaluation(settings)
    lossless = report.totals()["lossless"]
    assert lossless["diverged"] == 0 and lossless["identical"] >= 6, lossless
    noise = report.settings["fp8_order_noise"]
    splits = [r.comparison for r in report.results if r.comparison.status == "near_tie"]
    assert all(c.margin <= c.path_noise and c.path_noise >= noise for c in splits)
    assert report.to_dict()["settings"]["quantization"] == SCHEME
    assert report.totals()["acceptance_length"] > 1.8


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.slow
def test_vllm_cpu_fp8_layers_and_states_are_the_transformers_fp8_verifiers(peaked_verifier):
    """One engine of vLLM's CPU build with fp8_per_channel: its quantized weights, scales and a layer's
    output for a given input equal ours bit for bit; its captured states are closer to our FP8
    verifier's than to the unquantized verifier's at every aux id (the rest of the model runs in bf16 in
    both, with other kernels, so FP8 roundings flip here and there: not bit-equal)."""
    from speculators.data.capture import transformers_capture_fn
    from speculators.data.capture_vllm import VllmCapture
    from speculators.verifier.loading import load_verifier
    from tests.fp8_probe import qkv_of_first_layer

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (17, 40, 64, 33)]
    capture_ids = [*PEAKED_AUX, 8]
    capture = VllmCapture(str(peaked_verifier), capture_ids, "bfloat16", max_model_len=128, quantization=SCHEME)
    try:
        served = capture(prompts, [[]] * len(prompts))
        weight, scale, x, out = (torch.tensor(t) for t in capture.llm.apply_model(qkv_of_first_layer)[0])
    finally:
        capture.close()

    fp8 = load_verifier(peaked_verifier, dtype="bfloat16", quantization=SCHEME)
    attention = fp8.model.model.layers[0].self_attn
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    assert torch.equal(weight, torch.cat([p.weight.float() for p in projections]))
    assert torch.equal(scale.reshape(-1), torch.cat([p.weight_scale.reshape(-1) for p in projections]))
    with torch.inference_mode():
        ours = torch.cat([p(x.bfloat16()) for p in projections], dim=-1).float()
    # vLLM's fp32 sums and our exact ones round alike but for the odd last bit: at most 1 bf16 ulp.
    assert torch.allclose(ours, out, rtol=2**-7, atol=0) and (ours == out).float().mean() > 0.95

    plain = load_verifier(peaked_verifier, dtype="bfloat16")
    references = {
        name: transformers_capture_fn(v, capture_ids)(prompts, [[]] * len(prompts))
        for name, v in (("fp8", fp8), ("plain", plain))
    }

    def mean_error(reference: list[torch.Tensor]) -> torch.Tensor:
        errors = [
            ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).mean(dim=0)
            for a, b in zip(served, reference, strict=True)
        ]
        return torch.stack(errors).mean(dim=0)

    fp8_error, plain_error = mean_error(references["fp8"]), mean_error(references["plain"])
    assert (fp8_error < 0.75 * plain_error).all(), (fp8_error.tolist(), plain_error.tolist())


@pytest.mark.slow
def test_the_fp8_pipeline_on_vllm_cpu_serves_its_drafter_losslessly(peaked_verifier, tmp_path):
    """The FP8 lineage on vLLM's CPU build (bf16, as its FP8 needs): `prepare --regenerate` and `datagen`
    with `--backend vllm --quantization fp8_per_channel`, a drafter trained on those states, then the FP8
    verifier served alone and with the drafter. Their greedy tokens are the same, or part only where the
    FP8 judge finds a near-tie; the served acceptance is well above 1; and our FP8 verifier's greedy
    answers follow the FP8 server's further than the unquantized verifier's do (the judge re-scores with
    the right model)."""
    from speculators.data.capture import run_capture
    from speculators.data.prepare import run_prepare
    from speculators.data.prompt_set import load_prompts
    from speculators.data.regenerate import transformers_generate_fn
    from speculators.data.store import HiddenStateStore
    from speculators.eval.evaluate import tokenize_prompts
    from speculators.eval.output_judge import OutputJudge, compare_served_outputs
    from speculators.serving.serve import ServerSettings, VllmServer, acceptance_from_counters
    from speculators.settings import CaptureSettings, PrepareSettings
    from speculators.train.vocab import build_store_vocab
    from speculators.verifier.loading import load_verifier
    from tests.conftest import train_peaked_drafter
    from tests.unit.serving.test_serve_bench import completions

    prompts_file = str(write_peaked_prompts(tmp_path / "p.jsonl"))
    vllm = dict(verifier=str(peaked_verifier), backend="vllm", dtype="bfloat16", quantization=SCHEME)
    run_prepare(
        PrepareSettings(
            sources=[prompts_file],
            output=str(tmp_path / "data"),
            regenerate=True,
            max_length=256,
            max_new_tokens=48,
            **vllm,
        )
    )
    store = tmp_path / "store"
    run_capture(
        CaptureSettings(
            data=str(tmp_path / "data" / "samples.jsonl"),
            output=str(store),
            aux_layer_ids=PEAKED_AUX,
            storage="float32",
            **vllm,
        )
    )
    manifest = HiddenStateStore(store).manifest()
    assert manifest.verifier.quantization == SCHEME and manifest.verifier.dtype == "bfloat16"
    build_store_vocab(store, 128)
    drafter = train_peaked_drafter(store, peaked_verifier, tmp_path / "train")

    fp8 = load_verifier(peaked_verifier, dtype="bfloat16", quantization=SCHEME)
    prompts = tokenize_prompts(fp8.tokenizer, load_prompts(prompts_file))
    token_prompts = [ids for _, ids in prompts]
    server = dict(
        verifier=str(peaked_verifier),
        port=0,
        quantization=SCHEME,
        max_model_len=512,
        enforce_eager=True,
        kv_cache_gib=1,
    )
    outputs, counters = {}, {}
    for role, speculator in (("baseline", None), ("speculator", str(drafter))):
        settings = ServerSettings(**server, speculator=speculator, log_path=tmp_path / f"{role}.log")
        with VllmServer(settings) as running:
            command = running.command()
            assert command[command.index("--quantization") + 1] == SCHEME
            assert command[command.index("--dtype") + 1] == "bfloat16"
            before = running.metrics()
            outputs[role] = completions(running.url, running.model_name, token_prompts)
            counters[role] = acceptance_from_counters(before, running.metrics())
    assert counters["speculator"]["acceptance_length"] > 1.5, counters
    records = {
        role: [
            {"messages": [{"role": "user", "content": str(i)}], "prompt_token_ids": p, "token_ids": ids}
            for i, (p, ids) in enumerate(zip(token_prompts, outs, strict=True))
        ]
        for role, outs in outputs.items()
    }
    judge = OutputJudge(str(peaked_verifier), "auto", quantization=SCHEME)
    verdicts = compare_served_outputs(records["baseline"], records["speculator"], judge)
    assert verdicts["diverged"] == 0, verdicts["differences"]

    plain = load_verifier(peaked_verifier, dtype="bfloat16")
    agreement = {}
    for name, verifier in (("fp8", fp8), ("plain", plain)):
        generate = transformers_generate_fn(verifier.model, verifier.tokenizer, len(outputs["baseline"][0]), 0.0, 0)
        ours = generate(token_prompts)
        agreement[name] = sum(common_prefix(a, b) for a, b in zip(ours, outputs["baseline"], strict=True))
    assert agreement["fp8"] > agreement["plain"], agreement


@pytest.mark.slow
def test_vllm_cpu_cannot_run_fp8_per_tensor_for_the_reason_we_give(peaked_verifier, tmp_path):
    """Our early refusal names vLLM's own failure: its CPU build lacks _C::static_scaled_fp8_quant."""
    import subprocess
    import sys

    script = (
        "from vllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    LLM({str(peaked_verifier)!r}, quantization='fp8_per_tensor', dtype='bfloat16', max_model_len=128, "
        "enforce_eager=True)\n"
    )
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode != 0
    assert "static_scaled_fp8_quant() expected at most 0 argument(s)" in result.stdout + result.stderr
    from speculators.serving.serve import ServerSettings, VllmServer

    settings = ServerSettings(
        verifier=str(peaked_verifier), quantization="fp8_per_tensor", port=0, log_path=tmp_path / "vllm.log"
    )
    with pytest.raises(SpeculatorsError, match="static_scaled_fp8_quant"):
        VllmServer(settings).start()
