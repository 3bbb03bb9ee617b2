"""`speculators compare`: several drafters replayed on the verifier's greedy answers count what speculative
decoding counts, and their ratios come with a paired bootstrap interval."""

from __future__ import annotations

import json

import pytest

from speculators.cli import main
from speculators.data.prompt_set import load_prompts
from speculators.data.tokenization import turn_end_ids
from speculators.errors import SpeculatorsError
from speculators.eval.compare import (
    ComparedPrompt,
    Drafter,
    Replay,
    compare_prompts,
    paired_interval,
    parse_speculators,
)
from speculators.eval.evaluate import evaluate, load_proposer, tokenize_prompts
from speculators.verifier.loading import load_verifier
from tests.conftest import write_peaked_prompts
from tests.unit.eval.test_parallel_proposer import train_peaked_peagle
from tests.unit.train.test_dflash_train import train_peaked_dflash

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_peaked_prompts(tmp_path_factory.mktemp("compare-prompts") / "prompts.jsonl")


@pytest.fixture(scope="module")
def drafters(store, peaked_verifier, trained_drafter, tmp_path_factory):
    """An EAGLE-3 (K = 3), a P-EAGLE (K = 3) and a DFlash (block 4: K = 3) drafter trained on the peaked store."""
    peagle = train_peaked_peagle(store, peaked_verifier, tmp_path_factory.mktemp("compare-peagle"))
    dflash = train_peaked_dflash(store, peaked_verifier, tmp_path_factory.mktemp("compare-dflash"))
    return {"eagle3": trained_drafter, "peagle": peagle, "dflash": dflash}


def test_replayed_counts_equal_speculative_decoding_for_every_algorithm(peaked_verifier, drafters, prompts_file):
    verifier = load_verifier(peaked_verifier, dtype="float32")
    prompts = tokenize_prompts(verifier.tokenizer, load_prompts(str(prompts_file)))
    stop_ids = turn_end_ids(verifier.tokenizer)
    loaded = [
        Drafter(name, str(path), load_proposer("speculator", verifier, str(path), "float32"), 3)
        for name, path in drafters.items()
    ]
    assert [d.proposer.name for d in loaded] == ["eagle3", "peagle", "dflash"]
    replayed, answers = compare_prompts(verifier, prompts, loaded, "peaked", NEW_TOKENS, stop_ids, progress=False)
    assert len(replayed) == len(prompts) == 8
    for drafter in loaded:
        decoded = evaluate(verifier, prompts, drafter.proposer, 3, NEW_TOKENS, progress=False)
        assert decoded.totals()["lossless"]["identical"] == 8
        for result, replay, answer in zip(decoded.results, replayed, answers, strict=True):
            counted = replay.drafters[drafter.name]
            assert (counted.steps, counted.accepted_per_position) == (
                result.steps,
                result.accepted_per_position,
            ), f"{drafter.name} on {result.id}"
            assert replay.generated == result.generated and answer == result.greedy_ids
        # Not vacuous: each trained drafter accepts drafts at every position.
        assert decoded.totals()["acceptance_length"] > 1.5 and all(decoded.totals()["accepted_per_position"])


def unit(name: str, base: tuple[int, int], other: tuple[int, int], turn: int = 1) -> ComparedPrompt:
    """A prompt of question `name` where the baseline accepted base[0] drafts in base[1] steps, `other` other."""
    result = ComparedPrompt("set", f"{name}-{turn}", name, 10, 20, turn=turn)
    result.drafters = {"base": Replay(base[1], [base[0]]), "other": Replay(other[1], [other[0]])}
    return result


def test_the_paired_interval_resamples_units_and_brackets_the_ratio():
    # The other drafter accepts more on every question: the whole interval lies above 1.
    better = [unit(f"q{i}", (5 + i, 20), (9 + i, 18)) for i in range(12)]
    low, high = paired_interval(better, "other", "base", 4000, 0)
    ratio = (1 + sum(9 + i for i in range(12)) / 216) / (1 + sum(5 + i for i in range(12)) / 240)
    assert 1 < low < ratio < high
    assert paired_interval(better, "other", "base", 4000, 0) == (low, high)  # seeded
    assert paired_interval(better, "base", "base", 500, 0) == (1.0, 1.0)
    # Better on half the questions, worse on the other half: the interval holds 1.
    mixed = [unit(f"q{i}", (10, 20), (16, 20) if i % 2 else (4, 20)) for i in range(12)]
    low, high = paired_interval(mixed, "other", "base", 4000, 0)
    assert low < 1 < high
    # Two turns of a question resample together: with every question's turns cancelling out, each draw is
    # exactly even; resampled by prompt, it would not be.
    paired = [unit("q", (10, 20), (15, 20), 1), unit("q", (10, 20), (5, 20), 2)] * 1
    paired += [unit("r", (10, 20), (5, 20), 1), unit("r", (10, 20), (15, 20), 2)]
    assert paired_interval(paired, "other", "base", 500, 0) == (1.0, 1.0)


def test_compare_cli_writes_every_drafter_on_every_source(peaked_verifier, drafters, prompts_file, tmp_path, capsys):
    out = tmp_path / "compare.json"
    args = [
        "compare",
        "--verifier",
        str(peaked_verifier),
        "--speculator",
        f"e3={drafters['eagle3']}",
        "--speculator",
        str(drafters["dflash"]),
        "--prompts",
        str(prompts_file),
        "--max-prompts",
        "3",
        "--max-new-tokens",
        "16",
        "--output",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| e3 | eagle3 | 3 |" in printed and "| drafter | dflash | 3 |" in printed
    report = json.loads(out.read_text())
    assert report["baseline"] == "e3" and list(report["drafters"]) == ["e3", "drafter"]
    summary = report["prompt_sets"][str(prompts_file)]
    assert summary["prompts"] == 3 and summary["drafters"]["e3"]["versus_baseline"]["ratio"] == 1.0
    accepted = sum(sum(p["drafters"]["drafter"]["accepted_per_position"]) for p in report["per_prompt"])
    assert accepted == summary["drafters"]["drafter"]["accepted_tokens"]
    # Mistakes: one line each, before any decoding.
    for bad, message in (
        (["--baseline", "nobody"], "--baseline 'nobody' names no drafter"),
        (["--prompts", str(prompts_file)], "is given twice"),
        (["-k", "4"], "more than DFlash drafter drafter's block holds (3)"),
    ):
        assert main([*args, *bad]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SpeculatorsError, match="drafter name 'a' is given twice"):
        parse_speculators(["a=x", "a=y"])
    assert parse_speculators(["runs/kl/drafter/", "ce=runs/ce"]) == [("drafter", "runs/kl/drafter/"), ("ce", "runs/ce")]
