"""benchmarks/data_mix.py: each arm's training samples reach the same token budget by its own rule, and
its store holds exactly those samples (the measurement itself is the script's run, BENCHMARKS.md)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def data_mix():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import data_mix

        yield data_mix
    finally:
        sys.path.remove(str(BENCHMARKS))


@dataclass(frozen=True)
class Row:
    id: str
    num_tokens: int


POOL = [Row("a", 300), Row("b", 100), Row("c", 500), Row("d", 200), Row("e", 400), Row("f", 150)]
CODE = {"c", "f"}


def ids(rows):
    return [row.id for row in rows]


def test_take_tokens_stops_at_the_sample_that_crosses_the_budget(data_mix):
    assert ids(data_mix.take_tokens(POOL, 350)) == ["a", "b"]  # 300 < 350, 400 >= 350
    assert ids(data_mix.take_tokens(POOL, 400)) == ["a", "b"]
    assert ids(data_mix.take_tokens(POOL, 401)) == ["a", "b", "c"]
    assert data_mix.take_tokens(POOL, 0) == []
    assert ids(data_mix.take_tokens(POOL, 10**6)) == ids(POOL)


@pytest.mark.parametrize(
    ("arm", "expected"),
    [
        ("first", ["a", "b", "c"]),  # 900 tokens
        ("every-turn", ["a", "b", "c"]),  # (drawn from the other pool, by the same rule)
        ("twice-once", ["a", "b", "c", "d", "e"]),  # budget 1,200
        ("half-twice", ["a"]),  # budget 300: a reaches it
        ("short", ["b", "f", "d", "a"]),  # shortest first: 100 + 150 + 200 + 300
        ("long", ["c", "e"]),  # longest first: 500 + 400
        ("code-math", ["c", "f"]),  # the code rows only: 650 tokens
        ("prose", ["a", "b", "d"]),  # none of them: 600
    ],
)
def test_each_arm_draws_its_samples_by_its_rule(data_mix, arm, expected):
    assert ids(data_mix.select_arm(arm, POOL, lambda key: key in CODE, 600)) == expected


def test_an_unknown_arm_is_named(data_mix):
    with pytest.raises(ValueError, match="unknown arm sideways"):
        data_mix.select_arm("sideways", POOL, lambda key: False, 600)


def test_the_budget_arms_keep_tokens_times_epochs(data_mix):
    assert data_mix.epochs_of("twice-once", 3.0) == 1.5
    assert data_mix.epochs_of("half-twice", 3.0) == 6.0
    assert data_mix.epochs_of("long", 3.0) == 3.0


@pytest.mark.parametrize(
    ("text", "code_or_math"),
    [
        ("Write a ```python``` snippet", True),
        ("how do I fix this?\ndef f(x):\n    return x", True),
        ("What is 12 * 7?", True),
        ("Explain the SQL join types", True),
        ("Solve the equation for x", True),
        ("x = 3 + 4 * (2 - 1)", True),
        ("We met on 2023-01-05 and stayed 3 - 5 days.", False),
        ("Write a function that reads my notes", False),
        ("Tell me a story about a dog.", False),
        ("I have 3 cats and 2 dogs; name them.", False),
        ("Summarize the main ideas of this product launch", False),
    ],
)
def test_code_or_math_rows_are_told_from_the_rest(data_mix, text, code_or_math):
    assert bool(data_mix.CODE_OR_MATH.search(text)) is code_or_math


def test_a_selected_store_holds_exactly_the_chosen_samples_with_a_vocabulary_of_the_same_size(
    data_mix, store, tmp_path
):
    from speculators.data.store import StoreManifest

    manifest = StoreManifest.read(store / "manifest.json")
    chosen = [manifest.samples[1], manifest.samples[3]]
    sub = data_mix.select_store(store, [e.key for e in chosen], tmp_path / "sub")
    selected = StoreManifest.read(sub / "manifest.json")
    assert [e.key for e in selected.samples] == [e.key for e in chosen]
    assert selected.totals.tokens == sum(e.num_tokens for e in chosen)
    # Hard links to the store's shards (the store reader refuses a symlink out of a store), no others:
    assert sorted(path.name for path in (sub / "shards").rglob("*.safetensors")) == sorted(
        Path(e.shard).name for e in chosen
    )
    assert all((sub / e.shard).samefile(store / e.shard) and not (sub / e.shard).is_symlink() for e in chosen)
    vocab = json.loads((sub / "draft_vocab.json").read_text())
    assert vocab["draft_vocab_size"] == json.loads((store / "draft_vocab.json").read_text())["draft_vocab_size"]


def test_the_demo_keeps_what_the_short_arm_kept(data_mix):
    """prepare --max-train-tokens T --prefer shortest (the demo's data) keeps exactly the `short` arm's samples
    of the same pool, and `--prefer order` the `first` arm's: the study's winner is what the demo trains on."""
    from speculators.data.prepare import within_token_budget
    from speculators.data.tokenization import TokenizedSample

    samples = [TokenizedSample(row.id, [1] * row.num_tokens, [1] * row.num_tokens) for row in POOL]
    validation = TokenizedSample("validation-x", [1] * 999, [1] * 999)
    for arm, prefer in (("short", "shortest"), ("first", "order")):
        for budget in (1, 250, 450, 1000, 10_000):
            kept, report = within_token_budget([validation, *samples], budget, prefer)
            chosen = set(ids(data_mix.select_arm(arm, POOL, CODE.__contains__, budget)))
            assert [s.id for s in kept] == ["validation-x", *(row.id for row in POOL if row.id in chosen)]
            assert report["kept"] == len(chosen) and report["left_out"] == len(POOL) - len(chosen)


def test_the_pools_keep_every_sample_of_a_variant_with_a_token_budget(data_mix, monkeypatch, tmp_path):
    """The demo's datagen keeps a token budget; the pools the study (and data_scaling) draw from must not."""
    import data_scaling

    from speculators.cli import build_parser
    from speculators_assets.variants import PACKAGE_VARIANTS, load_variant

    demo = load_variant(PACKAGE_VARIANTS / "smollm2_135m.yaml")
    assert demo.datagen.max_train_tokens == 291_392
    commands: list[list[str]] = []
    monkeypatch.setattr(data_scaling, "run", lambda arguments, log: commands.append(arguments))
    data_scaling.build_store(demo, tmp_path)
    prepare = next(command for command in commands if command[0] == "prepare" and "--verifier" in command)
    settings = build_parser().parse_args(prepare)
    assert settings.max_train_tokens is None and settings.prefer == "order"
    assert demo.datagen.max_train_tokens == 291_392  # (the caller's variant is left as it was)


def test_a_comparison_is_reused_only_for_the_same_drafters_and_settings(data_mix, tmp_path):
    import argparse

    drafters = {"first": tmp_path / "drafter-first" / "drafter", "short": tmp_path / "drafter-short" / "drafter"}
    report = {
        "settings": {"prompts": ["mt-bench"], "max_prompts": 80, "max_new_tokens": 128},
        "baseline": "first",
        "drafters": {name: {"speculator": str(path)} for name, path in drafters.items()},
    }
    args = argparse.Namespace(compare=["mt-bench"], compare_questions=80, compare_max_new_tokens=128)
    assert data_mix.same_comparison(report, args, drafters)
    for change in ({"compare": ["natural:eval"]}, {"compare_questions": 40}, {"compare_max_new_tokens": 64}):
        assert not data_mix.same_comparison(report, argparse.Namespace(**{**vars(args), **change}), drafters)
    assert not data_mix.same_comparison(report, args, {"short": drafters["short"], "first": drafters["first"]})
    assert not data_mix.same_comparison(report, args, {"first": drafters["first"]})
