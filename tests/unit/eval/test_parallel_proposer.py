"""P-EAGLE drafting offline: one drafter forward per verifier step, lossless, and the same acceptance as
training's validation replays on the verifier's own answers."""

from __future__ import annotations

import pytest
import torch

from speculators.models.peagle import PEagleDrafter
from speculators.train.trainer import TrainConfig, train


def train_peaked_peagle(store, verifier, output):
    """A tiny P-EAGLE drafter (K = 3) overfit to the peaked verifier's answers, every chain trained."""
    train(
        TrainConfig(
            store=str(store),
            verifier=str(verifier),
            output=str(output),
            algorithm="peagle",
            ttt_steps=3,
            cod_ratio=1.0,
            cod_ratio_min=1.0,
            epochs=80,
            lr=1e-2,
            warmup=0.05,
            validation_share=0.0,
            token_budget=512,
            precision="fp32",
            log_every=50,
            eval_every=1000,
            checkpoint_every=1000,
            progress=False,
        )
    )
    return output / "drafter"


@pytest.fixture(scope="module")
def trained_peagle(store, peaked_verifier, tmp_path_factory):
    return train_peaked_peagle(store, peaked_verifier, tmp_path_factory.mktemp("peagle"))


def test_peagle_drafts_losslessly_with_the_replayed_acceptance(store, peaked_verifier, trained_peagle, tmp_path):
    from speculators.data.store import HiddenStateStore
    from speculators.eval.evaluate import evaluate, load_proposer
    from speculators.eval.parallel_proposer import PEagleProposer
    from speculators.train.data import PackedStore
    from speculators.train.distributed import wrap_model
    from speculators.train.objectives import objective_for
    from speculators.train.validation import greedy_in_draft_vocab, run_validation
    from speculators.train.vocab import load_draft_vocab
    from speculators.verifier.loading import VerifierHead, load_verifier
    from tests.unit.train.test_train import config_for

    verifier = load_verifier(peaked_verifier, dtype="float32")
    proposer = load_proposer("speculator", verifier, str(trained_peagle), "float32")
    assert isinstance(proposer, PEagleProposer) and proposer.name == "peagle"
    drafter = proposer.drafter
    calls = {"forwards": 0}
    drafter.register_forward_hook(lambda *_: calls.__setitem__("forwards", calls["forwards"] + 1))

    # Replay: every stored sample as validation, one pack each, every chain.
    packs = PackedStore(store, 4096, "validation", validation_share=1.0, seed=-1)
    head_source = VerifierHead.from_source(str(peaked_verifier), dtype="float32")
    selected = load_draft_vocab(store)["selected_ids"]
    head = (head_source.final_norm, head_source.lm_head_weight[selected].float())
    cpu = torch.device("cpu")
    in_vocab = greedy_in_draft_vocab(packs, head_source, selected, cpu, 0, 1)
    config = config_for(store, peaked_verifier, tmp_path, algorithm="peagle", ttt_steps=3)
    objective = objective_for(config, drafter, head)
    model = wrap_model(objective.forward_module(drafter), drafter, 1, cpu, False)
    metrics = run_validation(model, objective, packs, config, cpu, 0, 1, in_vocab)

    samples = [HiddenStateStore(store).read_sample(entry) for entry in packs.entries]
    prompts, budget = [], 0
    for index, sample in enumerate(samples):
        first = int(sample.loss_mask.nonzero()[0])
        prompts.append((f"s{index}", sample.input_ids[:first].tolist()))
        budget = max(budget, int(sample.loss_mask[first:].sum()))
    calls["forwards"] = 0
    report = evaluate(verifier, prompts, proposer, 3, max_new_tokens=budget, progress=False)
    totals = report.totals()
    assert totals["lossless"]["diverged"] == 0 and totals["lossless"]["identical"] == len(prompts)  # fp32
    assert calls["forwards"] == totals["drafts"]  # one drafter forward per verifier step
    assert totals["acceptance_length"] > 1.5
    assert len(totals["acceptance_per_position"]) == 3 and totals["acceptance_per_position"][1] > 0
    assert metrics["replayed_rounds"] == totals["drafts"]
    assert metrics["replayed_acceptance_per_position"] == pytest.approx(totals["acceptance_per_position"])
    assert metrics["replayed_acceptance_length"] == pytest.approx(totals["acceptance_length"])


def test_a_peagle_checkpoint_names_its_proposer(trained_peagle):
    from speculators.models.algorithms import algorithm_of_checkpoint

    algorithm = algorithm_of_checkpoint(trained_peagle)
    assert algorithm.parallel and algorithm.part("drafter") is PEagleDrafter


def test_speculators_evaluate_drafts_with_a_peagle_checkpoint(peaked_verifier, trained_peagle, tmp_path, capsys):
    """The command line: the checkpoint's algorithm picks the proposer; the report has K positions."""
    import json

    from speculators.cli import main
    from tests.conftest import write_peaked_prompts

    prompts = write_peaked_prompts(tmp_path / "prompts.jsonl")
    argv = ["evaluate", "--verifier", str(peaked_verifier), "--speculator", str(trained_peagle)]
    argv += ["--prompts", str(prompts), "--max-prompts", "2", "--max-new-tokens", "24", "--dtype", "float32"]
    assert main([*argv, "--output", str(tmp_path / "report.json")]) == 0
    assert "evaluating peagle (K=3)" in capsys.readouterr().out
    totals = json.loads((tmp_path / "report.json").read_text())
    assert totals["lossless"]["ok"] and len(totals["acceptance_per_position"]) == 3
    assert totals["acceptance_length"] > 1.5
