"""The tiny lineage end to end: every test here shares the session's `lineage` fixture (the five assets
materialized once through Dagster with real Pipes subprocesses, vLLM and GuideLLM). They live in one
module so that `make test`'s two pytest-xdist workers (`--dist loadfile`) materialize it once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from speculators.cli import main
from speculators_assets.demo import materialized
from speculators_assets.steps import NAMES, STEPS
from speculators_assets.variants import load_variants
from tests.dagster_dev import ROOT, dagster_dev, log_tail, runs, wait_for_new_run, wait_for_run

pytestmark = pytest.mark.slow
ASSETS = list(NAMES)
SCREENSHOTS = ROOT / "test-artifacts" / "ui"


def test_the_lineage_materializes_with_checks_and_a_rerun_reuses_everything(lineage):
    first = lineage["first"]
    assert first.success
    meta = materialized(first)
    assert list(meta) == ASSETS
    assert meta["raw_prompts"]["kept"] == 8 and meta["raw_prompts"]["reused"] is False
    hidden = meta["verifier_hidden_states"]
    assert hidden["samples"] == 8 and hidden["computed"] == 8 and hidden["regenerated"] == 8
    drafter = meta["trained_drafter"]
    assert drafter["acceptance_length_estimate"] > 1.5 and drafter["tokens_per_second"] > 0
    # No validation split in the tiny variant: the gate reads the training estimate and says so.
    assert drafter["acceptance_length"] == drafter["acceptance_length_estimate"]
    assert drafter["acceptance_length_source"] == "training estimate (no validation samples)"
    assert drafter["training_curves"].startswith("![loss and accuracy per TTT step](data:image/png;base64,")
    checkpoint = meta["speculator_checkpoint"]
    assert checkpoint["published"] is True and checkpoint["speculative_tokens"] == 3
    latest = Path(checkpoint["latest"])
    assert latest.is_symlink() and (latest / "accepted.json").is_file() and (latest / "model.safetensors").is_file()
    report = meta["benchmark_report"]
    assert report["acceptance_length"] > 1.5 and "| synchronous | tpot_ms (median) |" in report["report"]
    assert report["tpot_speedup_natural"] > 0 and 1 <= report["output_tokens_natural"] <= 48
    assert report["acceptance_length_fixed"] > 1.5
    assert report["plots"].count("data:image/png;base64,") == 4  # acceptance, latency, throughput, concurrency
    # The load sweep (c = 1 and 2; K = 1 beside K = 3): its choice per concurrency, the declared concurrency the
    # gate read, and the acceptance profile copied into the published checkpoint, which validate accepts.
    assert set(report["recommended_k"]) == {"1", "2"} and set(report["recommended_k"].values()) <= {0, 1, 3}
    assert report["serving_concurrency"] == 1 and report["prediction_error_max"] >= 0
    assert Path(report["acceptance_profile"]).parent == latest.resolve()
    assert main(["validate", str(latest)]) == 0
    # MT-Bench beside the eval prompts on the same servers: 2 questions (writing, roleplay), both turns.
    assert report["mt_bench_questions"] == 2 and report["mt_bench_acceptance_length"] > 1.0
    assert list(report["mt_bench_per_category"]) == ["writing", "roleplay", "overall"]
    assert report["mt_bench_tpot_speedup"] > 0 and "| | writing | roleplay | overall |" in report["mt_bench_table"]
    assert "## MT-Bench beside the main prompts" in report["report"]
    saved = json.loads((Path(report["path"]) / "report.json").read_text())
    assert saved["mt_bench"]["prompts"]["count"] == 4 and saved["prompts"]["count"] == 4
    (mt_bench_profile,) = saved["mt_bench"]["profiles"].values()
    assert mt_bench_profile["speculator"]["requests"]["successful"] == 4  # two questions x two turns
    # How busy the machine was around every GuideLLM run, both servers, main prompts and MT-Bench.
    loads = [p[role]["machine_load"] for p in saved["profiles"].values() for role in ("baseline", "speculator")]
    assert all(load["seconds"] > 0 and load["cores"] == os.cpu_count() for load in loads)
    points = sum(len(by_c) for by_c in saved["load_sweep"]["points"].values())  # (and every load-sweep point)
    assert saved["machine_load"]["runs"] == len(loads) + 2 + points and saved["machine_load"]["quiet"] in (True, False)
    assert "**Machine load** during the speed measurements:" in report["report"]
    answers = (Path(report["path"]) / "mt-bench" / "mt-bench-answers.jsonl").read_text().splitlines()
    assert [json.loads(a)["id"] for a in answers] == ["mt-bench-81", "mt-bench-91"]
    checks = {e.asset_check_key.name: e.passed for e in first.get_asset_check_evaluations()}
    evaluated = {(e.asset_key.to_user_string(), e.asset_check_key.name) for e in first.get_asset_check_evaluations()}
    assert evaluated == {(step.name, check.name) for step in STEPS for check in step.checks}  # each declared one
    assert checks["counts_match_prepared_data"] and checks["values_finite"] and checks["passes_validate"]
    assert checks["acceptance_floor"] and checks["no_regression"] and checks["report_complete"]
    assert checks["lossless_outputs"]  # fp32, temperature 0: every served output equals the baseline's
    # Each asset's data version comes from its content.
    versions = {
        e.materialization.asset_key.to_user_string(): e.materialization.tags.get("dagster/data_version")
        for e in first.get_asset_materialization_events()
    }
    assert versions["raw_prompts"] == meta["raw_prompts"]["data_version"]

    defs = lineage["defs"]
    started = time.perf_counter()
    second = dg.materialize(
        list(defs.assets), partition_key="tiny_llama", resources=defs.resources, instance=lineage["instance"]
    )
    again = materialized(second)
    assert again["raw_prompts"]["reused"] is True
    assert again["verifier_hidden_states"]["computed"] == 0 and again["verifier_hidden_states"]["reused"] == 8
    assert again["verifier_hidden_states"]["regenerated"] == 0
    assert again["trained_drafter"]["reused"] is True and again["trained_drafter"]["key"] == drafter["key"]
    assert again["benchmark_report"]["reused"] is True
    assert again["speculator_checkpoint"]["key"] == checkpoint["key"]
    assert time.perf_counter() - started < 120  # no regeneration, capture, training or benchmark


def test_a_dflash_partition_trains_on_the_shared_store_and_serves_its_report(lineage, tmp_path, monkeypatch):
    """A DFlash partition with `data_from: tiny_llama`: its prompts and store are tiny_llama's (found, not
    recomputed), its drafter a DFlash one, published with its mask embedding and benchmarked by vLLM."""
    variants = tmp_path / "variants"
    variants.mkdir()
    shutil.copy(Path(lineage["env"]["SPECULATORS_VARIANTS_DIR"]) / "tiny_llama.yaml", variants)
    (variants / "tiny_llama_dflash.yaml").write_text("""
description: tiny random Llama, DFlash on tiny_llama's store (tests)
data_from: tiny_llama
drafter: {algorithm: dflash, speculative_tokens: 3}
training: {epochs: 80, lr: 0.01, token_budget: 512, validation_share: 0.0, precision: fp32, block_size: 4,
           max_anchors: 64}
benchmark: {requests: 4, output_tokens: 16, natural_max_tokens: 48, concurrency: [], dtype: float32,
            max_model_len: 512, enforce_eager: true, kv_cache_gib: 1, fixed_length: false, sweep_k: []}
gates: {min_acceptance_length: 1.2, min_vocab_coverage: 0.5}
""")
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(variants))
    monkeypatch.setenv("SPECULATORS_STORAGE_ROOT", lineage["env"]["SPECULATORS_STORAGE_ROOT"])
    from speculators_assets.definitions import build_defs

    defs = build_defs()
    result = dg.materialize(
        list(defs.assets),
        partition_key="tiny_llama_dflash",
        resources=defs.resources,
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert result.success
    meta = materialized(result)
    assert meta["raw_prompts"]["reused"] is True
    hidden = meta["verifier_hidden_states"]
    assert hidden["computed"] == 0 and hidden["reused"] == 8 and hidden["regenerated"] == 0  # tiny_llama's store
    storage = Path(lineage["env"]["SPECULATORS_STORAGE_ROOT"])
    assert not (storage / "tiny_llama_dflash" / "verifier_hidden_states").exists()
    checkpoint = meta["speculator_checkpoint"]
    assert checkpoint["published"] is True and checkpoint["speculative_tokens"] == 3
    latest = Path(checkpoint["latest"])
    assert json.loads((latest / "config.json").read_text())["speculators_model_type"] == "dflash"
    assert (latest / "mask_embedding.pt").is_file() and (latest / "model.safetensors").is_file()
    report = meta["benchmark_report"]
    assert report["acceptance_length"] > 1.2 and "| synchronous-natural | tpot_ms (median) |" in report["report"]
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["passes_validate"] and checks["lossless_outputs"] and checks["report_complete"]


def test_a_changed_prompt_source_triggers_retraining_and_an_unchanged_one_does_not(lineage):
    from speculators_assets.definitions import retraining_requests

    assert lineage["first"].success
    defs, instance = lineage["defs"], lineage["instance"]
    variants = {"tiny_llama": load_variants()["tiny_llama"]}
    assert retraining_requests(instance, variants) == []
    schedule = defs.resolve_schedule_def("retrain_on_new_data")
    os.environ["SPECULATORS_AUTOMATED_VARIANTS"] = "tiny_llama"
    try:
        tick = schedule(dg.build_schedule_context(instance=instance))  # the schedule's own evaluation
    finally:
        os.environ.pop("SPECULATORS_AUTOMATED_VARIANTS")
    assert isinstance(tick, dg.SkipReason) and "no prompt source changed" in tick.skip_message
    original = lineage["prompts"].read_text()
    try:
        with open(lineage["prompts"], "a") as handle:
            handle.write(json.dumps({"prompt": "A brand new prompt about tide pools."}) + "\n")
        (request,) = retraining_requests(instance, variants)
        assert request.partition_key == "tiny_llama" and request.run_key.startswith("retrain-tiny_llama-")
    finally:
        lineage["prompts"].write_text(original)  # the later tests share the lineage
    assert retraining_requests(instance, variants) == []


def test_the_refresh_command_runs_the_benchmark_job_on_a_real_dagster_dev(lineage, tmp_path):
    assert lineage["first"].success
    home = tmp_path / "dagster-home"
    with dagster_dev(home, lineage["env"]) as url:
        reports = sorted((lineage["base"] / "storage" / "tiny_llama" / "benchmark_report").glob("*/report.json"))
        before = {path: path.stat().st_mtime for path in reports}
        assert before
        command = [sys.executable, "-m", "speculators_assets.cli", "refresh-benchmark", "--url", url]
        command += ["--timeout", "900"]
        env = {**os.environ, **lineage["env"]}
        ok = subprocess.run([*command, "--variant", "tiny_llama"], env=env, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr + log_tail(home)
        assert "finished: SUCCESS" in ok.stdout
        assert all(path.stat().st_mtime > mtime for path, mtime in before.items())  # measured anew, not reused
        bad = subprocess.run([*command, "--variant", "no_such_variant"], env=env, capture_output=True, text=True)
        assert bad.returncode != 0


def test_the_demo_command_materializes_through_dagster_and_prints_the_results(lineage, tmp_path):
    """`make demo`'s command on the tiny variant: every artifact is already there, so it reuses them all."""
    assert lineage["first"].success
    env = {**os.environ, **lineage["env"]}
    command = [sys.executable, "-m", "speculators_assets.cli", "demo", "--dagster-home", str(tmp_path / "home")]
    done = subprocess.run([*command, "--variant", "tiny_llama"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "Demo finished in" in out and "step times: raw_prompts" in out and "checks: " in out
    assert "PreviewWarning" not in out + done.stderr  # Dagster's known warning about its own Pipes API
    assert "benchmark (vLLM + GuideLLM, held-out prompts): acceptance length" in out
    assert "outputs with and without the speculator (token ids): 4 of 4 greedy outputs identical" in out
    report = Path(out.split("report: ")[1].split()[0])
    assert report.is_file() and report.parent.parent.name == "benchmark_report"
    # The run is recorded in the instance `make ui` opens.
    with dg.DagsterInstance.from_config(str(tmp_path / "home")) as instance:
        (run,) = instance.get_runs()
        assert run.job_name == "build_lineage" and run.status == dg.DagsterRunStatus.SUCCESS
        assert run.tags["dagster/partition"] == "tiny_llama"
    bad = subprocess.run([*command, "--variant", "no_such_variant"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "error: variant 'no_such_variant' is not a partition" in bad.stderr


def test_bench_writes_a_complete_sane_report(lineage):
    """`speculators bench` as the tiny lineage's benchmark step ran it (4 held-out prompts, 16 tokens,
    synchronous profiles, then the load sweep at 1 and 2 streams; the Dagster tests check how it got there)."""
    assert lineage["first"].success
    (report_json,) = (lineage["base"] / "storage" / "tiny_llama" / "benchmark_report").glob("*/report.json")
    out = report_json.parent
    for name in (
        "prompts.jsonl",
        "report.json",
        "report.md",
        "acceptance.png",
        "latency.png",
        "throughput.png",
        "baseline/vllm.log",
        "speculator/vllm.log",
    ):
        assert (out / name).stat().st_size > 0, name
    for role in ("baseline", "speculator"):
        for profile in ("synchronous", "synchronous-natural", "load-c2"):  # (c = 1: the natural profile itself)
            for kind in ("json", "html"):
                assert (out / role / f"guidellm-{profile}.{kind}").stat().st_size > 1000
    report = json.loads((out / "report.json").read_text())
    assert list(report["profiles"]) == ["synchronous", "synchronous-natural"]  # one stream at a time
    sweep = report["load_sweep"]  # natural length (the headline's), every server on the same 4 prompts
    assert (sweep["length"], sweep["concurrency"], sweep["requests"]) == ("natural", [1, 2], {"1": 4, "2": 4})
    assert sweep["ks"][0] == 0 and sweep["ks"][-1] == sweep["k"] == 3
    for k in sweep["ks"]:
        for c in ("1", "2"):
            point = sweep["points"][str(k)][c]
            assert point["requests"]["successful"] == 4 and point["output_tokens_per_s"] > 0
            assert k == 0 or point["spec_decode"]["drafts"] > 0
        role = {0: "baseline", 3: "speculator"}.get(k, f"speculator-k{k}")
        assert (out / role / "guidellm-load-c2.json").stat().st_size > 1000, role
        # A main server's c = 1 point is its synchronous-natural profile (the same 4 prompts), not a run again.
        assert (out / role / "guidellm-load-c1.json").exists() == role.startswith("speculator-k"), role
    for k, role in ((0, "baseline"), (3, "speculator")):
        single = report["profiles"]["synchronous-natural"][role]
        assert sweep["points"][str(k)]["1"]["output_tokens_per_s"] == single["output_tokens_per_s"]
    # Fixed length: every answer is exactly 16 tokens (ignore_eos); natural length: each stops at its end
    # of turn, at most 48 tokens (the tiny variant's cap), and the headline acceptance is measured there.
    fixed_rows = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    natural_rows = [json.loads(line) for line in (out / "prompts-natural.jsonl").read_text().splitlines()]
    assert [r["output_tokens_count"] for r in fixed_rows] == [16] * 8  # each prompt twice (GuideLLM's data end)
    assert fixed_rows[:4] == fixed_rows[4:] and len({json.dumps(r) for r in fixed_rows}) == 4
    assert [r["messages"] for r in natural_rows] == [r["messages"] for r in fixed_rows]
    assert all("output_tokens_count" not in r for r in natural_rows)
    natural = report["profiles"]["synchronous-natural"]
    assert report["profiles"]["synchronous"]["speculator"]["output_tokens_mean"] == 16
    assert 1 <= natural["baseline"]["output_tokens_mean"] == natural["speculator"]["output_tokens_mean"] <= 48
    assert report["acceptance"]["length"] == "natural"
    assert report["acceptance"]["drafts"] == natural["speculator"]["spec_decode"]["drafts"]
    fixed = report["acceptance_fixed_length"]
    assert fixed["drafts"] == sum(
        report["profiles"][p]["speculator"]["spec_decode"]["drafts"] for p in ("synchronous",)
    )
    assert report["settings"]["num_speculative_tokens"] == 3 and report["prompts"]["count"] == 4
    assert report["versions"]["guidellm"] and report["hardware"]["cpus"] >= 1
    for name, profile in report["profiles"].items():
        base, spec = profile["baseline"], profile["speculator"]
        assert base["requests"]["successful"] == spec["requests"]["successful"] == 4, name
        assert 0 < base["tpot_ms"] < 10_000 and 0 < spec["ttft_ms"] < 60_000
        assert profile["speedup"]["tpot_ms"] == pytest.approx(base["tpot_ms"] / spec["tpot_ms"])
        assert profile["speedup"]["output_tokens_per_s"] == pytest.approx(
            spec["output_tokens_per_s"] / base["output_tokens_per_s"]
        )
        assert base["spec_decode"]["drafts"] == 0 and spec["spec_decode"]["drafts"] > 0
    outputs = report["outputs"]
    assert (outputs["compared"], outputs["identical"], outputs["diverged"]) == (4, 4, 0)  # fp32, temperature 0
    for role in ("baseline", "speculator"):
        served = [json.loads(line) for line in (out / role / "outputs.jsonl").read_text().splitlines()]
        assert [len(o["token_ids"]) for o in served] == [16] * 4 and all(o["prompt_token_ids"] for o in served)
        assert ("top_logits" in served[0]) == (role == "baseline")
    # The baseline server reported the verifier's raw logits (--logprobs-mode raw_logits), which the judge
    # reads instead of loading the verifier: its greedy token first, each value the verifier's own logit.
    import torch

    from speculators.verifier.loading import load_verifier

    baseline = json.loads((out / "baseline" / "outputs.jsonl").read_text().splitlines()[0])
    verifier = load_verifier(report["settings"]["verifier"], dtype="float32")
    context = torch.tensor([baseline["prompt_token_ids"] + baseline["token_ids"]])
    with torch.inference_mode():
        logits = verifier.model(input_ids=context).logits[0, len(baseline["prompt_token_ids"]) - 1 :]
    assert len(baseline["top_logits"]) == 16 and all(len(top) == 20 for top in baseline["top_logits"])
    for i, top in enumerate(baseline["top_logits"]):
        assert top[0][0] == baseline["token_ids"][i]
        for token, value in top[:5]:
            assert value == pytest.approx(logits[i, token].item(), abs=1e-3), (i, token)
    acceptance = report["acceptance"]
    assert 1.5 < acceptance["acceptance_length"] <= 4.0
    assert acceptance["acceptance_length"] == pytest.approx(1 + sum(acceptance["acceptance_per_position"]))
    markdown = (out / "report.md").read_text()
    assert "| synchronous | tpot_ms (median) |" in markdown and "4 of 4 identical" in markdown
    assert "| synchronous-natural | output tokens per answer (mean) |" in markdown


# ----- the Dagster UI in a real browser: Chromium (Debian) driven by Playwright -----------------------


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


@pytest.fixture(scope="module")
def streamed_variants(lineage, tmp_path_factory) -> Path:
    """A variants folder of tiny_llama and tiny_llama_streamed (conftest's), over the lineage's storage: the
    streamed partition is materialized in-process first, then launched from the UI."""
    from tests.conftest import write_tiny_streamed_variant

    variants = tmp_path_factory.mktemp("streamed-variants")
    shutil.copy(Path(lineage["env"]["SPECULATORS_VARIANTS_DIR"]) / "tiny_llama.yaml", variants)
    write_tiny_streamed_variant(variants)
    return variants


def test_a_streamed_partition_materializes_all_five_assets_without_a_store(lineage, streamed_variants, monkeypatch):
    """tiny_llama's data with streamed hidden states (conftest's tiny_llama_streamed): verifier_hidden_states
    writes an index with one probe shard (the same data version as tiny_llama's full store), trained_drafter
    computes the states into its spool during training and keeps none of them, and the drafter is published and
    benchmarked like any other. (Eight samples and a probe of one: the index holds one shard of the eight, so its
    bytes are a fraction of the store's, not the 1% a real data set's index is.)"""
    from speculators.data.store import HiddenStateStore
    from speculators_assets.definitions import build_defs
    from speculators_assets.workload import directory_bytes

    assert lineage["first"].success
    stored = materialized(lineage["first"])
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(streamed_variants))
    monkeypatch.setenv("SPECULATORS_STORAGE_ROOT", lineage["env"]["SPECULATORS_STORAGE_ROOT"])
    defs = build_defs()
    result = dg.materialize(
        list(defs.assets),
        partition_key="tiny_llama_streamed",
        resources=defs.resources,
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert result.success
    meta = materialized(result)
    assert list(meta) == ASSETS
    hidden = meta["verifier_hidden_states"]
    assert hidden["mode"] == "streamed" and hidden["samples"] == 8
    assert (hidden["computed_samples"], hidden["index_samples"]) == (1, 7)
    assert hidden["data_version"] == stored["verifier_hidden_states"]["data_version"]
    assert hidden["probe_tokens_per_second"] > 0 and hidden["full_store_bytes_estimate"] > 0
    assert hidden["store_bytes"] < stored["verifier_hidden_states"]["store_bytes"] / 2  # (one shard of eight)
    store = Path(hidden["path"])
    drafter = meta["trained_drafter"]
    assert drafter["mode"] == "streamed" and drafter["key"] != stored["trained_drafter"]["key"]
    assert drafter["verifier_passes"] > 1 and 0 <= drafter["trainer_wait_share"] <= 1
    assert 0 <= drafter["producer_wait_share"] <= 1 and drafter["spool_peak_bytes"] > 0
    assert drafter["kept_bytes"] == 0 and drafter["capture_tokens_per_second"] > 0
    # keep: none: the store is the index verifier_hidden_states wrote, and the spool is gone.
    assert directory_bytes(store) == hidden["store_bytes"]
    assert len([e for e in HiddenStateStore(store).manifest().samples if e.computed]) == 1
    run = Path(drafter["path"]).parent
    assert not (run / "spool").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stream"]["mode"] == "streamed" and summary["stream"]["backend"] == "transformers"
    checkpoint = meta["speculator_checkpoint"]
    assert checkpoint["published"] is True and checkpoint["speculative_tokens"] == 3
    assert meta["benchmark_report"]["acceptance_length"] > 1.2
    checks = {e.asset_check_key.name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["values_finite"] and checks["counts_match_prepared_data"] and checks["passes_validate"]


def test_a_user_materializes_a_streamed_partition_from_the_asset_graph(lineage, streamed_variants, tmp_path):
    """tiny_llama_streamed (streamed hidden states) over the session's lineage storage, where the test before
    materialized it in-process (fresh materialization is tested there): the run launched from the UI goes
    through all five Pipes steps and their checks, reusing the artifacts."""
    from playwright.sync_api import sync_playwright

    assert lineage["first"].success
    env = {**lineage["env"], "SPECULATORS_VARIANTS_DIR": str(streamed_variants)}
    storage = lineage["base"] / "storage"
    home = tmp_path / "dagster-home"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with dagster_dev(home, env) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)
        page.goto(url + "/asset-groups/speculators", wait_until="networkidle")
        dismiss_first_visit_prompt(page)
        for name in ASSETS:
            assert page.get_by_text(name, exact=True).first.is_visible(), name
        page.screenshot(path=str(SCREENSHOTS / "1-asset-graph.png"))

        # Materialize all -> pick the tiny partition -> launch, as a user clicks through it.
        before = {run["runId"] for run in runs(url)}
        page.get_by_role("button", name="Materialize all").first.click()
        page.get_by_text("Select a partition or create one").click()
        page.keyboard.type("tiny_llama_streamed")
        page.locator("span", has_text="tiny_llama_streamed").first.click()
        page.keyboard.press("Escape")
        page.screenshot(path=str(SCREENSHOTS / "2-launch-dialog.png"))
        page.get_by_role("button", name="Launch 1 run").click()
        # Stay on the page until the launch request has reached the server: navigating away at once
        # can cancel it (seen on a loaded CI machine), and then no run ever exists.
        run_id = wait_for_new_run(url, before)
        (launched,) = [run for run in runs(url) if run["runId"] == run_id]
        assert {"key": "dagster/partition", "value": "tiny_llama_streamed"} in launched["tags"], launched

        page.goto(f"{url}/runs/{run_id}", wait_until="networkidle")
        assert wait_for_run(url, run_id, home) == "SUCCESS", run_id
        page.reload(wait_until="networkidle")
        page.get_by_text("Success", exact=True).first.wait_for()
        page.screenshot(path=str(SCREENSHOTS / "3-run-succeeded.png"))

        # The materialized partition's metadata: the benchmark table and acceptance length.
        page.goto(url + "/assets/benchmark_report?partition=tiny_llama_streamed", wait_until="networkidle")
        page.get_by_text("acceptance_length").first.wait_for()
        page.screenshot(path=str(SCREENSHOTS / "4-benchmark-report.png"), full_page=True)
        browser.close()
    report = next((storage / "tiny_llama_streamed" / "benchmark_report").glob("*/report.json"))
    assert json.loads(report.read_text())["acceptance"]["acceptance_length"] > 1.2
    assert (SCREENSHOTS / "3-run-succeeded.png").stat().st_size > 10_000
