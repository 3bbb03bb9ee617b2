"""A real `dagster dev` for tests: start it on a free loopback port, talk GraphQL to it, stop it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from speculators.serving.serve import free_port
from speculators_assets.demo import prepare_home
from tests.paths import ROOT_DIR

ROOT = ROOT_DIR
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}


@contextlib.contextmanager
def dagster_dev(home: Path, env: dict[str, str], *, startup_s: float = 180) -> Iterator[str]:
    """Run `dagster dev` with DAGSTER_HOME=home (telemetry off) and yield its URL; its log is home/dagster-dev.log."""
    home = prepare_home(home)
    url = f"http://127.0.0.1:{free_port()}"
    log_path = home / "dagster-dev.log"
    with open(log_path, "w") as log:
        command = [sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1"]
        server = subprocess.Popen(
            [*command, "-p", url.rsplit(":")[-1]],
            cwd=ROOT,
            env={**os.environ, **env, "DAGSTER_HOME": str(home)},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + startup_s
            while True:
                try:
                    with urllib.request.urlopen(url + "/server_info", timeout=2):
                        break
                except OSError:
                    assert server.poll() is None, f"dagster dev exited:\n{log_tail(home)}"
                    waited = time.monotonic() < deadline
                    assert waited, f"dagster dev did not answer in {startup_s:.0f} s:\n{log_tail(home)}"
                    time.sleep(1)
            yield url
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def log_tail(home: Path, chars: int = 4000) -> str:
    path = home / "dagster-dev.log"
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(url + "/graphql", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.load(response)
    assert "errors" not in body, body["errors"]
    return body["data"]


def runs(url: str) -> list[dict]:
    """Every run the instance knows, newest first: runId, status, jobName, tags."""
    data = graphql(
        url, "{ runsOrError { __typename ... on Runs { results { runId status jobName tags { key value } } } } }"
    )
    return data["runsOrError"]["results"]


def run_messages(url: str, run_id: str, last: int = 40) -> str:
    """The run's last event-log messages (errors carry their stack), for an assertion message."""
    query = (
        "query($id: ID!) { logsForRun(runId: $id) { __typename ... on EventConnection { events { __typename "
        "... on MessageEvent { message level stepKey } ... on ErrorEvent { error { message stack } } } } } }"
    )
    events = graphql(url, query, {"id": run_id})["logsForRun"].get("events", [])
    lines = []
    for event in events[-last:]:
        line = f"[{event.get('level')}] {event.get('stepKey') or ''} {event.get('message', '')}"
        error = event.get("error")
        if error:
            line += "\n" + error["message"] + "".join(error.get("stack") or [])
        lines.append(line)
    return "\n".join(lines)


def wait_for_new_run(url: str, known: set[str], timeout_s: float = 120) -> str:
    """The id of the first run not in `known`, once the instance has it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fresh = [run["runId"] for run in runs(url) if run["runId"] not in known]
        if fresh:
            return fresh[0]
        time.sleep(1)
    raise AssertionError(f"no run was launched within {timeout_s:.0f} s")


def wait_for_run(url: str, run_id: str, home: Path, timeout_s: float = 900) -> str:
    """Poll the run until it ends; on a timeout fail with its status, last events and the server log."""
    deadline = time.monotonic() + timeout_s
    while True:
        (status,) = [run["status"] for run in runs(url) if run["runId"] == run_id]
        if status in TERMINAL:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(
                f"run {run_id} still {status} after {timeout_s:.0f} s; its last events:\n"
                f"{run_messages(url, run_id)}\n--- dagster dev log ---\n{log_tail(home)}"
            )
        time.sleep(3)
