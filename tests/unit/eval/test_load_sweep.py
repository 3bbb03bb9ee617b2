"""The load sweep: its analysis (speculators.eval.load_sweep) on small made-up point tables, each figure
worked out by hand; the settings that shape it; bench's sweep of one server; report.md and the plot."""

from __future__ import annotations

import json
import math

import pytest

from speculators.errors import SpeculatorsError
from speculators.eval.load_sweep import analyse_load, argmax_k, break_even, expected_tokens, load_sweep_section


def point(tokens_per_s: float, acceptance_length: float | None = None) -> dict:
    """A GuideLLM summary as the sweep keeps it (spec_decode on a speculator server only)."""
    made: dict = {"output_tokens_per_s": tokens_per_s, "tpot_ms": 9.0}
    if acceptance_length is not None:
        made["spec_decode"] = {"acceptance_length": acceptance_length, "drafts": 10}
    return made


# K = 2, acceptance profile p = [0.6, 0.3]: E(0) = 1, E(1) = 1.6, E(2) = 1.9.
RATES = [0.6, 0.3]
TABLE = {
    0: {1: point(100), 2: point(180), 4: point(300), 8: point(400)},
    1: {1: point(140, 1.6), 2: point(225, 1.5), 4: point(330, 1.6), 8: point(420, 1.6)},
    2: {1: point(150, 1.9), 2: point(234, 1.8), 4: point(270, 1.9), 8: point(320, 1.6)},
}


def test_the_analysis_of_a_two_k_sweep_matches_the_figures_worked_by_hand():
    sweep = analyse_load(TABLE, RATES, k=2, serving_concurrency=4)
    assert sweep["expected_tokens"] == pytest.approx({"0": 1.0, "1": 1.6, "2": 1.9})
    # r(k, c) = AL(k, c) * T(0, c) / T(k, c)
    assert sweep["step_cost_ratio"]["2"] == pytest.approx(
        {"1": 1.9 * 100 / 150, "2": 1.8 * 180 / 234, "4": 1.9 * 300 / 270, "8": 1.6 * 400 / 320}
    )
    assert sweep["step_cost_ratio"]["1"]["2"] == pytest.approx(1.5 * 180 / 225)
    # S(k, c) = T(k, c) / T(0, c)
    assert sweep["speedup"]["2"] == pytest.approx({"1": 1.5, "2": 1.3, "4": 0.9, "8": 0.8})
    assert sweep["speedup"]["1"] == pytest.approx({"1": 1.4, "2": 1.25, "4": 1.1, "8": 1.05})
    # P(k, c) = E(k) / r(k, c)
    assert sweep["predicted_speedup"]["2"] == pytest.approx(
        {"1": 1.9 / (1.9 * 100 / 150), "2": 1.9 / (1.8 * 180 / 234), "4": 0.9, "8": 1.9 / 2.0}
    )
    assert sweep["predicted_speedup"]["1"]["2"] == pytest.approx(1.6 / (1.5 * 180 / 225))
    # P / S - 1 = E(k) / AL(k, c) - 1: zero where the point accepted what the profile expects
    assert sweep["prediction_error"]["2"] == pytest.approx({"1": 0, "2": 1.9 / 1.8 - 1, "4": 0, "8": 1.9 / 1.6 - 1})
    assert sweep["prediction_error"]["1"] == pytest.approx({"1": 0, "2": 1.6 / 1.5 - 1, "4": 0, "8": 0})
    assert sweep["prediction_error_max"] == pytest.approx(1.9 / 1.6 - 1)
    # Best K: K = 2 while one stream has the machine to itself, K = 1 once the steps cost more.
    best = sweep["best_k"]
    assert {c: (b["chosen"], b["measured_best"]) for c, b in best.items()} == {
        "1": (2, 2), "2": (2, 2), "4": (1, 1), "8": (1, 1)
    }  # fmt: skip
    assert best["1"]["predicted_gain"] == pytest.approx(1.0) and best["1"]["measured_gain"] == pytest.approx(1.0)
    assert best["4"]["predicted_gain"] == pytest.approx(1.1 / 0.9)
    assert best["8"]["predicted_gain"] == pytest.approx(1.05 / 0.95)
    assert best["8"]["measured_gain"] == pytest.approx(1.05 / 0.8)
    # Break-even of K = 2: below 1 first at c = 4 (0.9), after c = 2 (1.3): 0.3 of the 0.4 drop, in log2(c).
    crossing = sweep["break_even_concurrency"]
    assert crossing["value"] == pytest.approx(2 ** (1 + 0.75))
    assert "c = 3.4" in crossing["note"] and "c = 2, 1.300x" in crossing["note"]
    assert sweep["speedup_at_serving_concurrency"] == pytest.approx(0.9)  # K = 2 at c = 4


def test_the_verifier_alone_is_chosen_where_every_k_is_predicted_slower():
    """K = 1, p = [0.5]: at c = 4 the drafter's step costs more than it yields, so K = 0 is chosen."""
    table = {0: {1: point(100), 4: point(400)}, 1: {1: point(140, 1.5), 4: point(360, 1.5)}}
    sweep = analyse_load(table, [0.5], k=1, serving_concurrency=1)
    assert sweep["predicted_speedup"]["1"] == pytest.approx({"1": 1.4, "4": 0.9})
    at_four = sweep["best_k"]["4"]
    assert (at_four["chosen"], at_four["measured_best"]) == (0, 0)
    assert at_four["predicted_gain"] == pytest.approx(1 / 0.9) and at_four["measured_gain"] == pytest.approx(1 / 0.9)
    assert sweep["best_k"]["1"]["chosen"] == 1
    # from 1.4 at c = 1 to 0.9 at c = 4: 0.4 of 0.5 of the way, two doublings
    assert sweep["break_even_concurrency"]["value"] == pytest.approx(2 ** (0.8 * 2))
    assert sweep["speedup_at_serving_concurrency"] == pytest.approx(1.4)


def test_ties_choose_the_smaller_k():
    """p = [0.5, 0.0]: K = 2 expects what K = 1 does, and costs the same here; the smaller K is chosen."""
    table = {0: {1: point(100)}, 1: {1: point(150, 1.5)}, 2: {1: point(150, 1.5)}}
    sweep = analyse_load(table, [0.5, 0.0], k=2, serving_concurrency=1)
    best = sweep["best_k"]["1"]
    assert sweep["predicted_speedup"]["1"]["1"] == pytest.approx(sweep["predicted_speedup"]["2"]["1"])
    assert (best["chosen"], best["measured_best"]) == (1, 1) and best["predicted_gain"] == pytest.approx(1.0)
    assert argmax_k({0: 1.0, 1: 1.0, 2: 0.5}) == 0  # a drafter that gains nothing: the verifier alone


def test_break_even_is_null_with_a_note_where_the_speedup_does_not_cross_1():
    assert break_even({1: 0.9, 2: 0.8, 4: 0.5}) == {
        "value": None,
        "note": "slower than the verifier alone at every swept concurrency",
    }
    assert break_even({1: 0.9, 2: 1.1})["note"] == "slower than the verifier alone already at c = 1"
    assert break_even({1: 1.2, 2: 1.0, 8: 1.01}) == {  # 1.0 is not slower
        "value": None,
        "note": "faster than the verifier alone at every swept concurrency, up to c = 8",
    }
    assert break_even({1: 1.2})["value"] is None  # a single-stream sweep (--concurrency=)
    exact = break_even({1: 1.5, 2: 1.0, 4: 0.5})  # 1.0 at c = 2, then below: the crossing starts at c = 2
    assert exact["value"] == pytest.approx(2.0)


def test_expected_tokens_sum_the_prefix_rates_and_a_point_without_drafts_is_refused():
    assert expected_tokens([0.7, 0.4, 0.1], 0) == 1.0
    assert expected_tokens([0.7, 0.4, 0.1], 2) == pytest.approx(2.1)
    with pytest.raises(SpeculatorsError, match="3 positions; it cannot predict K = 4"):
        expected_tokens([0.7, 0.4, 0.1], 4)
    no_drafts = {0: {1: point(100)}, 1: {1: {"output_tokens_per_s": 120.0, "spec_decode": {"acceptance_length": None}}}}
    with pytest.raises(SpeculatorsError, match="the K = 1 server drafted nothing"):
        analyse_load(no_drafts, [0.5], k=1, serving_concurrency=1)
    with pytest.raises(SpeculatorsError, match="measured no output tokens/s"):
        analyse_load({0: {1: point(100)}, 1: {1: point(0.0, 1.5)}}, [0.5], k=1, serving_concurrency=1)


def test_the_section_pads_missing_positions_and_keys_everything_by_string():
    """vLLM exports a position's counter only once a token was accepted there: the profile's missing
    positions are zeros (E(2) = E(1))."""
    table = {0: {1: point(100), 2: point(150)}, 1: {1: point(140, 1.5), 2: point(180, 1.5)},
             2: {1: point(130, 1.5), 2: point(160, 1.5)}}  # fmt: skip
    acceptance = {"acceptance_per_position": [0.5], "acceptance_length": 1.5, "drafts": 40, "length": "natural"}
    section = load_sweep_section(
        length="natural", requests={1: 8, 2: 8}, k=2, serving_concurrency=2, acceptance=acceptance,
        source="made up", points=table,
    )  # fmt: skip
    assert section["profile"]["acceptance_per_position"] == [0.5, 0.0]
    assert section["expected_tokens"] == pytest.approx({"0": 1.0, "1": 1.5, "2": 1.5})
    assert (section["concurrency"], section["ks"], section["requests"]) == ([1, 2], [0, 1, 2], {"1": 8, "2": 8})
    assert section["points"]["2"]["2"]["output_tokens_per_s"] == 160
    assert section["speedup_at_serving_concurrency"] == pytest.approx(160 / 150)
    json.dumps(section)  # (report.json)
    from speculators.eval.records import LoadSweep

    record = LoadSweep(**section)
    assert record.best_k["1"].chosen == 1 and record.break_even_concurrency.value is None


# ----- the settings ------------------------------------------------------------------------------


def test_the_sweep_settings_give_the_points_and_refuse_an_unswept_serving_concurrency(tmp_path, capsys):
    from speculators.cli import build_parser, main
    from speculators.settings import BenchSettings

    common = {"verifier": "v", "speculator": "s", "output": str(tmp_path / "out")}
    settings = BenchSettings(**common, concurrency=[8, 2, 4, 2])
    assert settings.load_concurrencies() == [1, 2, 4, 8]
    # n(c) = min(max(load_requests, 2c), prompts): 8 each, 16 for 8 streams, at most the 12 prompts
    assert settings.load_points(12) == [(1, 8), (2, 8), (4, 8), (8, 12)]
    assert BenchSettings(**common, concurrency=[8], load_requests=3).load_points(100) == [(1, 3), (8, 16)]
    assert BenchSettings(**common, concurrency=[]).load_points(5) == [(1, 5)]
    assert [p["kind"] for p in settings.profiles()] == ["synchronous", "synchronous"]  # no concurrent profile
    assert settings.load_natural() and not BenchSettings(**common, natural_max_tokens=0).load_natural()

    parsed = build_parser().parse_args(
        ["bench", "--verifier", "v", "--speculator", "s", "--output", "o", "--sweep-k", "1,2", "--load-requests", "4",
         "--concurrency", "2,4", "--serving-concurrency", "4"]
    )  # fmt: skip
    assert (parsed.sweep_k, parsed.load_requests, parsed.serving_concurrency) == ([1, 2], 4, 4)
    assert build_parser().parse_args(["bench", "--verifier", "v", "--speculator", "s", "--output", "o",
                                      "--sweep-k="]).sweep_k == []  # fmt: skip

    arguments = ["bench", "--verifier", "v", "--speculator", "s", "--output", str(tmp_path / "out")]
    assert main([*arguments, "--concurrency", "2,4", "--serving-concurrency", "3"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --serving-concurrency 3 is not measured by the load sweep (1 and --concurrency 2,4): add it to "
        "--concurrency or serve at one of those"
    )
    assert main([*arguments, "--load-requests", "0"]) == 2 and "--load-requests" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_sweep_k_outside_1_to_the_main_k_is_one_line_before_any_server(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    from speculators.cli import main
    from speculators.eval import bench
    from speculators.eval.bench import smaller_ks
    from speculators.settings import BenchSettings

    common = {"verifier": "v", "speculator": "s", "output": "o"}
    assert smaller_ks(BenchSettings(**common), 4) == [1, 2, 3]  # default: every smaller K
    assert smaller_ks(BenchSettings(**common, sweep_k=[2, 1, 2]), 4) == [1, 2]
    assert smaller_ks(BenchSettings(**common, sweep_k=[]), 4) == []
    with pytest.raises(SpeculatorsError, match=r"--sweep-k 1,3: 3 is not a smaller K than the main K = 3; pick "):
        smaller_ks(BenchSettings(**common, sweep_k=[1, 3]), 3)

    checkpoint = SimpleNamespace(config=SimpleNamespace(speculative_tokens=2))  # (K read from the checkpoint)
    monkeypatch.setattr(bench, "read_speculator_checkpoint", lambda path: checkpoint)
    out = tmp_path / "out"
    arguments = ["bench", "--verifier", "v", "--speculator", "s", "--output", str(out)]
    assert main([*arguments, "--sweep-k", "2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --sweep-k 2: 2 is not a smaller K than the main K = 2; pick values in 1..1 (or --sweep-k= for none)"
    )
    assert not out.exists()


# ----- bench's sweep of one server, report.md and the plot -------------------------------------------


class SweptServer:
    url, model_name, model_dir = "http://h", "m", "tok"


def test_bench_sweeps_a_server_on_the_first_n_prompts_at_each_concurrency(tmp_path, monkeypatch, capsys):
    """Each point is one GuideLLM run at the headline length: synchronous at c = 1, c streams beyond, on
    max_requests = n(c) of the file's rows, its files named after c; the spec-decode counters kept on a
    speculator server only."""
    from speculators.eval import bench
    from speculators.settings import BenchSettings

    runs = []

    def run_profile(server, command, paths, requests, folder, settings, label):
        runs.append((command, paths, requests, label))
        return {"output_tokens_per_s": 50.0 * len(runs), "tpot_ms": 9.0, "itl_ms": 8.0, "ttft_ms": 20.0,
                "output_tokens_mean": 30.0, "requests": {"successful": requests}, "duration_s": 1.0,
                "spec_decode": {"acceptance_length": 1.5, "drafts": 4}, "machine_load": {"quiet": True}}  # fmt: skip

    monkeypatch.setattr(bench, "run_profile", run_profile)
    settings = BenchSettings(
        verifier="v", speculator="s", output=str(tmp_path), concurrency=[4], load_requests=3, num_speculative_tokens=3
    )
    points = bench.measure_load("speculator-k2", SweptServer(), settings, tmp_path, prompts=10)  # type: ignore[arg-type]
    assert list(points) == [1, 4]
    (first, paths, requests, label), (second, _, requests_at_four, _) = runs
    assert (requests, requests_at_four) == (3, 8) and label == "[speculator-k2] load c=1"
    assert paths["json"] == tmp_path / "speculator-k2" / "guidellm-load-c1.json"
    assert first[first.index("--data") + 1] == f"kind=json_file,path={tmp_path / 'prompts-natural.jsonl'}"
    assert json.loads(first[first.index("--profile") + 1]) == {"kind": "synchronous"}
    assert json.loads(second[second.index("--profile") + 1]) == {"kind": "concurrent", "streams": 4}
    assert second[second.index("--constraint") + 1] == "kind=max_requests,count=8"
    assert points[4]["spec_decode"]["acceptance_length"] == 1.5 and "duration_s" not in points[4]
    assert "[speculator-k2] load c=4: 8 requests, 100.0 output tokens/s" in capsys.readouterr().out

    fixed = settings.model_copy(update={"natural_max_tokens": 0})
    runs.clear()
    baseline = bench.measure_load("baseline", SweptServer(), fixed, tmp_path, prompts=10)  # type: ignore[arg-type]
    command = runs[0][0]
    assert command[command.index("--data") + 1].endswith("/prompts.jsonl") and "spec_decode" not in baseline[1]
    assert bench.role_k("baseline", settings) == 0 and bench.role_k("speculator", settings) == 3
    assert bench.role_k(bench.sweep_role(2), settings) == 2
    server = bench.role_server_settings("speculator-k2", settings, tmp_path)
    assert (server.speculator, server.num_speculative_tokens) == ("s", 2)
    assert bench.role_server_settings("baseline", settings, tmp_path).speculator is None

    # A main server's synchronous profile of every prompt is its c = 1 point; of fewer, it is measured again.
    runs.clear()
    main = {"output_tokens_per_s": 7.0, "tpot_ms": 1.0, "itl_ms": 1.0, "ttft_ms": 1.0, "output_tokens_mean": 9.0,
            "requests": {"successful": 10}, "spec_decode": {"acceptance_length": 2.0, "drafts": 9}, "duration_s": 3.0,
            "machine_load": {"quiet": True}}  # fmt: skip
    every = settings.model_copy(update={"load_requests": 10})
    reused = bench.measure_load("speculator", SweptServer(), every, tmp_path, prompts=10, single_stream=main)
    assert [r[3] for r in runs] == ["[speculator] load c=4"] and reused[1]["output_tokens_per_s"] == 7.0
    assert "duration_s" not in reused[1]
    runs.clear()
    bench.measure_load("speculator", SweptServer(), settings, tmp_path, prompts=10, single_stream=main)
    assert [r[3] for r in runs] == ["[speculator] load c=1", "[speculator] load c=4"]


def test_report_md_has_the_under_load_section_and_the_plot_is_drawn(tmp_path):
    from speculators.eval.bench_report import load_sweep_lines, machine_load_summary, plot_load_sweep

    acceptance = {"acceptance_per_position": RATES, "acceptance_length": 1.9, "drafts": 50, "length": "natural"}
    requests = {1: 8, 2: 8, 4: 8, 8: 16}
    sweep = load_sweep_section(
        length="natural", requests=requests, k=2, serving_concurrency=1, acceptance=acceptance,
        source="the main K's synchronous-natural profile", points=TABLE,
    )  # fmt: skip
    text = "\n".join(load_sweep_lines(sweep))
    assert "## Under load" in text and "| concurrency | requests | baseline tokens/s | K=1 | K=2 |" in text
    assert "| 8 | 16 | 400.0 | 1.050x / 1.050x | 0.800x / 0.950x |" in text
    assert "c=4: K=1 (gain over K=2: predicted 1.222x, measured 1.222x; measured best K=1)" in text
    assert "**Break-even concurrency** of K=2: the speed-up falls below 1 at about c = 3.4" in text
    assert "Largest prediction error: 18.7%" in text and "c=1: **1.500x**" in text
    assert load_sweep_lines(None) == []

    plot_load_sweep(sweep, tmp_path)
    assert (tmp_path / "concurrency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for each in sweep["points"].values():
        for c, measured in each.items():
            measured["machine_load"] = {"quiet": c != "8", "other_cores": 0.5 if c == "8" else 0.0, "steal_cores": 0.0}
    summary = machine_load_summary({"profiles": {}, "load_sweep": sweep})
    assert summary["runs"] == 12 and not summary["quiet"]
    assert summary["busy_runs"] == ["load K=0 c=8", "load K=1 c=8", "load K=2 c=8"]
    assert math.isclose(summary["other_cores_max"], 0.5)


# ----- GuideLLM runs that recorded nothing ----------------------------------------------------------


def fake_guidellm(tmp_path, failures: int) -> list[str]:
    """A command that fails `failures` times as GuideLLM 0.8.1 does when its scheduler ends a run before
    recording a request (the message copied from the installed GuideLLM's source, so a new wording
    fails this test), then writes a report of 2 successful requests."""
    import inspect
    import sys

    from guidellm.benchmark.schemas import metrics

    from speculators.eval.guidellm import RECORDED_NOTHING

    assert RECORDED_NOTHING in inspect.getsource(metrics.GenerativeMetrics.compile)
    stat = {"successful": {"median": 5.0, "mean": 5.0}}
    report = {
        "metadata": {"guidellm_version": "0.8.1"},
        "benchmarks": [
            {
                "duration": 1.0,
                "metrics": {
                    **{name: stat for name in ("time_to_first_token_ms", "inter_token_latency_ms",
                                               "time_per_output_token_ms", "output_tokens_per_second",
                                               "request_latency", "output_tokens_per_iteration",
                                               "output_token_count")},
                    "request_totals": {"successful": 2, "errored": 0, "incomplete": 0},
                },
            }
        ],
    }  # fmt: skip
    script = tmp_path / "guidellm.py"
    script.write_text(
        "import json, pathlib, sys\n"
        f"count = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "runs = int(count.read_text()) + 1 if count.exists() else 1\n"
        "count.write_text(str(runs))\n"
        f"if runs <= {failures}:\n"
        "    print('Traceback (most recent call last):')\n"
        f"    print('ValueError: Cannot compile GenerativeMetrics: ' + {RECORDED_NOTHING + '.'!r})\n"
        "    sys.exit(1)\n"
        f"pathlib.Path({str(tmp_path / 'report.json')!r}).write_text({json.dumps(report)!r})\n"
    )
    return [sys.executable, str(script)]


class IdleServer:
    """What run_profile reads of a vLLM server: its counters, which stand still here."""

    url = "http://h"

    def metrics(self):
        from speculators.serving.serve import parse_spec_decode_counters

        return parse_spec_decode_counters("")

    def reset_prefix_cache(self):
        pass

    def process_groups(self):
        return []


@pytest.mark.parametrize("failures", [1, 2, 3])
def test_a_guidellm_run_that_recorded_nothing_is_taken_again_up_to_the_attempts(
    tmp_path, monkeypatch, capsys, failures
):
    """The CI failure of 2026-12-06: GuideLLM exited 1 on a load point, having recorded none of its 2
    requests. bench takes such a run again (up to GUIDELLM_ATTEMPTS runs); the last one's failure, and any
    other GuideLLM failure, still fails bench with the end of its log."""
    from speculators.eval import bench
    from speculators.eval.guidellm import GUIDELLM_ATTEMPTS, GuideLLMRecordedNothing
    from speculators.settings import BenchSettings

    monkeypatch.setattr(bench, "wait_until_idle", lambda url: None)
    paths = {"json": tmp_path / "report.json", "log": tmp_path / "guidellm.log"}
    settings = BenchSettings(verifier="v", speculator="s", output=str(tmp_path), num_speculative_tokens=3)
    command = fake_guidellm(tmp_path, failures)
    server = IdleServer()
    if failures < GUIDELLM_ATTEMPTS:
        summary = bench.run_profile(server, command, paths, 2, tmp_path, settings, "[speculator] load c=1")  # type: ignore[arg-type]
        assert summary["requests"]["successful"] == 2 and summary["tpot_ms"] == 5.0
        assert capsys.readouterr().out.count("ended the run before recording any request; running it again") == failures
    else:
        with pytest.raises(GuideLLMRecordedNothing, match=r"GuideLLM failed with code 1; the end of .*guidellm\.log"):
            bench.run_profile(server, command, paths, 2, tmp_path, settings, "[speculator] load c=1")  # type: ignore[arg-type]
    assert int((tmp_path / "runs").read_text()) == min(failures + 1, GUIDELLM_ATTEMPTS)


def test_any_other_guidellm_failure_fails_at_once(tmp_path, monkeypatch):
    import sys

    from speculators.eval import bench
    from speculators.eval.guidellm import GuideLLMRecordedNothing
    from speculators.settings import BenchSettings

    monkeypatch.setattr(bench, "wait_until_idle", lambda url: None)
    paths = {"json": tmp_path / "report.json", "log": tmp_path / "guidellm.log"}
    settings = BenchSettings(verifier="v", speculator="s", output=str(tmp_path), num_speculative_tokens=3)
    command = [sys.executable, "-c", "import sys; print('ConnectionError: refused'); sys.exit(2)"]
    with pytest.raises(SpeculatorsError, match="GuideLLM failed with code 2") as failure:
        bench.run_profile(IdleServer(), command, paths, 2, tmp_path, settings, "[speculator] load c=1")  # type: ignore[arg-type]
    assert not isinstance(failure.value, GuideLLMRecordedNothing)
    assert "ConnectionError: refused" in str(failure.value)
