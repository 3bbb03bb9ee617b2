"""Offline evaluator: speculative decoding with transformers, acceptance statistics, the lossless check."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.cli import main
from speculators.data.prompt_set import load_prompts
from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import (
    EvaluationReport,
    Generation,
    LosslessError,
    OracleProposer,
    PromptResult,
    WrongProposer,
    compare_outputs,
    evaluate,
    greedy_generate,
    load_proposer,
    run_evaluation,
    speculative_generate,
    tokenize_prompts,
)
from speculators.settings import EvaluateSettings
from speculators.verifier.loading import load_verifier
from tests.conftest import write_peaked_prompts

K = 3


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """The prompts the peaked verifier's store (and the trained drafter) were built from."""
    return write_peaked_prompts(tmp_path_factory.mktemp("eval-prompts") / "prompts.jsonl")


def test_oracle_accepts_everything_and_a_wrong_proposer_nothing(peaked_verifier, prompts_file):
    verifier = load_verifier(peaked_verifier, dtype="float32")
    prompts = tokenize_prompts(verifier.tokenizer, load_prompts(str(prompts_file), 3))
    new_tokens = 25  # 1 from the prefill + 6 steps of K+1
    oracle = evaluate(verifier, prompts, OracleProposer(), K, new_tokens, stop_at_eos=False, progress=False)
    totals = oracle.totals()
    assert totals["acceptance_length"] == K + 1
    assert totals["acceptance_per_position"] == [1.0] * K
    assert totals["verifier_steps"] == 3 * 6 and totals["generated_tokens"] == 3 * new_tokens
    assert totals["lossless"] == {"identical": 3, "near_tie": 0, "diverged": 0, "ok": True}

    wrong = evaluate(
        verifier, prompts, WrongProposer(verifier.vocab_size), K, new_tokens, stop_at_eos=False, progress=False
    ).totals()
    assert wrong["acceptance_length"] == 1.0 and wrong["accepted_tokens"] == 0
    assert wrong["verifier_steps"] == 3 * (new_tokens - 1) and wrong["draft_tokens"] == K * wrong["drafts"]
    assert wrong["lossless"]["identical"] == 3


def test_lossless_for_a_trained_and_a_random_drafter_whose_acceptance_differs(
    peaked_verifier, trained_drafter, prompts_file, tmp_path
):
    random_drafter = tmp_path / "random"
    assert (
        main(
            [
                "init",
                "--verifier",
                str(peaked_verifier),
                "--output",
                str(random_drafter),
                "--draft-vocab-size",
                "128",
                "--aux-layer-ids",
                "1,4,6",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    reports = {}
    for name, speculator in (("trained", trained_drafter), ("random", random_drafter)):
        reports[name] = run_evaluation(
            EvaluateSettings(
                verifier=str(peaked_verifier),
                prompts=str(prompts_file),
                speculator=str(speculator),
                num_speculative_tokens=K,
                max_new_tokens=40,
                dtype="float32",
                output=tmp_path / f"{name}.json",
            )
        )
        # fp32: every prompt exactly as plain greedy decoding.
        assert reports[name].totals()["lossless"]["identical"] == 8, reports[name].render()
    trained, random = reports["trained"].totals(), reports["random"].totals()
    assert trained["acceptance_length"] > 2.0 > random["acceptance_length"] + 0.5
    rates = trained["acceptance_per_position"]
    assert rates[0] >= rates[1] >= rates[2] > 0  # chain acceptance can only fall along the draft
    written = json.loads((tmp_path / "trained.json").read_text())
    assert written["acceptance_length"] == pytest.approx(trained["acceptance_length"])
    assert len(written["per_prompt"]) == 8 and written["settings"]["num_speculative_tokens"] == K
    assert sum(p["accepted"] for p in written["per_prompt"]) == written["accepted_tokens"]
    assert written["tokens_per_second"]["baseline"] > 0 and written["tokens_per_second"]["speculative"] > 0


def test_bf16_divergences_are_only_near_ties(peaked_verifier, trained_drafter, prompts_file):
    report = run_evaluation(
        EvaluateSettings(
            verifier=str(peaked_verifier),
            prompts=str(prompts_file),
            speculator=str(trained_drafter),
            num_speculative_tokens=K,
            max_new_tokens=40,
            dtype="bfloat16",
        )
    )
    for result in report.results:
        assert result.comparison.status in ("identical", "near_tie"), report.render()
        if result.comparison.status == "near_tie":
            assert result.comparison.margin <= result.comparison.tolerance
    report.raise_for_divergence()


def test_a_reference_library_checkpoint_evaluates(tiny_verifier_dir, tmp_path):
    from tests.unit.checkpoint.test_convert import research_tensors, write_reference_library_checkpoint

    source = write_reference_library_checkpoint(tmp_path / "reference", research_tensors(seed=2))
    report = run_evaluation(
        EvaluateSettings(
            verifier=str(tiny_verifier_dir("llama")),
            prompts="demo:eval",
            speculator=str(source),
            max_prompts=2,
            max_new_tokens=12,
            dtype="float32",
        )
    )
    assert report.settings["num_speculative_tokens"] == 5  # the checkpoint's own K
    assert report.totals()["lossless"]["identical"] == 2 and report.totals()["drafts"] > 0


def generation(tokens, top2):
    return Generation(tokens=tokens, top2=top2, seconds=1.0)


def test_divergences_are_classified_by_the_top_two_margin():
    same = [(5, 10.0, 6, 9.0)]
    baseline = generation([5, 7], [*same, (7, 12.0, 8, 11.99)])
    assert compare_outputs(baseline, generation([5, 7], [*same, (7, 12.0, 8, 11.0)]), torch.bfloat16).status == (
        "identical"
    )
    # The speculative run picked the baseline's runner-up, 0.005 below: within 4 bf16 ulps of 12 (4 x 0.0625).
    tie = compare_outputs(baseline, generation([5, 8], [*same, (8, 12.0, 7, 11.995)]), torch.bfloat16)
    assert (tie.status, tie.position, tie.baseline_token, tie.speculative_token) == ("near_tie", 1, 7, 8)
    assert tie.margin == pytest.approx(0.005) and tie.tolerance == pytest.approx(4 * 2**-7 * 8)
    # Same gap in fp32 is far beyond rounding: a bug.
    assert compare_outputs(baseline, generation([5, 8], [*same, (8, 12.0, 7, 11.995)]), torch.float32).status == (
        "diverged"
    )
    # A token outside the baseline's top two is never a tie; an explicit tolerance overrides the default.
    assert compare_outputs(baseline, generation([5, 9], [*same, (9, 12.0, 3, 11.9)]), torch.bfloat16).status == (
        "diverged"
    )
    assert (
        compare_outputs(
            baseline, generation([5, 8], [*same, (8, 12.0, 7, 11.9)]), torch.float32, tie_tolerance=0.5
        ).status
        == "near_tie"
    )
    # Stopping early with the same tokens so far is a divergence too.
    assert compare_outputs(baseline, generation([5], same), torch.float32).status == "diverged"


def test_a_split_among_three_tied_tokens_is_judged_by_the_other_tokens_logit():
    """bf16 rounds logits near 20 to steps of 0.125: three tokens can tie at the top, and the speculative
    decoder may pick the third, which is neither decoder's runner-up (seen on a DFlash drafter at K = 7)."""
    same = [(5, 10.0, 6, 9.0)]
    baseline = generation([5, 7], [*same, (7, 20.0, 8, 20.0)])
    baseline.candidates = [[(5, 10.0), (6, 9.0)], [(7, 20.0), (8, 20.0), (9, 20.0), (3, 19.0)]]
    speculative = generation([5, 9], [*same, (9, 20.125, 8, 20.125)])
    speculative.candidates = [[(5, 10.0), (6, 9.0)], [(9, 20.125), (8, 20.125), (7, 20.0), (3, 19.0)]]
    split = compare_outputs(baseline, speculative, torch.bfloat16)
    assert (split.status, split.position, split.baseline_token, split.speculative_token) == ("near_tie", 1, 7, 9)
    assert split.margin == 0.0 and split.tolerance == pytest.approx(4 * 2**-7 * 16)
    # One decoder's candidates suffice (here the speculative one's: the baseline's 7 lies 0.125 below its top).
    one_sided = compare_outputs(generation([5, 7], baseline.top2), speculative, torch.bfloat16)
    assert (one_sided.status, one_sided.margin) == ("near_tie", 0.125)
    # With each token a whole logit below the other decoder's top, it is a divergence.
    baseline.candidates[1][2] = (9, 19.0)
    speculative.candidates[1][2] = (7, 19.125)
    far = compare_outputs(baseline, speculative, torch.bfloat16)
    assert (far.status, far.margin) == ("diverged", 1.0)
    # Neither decoder kept the other's token (it lies below every kept logit): nothing explains the split.
    speculative.candidates = []
    assert compare_outputs(generation([5, 7], baseline.top2), speculative, torch.bfloat16).status == "diverged"


def test_decoders_keep_their_largest_logits_for_the_judge(peaked_verifier):
    """greedy_generate and speculative_generate record top_candidates for every token they output."""
    from speculators.eval.lossless import TIE_CANDIDATES

    verifier = load_verifier(str(peaked_verifier), dtype="float32")
    baseline = greedy_generate(verifier, [1, 2, 3, 4], 6, set())
    assert len(baseline.candidates) == len(baseline.tokens) == 6
    for token, row, top2 in zip(baseline.tokens, baseline.candidates, baseline.top2, strict=True):
        assert len(row) == TIE_CANDIDATES and row[0] == (token, top2[1])
        assert [logit for _, logit in row] == sorted((logit for _, logit in row), reverse=True)
    # The speculative decoder keeps one row per output token too, from its K+1-token passes: the same ids.
    speculative = speculative_generate(verifier, [1, 2, 3, 4], OracleProposer(), 3, 6, set(), baseline.tokens)
    assert speculative.tokens == baseline.tokens and speculative.steps < 6
    ids = [[[i for i, _ in row] for row in g.candidates] for g in (baseline, speculative)]
    assert ids[0] == ids[1]


def test_a_real_divergence_is_an_error_naming_prompt_and_position():
    baseline = generation([5, 7], [(5, 10.0, 6, 9.0), (7, 12.0, 8, 11.0)])
    speculative = generation([5, 9], [(5, 10.0, 6, 9.0), (9, 12.0, 7, 11.0)])
    report = EvaluationReport(settings={"num_speculative_tokens": K, "max_new_tokens": 2, "proposer": "eagle3"})
    report.results.append(
        PromptResult("p-17", 4, 2, 1, 1, 0, 1.0, 1.0, [0] * K, compare_outputs(baseline, speculative, torch.float32))
    )
    assert not report.totals()["lossless"]["ok"]
    with pytest.raises(LosslessError, match="prompt p-17 at generated token 1"):
        report.raise_for_divergence()


def test_evaluate_cli_and_its_errors(
    peaked_verifier, tiny_verifier_dir, trained_drafter, prompts_file, tmp_path, capsys
):
    out = tmp_path / "report.json"
    args = ["--prompts", str(prompts_file), "--max-prompts", "2", "--max-new-tokens", "16", "--output", str(out)]
    assert main(["evaluate", "--verifier", str(peaked_verifier), "--speculator", str(trained_drafter), *args]) == 0
    printed = capsys.readouterr().out
    assert "acceptance length" in printed and "lossless: 2 identical" in printed
    assert json.loads(out.read_text())["prompts"] == 2
    # A drafter for another verifier (vocab 512 vs the peaked one's): one clear sentence.
    from speculators.verifier.tiny import make_tiny_verifier

    other = make_tiny_verifier("llama", tmp_path / "other", vocab_size=1024)
    assert main(["evaluate", "--verifier", str(other), "--speculator", str(trained_drafter), "--max-prompts", "1"]) == 2
    assert "does not fit verifier" in capsys.readouterr().err
    verifier = load_verifier(peaked_verifier, dtype="float32")
    with pytest.raises(SpeculatorsError, match="needs a speculator checkpoint"):
        load_proposer("eagle3", verifier, None, "float32")
    unusable = tmp_path / "unusable.jsonl"
    unusable.write_text('{"title": "no prompt here"}\n')
    with pytest.raises(SpeculatorsError, match=r"gave no usable prompts .*rejected 1"):
        load_prompts(str(unusable))
