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
