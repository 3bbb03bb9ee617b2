"""GuideLLM as bench runs it: the metrics it reports, its profiles' names, the command of one run, the
run itself (a subprocess, offline, with a timeout) and its JSON report read back into the summary
report.json keeps per profile and server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from speculators.errors import SpeculatorsError

# GuideLLM metric -> (report name, statistic, higher is better)
METRICS = {
    "time_to_first_token_ms": ("ttft_ms", "median", False),
    "inter_token_latency_ms": ("itl_ms", "median", False),
    "time_per_output_token_ms": ("tpot_ms", "median", False),
    "output_tokens_per_second": ("output_tokens_per_s", "mean", True),
    "request_latency": ("request_latency_s", "median", False),
}


def profile_name(profile: dict[str, Any]) -> str:
    name = profile["kind"] if profile["kind"] == "synchronous" else f"concurrent-{profile['streams']}"
    return f"{name}-natural" if profile.get("natural") else name


def guidellm_profile(profile: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in profile.items() if k != "natural"}


def guidellm_command(
    url: str,
    model: str,
    tokenizer: str,
    data: Path,
    profile: dict[str, Any],
    requests: int,
    json_path: Path,
    html_path: Path,
    max_tokens: int | None = None,
) -> list[str]:
    """A GuideLLM run; `max_tokens` caps answers that have no per-row budget (natural length)."""
    body: dict[str, Any] = {"temperature": 0}
    if max_tokens:
        body["max_tokens"] = max_tokens
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "request_format": "/v1/chat/completions",
        "extras": {"body": body},
    }
    # GuideLLM hangs after a file's last row unless max_requests stops it; never ask for more rows than exist.
    return [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        json.dumps(backend),
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=json_file,path={data}",
        "--profile",
        json.dumps(profile),
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--output",
        f"kind=json,path={json_path}",
        "--output",
        f"kind=html,path={html_path}",
        "--disable-progress",
    ]


GUIDELLM_ATTEMPTS = 3
# What GuideLLM 0.8.1 raises when its scheduler ended the run before it recorded any request (the run ending
# with its requests still in flight, as in run_profile's short counts, with none of them done).
RECORDED_NOTHING = "No measurement start or end times available"


class GuideLLMRecordedNothing(SpeculatorsError):
    """GuideLLM ended a run before recording any request: the run is worth taking again."""


def run_guidellm(command: list[str], log_path: Path, cwd: Path, timeout: float) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cwd / ".cache")}
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SpeculatorsError(f"GuideLLM did not finish in {timeout:.0f} s; see {log_path}") from None
    if result.returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-25:])
        error = GuideLLMRecordedNothing if any(RECORDED_NOTHING in line for line in lines[-5:]) else SpeculatorsError
        raise error(f"GuideLLM failed with code {result.returncode}; the end of {log_path}:\n{tail}")


def read_guidellm_report(path: Path) -> dict[str, Any]:
    """Headline metrics and request counts."""
    try:
        data = json.loads(path.read_text())
        benchmark = data["benchmarks"][0]
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise SpeculatorsError(f"GuideLLM report {path} is missing or unreadable ({error})") from None
    metrics = benchmark["metrics"]
    summary: dict[str, Any] = {"guidellm_version": data.get("metadata", {}).get("guidellm_version")}
    for name, (key, statistic, _) in METRICS.items():
        summary[key] = metrics[name]["successful"][statistic]
    summary["tokens_per_iteration"] = metrics["output_tokens_per_iteration"]["successful"]["mean"]
    summary["output_tokens_mean"] = metrics["output_token_count"]["successful"]["mean"]
    summary["requests"] = metrics["request_totals"]
    summary["duration_s"] = benchmark.get("duration")
    return summary
