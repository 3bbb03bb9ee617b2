"""DFlash training: anchors, slot weights, the run (checkpoint, resume), and offline drafting with the result."""

from __future__ import annotations

import json
import math

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import run_evaluation
from speculators.models.dflash import DFlashDrafter
from speculators.settings import EvaluateSettings
from speculators.train.dflash_objective import draw_anchors, scorable_anchors, slot_weights
from speculators.train.trainer import train
from tests.conftest import write_peaked_prompts
from tests.unit.train.test_train import config_for, interrupt_at_checkpoint


def test_anchors_are_the_indices_whose_block_has_a_scored_target_in_their_document():
    #            index: 0  1  2  3  4  5  6  7
    loss_mask = torch.tensor([[0, 0, 0, 1, 0, 0, 0, 1]], dtype=torch.bool)
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    # K = 3: anchor a scores targets a, a+1, a+2 (same document)
    assert scorable_anchors(loss_mask, documents, 3).nonzero().flatten().tolist() == [1, 2, 3, 5, 6, 7]
    drawn = draw_anchors(loss_mask, documents, 3, 4, seed=7)
    assert drawn.tolist() == sorted(drawn.tolist()) and len(drawn) == 4
    assert set(drawn.tolist()) <= {1, 2, 3, 5, 6, 7}
    assert torch.equal(drawn, draw_anchors(loss_mask, documents, 3, 4, seed=7))  # a resumed run draws alike
    assert not all(torch.equal(drawn, draw_anchors(loss_mask, documents, 3, 4, seed=s)) for s in range(8, 12))


def test_slot_weights_are_the_published_decay_and_d_pace():
    scored = torch.tensor([[True, True, True], [True, False, True]])
    decay = slot_weights(torch.zeros(2, 3), scored, "decay", 4.0)
    torch.testing.assert_close(decay[0], torch.tensor([1.0, math.exp(-1 / 4), math.exp(-2 / 4)]))
    assert decay[1, 1] == 0
    # D-PACE: confidence q = exp(-CE), smoothed s = 0.5 q + 0.5, weight_k = sum_{j >= k} prod_{i <= j} s_i
    cross_entropy = torch.tensor([[0.0, math.log(2), math.log(4)], [0.0, 5.0, math.log(2)]])
    s = [1.0, 0.75, 0.625]
    prefix = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    expected = torch.tensor([sum(prefix), prefix[1] + prefix[2], prefix[2]])
    torch.testing.assert_close(slot_weights(cross_entropy, scored, "dpace", 4.0)[0], expected)
    # an unscored slot weighs nothing and passes confidence 1 on
    second = [1.0, 1.0, 0.75]
    torch.testing.assert_close(
        slot_weights(cross_entropy, scored, "dpace", 4.0)[1], torch.tensor([second[0] + second[2], 0.0, second[2]])
    )


def test_dflash_trains_and_a_resumed_run_equals_an_uninterrupted_one(store, peaked_verifier, tmp_path):
    """Random anchors (16 of each pack's) seeded by the pack's place in the run: a run stopped after its
    step-4 checkpoint and resumed ends with the weights of one that ran straight through."""
    settings = dict(algorithm="dflash", block_size=4, max_anchors=16, max_steps=8, checkpoint_every=4)
    summary = train(config_for(store, peaked_verifier, tmp_path / "reference", **settings))
    assert summary.steps == 8
    resumed = config_for(store, peaked_verifier, tmp_path / "resumed", **settings)
    interrupt_at_checkpoint(resumed, 4)
    assert train(resumed).steps == 8
    a = DFlashDrafter.from_pretrained(tmp_path / "reference" / "checkpoints" / "last" / "drafter").state_dict()
    b = DFlashDrafter.from_pretrained(tmp_path / "resumed" / "checkpoints" / "last" / "drafter").state_dict()
    assert a.keys() == b.keys() and "mask_embedding" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    config = json.loads((tmp_path / "reference" / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["aux_hidden_state_layer_ids"] == [1, 4, 6]  # the store's
    assert config["mask_token_id"] == 1  # the tiny Llama's <|end_of_text|>: its template never writes it
    log = [json.loads(line) for line in (tmp_path / "reference" / "train_log.jsonl").read_text().splitlines()]
    validations = [entry for entry in log if "replayed_acceptance_length" in json.dumps(entry)]
    assert validations, "validation reports the replayed acceptance"


def train_peaked_dflash(store, verifier, output):
    """A tiny DFlash drafter (block 4: K = 3) overfit to the peaked verifier's answers."""
    train(
        config_for(
            store,
            verifier,
            output,
            algorithm="dflash",
            block_size=4,
            epochs=80,
            lr=1e-2,
            warmup=0.05,
            validation_share=0.0,
            token_budget=512,
            log_every=50,
            eval_every=1000,
            checkpoint_every=1000,
        )
    )
    return output / "drafter"


@pytest.fixture(scope="module")
def trained_dflash(store, peaked_verifier, tmp_path_factory):
    return train_peaked_dflash(store, peaked_verifier, tmp_path_factory.mktemp("dflash-run"))


def test_a_trained_dflash_drafter_is_lossless_offline_with_acceptance_above_one(
    trained_dflash, peaked_verifier, tmp_path
):
    prompts = write_peaked_prompts(tmp_path / "prompts.jsonl")
    report = run_evaluation(
        EvaluateSettings(
            verifier=str(peaked_verifier),
            prompts=str(prompts),
            speculator=str(trained_dflash),
            max_new_tokens=40,
            dtype="float32",
        )
    )
    totals = report.totals()
    assert totals["lossless"]["identical"] == 8, report.render()
    assert totals["acceptance_length"] > 2.0, report.render()
    assert len(totals["acceptance_per_position"]) == 3  # K from the checkpoint: block size - 1


def test_dflash_settings_that_cannot_work_are_one_line(store, peaked_verifier, tmp_path, trained_dflash):
    with pytest.raises(SpeculatorsError, match="mask_token_id 600 is outside the verifier vocabulary of 512"):
        train(config_for(store, peaked_verifier, tmp_path / "a", algorithm="dflash", mask_token_id=600, max_steps=1))
    with pytest.raises(
        SpeculatorsError,
        match="is a dflash drafter, and --algorithm eagle3 starts from eagle3 drafters; pass --algorithm dflash",
    ):
        train(config_for(store, peaked_verifier, tmp_path / "b", warm_start=str(trained_dflash), max_steps=1))
    dpace = train(
        config_for(store, peaked_verifier, tmp_path / "d", algorithm="dflash", dflash_loss="dpace", max_steps=2)
    )
    assert dpace.steps == 2 and all(math.isfinite(value) for value in dpace.final_train["loss"])
    with pytest.raises(ValueError, match="--block-size 5 does not hold the bonus token and --speculative-tokens 3"):
        config_for(store, peaked_verifier, tmp_path / "c", algorithm="dflash", block_size=5, speculative_tokens=3)
    # --fc-norm would train the same weights (a dflash drafter has no aux-state norm): refused, not ignored.
    with pytest.raises(ValueError, match="a dflash drafter has none; drop --fc-norm"):
        config_for(store, peaked_verifier, tmp_path / "e", algorithm="dflash", fc_norm=True)
    assert config_for(store, peaked_verifier, tmp_path / "f", algorithm="peagle", fc_norm=True).fc_norm


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_dflash_on_two_cpu_processes_equals_one_process(store, peaked_verifier, tmp_path, sharding):
    """torchrun with 2 ranks (gloo): DDP and FSDP2 train the DFlash drafter as one process with the same global
    batch does (the anchors are drawn by each pack's place in the run, so every rank draws what one process
    drew for that pack). Under FSDP2 each layer projects its own context keys/values inside its forward."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from speculators.flags import to_argv
    from tests.unit.train.test_train import ROOT

    settings = dict(algorithm="dflash", block_size=4, max_anchors=16, max_steps=6)
    train(config_for(store, peaked_verifier, tmp_path / "single", grad_accumulation=2, **settings))
    on_two = config_for(store, peaked_verifier, tmp_path / sharding, fsdp=sharding == "fsdp", **settings)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "speculators.cli", "train", *to_argv(on_two)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    multi = json.loads((tmp_path / sharding / "summary.json").read_text())
    assert multi["world_size"] == 2 and multi["train_tokens"] == single["train_tokens"]
    a = DFlashDrafter.from_pretrained(tmp_path / "single" / "checkpoints" / "last" / "drafter").state_dict()
    b = DFlashDrafter.from_pretrained(tmp_path / sharding / "checkpoints" / "last" / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)


def test_validation_replay_equals_offline_decoding_with_the_same_dflash_drafter(
    trained_dflash, store, peaked_verifier, tmp_path
):
    """The validation pass anchors a block at every index and replays decoding from the slots' hits; on the
    store's own greedy answers it counts the rounds and per-position acceptances `speculators evaluate`
    counts when DFlashProposer decodes those prompts with the same drafter (fp32): the training forward
    and the inference forward draft alike."""
    from speculators.data.store import HiddenStateStore
    from speculators.data.tokenization import turn_end_ids
    from speculators.eval.block_proposer import DFlashProposer
    from speculators.eval.evaluate import evaluate
    from speculators.train.data import PackedStore
    from speculators.train.distributed import wrap_model
    from speculators.train.objectives import objective_for
    from speculators.train.validation import greedy_in_draft_vocab, run_validation
    from speculators.train.vocab import load_draft_vocab
    from speculators.verifier.loading import VerifierHead, load_verifier

    verifier = load_verifier(peaked_verifier, dtype="float32")
    drafter = DFlashDrafter.from_pretrained(
        trained_dflash, verifier_embeddings=verifier.embedding_weight, dtype="float32"
    ).eval()
    k = drafter.config.speculative_tokens
    packs = PackedStore(store, 4096, "validation", validation_share=1.0, seed=-1)
    head_source = VerifierHead.from_source(str(peaked_verifier), dtype="float32")
    selected = load_draft_vocab(store)["selected_ids"]
    head = (head_source.final_norm, head_source.lm_head_weight[selected].float())
    cpu = torch.device("cpu")
    in_vocab = greedy_in_draft_vocab(packs, head_source, selected, cpu, 0, 1)
    config = config_for(store, peaked_verifier, tmp_path, algorithm="dflash", block_size=k + 1)
    objective = objective_for(config, drafter, head)
    model = wrap_model(objective.forward_module(drafter), drafter, 1, cpu, False)
    metrics = run_validation(model, objective, packs, config, cpu, 0, 1, in_vocab)

    samples = [HiddenStateStore(store).read_sample(entry) for entry in packs.entries]
    prompts, answers = [], []
    for index, sample in enumerate(samples):
        first = int(sample.loss_mask.nonzero()[0])
        prompts.append((f"s{index}", sample.input_ids[:first].tolist()))
        answers.append(sample.input_ids[first:][sample.loss_mask[first:]].tolist())
    budget = max(len(a) for a in answers)
    assert turn_end_ids(verifier.tokenizer)
    report = evaluate(verifier, prompts, DFlashProposer(drafter), k, max_new_tokens=budget, progress=False)
    totals = report.totals()
    assert metrics["replayed_rounds"] == totals["drafts"] > 0
    assert metrics["replayed_acceptance_per_position"] == pytest.approx(totals["acceptance_per_position"])
    assert metrics["replayed_acceptance_length"] == pytest.approx(totals["acceptance_length"])
    assert totals["acceptance_length"] > 2.0
