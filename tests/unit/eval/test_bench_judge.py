"""bench's lossless judge after the measurements: report.json and report.md are written before it runs, so a
judge that fails loses nothing; and its transformers re-score refuses, in one line naming the split it could
not re-score, a verifier that does not fit where it would load (sizes from the config, nothing loaded)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from speculators.eval import output_judge
from speculators.eval.bench import judge_and_write, measurements_report
from speculators.eval.output_judge import GIB, OutputJudge, rescore_refusal, verifier_weight_bytes
from speculators.serving.serve import spec_decode_record
from speculators.settings import BenchSettings
from tests.paths import ROOT_DIR

MISTRAL_LARGE_3 = ROOT_DIR / "tests" / "data" / "model_configs" / "mistral_large_3.params.json"


def measured_report(tmp_path) -> dict:
    """report.json's content from two servers' (made-up) measurements of one synchronous profile."""
    settings = BenchSettings(
        verifier="v", speculator="s", output=str(tmp_path), num_speculative_tokens=3, concurrency=[], sweep_k=[]
    )

    def summary(tpot: float, spec: dict) -> dict:
        return {
            "ttft_ms": 20.0,
            "itl_ms": tpot,
            "tpot_ms": tpot,
            "output_tokens_per_s": 1000 / tpot,
            "request_latency_s": 1.0,
            "output_tokens_mean": 64.0,
            "requests": {"successful": 4},
            "spec_decode": spec,
        }

    none = spec_decode_record(0, 0, 0, [])
    drafted = spec_decode_record(drafts=10, draft_tokens=30, accepted=12, per_position=[6, 4, 2])
    runs = {  # (the load sweep's one point, c = 1: the synchronous profile itself)
        "baseline": {"server": {"role": "baseline"}, "profiles": {"synchronous": summary(10.0, none)}},
        "speculator": {"server": {"role": "speculator"}, "profiles": {"synchronous": summary(8.0, drafted)}},
    }
    for run in runs.values():
        run["load"] = {1: run["profiles"]["synchronous"]}
    prompts = SimpleNamespace(info={"count": 4}, conversations=[None] * 4, source="demo:eval")
    return measurements_report(settings, prompts, runs, None, 0.0)


def test_bench_writes_its_measurements_before_the_judge_and_keeps_them_when_the_judge_fails(tmp_path):
    from speculators.eval.records import BenchReport
    from speculators_assets.records import read_record

    def failing_judge() -> dict:
        assert json.loads((tmp_path / "report.json").read_text())["profiles"]  # written before it runs
        raise torch_oom

    torch_oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        judge_and_write(measured_report(tmp_path), tmp_path, failing_judge)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["profiles"]["synchronous"]["speedup"]["tpot_ms"] == pytest.approx(1.25)
    assert saved["acceptance"]["acceptance_length"] == pytest.approx(2.2)
    assert saved["outputs"] == {
        "not_judged": "the lossless comparison failed (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    }
    markdown = (tmp_path / "report.md").read_text()
    assert "**Greedy outputs**: not compared: the lossless comparison failed (RuntimeError" in markdown
    assert "| synchronous | tpot_ms (median) | 10.000 | 8.000 | 1.250x |" in markdown
    assert (tmp_path / "latency.png").is_file()
    # Dagster's benchmark_report reuses only a report with its comparison: this one runs the bench again.
    assert read_record(BenchReport, tmp_path) is None

    compared = {"compared": 4, "identical": 4, "near_tie": 0, "diverged": 0, "differences": []}
    report = judge_and_write(measured_report(tmp_path), tmp_path, lambda: compared)
    assert report["outputs"] == json.loads((tmp_path / "report.json").read_text())["outputs"] == compared
    assert read_record(BenchReport, tmp_path) is not None


@pytest.fixture(scope="module")
def mistral_large_3(tmp_path_factory):
    """Mistral Large 3's own params.json as a Mistral-format checkpoint folder (its weights file empty)."""
    folder = tmp_path_factory.mktemp("mistral-large-3")
    shutil.copy(MISTRAL_LARGE_3, folder / "params.json")
    (folder / "consolidated.safetensors").touch()
    return folder


def test_mistral_large_3s_size_comes_from_its_config_and_its_re_score_is_refused_in_one_line(
    mistral_large_3, monkeypatch
):
    weights = verifier_weight_bytes(str(mistral_large_3), "bfloat16")
    assert weights is not None and 1.3e12 < weights < 1.4e12  # ~675B parameters in bf16

    def never(*args, **kwargs):
        raise AssertionError("the re-score loaded the verifier")

    monkeypatch.setattr(output_judge, "load_verifier", never)
    monkeypatch.setattr(output_judge, "gpu_memory", lambda: [80 * GIB] * 8)
    monkeypatch.setattr(output_judge, "host_memory_available", lambda: 2048 * GIB)
    judge = OutputJudge(str(mistral_large_3), "bfloat16")
    verdict = judge([1, 2, 3], [4, 5, 9], [4, 6, 9])  # no served logits: only a re-score could judge it
    assert verdict["status"] == "diverged" and verdict["position"] == 1
    size = f"{weights / GIB:,.1f}"
    assert verdict["reason"] == (
        f"not judged: the transformers re-score of tokens 5 / 6 at output position 1 could not run: its weights "
        f"({size} GiB) do not fit one GPU (80.0 GiB) beside the activations"
    )
    assert judge([1], [7, 8], [7, 9])["reason"].endswith("do not fit one GPU (80.0 GiB) beside the activations")


def test_the_re_score_fits_the_verifiers_placement_or_says_why_not():
    ml3, llama_70b = 1_346_842_179_584, 141_000_000_000
    h100s, h200s = [80 * GIB] * 8, [141 * GIB] * 8
    # A Hugging Face checkpoint spreads over every GPU (a device map); Mistral's format goes whole to one.
    assert rescore_refusal(llama_70b, h100s, 2048 * GIB, whole_in_host=False) is None
    assert rescore_refusal(llama_70b, h100s, 2048 * GIB, whole_in_host=True) == (
        "its weights (131.3 GiB) do not fit one GPU (80.0 GiB) beside the activations"
    )
    assert rescore_refusal(ml3, h200s, 2048 * GIB, whole_in_host=False) == (
        "its weights (1,254.3 GiB) do not fit the 8 GPUs together (1,128.0 GiB) beside the activations"
    )
    assert rescore_refusal(ml3, h200s, 1024 * GIB, whole_in_host=True).startswith(
        "its weights (1,254.3 GiB) are read whole into host memory (1,024.0 GiB available) in its Mistral format"
    )
    assert rescore_refusal(llama_70b, [], 64 * GIB, whole_in_host=False) == (
        "its weights (131.3 GiB) do not fit this host's 64.0 GiB of available memory (no GPU)"
    )
    assert rescore_refusal(270_000_000, [], 8 * GIB, whole_in_host=False) is None  # SmolLM2 on a laptop
