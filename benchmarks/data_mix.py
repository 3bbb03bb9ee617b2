"""Which data teaches the demo's drafter most per minute of training, in one run: drafters trained with
the variant's recipe on the same number of tokens x epochs, each from a different choice of data, then
all of them judged by `speculators compare` on MT-Bench and `natural:eval` with paired intervals.

    python benchmarks/data_mix.py --work-dir /tmp/mix [--variant smollm2_135m] [--pool 1800] \
        [--turns-pool 600] [--arms first,every-turn,short,long,code-math,prose,twice-once,half-twice] \
        [--budget-tokens T] [--compare mt-bench --compare natural:eval] [--compare-questions 80]

Two pools, built with the variant's own commands (its prompt sources, datagen and capture, as the Dagster
steps run them; `data_scaling.build_store`), differing in one knob only:
- `pool-first`: `max_samples` = --pool, every conversation's first user turn (the demo's `max_user_turns: 1`);
- `pool-turns`: `max_samples` = --turns-pool, every user turn (`max_user_turns` unset); an answer clipped at
  the variant's `max_answer_tokens` still ends its conversation, as it does in the variant.

The budget T is the variant's datagen `max_train_tokens` (the demo's 291,392), or without one the training
tokens of its `max_samples` first training samples of `pool-first`; --budget-tokens sets it. The pools keep
every sample (the variant's token budget is left out of them). Each arm takes training samples until their
tokens reach its budget (the sample that crosses it is the last), keeps every validation sample
(`natural:validation`, answered by the verifier: the replayed acceptance), gets a draft vocabulary of its
own, and trains for the variant's epochs unless said:
- `first`: pool-first in its order, T tokens: the demo's data until 2026-12-06 (the baseline);
- `every-turn`: pool-turns in its order, T tokens;
- `short` / `long`: pool-first's shortest / longest samples first, T tokens (`short`: the demo's data since);
- `code-math` / `prose`: pool-first's code and maths rows only (CODE_OR_MATH below) / none of them, T tokens
  each, against `first`'s natural share (the script prints it);
- `twice-once`: pool-first in order, 2T tokens, half the epochs;
- `half-twice`: pool-first in order, T / 2 tokens, twice the epochs.
So every arm trains on T x epochs tokens (its packing decides the steps; the table gives the minutes).
The recipes are chosen on the replayed acceptance (natural:validation); MT-Bench and natural:eval, which
no recipe was chosen on, are the reported figures. Every step resumes: finished pools, stores and
drafters are reused.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from data_scaling import build_store, train  # (this script's folder is on sys.path when it runs)
from recipe_sweep import best_validation, select_store

ARMS = {
    "first": "pool-first in order, T tokens (the demo's data until 2026-12-06)",
    "every-turn": "every user turn (pool-turns in order), T tokens",
    "short": "the shortest first turns, T tokens (the demo's data since)",
    "long": "the longest first turns, T tokens",
    "code-math": "code and maths rows only, T tokens",
    "prose": "no code or maths rows, T tokens",
    "twice-once": "2T tokens, half the epochs",
    "half-twice": "T / 2 tokens, twice the epochs",
}
# A row is code or maths when its text (prompt and answer) holds a code fence, a line that opens like code,
# a programming language's name, a maths word, or an arithmetic expression (no "-": dates and ranges are not
# maths). A heuristic for ShareGPT's English rows; the script prints the share it finds in the pool.
CODE_OR_MATH = re.compile(
    r"```|^\s*(def|class|import|from \S+ import|return|function|const|let|var|public|private|#include|SELECT)\s"
    r"|\b(python|javascript|typescript|java|c\+\+|c#|sql|html|css|php|golang|bash|regex)\b"
    r"|\b(equations?|integrals?|derivatives?|probability|algebra|theorem|calculus|solve for)\b"
    r"|\b\d+(\.\d+)?\s*[+*/^=×÷]\s*\(?\d",
    re.IGNORECASE | re.MULTILINE,
)


@dataclass(frozen=True)
class Pool:
    """A pool's store, its training samples (manifest entries, in order) and its rows' code/maths and turns."""

    store: Path
    training: list[Any]
    code_math: set[str]
    user_turns: dict[str, int]


class Sample(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...


def take_tokens(samples: Sequence[Sample], budget: int) -> list[Sample]:
    """Samples in order until their tokens reach `budget` (the one that crosses it is the last)."""
    taken: list[Sample] = []
    total = 0
    for sample in samples:
        if total >= budget:
            break
        taken.append(sample)
        total += sample.num_tokens
    return taken


def select_arm(arm: str, samples: Sequence[Sample], is_code_math: Callable[[str], bool], budget: int) -> list[Sample]:
    """The training samples of an arm drawn from pool-first's (or, for every-turn, pool-turns') samples."""
    if arm in ("first", "every-turn"):
        return take_tokens(samples, budget)
    if arm == "twice-once":
        return take_tokens(samples, 2 * budget)
    if arm == "half-twice":
        return take_tokens(samples, budget // 2)
    if arm in ("short", "long"):  # stable: equal lengths keep the pool's order
        return take_tokens(sorted(samples, key=lambda s: s.num_tokens, reverse=arm == "long"), budget)
    if arm == "code-math":
        return take_tokens([s for s in samples if is_code_math(s.id)], budget)
    if arm == "prose":
        return take_tokens([s for s in samples if not is_code_math(s.id)], budget)
    raise ValueError(f"unknown arm {arm}; name one of {', '.join(ARMS)}")


def epochs_of(arm: str, epochs: float) -> float:
    return {"twice-once": epochs / 2, "half-twice": epochs * 2}.get(arm, epochs)


def read_conversations(data: Path) -> tuple[set[str], dict[str, int]]:
    """From a prepare folder's conversations.jsonl: the ids of the code or maths rows (CODE_OR_MATH over
    every message), and each row's user turns."""
    code_math, turns = set(), {}
    with open(data / "conversations.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if CODE_OR_MATH.search("\n".join(str(m.get("content") or "") for m in row["messages"])):
                code_math.add(row["id"])
            turns[row["id"]] = sum(1 for m in row["messages"] if m["role"] == "user")
    return code_math, turns


def compare(args: argparse.Namespace, drafters: dict[str, Path]) -> dict[str, Any]:
    """`speculators compare` of the drafters on the --compare sources against the first one, in
    compare-<sources>.json; an earlier report is reused only when it compared the same drafters the same way
    (otherwise the new comparison replaces it)."""
    out = args.work_dir / f"compare-{'+'.join(re.sub(r'[^A-Za-z0-9.-]+', '-', s) for s in args.compare)}.json"
    if not out.is_file() or not same_comparison(json.loads(out.read_text()), args, drafters):
        command = [sys.executable, "-m", "speculators.cli", "compare", "--verifier", args.verifier]
        for name, drafter in drafters.items():
            command += ["--speculator", f"{name}={drafter}"]
        for source in args.compare:
            command += ["--prompts", source]
        command += ["--baseline", next(iter(drafters)), "--max-prompts", str(args.compare_questions)]
        command += ["--max-new-tokens", str(args.compare_max_new_tokens), "--dtype", "auto", "--output", str(out)]
        print(f"\n$ speculators {' '.join(command[3:])}", flush=True)
        subprocess.run(command, check=True)
    return json.loads(out.read_text())


def same_comparison(report: dict[str, Any], args: argparse.Namespace, drafters: dict[str, Path]) -> bool:
    settings = report["settings"]
    return (
        {name: d["speculator"] for name, d in report["drafters"].items()} == {n: str(d) for n, d in drafters.items()}
        and report["baseline"] == next(iter(drafters))
        and settings["prompts"] == args.compare
        and settings["max_prompts"] == args.compare_questions
        and settings["max_new_tokens"] == args.compare_max_new_tokens
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", required=True, type=Path)
    parser.add_argument("--variant", default="smollm2_135m")
    parser.add_argument("--pool", type=int, default=1800, help="pool-first's conversations (max_samples)")
    parser.add_argument("--turns-pool", type=int, default=600, help="pool-turns' conversations (max_samples)")
    parser.add_argument("--arms", default=",".join(ARMS), help="the arms, the first one the baseline")
    parser.add_argument(
        "--budget-tokens", type=int, help="T (default: the variant's max_train_tokens, else its first max_samples)"
    )
    parser.add_argument("--compare", action="append", help="a prompt source for speculators compare (repeatable)")
    parser.add_argument("--compare-questions", type=int, default=80, help="compare: prompts per source")
    parser.add_argument("--compare-max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    args.compare = args.compare or ["mt-bench", "natural:eval"]
    arms = [arm for arm in args.arms.split(",") if arm]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown:
        parser.error(f"unknown arm {unknown[0]}; name one of {', '.join(ARMS)}")

    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.store import StoreManifest
    from speculators_assets.variants import load_variants

    base = load_variants()[args.variant]
    args.verifier = base.verifier
    work: Path = args.work_dir

    def pool(name: str, samples: int, turns: int | None) -> Pool:
        prompts = base.prompts.model_copy(update={"max_samples": samples, "max_user_turns": turns})
        started = time.perf_counter()
        store = build_store(base.model_copy(update={"prompts": prompts}), work / name)
        print(f"{name}: {store} ({(time.perf_counter() - started) / 60:.1f} min)", flush=True)
        entries = StoreManifest.read(store / "manifest.json").samples
        # Each pool's rows are told apart on their own text (every-turn rows hold more turns than first-turn ones).
        code_math, user_turns = read_conversations(work / name / "data")
        training = [e for e in entries if not e.id.startswith(VALIDATION_PREFIX)]
        return Pool(store, training, code_math, user_turns)

    pools = {"first": pool("pool-first", args.pool, 1)}
    if "every-turn" in arms:
        pools["turns"] = pool("pool-turns", args.turns_pool, None)

    first = pools["first"].training
    budget = (
        args.budget_tokens
        or base.datagen.max_train_tokens
        or sum(e.num_tokens for e in first[: base.prompts.max_samples])
    )
    epochs = float(base.training.epochs or 1)
    pool_tokens = sum(e.num_tokens for e in first)
    share = sum(e.num_tokens for e in first if e.id in pools["first"].code_math) / pool_tokens
    print(
        f"pool-first: {len(first)} samples, {pool_tokens} tokens, code and maths {share:.1%} of them; "
        f"budget T = {budget} tokens x {epochs:g} epochs",
        flush=True,
    )

    rows, drafters = [], {}
    for arm in arms:
        drawn = pools["turns" if arm == "every-turn" else "first"]
        chosen = select_arm(arm, drawn.training, drawn.code_math.__contains__, budget)
        sub = select_store(drawn.store, [e.key for e in chosen], work / f"store-{arm}")
        arm_epochs = epochs_of(arm, epochs)
        recipe = base.training.model_copy(update={"epochs": arm_epochs})
        summary = train(base.model_copy(update={"training": recipe}), sub, work / f"drafter-{arm}")
        drafters[arm] = work / f"drafter-{arm}" / "drafter"
        tokens = sum(e.num_tokens for e in chosen)
        rows.append(
            {
                "arm": arm,
                "samples": len(chosen),
                "tokens": tokens,
                "epochs": arm_epochs,
                "mean_tokens": tokens / len(chosen),
                "mean_user_turns": sum(drawn.user_turns.get(e.id, 1) for e in chosen) / len(chosen),
                "code_math_share": sum(e.num_tokens for e in chosen if e.id in drawn.code_math) / tokens,
                "train_minutes": summary.train_seconds / 60,
                "replayed": best_validation(summary, work / f"drafter-{arm}")["replayed_acceptance_length"],
            }
        )

    report = compare(args, drafters)
    (work / "data_mix.json").write_text(json.dumps({"budget_tokens": budget, "arms": rows}, indent=2) + "\n")
    print(
        f"\nvariant {args.variant} (its recipe), budget T = {budget} tokens x {epochs:g} epochs; replayed on "
        f"natural:validation; {', '.join(args.compare)} by `speculators compare` against `{arms[0]}` "
        f"(paired bootstrap 95% over questions)\n"
    )
    sets = list(report["prompt_sets"])
    print(
        "| arm | data | samples | tokens x epochs | tokens/sample | user turns | code+maths | train min | replayed | "
        + " | ".join(f"{name} AL (ratio, 95%)" for name in sets)
        + " |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---|" * len(sets))
    for row in rows:
        cells = []
        for name in sets:
            d = report["prompt_sets"][name]["drafters"][row["arm"]]
            v = d["versus_baseline"]
            cells.append(f"{d['acceptance_length']:.3f} ({v['ratio']:.3f}x, {v['low']:.3f}-{v['high']:.3f})")
        print(
            f"| {row['arm']} | {ARMS[row['arm']]} | {row['samples']} | {row['tokens']} x {row['epochs']:g} | "
            f"{row['mean_tokens']:.0f} | {row['mean_user_turns']:.2f} | {row['code_math_share']:.1%} | "
            f"{row['train_minutes']:.1f} | {row['replayed']:.3f} | " + " | ".join(cells) + " |"
        )


if __name__ == "__main__":
    main()
