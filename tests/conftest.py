"""Shared fixtures: tiny random verifiers of each family, built once per test session, offline."""

from __future__ import annotations

import os

import pytest

# No test may reach a model hub; quiet transformers' progress bars.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

CAPTURE_FAMILIES = ("llama", "qwen3", "qwen3_moe", "gpt_oss")


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory):
    """family -> directory of a tiny random verifier (8 layers, hidden 64, vocab 512), cached."""
    from speculators.tiny_models import make_tiny_verifier

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
