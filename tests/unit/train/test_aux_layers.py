"""Capture once, train several: a store keeps the union of the aux layers its drafters read, and each
drafter reads its own among them (EAGLE-3 three, DFlash any number)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from speculators.checkpoint.validation import validate_checkpoint
from speculators.data.store import HiddenStateStore
from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import run_evaluation
from speculators.models.dflash import DFlashDrafter
from speculators.models.eagle3 import Eagle3Drafter
from speculators.settings import EvaluateSettings
from speculators.train.trainer import train
from tests.conftest import PEAKED_AUX, build_peaked_store, write_peaked_prompts
from tests.unit.train.test_train import config_for

UNION = [1, 2, 4, 6, 7]  # PEAKED_AUX [1, 4, 6] and two more, as a DFlash recipe of five layers reads


@pytest.fixture(scope="module")
def union_store(peaked_verifier, tmp_path_factory):
    return build_peaked_store(peaked_verifier, tmp_path_factory.mktemp("union-store"), aux_layer_ids=UNION)


def test_a_union_store_holds_every_layer_and_the_three_layer_stores_states_among_them(union_store, store):
    """The same samples captured with five aux layers: each shard's aux states are [T, 5, H], and those of
    the three-layer store's layers are its states exactly."""
    wide, narrow = HiddenStateStore(union_store).manifest(), HiddenStateStore(store).manifest()
    assert wide.aux_layer_ids == UNION and narrow.aux_layer_ids == PEAKED_AUX
    assert [e.id for e in wide.samples] == [e.id for e in narrow.samples]
    columns = [UNION.index(i) for i in PEAKED_AUX]
    for a, b in zip(wide.samples, narrow.samples, strict=True):
        five = HiddenStateStore(union_store).read_sample(a)
        three = HiddenStateStore(store).read_sample(b)
        assert five.aux_hidden_states.shape == (a.num_tokens, 5, 64)
        assert torch.equal(five.aux_hidden_states[:, columns], three.aux_hidden_states)
        assert torch.equal(five.target_hidden_states, three.target_hidden_states)


def test_eagle3_on_a_union_store_trains_exactly_as_on_a_store_of_its_own_three_layers(
    union_store, store, peaked_verifier, tmp_path
):
    """EAGLE-3 reads three layers: --aux-layer-ids picks them from the five, and the drafter equals the one
    trained on a store of exactly those three (same samples, same steps)."""
    settings = dict(max_steps=4, checkpoint_every=100, eval_every=100)
    train(config_for(store, peaked_verifier, tmp_path / "three", **settings))
    train(config_for(union_store, peaked_verifier, tmp_path / "five", aux_layer_ids=PEAKED_AUX, **settings))
    a = Eagle3Drafter.from_pretrained(tmp_path / "three" / "drafter", dtype="float32")
    b = Eagle3Drafter.from_pretrained(tmp_path / "five" / "drafter", dtype="float32")
    assert b.config.eagle_aux_hidden_state_layer_ids == PEAKED_AUX
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=name)
    log = [json.loads(line) for line in (tmp_path / "five" / "train_log.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (tmp_path / "three" / "train_log.jsonl").read_text().splitlines()]
    assert [e.get("loss") for e in log] == [e.get("loss") for e in reference]


def test_dflash_on_a_union_store_reads_every_layer_and_drafts_losslessly(union_store, peaked_verifier, tmp_path):
    """DFlash reads all five by default: its config names them (vLLM reads target_layer_ids a - 1), its fc
    takes 5 x the verifier width, and the evaluator captures the five live to draft."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    options = dict(algorithm="dflash", block_size=4, max_anchors=16, epochs=20, lr=1e-2, validation_share=0.0)
    train(config_for(union_store, peaked_verifier, tmp_path / "run", **options, token_budget=512, eval_every=1000))
    drafter = tmp_path / "run" / "drafter"
    config = json.loads((drafter / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == UNION
    assert SpeculatorsConfig.extract_transformers_pre_trained_config(config)["dflash_config"]["target_layer_ids"] == [
        0,
        1,
        3,
        5,
        6,
    ]
    weights = load_file(str(drafter / "model.safetensors"))
    assert weights["fc.weight"].shape == (64, 5 * 64)
    report = validate_checkpoint(drafter, verifier=str(peaked_verifier))
    assert report.ok and report.summary["aux layer ids"] == UNION, report.render()
    report = run_evaluation(
        EvaluateSettings(
            verifier=str(peaked_verifier),
            prompts=str(write_peaked_prompts(tmp_path / "prompts.jsonl")),
            speculator=str(drafter),
            max_new_tokens=24,
            dtype="float32",
        )
    )
    totals = report.totals()
    assert totals["lossless"]["identical"] == 8 and totals["acceptance_length"] > 1.0, report.render()
    assert DFlashDrafter.from_pretrained(drafter).fc.in_features == 5 * 64


def test_aux_layers_a_drafter_cannot_read_are_one_line(union_store, peaked_verifier, tmp_path, trained_drafter):
    def run(name, **overrides):
        train(config_for(union_store, peaked_verifier, tmp_path / name, max_steps=1, **overrides))

    # EAGLE-3's default, the verifier's [2, 4, 5], is not among the five: the store's layers are named
    with pytest.raises(
        SpeculatorsError, match=r"the store keeps aux layers \[1, 2, 4, 6, 7\] and eagle3 drafters read 3"
    ):
        run("default")
    with pytest.raises(SpeculatorsError, match=r"--aux-layer-ids: aux layers \[3\] are not in the store"):
        run("missing", aux_layer_ids=[1, 3, 4])
    with pytest.raises(SpeculatorsError, match=r"must be 3 distinct non-negative layer ids, e\.g\. 2,15,27 \(eagle3"):
        run("two", aux_layer_ids=[1, 2])
    with pytest.raises(SpeculatorsError, match=r"--aux-layer-ids: aux layers \[5\] are not in the store"):
        run("dflash", algorithm="dflash", aux_layer_ids=[5])
    # a warm start keeps the layers it reads: [1, 4, 6] are in the store, other --aux-layer-ids are refused
    with pytest.raises(SpeculatorsError, match=r"--aux-layer-ids \[1, 2, 4\] differs from the aux layers \[1, 4, 6\]"):
        run("warm", warm_start=str(trained_drafter), aux_layer_ids=[1, 2, 4])
    assert (
        train(
            config_for(union_store, peaked_verifier, tmp_path / "w", warm_start=str(trained_drafter), max_steps=1)
        ).steps
        == 1
    )
