"""Which of vLLM's model runners capture reads (capture_vllm.model_runner_kind): an isinstance on the
installed vLLM's own classes, so it stays right for the CPU build's V2 runner, for V1's subclasses and for a
vLLM without V1 (0.34), where a check by module name or attributes was wrong."""

from __future__ import annotations

import importlib

import pytest

from speculators.data import capture_vllm


def runner(module: str, name: str) -> object:
    """An instance of one of vLLM's runner classes, made without its constructor (no engine needed)."""
    cls = getattr(importlib.import_module(module), name)
    return object.__new__(cls)


@pytest.fixture(scope="module")
def runners() -> dict[str, object]:
    return {
        "cuda V2": runner("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
        "cpu V2": runner("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
        "cuda V1": runner("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
        "cpu V1": runner("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    }


def test_each_runner_of_the_installed_vllm_is_told_apart_by_its_class(runners):
    kinds = {name: capture_vllm.model_runner_kind(r) for name, r in runners.items()}
    assert kinds == {"cuda V2": "V2", "cpu V2": "V2", "cuda V1": "V1", "cpu V1": "V1"}
    # The CPU build's V2 runner lives outside vllm.v1.worker.gpu and has no persistent input_batch: the
    # module-name check took it for neither runner and refused to capture.
    assert capture_vllm.runner_is_v2(runners["cpu V2"]) and not capture_vllm.runner_is_v2(runners["cpu V1"])


def test_a_vllm_without_model_runner_v1_still_captures_with_v2_and_names_anything_else(runners, monkeypatch):
    classes = capture_vllm.model_runner_classes()
    without_v1 = {"V2": classes["V2"], "V1": None}
    assert capture_vllm.model_runner_kind(runners["cpu V2"], without_v1) == "V2"
    with pytest.raises(RuntimeError, match=r"CPUModelRunner is neither Model Runner V1 nor V2.*--backend transformers"):
        capture_vllm.model_runner_kind(runners["cpu V1"], without_v1)
    # A module vLLM removed reads as no class, not as an import error in every worker.
    monkeypatch.setitem(capture_vllm.MODEL_RUNNER_MODULES, "V1", "vllm.v1.worker.removed_model_runner")
    capture_vllm.model_runner_classes.cache_clear()
    try:
        assert capture_vllm.model_runner_classes() == without_v1
    finally:
        monkeypatch.undo()
        capture_vllm.model_runner_classes.cache_clear()
