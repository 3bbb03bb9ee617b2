"""The load sweep's analysis: from the servers' measured points (output tokens/s, tokens per step) and the
main speculator's single-stream acceptance profile, the speed-up at every concurrency, the speed-up the
profile predicts at every K, the best K per concurrency and where the main K stops paying.

Pure functions (no I/O): bench measures the points, report.json's `load_sweep` holds what they give.

- E(k) = 1 + p_1 + ... + p_k: expected tokens per verifier step at k drafts, from the per-position rates
  p_i measured at the main K (accepted drafts are a prefix, so p_i = P(the first i accepted)).
- T(k, c): a point's output tokens/s; AL(k, c) its measured tokens per step (1 + accepted / drafts; 1 at k = 0).
- r(k, c) = AL(k, c) * T(0, c) / T(k, c): one engine step at K = k over one of the verifier alone, c streams.
- S(k, c) = T(k, c) / T(0, c), measured; P(k, c) = E(k) / r(k, c), predicted (so P / S = E(k) / AL(k, c)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from speculators.errors import SpeculatorsError

Points = Mapping[int, Mapping[int, Mapping[str, Any]]]  # k -> concurrency -> a GuideLLM run's summary


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """E(k): tokens per verifier step at k drafts, from the per-position acceptance rates measured at K >= k."""
    if k > len(rates):
        raise SpeculatorsError(f"the acceptance profile has {len(rates)} positions; it cannot predict K = {k}")
    return 1.0 + sum(rates[:k])


def tokens_per_step(point: Mapping[str, Any], k: int) -> float:
    """AL(k, c): the point's measured tokens per engine step (the verifier alone makes one)."""
    if k == 0:
        return 1.0
    length = (point.get("spec_decode") or {}).get("acceptance_length")
    if not length:
        raise SpeculatorsError(f"the K = {k} server drafted nothing in a load-sweep point; see its vllm.log")
    return float(length)


def throughput(point: Mapping[str, Any], k: int, c: int) -> float:
    tokens_per_s = point.get("output_tokens_per_s")
    if not tokens_per_s or tokens_per_s <= 0:
        raise SpeculatorsError(f"the K = {k} server's load-sweep point at c = {c} measured no output tokens/s")
    return float(tokens_per_s)


def argmax_k(values: Mapping[int, float]) -> int:
    """The K with the largest value; on a tie the smallest such K (fewer drafts cost less to serve)."""
    best = max(values.values())
    return min(k for k, value in values.items() if value == best)


def break_even(speedups: Mapping[int, float]) -> dict[str, Any]:
    """The concurrency where the speed-up falls below 1: the first swept c where it is < 1, interpolated
    linearly in log2(c) between it and the swept c before it; null with a note where it does not cross."""
    swept = sorted(speedups)
    if speedups[swept[0]] < 1:
        everywhere = all(speedups[c] < 1 for c in swept)
        note = (
            "slower than the verifier alone at every swept concurrency"
            if everywhere
            else f"slower than the verifier alone already at c = {swept[0]}"
        )
        return {"value": None, "note": note}
    for before, after in itertools.pairwise(swept):
        high, low = speedups[before], speedups[after]
        if low < 1:
            share = (high - 1) / (high - low)  # of the way from `before` to `after`, in log2(c)
            value = 2 ** (math.log2(before) + share * (math.log2(after) - math.log2(before)))
            return {
                "value": value,
                "note": f"the speed-up falls below 1 at about c = {value:.1f} (interpolated in log2(c) between "
                f"c = {before}, {high:.3f}x, and c = {after}, {low:.3f}x)",
            }
    return {"value": None, "note": f"faster than the verifier alone at every swept concurrency, up to c = {swept[-1]}"}


def analyse_load(points: Points, rates: Sequence[float], k: int, serving_concurrency: int) -> dict[str, Any]:
    """report.json `load_sweep`'s derived keys from the points (k -> c -> summary; k = 0 the verifier alone,
    `k` the main K) and the main K's acceptance rates per position. Keys of dicts are strings (JSON)."""
    concurrencies = sorted(points[0])
    ks = sorted(points)
    if ks[0] != 0 or ks[-1] != k or any(sorted(points[each]) != concurrencies for each in ks):
        raise SpeculatorsError("the load sweep's servers measured different points; this is a bug")
    base = {c: throughput(points[0][c], 0, c) for c in concurrencies}
    ratio, measured, predicted, error = {}, {}, {}, {}
    for each in ks[1:]:
        for c in concurrencies:
            tokens_per_s = throughput(points[each][c], each, c)
            ratio[each, c] = tokens_per_step(points[each][c], each) * base[c] / tokens_per_s
            measured[each, c] = tokens_per_s / base[c]
            predicted[each, c] = expected_tokens(rates, each) / ratio[each, c]
            error[each, c] = predicted[each, c] / measured[each, c] - 1

    def by_k(values: Mapping[tuple[int, int], float]) -> dict[str, dict[str, float]]:
        return {str(each): {str(c): values[each, c] for c in concurrencies} for each in ks[1:]}

    best = {}
    for c in concurrencies:
        measured_at = {0: 1.0, **{each: measured[each, c] for each in ks[1:]}}
        predicted_at = {0: 1.0, **{each: predicted[each, c] for each in ks[1:]}}
        chosen = argmax_k(predicted_at)
        best[str(c)] = {
            "chosen": chosen,
            "measured_best": argmax_k(measured_at),
            "predicted_gain": predicted_at[chosen] / predicted_at[k],
            "measured_gain": measured_at[chosen] / measured_at[k],
        }
    return {
        "expected_tokens": {str(each): expected_tokens(rates, each) for each in ks},
        "step_cost_ratio": by_k(ratio),
        "speedup": by_k(measured),
        "predicted_speedup": by_k(predicted),
        "prediction_error": by_k(error),
        "prediction_error_max": max((abs(e) for e in error.values()), default=0.0),
        "best_k": best,
        "break_even_concurrency": break_even({c: measured[k, c] for c in concurrencies}),
        "speedup_at_serving_concurrency": measured[k, serving_concurrency],
    }


def load_sweep_section(
    *,
    length: str,
    requests: Mapping[int, int],
    k: int,
    serving_concurrency: int,
    acceptance: Mapping[str, Any],
    source: str,
    points: Points,
) -> dict[str, Any]:
    """report.json's `load_sweep`: how it ran, the acceptance profile it predicts from (`acceptance`: the
    report's headline), every point as measured, and the analysis (analyse_load)."""
    rates = list(acceptance["acceptance_per_position"])
    if len(rates) > k:
        raise SpeculatorsError(f"the headline acceptance has {len(rates)} positions for K = {k}; this is a bug")
    rates += [0.0] * (k - len(rates))  # (vLLM exports a position's counter once a token was accepted there)
    ks = sorted(points)
    concurrencies = sorted(points[0])
    return {
        "length": length,
        "concurrency": concurrencies,
        "requests": {str(c): requests[c] for c in concurrencies},
        "k": k,
        "ks": ks,
        "serving_concurrency": serving_concurrency,
        "profile": {
            "acceptance_per_position": rates,
            "acceptance_length": acceptance["acceptance_length"],
            "drafts": acceptance["drafts"],
            "source": source,
        },
        "points": {str(each): {str(c): dict(points[each][c]) for c in concurrencies} for each in ks},
        **analyse_load(points, rates, k, serving_concurrency),
    }
