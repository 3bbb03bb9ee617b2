"""vLLM (CPU build) reads a checkpoint our code writes and decodes losslessly with it (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The model explains the next token", "Our team measures the latency", "def add(a, b):"]


def run_vllm(*args: str) -> dict:
    script = Path(__file__).with_name("vllm_generate.py")
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=900)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_vllm_serves_our_eagle3_checkpoint_losslessly(tiny_verifier_dir, tmp_path):
    from speculators.cli import main

    verifier = str(tiny_verifier_dir("llama"))
    drafter = tmp_path / "drafter"
    assert (
        main(
            [
                "init",
                "--verifier",
                verifier,
                "--output",
                str(drafter),
                "--draft-vocab-size",
                "256",
                "--aux-layer-ids",
                "1,4,8",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    baseline = run_vllm(verifier, json.dumps(PROMPTS))
    speculative = run_vllm(verifier, json.dumps(PROMPTS), str(drafter), "3")
    # fp32 greedy: speculative decoding must not change a single token.
    assert speculative["token_ids"] == baseline["token_ids"]
    assert all(len(ids) == 24 for ids in baseline["token_ids"])
    counters = speculative["counters"]
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == 3 * counters["vllm:spec_decode_num_drafts"]
