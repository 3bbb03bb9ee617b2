"""How busy the machine was with other work while bench measured a speed (speculators/eval/machine_load.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from speculators.eval import machine_load
from speculators.eval.machine_load import load_note, load_snapshot, other_load


def snapshot(time_s: float, busy: int, steal: int, measured: int, own_s: float) -> dict:
    return {"time": time_s, "busy": busy, "steal": steal, "measured": measured, "own_s": own_s}


def test_other_load_is_the_busy_time_outside_the_measured_processes_in_average_cores(monkeypatch):
    monkeypatch.setattr(machine_load, "clock_ticks", lambda: 100)
    monkeypatch.setattr(machine_load.os, "cpu_count", lambda: 2)
    # 4 s: the machine busy 6 core-seconds, the server's group 3.5, bench and GuideLLM 1.5 -> 1 other
    # core-second over 4 s = 0.25 cores; the hypervisor took 0.2 core-seconds = 0.05 cores.
    load = other_load(snapshot(10.0, 1000, 50, 400, 2.0), snapshot(14.0, 1600, 70, 750, 3.5))
    assert load == {"seconds": 4.0, "cores": 2, "other_cores": 0.25, "steal_cores": 0.05, "quiet": False}
    assert "other processes kept 0.25 and the hypervisor 0.05 of 2 cores busy" in load_note(load)
    quiet = other_load(snapshot(10.0, 1000, 50, 400, 2.0), snapshot(14.0, 1520, 70, 750, 3.5))
    assert quiet["other_cores"] == 0.05 and quiet["quiet"] is True and load_note(quiet) == ""
    stolen = other_load(snapshot(10.0, 1000, 50, 400, 2.0), snapshot(14.0, 1500, 150, 750, 3.5))
    assert stolen["other_cores"] == 0.0 and stolen["steal_cores"] == 0.25 and stolen["quiet"] is False
    assert other_load(None, snapshot(14.0, 0, 0, 0, 0.0)) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_busy_process_counts_as_other_load_unless_its_group_is_measured():
    busy = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 6\nwhile time.time() < end: pass"],
        start_new_session=True,  # its own process group, as a vLLM server runs
    )
    try:
        time.sleep(0.5)  # (interpreter start-up)
        unmeasured, measured = load_snapshot([]), load_snapshot([busy.pid])
        time.sleep(2.0)
        # Read while the process still runs: once waited for, its time would count as this process's own.
        unmeasured, measured = (
            other_load(unmeasured, load_snapshot([])),
            other_load(measured, load_snapshot([busy.pid])),
        )
    finally:
        busy.kill()
        busy.wait()
    # The loop kept about one core busy for the 2 s: other work when its group is not measured, not when it is.
    assert unmeasured["other_cores"] - measured["other_cores"] > 0.6
    assert unmeasured["quiet"] is False
    assert machine_load.process_group_ticks(busy.pid) == 0  # (gone)


def test_bench_reports_whether_every_speed_figure_was_measured_on_a_quiet_machine():
    from speculators.eval.bench_report import load_line, load_text, machine_load_summary

    quiet = {"seconds": 60.0, "cores": 2, "other_cores": 0.02, "steal_cores": 0.0, "quiet": True}
    busy = {"seconds": 80.0, "cores": 2, "other_cores": 0.83, "steal_cores": 0.01, "quiet": False}
    report = {
        "profiles": {
            "synchronous-natural": {"baseline": {"machine_load": quiet}, "speculator": {"machine_load": busy}}
        },
        "mt_bench": {
            "profiles": {
                "synchronous-natural": {"baseline": {"machine_load": quiet}, "speculator": {"machine_load": quiet}}
            }
        },
    }
    summary = machine_load_summary(report)
    assert summary == {
        "quiet": False,
        "runs": 4,
        "other_cores_max": 0.83,
        "steal_cores_max": 0.01,
        "busy_runs": ["synchronous-natural speculator"],
    }
    line = load_line(summary)
    assert "**not quiet**" in line and "synchronous-natural speculator" in line and "at most 0.83" in line
    assert "busy during synchronous-natural speculator" in load_text(summary)
    report["profiles"]["synchronous-natural"]["speculator"]["machine_load"] = quiet
    assert machine_load_summary(report)["quiet"] is True
    assert load_line(machine_load_summary(report)).startswith("**Machine load** during the speed measurements: quiet")
    unmeasured = {"profiles": {"synchronous": {"baseline": {"machine_load": None}, "speculator": {}}}}
    assert machine_load_summary(unmeasured) == {"quiet": None, "runs": 2, "busy_runs": []}
    assert "not measured" in load_line(machine_load_summary(unmeasured))
    assert "not measured" in load_text({})
