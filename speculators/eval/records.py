"""Typed records of report.json, the file `speculators bench` writes beside report.md and its plots,
for its readers (the Dagster code location's benchmark_report).

bench writes the file as it always has; a record names the keys its readers use and keeps every other
key (`extra="allow"`), so reports of older and newer versions read alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ReportRecord(BaseModel):
    model_config = ConfigDict(extra="allow")


class Speedups(ReportRecord):
    """A profile's speculator-over-baseline ratios (>1: the speculator is better); a ratio either side
    could not measure is absent, read as 0."""

    tpot_ms: float = 0.0
    output_tokens_per_s: float = 0.0


class ServerSummary(ReportRecord):
    """One server's GuideLLM summary of a profile."""

    output_tokens_mean: float | None = None


class ProfileComparison(ReportRecord):
    """One GuideLLM profile measured on both servers."""

    baseline: ServerSummary = ServerSummary()
    speculator: ServerSummary = ServerSummary()
    speedup: Speedups = Speedups()


class Acceptance(ReportRecord):
    """The speculator server's acceptance counters, summed over profiles."""

    acceptance_length: float | None = None
    acceptance_per_position: list[float] = []


class OutputComparison(ReportRecord):
    """The two servers' greedy outputs, prompt by prompt: identical, a near-tie, or diverged."""

    compared: int
    identical: int
    near_tie: int
    diverged: int


class CategoryColumns(ReportRecord):
    """`per_category`: each category's column of acceptance and speed-up (eval.evaluate.category_table's input)."""

    columns: dict[str, dict[str, Any]]


class PromptSetInfo(ReportRecord):
    questions: int | None = None  # MT-Bench questions (both turns each)


class PromptSetReport(ReportRecord):
    """One set of prompts measured on both servers: its profiles, acceptance and per-category columns."""

    profiles: dict[str, ProfileComparison]
    acceptance: Acceptance
    acceptance_fixed_length: Acceptance | None = None  # the fixed-length profiles' (absent without them)
    per_category: CategoryColumns | None = None  # where the prompts have categories


class MtBenchReport(PromptSetReport):
    """`mt_bench`: MT-Bench measured beside the eval prompts (--mt-bench)."""

    prompts: PromptSetInfo


class MachineLoad(ReportRecord):
    """`machine_load`: how busy the machine was during the GuideLLM runs (bench's machine_load_summary);
    `quiet` None where no run could be measured."""

    quiet: bool | None = None
    other_cores_max: float = 0.0


class BreakEven(ReportRecord):
    """Where the main K stops paying: the interpolated concurrency, or None with the note saying why."""

    value: float | None = None
    note: str = ""


class BestK(ReportRecord):
    """At one concurrency: the K the acceptance profile and the step costs pick, the K measured best, and
    each one's gain over the main K."""

    chosen: int
    measured_best: int
    predicted_gain: float
    measured_gain: float


class LoadSweep(ReportRecord):
    """`load_sweep`: every server at every concurrency (c = 1 first), the speed-ups measured and predicted
    from the acceptance profile, the best K per concurrency and the break-even concurrency (keys of the
    dicts: K and c as strings; speculators.eval.load_sweep computes them)."""

    length: str
    concurrency: list[int]
    k: int
    ks: list[int]
    serving_concurrency: int = 1
    speedup: dict[str, dict[str, float]]
    predicted_speedup: dict[str, dict[str, float]]
    step_cost_ratio: dict[str, dict[str, float]]
    prediction_error_max: float
    best_k: dict[str, BestK]
    break_even_concurrency: BreakEven
    speedup_at_serving_concurrency: float


class ReportedSettings(ReportRecord):
    num_speculative_tokens: int  # K as the servers ran it


class BenchReport(PromptSetReport):
    """report.json: the eval prompts on both servers, the lossless comparison, how quiet the machine was,
    and MT-Bench beside them where it ran."""

    FILE: ClassVar[str] = "report.json"

    settings: ReportedSettings
    outputs: OutputComparison
    machine_load: MachineLoad | None = None  # (absent in early reports)
    mt_bench: MtBenchReport | None = None
    load_sweep: LoadSweep | None = None  # (absent in reports made before the load sweep)
