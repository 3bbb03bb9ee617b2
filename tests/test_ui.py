"""The Dagster UI in a real browser: Chromium (Debian) driven by Playwright materializes a tiny partition."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_assets import write_tiny_variant

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SCREENSHOTS = ROOT / "test-artifacts" / "ui"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(path).exists(), "Chromium is missing: apt-get install chromium (.ci/run does)"
    return path


def dismiss_first_visit_prompt(page) -> None:
    """Dagster shows a newsletter prompt on a first visit, a moment after the page loads; skip it and
    wait until its backdrop is gone (it swallows clicks)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.get_by_role("button", name="Skip").click(timeout=20_000)
    except PlaywrightTimeout:
        return  # not shown
    page.locator(".dagster-backdrop").first.wait_for(state="detached", timeout=20_000)


def test_a_user_materializes_a_tiny_partition_from_the_asset_graph(peaked_verifier, tmp_path):
    from playwright.sync_api import sync_playwright

    from speculators.demo_prompts import demo_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in demo_prompts()[:8]))
    write_tiny_variant(tmp_path / "variants", peaked_verifier, prompts)
    home = tmp_path / "dagster-home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    env = {**os.environ, "DAGSTER_HOME": str(home), "SPECULATORS_VARIANTS_DIR": str(tmp_path / "variants"),
           "SPECULATORS_STORAGE_ROOT": str(tmp_path / "storage")}  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    log_path = tmp_path / "dagster-dev.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "dagster", "dev", "-w", "workspace.yaml", "-h", "127.0.0.1",
                                   "-p", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    with urllib.request.urlopen(url + "/server_info", timeout=2):
                        break
                except OSError:
                    assert server.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                    time.sleep(1)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(url + "/asset-groups/speculators", wait_until="networkidle")
                dismiss_first_visit_prompt(page)
                for name in ("raw_prompts", "verifier_hidden_states", "trained_drafter", "speculator_checkpoint",
                             "benchmark_report"):  # fmt: skip
                    assert page.get_by_text(name, exact=True).first.is_visible(), name
                page.screenshot(path=str(SCREENSHOTS / "1-asset-graph.png"))

                # Materialize all -> pick the tiny partition -> launch, as a user clicks through it.
                page.get_by_role("button", name="Materialize all").first.click()
                page.get_by_text("Select a partition or create one").click()
                page.keyboard.type("tiny_llama")
                page.locator("span", has_text="tiny_llama").first.click()
                page.keyboard.press("Escape")
                page.screenshot(path=str(SCREENSHOTS / "2-launch-dialog.png"))
                page.get_by_role("button", name="Launch 1 run").click()

                page.goto(url + "/runs", wait_until="networkidle")
                deadline = time.monotonic() + 900
                while not page.get_by_text("Success", exact=True).count():
                    assert not page.get_by_text("Failure", exact=True).count(), log_path.read_text()[-4000:]
                    assert time.monotonic() < deadline, "the run did not finish in 15 minutes"
                    time.sleep(5)
                    page.reload(wait_until="networkidle")
                page.screenshot(path=str(SCREENSHOTS / "3-run-succeeded.png"))

                # The materialized partition's metadata: the benchmark table and acceptance length.
                page.goto(url + "/assets/benchmark_report?partition=tiny_llama", wait_until="networkidle")
                page.get_by_text("acceptance_length").first.wait_for()
                page.screenshot(path=str(SCREENSHOTS / "4-benchmark-report.png"), full_page=True)
                browser.close()
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    report = next((tmp_path / "storage" / "tiny_llama" / "benchmark_report").glob("*/report.json"))
    assert json.loads(report.read_text())["acceptance"]["acceptance_length"] > 1.5
    assert (SCREENSHOTS / "3-run-succeeded.png").stat().st_size > 10_000
