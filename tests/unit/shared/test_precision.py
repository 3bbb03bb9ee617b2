"""What `--dtype auto` means: bf16 only where the hardware computes it (slow elsewhere), and where it is resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from speculators import precision
from speculators.cli import build_parser, compute_device
from speculators.errors import SpeculatorsError
from speculators.serving.serve import ServerSettings, VllmServer


@pytest.fixture
def cpu_bf16(monkeypatch):
    def set_native(native: bool) -> None:
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda: native)
        precision.warn_slow_bf16.cache_clear()

    return set_native


def test_auto_is_bf16_only_where_native(cpu_bf16, capsys):
    cpu_bf16(True)
    assert precision.resolve_dtype("auto", "cpu") == "bfloat16"
    assert precision.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert capsys.readouterr().err == ""
    cpu_bf16(False)
    assert precision.resolve_dtype("auto", "cpu") == "float32"
    assert precision.resolve_dtype("float32", "cpu") == "float32"
    assert precision.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # explicit wins, with a warning
    assert "no native bf16" in capsys.readouterr().err
    with pytest.raises(SpeculatorsError, match="dtype 'bf16' is not one of auto, bfloat16, float16, float32"):
        precision.resolve_dtype("bf16")


def test_cpu_flags_are_read_from_cpuinfo():
    flags = Path("/proc/cpuinfo").read_text()
    assert precision.cpu_has_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_commands_default_to_auto_and_vllm_resolves_for_its_own_device():
    parser = build_parser()
    datagen = ["datagen", "--data", "d", "--verifier", "v", "--output", "o"]
    bench = ["bench", "--verifier", "v", "--speculator", "s", "--output", "o"]
    for argv in (["prepare", "--source", "s", "--output", "o"], datagen, ["serve"], bench):
        assert parser.parse_args(argv).dtype == "auto", argv
    assert compute_device(parser.parse_args(datagen)) == "cpu"
    vllm = parser.parse_args([*datagen, "--backend", "vllm"])
    # vLLM computes where its installed build does, whatever --device says (asked without touching CUDA)
    assert compute_device(vllm) == "vllm"
    assert compute_device(parser.parse_args(["serve"])) == "vllm"


def test_the_server_is_started_with_a_concrete_dtype(cpu_bf16, peaked_verifier):
    cpu_bf16(False)
    command = VllmServer(ServerSettings(verifier=str(peaked_verifier), port=0, dtype="auto")).command()
    assert command[command.index("--dtype") + 1] == "float32"  # vLLM's own auto would take the config's bf16
    cpu_bf16(True)
    command = VllmServer(ServerSettings(verifier=str(peaked_verifier), port=0, dtype="auto")).command()
    assert command[command.index("--dtype") + 1] == "bfloat16"


def test_settings_resolve_auto_where_their_command_computes(cpu_bf16, monkeypatch):
    from speculators.settings import BenchSettings, CaptureSettings, EvaluateSettings

    cpu_bf16(False)
    capture = CaptureSettings(data="s.jsonl", verifier="v", output="o")
    assert capture.dtype == "auto" and precision.with_compute_dtype(capture, on_vllm=False).dtype == "float32"
    cpu_bf16(True)
    assert precision.with_compute_dtype(capture, on_vllm=False).dtype == "bfloat16"
    # a concrete dtype is kept, the same object
    fixed = capture.model_copy(update={"dtype": "float16"})
    assert precision.with_compute_dtype(fixed, on_vllm=False) is fixed
    # vLLM's FP8 verifiers compute in bf16 whatever the machine; evaluate (transformers) as the CPU does
    cpu_bf16(False)
    bench = BenchSettings(verifier="v", speculator="s", output="o", quantization="fp8_per_channel")
    assert precision.with_compute_dtype(bench, on_vllm=True).dtype == "bfloat16"
    evaluate = EvaluateSettings(verifier="v", dtype="auto")
    assert precision.with_compute_dtype(evaluate, on_vllm=False).dtype == "float32"


def test_the_python_api_takes_the_default_dtype_as_the_command_line_does(cpu_bf16, peaked_verifier, tmp_path):
    """run_prepare and run_capture called with their settings' default `--dtype auto` (as docs/python-api.md
    shows) compute in what the command line would resolve it to, instead of refusing 'auto'."""
    import json

    from speculators.data.capture import run_capture
    from speculators.data.prepare import run_prepare
    from speculators.settings import CaptureSettings, PrepareSettings
    from tests.conftest import write_peaked_prompts

    cpu_bf16(False)
    prompts = write_peaked_prompts(tmp_path / "prompts.jsonl")
    data, store = tmp_path / "data", tmp_path / "store"
    run_prepare(
        PrepareSettings(
            sources=[str(prompts)],
            output=str(data),
            verifier=str(peaked_verifier),
            regenerate=True,
            max_samples=2,
            max_new_tokens=8,
        )
    )
    run_capture(CaptureSettings(data=str(data / "samples.jsonl"), verifier=str(peaked_verifier), output=str(store)))
    assert json.loads((store / "manifest.json").read_text())["verifier"]["dtype"] == "float32"
