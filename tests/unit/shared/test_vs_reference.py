"""benchmarks/vs_reference.py --algorithm dflash: the one recipe reaches both trainers alike (the
reference's train CLI flags and our TrainConfig fields), so a head to head compares implementations,
not settings."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "vs_reference.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("vs_reference", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dflash_args(tmp_path, **changes):
    values = dict(
        algorithm="dflash", block_size=8, max_anchors=64, dflash_gamma=7.0, mask_token_id=16, ttt_steps=3,
        step_decay=1.0, draft_layers=2, work_dir=str(tmp_path),
    )  # fmt: skip
    return argparse.Namespace(**(values | changes))


def flag_values(argv):
    """--flag value pairs of an argv (flags without a value map to None)."""
    pairs, index = {}, 0
    while index < len(argv):
        value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
        pairs[argv[index]] = value
        index += 2 if value is not None else 1
    return pairs


def test_dflash_recipe_is_the_same_on_both_sides(bench, tmp_path):
    args = dflash_args(tmp_path)
    reference = flag_values(bench.reference_algorithm_argv(args))
    ours = bench.ours_algorithm_config(args)
    assert reference["--block-size"] == "8" and ours["block_size"] == 8
    assert reference["--max-anchors"] == "64" and ours["max_anchors"] == 64
    assert reference["--mask-token-id"] == "16" and ours["mask_token_id"] == 16
    assert reference["--dflash-decay-gamma"] == "7.0" and ours["dflash_gamma"] == 7.0
    assert reference["--per-position-loss-weight"] == "fixed-exp-decay" and ours["dflash_loss"] == "decay"
    assert reference["--draft-arch"] == "qwen3" and ours["algorithm"] == "dflash"
    assert "--ttt-steps" not in reference and "ttt_steps" not in ours
    assert bench.run_folder(args, "reference") == tmp_path / "reference-dflash"
    eagle3 = dflash_args(tmp_path, algorithm="eagle3")
    assert flag_values(bench.reference_algorithm_argv(eagle3))["--ttt-steps"] == "3"
    assert bench.run_folder(eagle3, "ours") == tmp_path / "ours"  # EAGLE-3 runs keep their folders


def test_our_dflash_fields_are_train_config_fields(bench, tmp_path):
    from speculators.settings import TrainConfig

    if "block_size" not in TrainConfig.model_fields:
        pytest.skip("our DFlash trainer's settings are not in this tree")
    ours = bench.ours_algorithm_config(dflash_args(tmp_path))
    config = TrainConfig(store="s", verifier="v", output="o", **ours)
    for name, value in ours.items():
        assert getattr(config, name) == value, name
