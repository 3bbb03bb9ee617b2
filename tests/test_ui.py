"""The Dagster UI in a real browser: Chromium (Debian) driven by Playwright materializes a tiny partition."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.dagster_dev import ROOT, dagster_dev, runs, wait_for_new_run, wait_for_run

pytestmark = pytest.mark.slow
SCREENSHOTS = ROOT / "test-artifacts" / "ui"


def chromium() -> str:
    path = shutil.which("chromium") or "/usr/bin/chromium"
    assert Path(path).exists(), "Chromium is missing: make test installs it (as root or with sudo)"
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


def test_a_user_materializes_a_tiny_partition_from_the_asset_graph(lineage, tmp_path):
    """The tiny variant's storage is the session's lineage (fresh materialization is tested there): the
    run launched from the UI goes through all five Pipes steps and their checks, reusing the artifacts."""
    from playwright.sync_api import sync_playwright

    assert lineage["first"].success
    env, storage = lineage["env"], lineage["base"] / "storage"
    home = tmp_path / "dagster-home"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with dagster_dev(home, env) as url, sync_playwright() as playwright:
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
        before = {run["runId"] for run in runs(url)}
        page.get_by_role("button", name="Materialize all").first.click()
        page.get_by_text("Select a partition or create one").click()
        page.keyboard.type("tiny_llama")
        page.locator("span", has_text="tiny_llama").first.click()
        page.keyboard.press("Escape")
        page.screenshot(path=str(SCREENSHOTS / "2-launch-dialog.png"))
        page.get_by_role("button", name="Launch 1 run").click()
        # Stay on the page until the launch request has reached the server: navigating away at once
        # can cancel it (seen on a loaded CI machine), and then no run ever exists.
        run_id = wait_for_new_run(url, before)
        (launched,) = [run for run in runs(url) if run["runId"] == run_id]
        assert {"key": "dagster/partition", "value": "tiny_llama"} in launched["tags"], launched

        page.goto(f"{url}/runs/{run_id}", wait_until="networkidle")
        assert wait_for_run(url, run_id, home) == "SUCCESS", run_id
        page.reload(wait_until="networkidle")
        page.get_by_text("Success", exact=True).first.wait_for()
        page.screenshot(path=str(SCREENSHOTS / "3-run-succeeded.png"))

        # The materialized partition's metadata: the benchmark table and acceptance length.
        page.goto(url + "/assets/benchmark_report?partition=tiny_llama", wait_until="networkidle")
        page.get_by_text("acceptance_length").first.wait_for()
        page.screenshot(path=str(SCREENSHOTS / "4-benchmark-report.png"), full_page=True)
        browser.close()
    report = next((storage / "tiny_llama" / "benchmark_report").glob("*/report.json"))
    assert json.loads(report.read_text())["acceptance"]["acceptance_length"] > 1.5
    assert (SCREENSHOTS / "3-run-succeeded.png").stat().st_size > 10_000
