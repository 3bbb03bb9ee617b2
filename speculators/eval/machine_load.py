"""How busy the machine was with other work while a speed figure was measured.

A speed-up is the ratio of two measurements taken minutes apart. On a small machine (the project's CPU
machines have 2 cores) another process busy for part of one measurement and not the other moves the
ratio by far more than the drafter does: the AVX2 demo's speculator run of 2026-12-03 measured 56.7 ms a
token where the same server, drafter and prompts measured 39.8 ms rerun alone (BENCHMARKS.md). bench
therefore records, around each measured run, the CPU time the machine spent on processes other than the
ones measured (the server's process group, bench itself and the clients it waited for) and the time the
hypervisor took away (steal), both as average cores over the run.

Linux only (/proc); elsewhere `load_snapshot` returns None and nothing is recorded.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

PROC = Path("/proc")
# Average cores taken by other work above which a run's speed figures are flagged as not comparable:
# a tenth of a core is within what an idle Linux machine's daemons and bench's own polling use.
BUSY_CORES = 0.1


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int] | None:
    """(busy, steal) CPU ticks summed over every core since boot, from /proc/stat's first line."""
    try:
        fields = (PROC / "stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    # cpu user nice system idle iowait irq softirq steal [guest guest_nice: already inside user / nice]
    values = [int(v) for v in fields[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values
    return user + nice + system + irq + softirq, steal


def process_group_ticks(pgid: int) -> int:
    """CPU ticks used by the live processes of group `pgid` and the children each has waited for."""
    total = 0
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # (gone between the listing and the read)
            continue
        # After the command name in parentheses: state ppid pgrp ... utime (14) stime cutime cstime (17).
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += sum(int(v) for v in fields[11:15])
    return total


def own_seconds() -> float:
    """CPU seconds used by this process and the children it has waited for (GuideLLM's runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def load_snapshot(measured_groups: list[int]) -> dict[str, Any] | None:
    """The counters `other_load` compares: the machine's busy and stolen ticks, the measured process
    groups' ticks, this process's own CPU seconds, the time. None where /proc is not there."""
    machine = machine_ticks()
    if machine is None:
        return None
    return {
        "time": time.monotonic(),
        "busy": machine[0],
        "steal": machine[1],
        "measured": sum(process_group_ticks(pgid) for pgid in measured_groups),
        "own_s": own_seconds(),
    }


def other_load(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Average cores busy with processes other than the measured ones (`other_cores`) and taken by the
    hypervisor (`steal_cores`) between two snapshots, with the machine's core count and whether the
    run counts as measured on a quiet machine (`quiet`: neither above BUSY_CORES)."""
    if before is None or after is None:
        return None
    seconds = after["time"] - before["time"]
    if seconds <= 0:
        return None
    tick = clock_ticks()
    busy = (after["busy"] - before["busy"]) / tick
    measured = (after["measured"] - before["measured"]) / tick + (after["own_s"] - before["own_s"])
    other = max(busy - measured, 0.0) / seconds
    steal = (after["steal"] - before["steal"]) / tick / seconds
    return {
        "seconds": round(seconds, 1),
        "cores": os.cpu_count(),
        "other_cores": round(other, 3),
        "steal_cores": round(steal, 3),
        "quiet": other <= BUSY_CORES and steal <= BUSY_CORES,
    }


def load_note(load: dict[str, Any] | None) -> str:
    """One clause for a progress line; empty when the run was measured on a quiet machine."""
    if not load or load["quiet"]:
        return ""
    return (
        f"; other processes kept {load['other_cores']:.2f} and the hypervisor {load['steal_cores']:.2f} of "
        f"{load['cores']} cores busy during this run: its speed figures are not comparable (rerun on an idle machine)"
    )
