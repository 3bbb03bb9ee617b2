"""P-EAGLE training: the loop trains, validates (replayed parallel decoding), checkpoints and resumes it."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.checkpoint.validation import validate_checkpoint
from speculators.errors import SpeculatorsError
from speculators.models.peagle import PEagleDrafter
from speculators.train.trainer import train
from tests.unit.train.test_train import config_for, interrupt_at_checkpoint


def peagle_config(store, verifier, output, **overrides):
    options = dict(algorithm="peagle", ttt_steps=3, cod_ratio=0.7, cod_ratio_min=0.3, mask_token_id=5)
    options.update(overrides)
    return config_for(store, verifier, output, **options)


def test_peagle_trains_validates_and_writes_a_peagle_checkpoint(store, peaked_verifier, tmp_path):
    summary = train(peagle_config(store, peaked_verifier, tmp_path / "run", max_steps=12, lr=1e-2))
    drafter = PEagleDrafter.from_pretrained(tmp_path / "run" / "drafter", dtype="float32")
    assert drafter.config.mask_token_id == 5 and drafter.config.speculative_tokens == 3
    assert drafter.mask_hidden.shape == (1, 1, 3 * 64)
    config = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    report = validate_checkpoint(tmp_path / "run" / "drafter", verifier=str(peaked_verifier))
    assert report.ok, report
    rows = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    validations = [row for row in rows if row["event"] == "validation"]
    assert validations and len(validations[-1]["replayed_acceptance_per_position"]) == 3
    assert len(summary.final_train["loss"]) == 3  # one per depth
    trains = [row for row in rows if row["event"] == "train"]
    assert sum(trains[-1]["loss"]) < sum(trains[0]["loss"])


def test_a_resumed_peagle_run_equals_an_uninterrupted_one(store, peaked_verifier, tmp_path):
    """The COD draws are seeded by the run's seed and the pack, so the resumed steps draw the same chains."""
    train(peagle_config(store, peaked_verifier, tmp_path / "reference", max_steps=8))
    resumed = peagle_config(store, peaked_verifier, tmp_path / "resumed", max_steps=8)
    interrupt_at_checkpoint(resumed, 4)
    assert train(resumed).steps == 8
    a = PEagleDrafter.from_pretrained(tmp_path / "reference" / "checkpoints" / "last" / "drafter").state_dict()
    b = PEagleDrafter.from_pretrained(tmp_path / "resumed" / "checkpoints" / "last" / "drafter").state_dict()
    assert a.keys() == b.keys() and "mask_hidden" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)
    # A different seed draws other chains: the draw is not the same whatever the seed.
    train(peagle_config(store, peaked_verifier, tmp_path / "other", max_steps=8, seed=1))
    other = PEagleDrafter.from_pretrained(tmp_path / "other" / "checkpoints" / "last" / "drafter").state_dict()
    assert not torch.equal(a["mask_hidden"], other["mask_hidden"])


def test_warm_start_from_eagle3_keeps_its_layers_and_adds_mask_hidden(
    store, peaked_verifier, trained_drafter, tmp_path
):
    from speculators.models.eagle3 import Eagle3Drafter

    train(
        peagle_config(store, peaked_verifier, tmp_path / "warm", max_steps=1, lr=1e-9, warm_start=str(trained_drafter))
    )
    eagle3 = Eagle3Drafter.from_pretrained(trained_drafter, dtype="float32").state_dict()
    peagle = PEagleDrafter.from_pretrained(tmp_path / "warm" / "drafter", dtype="float32").state_dict()
    assert set(peagle) == set(eagle3) | {"mask_hidden"}
    torch.testing.assert_close(peagle["layers.0.self_attn.q_proj.weight"], eagle3["layers.0.self_attn.q_proj.weight"])


def test_peagle_refuses_fc_norm_and_a_peagle_warm_start_for_eagle3(store, peaked_verifier, tmp_path):
    with pytest.raises(SpeculatorsError, match="vLLM's P-EAGLE reader \\(update_peagle\\) drops it"):
        train(peagle_config(store, peaked_verifier, tmp_path / "fc", fc_norm=True))
    with pytest.raises(SpeculatorsError, match="mask_token_id 512 is outside the verifier vocab of 512"):
        train(peagle_config(store, peaked_verifier, tmp_path / "mask", mask_token_id=512))
    train(peagle_config(store, peaked_verifier, tmp_path / "p", max_steps=1))
    with pytest.raises(
        SpeculatorsError,
        match="is a peagle drafter, and --algorithm eagle3 starts from eagle3 drafters; pass --algorithm peagle",
    ):
        train(
            config_for(store, peaked_verifier, tmp_path / "e", max_steps=1, warm_start=str(tmp_path / "p" / "drafter"))
        )


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_cpu_processes_train_peagle_as_one_process_does(store, peaked_verifier, tmp_path, sharding):
    """torchrun with 2 ranks (gloo), DDP or FSDP2, draws the same chains per pack and trains the same drafter
    as one process with the same global batch (`speculators train --algorithm peagle` on the command line)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.paths import ROOT_DIR

    options = dict(max_steps=6, grad_accumulation=2, cod_ratio=0.5, cod_ratio_min=0.25)
    train(peagle_config(store, peaked_verifier, tmp_path / "single", **options))
    flags = ["--store", str(store), "--verifier", str(peaked_verifier), "--output", str(tmp_path / sharding)]
    flags += ["--algorithm", "peagle", "--ttt-steps", "3", "--cod-ratio", "0.5", "--cod-ratio-min", "0.25"]
    flags += ["--mask-token-id", "5", "--token-budget", "128", "--lr", "2e-3", "--precision", "fp32"]
    flags += ["--max-steps", "6", "--log-every", "2", "--eval-every", "4", "--checkpoint-every", "4"]
    flags += ["--validation-share", "0.15", "--no-progress", *(["--fsdp"] if sharding == "fsdp" else [])]
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "speculators.cli", "train", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT_DIR), "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    single = json.loads((tmp_path / "single" / "summary.json").read_text())
    multi = json.loads((tmp_path / sharding / "summary.json").read_text())
    assert multi["world_size"] == 2 and multi["train_tokens"] == single["train_tokens"]
    a = PEagleDrafter.from_pretrained(tmp_path / "single" / "checkpoints" / "last" / "drafter").state_dict()
    b = PEagleDrafter.from_pretrained(tmp_path / sharding / "checkpoints" / "last" / "drafter").state_dict()
    assert "mask_hidden" in a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-5, rtol=1e-4)
