"""Bad, unsafe and careless input against the command line: each case ends in one `error:` line
(exit 2) naming the value and the fix, or is accepted because it is right; nothing a user made is
deleted, nothing is half-written, and nothing is trained on that should not be.

Small on purpose: a tiny verifier, the 8-sample peaked store of conftest, tiny files, in-process CLI
calls. The classes of the battery: output folders (unsafe), non-finite and corrupted training data
(silent), store identity and aux ids (silent), environment failures (tracebacks), and two writers of
one store (concurrency). Prompt rows and images are in test_battery_data.py, checkpoint files and
variant files in test_battery_checkpoint.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from speculators.cli import main
from speculators.data.store import HiddenStateStore, SampleEntry, file_sha256
from speculators.errors import SpeculatorsError


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `speculators ARGV` in this process (argparse's exits included)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def one_error(capsys, pattern: str, *argv: str) -> str:
    """Run, expecting exit 2 with exactly one `error:` line that matches `pattern`; returns the line."""
    import re

    code, _, err = run(capsys, *argv)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir) -> Path:
    return Path(tiny_verifier_dir("llama"))


@pytest.fixture(scope="module")
def drafter(verifier, tmp_path_factory) -> Path:
    """An untrained fp32 drafter for the tiny verifier, as `speculators init` writes it."""
    output = tmp_path_factory.mktemp("battery") / "drafter"
    assert main(["init", "--verifier", str(verifier), "--output", str(output), "--dtype", "float32"]) == 0
    return output


def user_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "notes.txt").write_text("mine")
    return path


def copy_store(store: Path, target: Path) -> Path:
    shutil.copytree(store, target)
    (target / ".lock").unlink(missing_ok=True)
    return target


def train_args(store: Path, verifier: Path, output: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--store",
        str(store),
        "--verifier",
        str(verifier),
        "--output",
        str(output),
        "--epochs",
        "2",
        "--token-budget",
        "256",
        "--validation-share",
        "0",
        "--precision",
        "fp32",
        "--no-progress",
        *extra,
    ]


# ----- unsafe: a user's folders and files are never replaced unasked ---------------------------------


@pytest.mark.parametrize("command", ["convert", "init", "tiny-verifier"])
def test_an_output_folder_of_the_users_own_files_is_refused_and_kept(command, verifier, drafter, tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    argv = {
        "convert": ["convert", drafter, "--verifier", verifier, "--output", mine],
        "init": ["init", "--verifier", verifier, "--output", mine],
        "tiny-verifier": ["tiny-verifier", "--family", "llama", "--output", mine],
    }[command]
    one_error(capsys, rf"output folder {mine} holds files that are not .*\(notes\.txt\).*--overwrite", *argv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing beside it either
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    # Asked for, the folder is replaced by the artifact.
    assert run(capsys, *argv, "--overwrite")[0] == 0
    assert not (mine / "notes.txt").exists() and (mine / "config.json").is_file()


@pytest.mark.parametrize("command", ["convert", "init", "prepare", "datagen", "train"])
def test_an_output_path_that_is_a_file_is_refused_and_the_file_kept(
    command, verifier, drafter, store, tmp_path, capsys
):
    target = tmp_path / "report.txt"
    target.write_text("mine")
    argv = {
        "convert": ["convert", drafter, "--verifier", verifier, "--output", target],
        "init": ["init", "--verifier", verifier, "--output", target],
        "prepare": ["prepare", "--source", "natural:eval", "--output", target],
        "datagen": ["datagen", "--data", tmp_path / "samples.jsonl", "--verifier", verifier, "--output", target],
        "train": ["train", "--store", store, "--verifier", verifier, "--output", target],
    }[command]
    one_error(capsys, rf"{target} is a file, not a folder", *argv)
    assert target.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]


def test_an_earlier_artifact_is_replaced_but_not_one_holding_a_users_file(verifier, drafter, tmp_path, capsys):
    output = tmp_path / "checkpoint"
    assert run(capsys, "convert", drafter, "--verifier", verifier, "--output", output)[0] == 0
    first = file_sha256(output / "model.safetensors")
    assert run(capsys, "convert", drafter, "--verifier", verifier, "--output", output, "--dtype", "bfloat16")[0] == 0
    assert file_sha256(output / "model.safetensors") != first  # replaced, no --overwrite needed
    (output / "README.md").write_text("my notes on this drafter")
    one_error(
        capsys,
        r"also holds README\.md, which the new artifact does not write",
        "convert",
        drafter,
        "--verifier",
        verifier,
        "--output",
        output,
    )
    assert (output / "README.md").read_text() == "my notes on this drafter"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # no temporary or .old folder left


# ----- silent: nothing is trained on, or published, that should not be ------------------------------


def test_a_nan_in_a_shard_stops_training_naming_the_sample_and_publishes_nothing(
    store, peaked_verifier, tmp_path, capsys
):
    from safetensors.torch import load_file, save_file

    bad = copy_store(store, tmp_path / "store")
    manifest = json.loads((bad / "manifest.json").read_text())
    entry = manifest["samples"][3]
    shard = bad / entry["shard"]
    tensors = load_file(str(shard))
    tensors["aux_hidden_states"][5, 1, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"key": entry["key"]})
    entry["checksum"], entry["bytes"] = file_sha256(shard), shard.stat().st_size  # a consistent, poisoned store
    (bad / "manifest.json").write_text(json.dumps(manifest))
    output = tmp_path / "run"
    one_error(
        capsys,
        rf"training stopped at step \d+: the loss or its gradient is not finite .*sample\(s\) {entry['id']} are "
        rf"not finite: check the store with 'speculators verify-store",
        *train_args(bad, peaked_verifier, output),
    )
    assert not (output / "drafter").exists() and not (output / "summary.json").exists()
    code, out, _ = run(capsys, "verify-store", bad)  # and the store check names it
    assert code == 1 and f"sample {entry['id']} has non-finite states" in out


def test_diverging_weights_stop_training_and_an_infinite_rate_is_refused(store, peaked_verifier, tmp_path, capsys):
    for value in ("inf", "nan"):
        one_error(
            capsys,
            rf"--lr {value}: input should be a finite number",
            *train_args(store, peaked_verifier, tmp_path / "x", "--lr", value),
        )
    one_error(
        capsys,
        r"--epochs nan: input should be a finite number",
        *train_args(store, peaked_verifier, tmp_path / "x", "--epochs", "nan"),
    )
    output = tmp_path / "run"
    one_error(
        capsys,
        r"--lr 1e\+30: input should be less than or equal to 1$",
        *train_args(store, peaked_verifier, output, "--lr", "1e30"),
    )
    assert not output.exists()
    # Weights that diverge all the same: a rate the flags no longer take, given through the Python API.
    from speculators.cli import build_parser
    from speculators.errors import SpeculatorsError
    from speculators.flags import from_args
    from speculators.settings import TrainConfig
    from speculators.train.trainer import train

    config = from_args(TrainConfig, build_parser().parse_args(train_args(store, peaked_verifier, output)))
    pattern = (
        r"not finite .* on samples whose stored states are finite .*the weights diverged; lower --lr \(now 1e\+30\)"
    )
    with pytest.raises(SpeculatorsError, match=pattern):
        train(config.model_copy(update={"lr": 1e30}))
    assert not (output / "drafter").exists()


def test_a_bit_flipped_shard_is_named_before_it_is_trained_on(store, peaked_verifier, tmp_path, capsys):
    flipped = copy_store(store, tmp_path / "store")
    entry = json.loads((flipped / "manifest.json").read_text())["samples"][2]
    shard = flipped / entry["shard"]
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0x08  # one bit of the states, the safetensors header intact
    shard.write_bytes(bytes(data))
    output = tmp_path / "run"
    one_error(
        capsys,
        rf"shard {shard} of sample {entry['id']} is corrupted \(checksum mismatch\)",
        *train_args(flipped, peaked_verifier, output),
    )
    assert not (output / "drafter").exists()


# ----- a store's manifest names nothing outside the store -------------------------------------------


def edited_manifest(store: Path, index: int, **changes: str) -> dict:
    """The store's manifest with sample `index`'s entry changed (and written back); returns that entry."""
    manifest = json.loads((store / "manifest.json").read_text())
    entry = manifest["samples"][index]
    entry.update(changes)
    (store / "manifest.json").write_text(json.dumps(manifest))
    return entry


def outside_copy(store: Path, entry: dict, target: Path) -> Path:
    """A copy of the entry's shard outside the store: whole and matching the checksum, so a reader that
    followed a path to it would hash it, find it good and go on; only a path refusal stops it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(store / entry["shard"], target)
    return target


@pytest.mark.parametrize("escape", ["relative", "absolute", "another key's", "key"])
def test_a_manifest_naming_a_shard_outside_its_place_is_refused_by_every_reader(
    escape, store, peaked_verifier, tmp_path, capsys
):
    held = copy_store(store, tmp_path / "store")
    entry = json.loads((held / "manifest.json").read_text())["samples"][2]
    outside = outside_copy(held, entry, tmp_path / "elsewhere" / "states.safetensors")
    other = json.loads((held / "manifest.json").read_text())["samples"][5]
    shard, key = {
        "relative": ("../elsewhere/states.safetensors", entry["key"]),
        "absolute": (str(outside), entry["key"]),
        "another key's": (other["shard"], entry["key"]),  # inside the store, but not this key's place
        "key": ("shards/../../elsewhere/states.safetensors", "../../elsewhere/states"),
    }[escape]
    edited_manifest(held, 2, shard=shard, key=key)
    manifest = (held / "manifest.json").read_text()
    place = (
        "none: its key '.*' is not 32 hex digits"
        if escape == "key"
        else r"shards/[0-9a-f]{2}/[0-9a-f]{32}\.safetensors"
    )
    refusal = (
        rf"{held / 'manifest.json'} names shard '{re.escape(shard)}' for sample {entry['id']}, not the store's own "
        rf"place for its key \({place}\): the manifest was altered and none of its shards is opened; re-run "
        r"'speculators datagen' into a new --output \(or into this one with --overwrite\)"
    )
    for argv in (
        ["vocab", "--store", held, "--draft-vocab-size", "64"],
        ["verify-store", held],
        train_args(held, peaked_verifier, tmp_path / "run"),
    ):
        line = one_error(capsys, refusal, *argv)
        assert "delete" not in line and "checksum" not in line
    assert not (tmp_path / "run").exists() and (held / "manifest.json").read_text() == manifest
    assert (held / "draft_vocab.json").read_bytes() == (store / "draft_vocab.json").read_bytes()
    # datagen refuses it too, and replaces it with --overwrite (the shards are its own, keyed by content)
    samples = tmp_path / "samples.jsonl"
    entries = json.loads((store / "manifest.json").read_text())["samples"]
    samples.write_text("".join(HiddenSample(store, e).to_json() + "\n" for e in entries))
    argv = ["datagen", "--data", samples, "--verifier", peaked_verifier, "--output", held, "--storage", "float32"]
    one_error(capsys, refusal, *argv, "--aux-layer-ids", "1,4,6")
    assert (held / "manifest.json").read_text() == manifest
    assert run(capsys, *argv, "--aux-layer-ids", "1,4,6", "--overwrite")[0] == 0
    assert run(capsys, "verify-store", held)[0] == 0


def test_a_shard_symlinked_out_of_the_store_is_refused_and_one_inside_it_followed(
    store, peaked_verifier, tmp_path, capsys
):
    held = copy_store(store, tmp_path / "store")
    entry = json.loads((held / "manifest.json").read_text())["samples"][4]
    shard = held / entry["shard"]
    outside = outside_copy(held, entry, tmp_path / "elsewhere" / "states.safetensors")
    shard.unlink()
    shard.symlink_to(outside)  # whole, matching its checksum: only the path stops a reader
    refusal = (
        rf"shard {re.escape(str(shard))} of sample {entry['id']} resolves to {re.escape(str(outside))}, outside the "
        rf"store {held} \(a symlink out of it\); nothing outside a store is read: re-run 'speculators datagen' "
        r"into a new --output \(or into this one with --overwrite\), or link the whole store folder rather than its "
        r"shards"
    )
    one_error(capsys, refusal, "vocab", "--store", held, "--draft-vocab-size", "64")
    one_error(capsys, refusal, *train_args(held, peaked_verifier, tmp_path / "run"))
    code, out, _ = run(capsys, "verify-store", held)
    assert code == 1 and "resolves to" in out and "delete" not in out
    # A `shards` folder linked elsewhere is the same escape, for every shard.
    moved = copy_store(store, tmp_path / "moved")
    shutil.move(moved / "shards", tmp_path / "shards-elsewhere")
    (moved / "shards").symlink_to(tmp_path / "shards-elsewhere")
    one_error(
        capsys,
        r"resolves to .*shards-elsewhere.*outside the store",
        "vocab",
        "--store",
        moved,
        "--draft-vocab-size",
        "8",
    )
    # Inside the store a link is followed (the shard's checksum still checked); so is a store reached by a link.
    inside = held / "kept" / "states.safetensors"
    inside.parent.mkdir()
    shutil.move(outside, inside)
    shard.unlink()
    shard.symlink_to(inside)
    assert run(capsys, "vocab", "--store", held, "--draft-vocab-size", "128")[0] == 0
    assert (held / "draft_vocab.safetensors").read_bytes() == (store / "draft_vocab.safetensors").read_bytes()
    (tmp_path / "link").symlink_to(held)
    assert run(capsys, "verify-store", tmp_path / "link")[0] == 0


def test_vocab_checks_each_shards_checksum_before_counting_it(store, tmp_path, capsys):
    flipped = copy_store(store, tmp_path / "store")
    entry = json.loads((flipped / "manifest.json").read_text())["samples"][1]
    shard = flipped / entry["shard"]
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0x08  # a bit of the states: the tokens vocab reads are intact, the shard is not
    shard.write_bytes(bytes(data))
    vocab = (flipped / "draft_vocab.safetensors").read_bytes()
    one_error(
        capsys,
        rf"shard {shard} of sample {entry['id']} is corrupted \(checksum mismatch\); delete it and re-run "
        r"'speculators datagen' to recompute it",
        "vocab",
        "--store",
        flipped,
        "--draft-vocab-size",
        "64",
    )
    assert (flipped / "draft_vocab.safetensors").read_bytes() == vocab  # the earlier vocabulary kept


def test_vocab_on_a_store_without_supervised_tokens_is_one_line_and_writes_nothing(store, tmp_path, capsys):
    from speculators.data.conversation import VALIDATION_PREFIX

    held = copy_store(store, tmp_path / "store")
    for name in ("draft_vocab.safetensors", "draft_vocab.json"):
        (held / name).unlink()
    manifest = json.loads((held / "manifest.json").read_text())
    for entry in manifest["samples"]:  # every sample of a validation source: none to learn the vocabulary from
        entry["id"] = VALIDATION_PREFIX + entry["id"]
    (held / "manifest.json").write_text(json.dumps(manifest))
    one_error(
        capsys,
        rf"the store {held} has no supervised tokens to count \(8 samples, 8 of them validation-only, \d+ supervised "
        r"tokens in all\); run datagen on prompts with answers outside the validation sources",
        "vocab",
        "--store",
        held,
        "--draft-vocab-size",
        "64",
    )
    assert not (held / "draft_vocab.safetensors").exists() and not (held / "draft_vocab.json").exists()


def test_datagen_on_no_samples_and_train_on_no_training_samples_are_one_line_and_write_nothing(
    store, peaked_verifier, tmp_path, capsys
):
    from speculators.data.conversation import VALIDATION_PREFIX

    empty = tmp_path / "samples.jsonl"
    empty.write_text("")
    one_error(
        capsys,
        r"no samples to capture; the prepared data is empty",
        *["datagen", "--data", empty, "--verifier", peaked_verifier, "--output", tmp_path / "new"],
    )
    assert not (tmp_path / "new").exists()
    held = copy_store(store, tmp_path / "store")
    manifest = json.loads((held / "manifest.json").read_text())
    for entry in manifest["samples"]:  # every sample held out for validation: none left to train on
        entry["id"] = VALIDATION_PREFIX + entry["id"]
    (held / "manifest.json").write_text(json.dumps(manifest))
    one_error(
        capsys,
        rf"the store {held} has no training samples with supervised tokens; run datagen on more data",
        *train_args(held, peaked_verifier, tmp_path / "run"),
    )
    assert not (tmp_path / "run").exists()


def test_datagen_refuses_a_store_of_another_verifier_and_keeps_it(store, peaked_verifier, verifier, tmp_path, capsys):
    """The peaked store holds the peaked verifier's states; the plain tiny verifier is another one."""
    from speculators.data.tokenization import read_samples

    held = copy_store(store, tmp_path / "store")
    manifest = (held / "manifest.json").read_text()
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(HiddenSample(held, e).to_json() + "\n" for e in json.loads(manifest)["samples"]))
    assert len(read_samples(samples)) == 8
    argv = [
        "datagen",
        "--data",
        samples,
        "--verifier",
        verifier,
        "--output",
        held,
        "--aux-layer-ids",
        "1,4,6",
        "--storage",
        "float32",
    ]
    one_error(
        capsys,
        rf"store {held} holds the states of verifier {peaked_verifier} .* not of {verifier} .*write to "
        r"a new --output, or pass --overwrite",
        *argv,
    )
    assert (held / "manifest.json").read_text() == manifest
    # The same verifier, other aux ids: refused too; another folder: accepted.
    one_error(
        capsys,
        r"aux layers \[1, 4, 6\], float32\), not of .* aux layers \[2, 4, 6\]",
        "datagen",
        "--data",
        samples,
        "--verifier",
        peaked_verifier,
        "--output",
        held,
        "--aux-layer-ids",
        "2,4,6",
        "--storage",
        "float32",
    )
    assert run(capsys, *argv[:6], tmp_path / "other", *argv[7:])[0] == 0
    # With --overwrite the store is re-pointed; the old shards stay (content addressed).
    old_shards = {p.name for p in (held / "shards").rglob("*.safetensors")}
    assert run(capsys, *argv, "--overwrite")[0] == 0
    assert old_shards < {p.name for p in (held / "shards").rglob("*.safetensors")}


class HiddenSample:
    """A stored sample's tokens as a samples.jsonl row (the data datagen would capture again)."""

    def __init__(self, root: Path, entry: dict):
        ids, mask = HiddenStateStore(root).read_tokens(SampleEntry.model_validate(entry))
        self.row = {"id": entry["id"], "input_ids": ids.tolist(), "loss_mask": mask.int().tolist()}

    def to_json(self) -> str:
        return json.dumps(self.row)


def test_a_folder_with_another_manifest_is_not_taken_for_a_store(store, peaked_verifier, tmp_path, capsys):
    mine = user_folder(tmp_path / "mine")
    (mine / "manifest.json").write_text('{"my": "manifest"}')
    samples = tmp_path / "samples.jsonl"
    entry = json.loads((store / "manifest.json").read_text())["samples"][0]
    samples.write_text(HiddenSample(store, entry).to_json() + "\n")
    one_error(
        capsys,
        rf"{mine / 'manifest.json'} is not a version-1 hidden-state store manifest",
        "datagen",
        "--data",
        samples,
        "--verifier",
        peaked_verifier,
        "--output",
        mine,
    )
    assert (mine / "manifest.json").read_text() == '{"my": "manifest"}' and not (mine / "shards").exists()


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        # (a store keeps any number of layers: each drafter trained on it reads its own)
        (
            ["--aux-layer-ids", "2,2,5"],
            r"--aux-layer-ids \[2, 2, 5\]: aux layer ids \[2, 2, 5\] must be 1 to 64 distinct",
        ),
        (["--aux-layer-ids=-1,2,5"], r"must be 1 to 64 distinct non-negative layer ids"),
        (["--aux-layer-ids", ",".join(map(str, range(65)))], r"must be 1 to 64 distinct non-negative layer ids"),
        (["--aux-layer-ids", "1,2,x"], r"'1,2,x' is not a comma-separated list of int"),
        (["--batch-size", "0"], r"--batch-size 0: input should be greater than 0"),
        (["--device", "gpu"], r"--device 'gpu': device 'gpu' is not auto, cpu, cuda or cuda:N"),
        (["--storage", "int8"], r"invalid choice: 'int8'"),
    ],
)
def test_bad_datagen_flags_are_one_line(argv, pattern, tmp_path, capsys):
    one_error(capsys, pattern, "datagen", "--data", "d.jsonl", "--verifier", "v", "--output", tmp_path / "s", *argv)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--aux-layer-ids", "2,2,5"], r"aux layer ids \[2, 2, 5\] must be 3 distinct non-negative layer ids"),
        (["--aux-layer-ids", "1,2,50"], r"aux layer ids \[1, 2, 50\] exceed the verifier's 8 layers"),
        (["--draft-vocab-size", "0"], r"argument --draft-vocab-size: 0 must be in 1\.\.4194304"),
        (["--draft-vocab-size", "100000"], r"--draft-vocab-size 100000 must lie in 1\.\.512"),
        (["--num-layers", "0"], r"argument --num-layers: 0 must be in 1\.\.32"),
        (["--num-layers", "33"], r"argument --num-layers: 33 must be in 1\.\.32"),
        (["--speculative-tokens", "0"], r"argument --speculative-tokens: 0 must be in 1\.\.64"),
    ],
)
def test_bad_init_sizes_are_one_line(argv, pattern, verifier, tmp_path, capsys):
    one_error(capsys, pattern, "init", "--verifier", verifier, "--output", tmp_path / "d", *argv)
    assert not (tmp_path / "d").exists()


OVERSIZED_NUMBERS = [
    (["train", "--epochs", "1e308"], r"--epochs 1e\+308: input should be less than or equal to 10000$"),
    (
        ["train", "--max-steps", "1" + "0" * 12],
        r"--max-steps 1000000000000: input should be less than or equal to 1000000000",
    ),
    (
        ["train", "--token-budget", str(2**30)],
        r"--token-budget 1073741824: input should be less than or equal to 1048576",
    ),
    (["train", "--ttt-steps", "1000"], r"--ttt-steps 1000: input should be less than or equal to 64"),
    (["train", "--lr", "2"], r"--lr 2\.0: input should be less than or equal to 1$"),
    (["train", "--seed", "-1"], r"--seed -1: input should be greater than or equal to 0"),
    (
        ["vocab", "--draft-vocab-size", "1000000000000"],
        r"argument --draft-vocab-size: 1000000000000 must be in 1\.\.4194304",
    ),
    (
        ["prepare", "--max-length", "1000000000"],
        r"--max-length 1000000000: input should be less than or equal to 1048576",
    ),
    (["prepare", "--temperature", "1e308"], r"--temperature 1e\+308: input should be less than or equal to 10$"),
    (["prepare", "--nnodes", "100000"], r"--nnodes 100000: input should be less than or equal to 1024"),
    (
        ["datagen", "--batch-size", "1000000000"],
        r"--batch-size 1000000000: input should be less than or equal to 65536",
    ),
    (
        ["datagen", "--aux-layer-ids", "2,15,100000"],
        r"aux layer ids \[2, 15, 100000\] must be layer ids below 4096",
    ),
    (
        ["bench", "--concurrency", "2,1000000"],
        r"--concurrency 1000000: input should be less than or equal to 65536",
    ),
    (
        ["bench", "--guidellm-timeout", "1e300"],
        r"--guidellm-timeout 1e\+300: input should be less than or equal to 604800",
    ),
    (["follow", "--idle-timeout", "1e308"], r"argument --idle-timeout: 1e308 must be in 1\.\.604800"),
]


@pytest.mark.parametrize(("argv", "pattern"), OVERSIZED_NUMBERS, ids=[" ".join(argv) for argv, _ in OVERSIZED_NUMBERS])
def test_a_number_past_what_its_step_can_run_is_one_line_before_any_work(argv, pattern, tmp_path, capsys):
    """Every numeric flag is bounded both ways (test_flags.py checks that each has its bounds): a value
    that would overflow a step count, allocate without end or wait forever is named with its limit
    before anything is read or written."""
    command, *flags = argv
    required = {
        "train": ["--store", tmp_path / "s", "--verifier", "v", "--output", tmp_path / "o"],
        "vocab": ["--store", tmp_path / "o"],
        "prepare": ["--source", "demo:train", "--output", tmp_path / "o"],
        "datagen": ["--data", "d.jsonl", "--verifier", "v", "--output", tmp_path / "o"],
        "bench": ["--verifier", "v", "--speculator", "s", "--output", tmp_path / "o"],
        "follow": [],
    }[command]
    one_error(capsys, pattern, command, *required, *flags)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("row", "pattern"),
    [
        ({"id": "a", "input_ids": [-5, 3, 4], "loss_mask": [0, 1, 1]}, r"token id -5 is negative"),
        ({"id": "a", "input_ids": "hello", "loss_mask": [0, 1, 1, 1, 1]}, r"'input_ids' is not a non-empty list"),
        ({"id": "a", "input_ids": [1, 2.5, 3], "loss_mask": [0, 1, 1]}, r"'input_ids' is not a non-empty list"),
        ({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 2, 1]}, r"'loss_mask' is not a list of 0/1"),
        ({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}, r"3 input_ids but 2 loss_mask entries"),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, r"no string 'id'"),
        ([1, 2, 3], r"not a JSON object"),
    ],
)
def test_sample_rows_of_wrong_types_are_named_with_their_line(row, pattern, verifier, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    good = {"id": "ok", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    samples.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    one_error(
        capsys,
        rf"{samples}:2 is not a tokenized sample \({pattern}",
        "datagen",
        "--data",
        samples,
        "--verifier",
        verifier,
        "--output",
        tmp_path / "store",
    )
    assert not (tmp_path / "store" / "manifest.json").exists()


def test_a_token_id_beyond_the_verifiers_vocab_is_refused(verifier, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"id": "big", "input_ids": [1, 2, 512], "loss_mask": [0, 1, 1]}) + "\n")
    one_error(
        capsys,
        r"sample big has token ids outside the verifier vocab 0\.\.511",
        "datagen",
        "--data",
        samples,
        "--verifier",
        verifier,
        "--output",
        tmp_path / "store",
    )


# ----- tracebacks owed one line: the machine and the flags ------------------------------------------


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["datagen", "train", "prepare"])
def test_cuda_asked_for_on_a_machine_without_it_is_one_line(command, verifier, store, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    argv = {
        "datagen": ["datagen", "--data", samples, "--verifier", verifier, "--output", tmp_path / "s"],
        "train": ["train", "--store", store, "--verifier", verifier, "--output", tmp_path / "r"],
        "prepare": [
            "prepare",
            "--source",
            "natural:eval",
            "--max-samples",
            "2",
            "--output",
            tmp_path / "p",
            "--verifier",
            verifier,
            "--regenerate",
        ],
    }[command]
    one_error(
        capsys,
        r"--device cuda(:1)?: this machine has no usable CUDA GPU .*use --device cpu",
        *argv,
        "--device",
        "cuda" if command != "train" else "cuda:1",
    )


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--port", "70000"], r"argument --port: 70000 must be in 0\.\.65535"),
        (["--port", "-1"], r"argument --port: -1 must be in 0\.\.65535"),
        (["--port", "http"], r"argument --port: 'http' is not an integer"),
        (["--tensor-parallel-size", "0"], r"argument --tensor-parallel-size: 0 must be in 1\.\.1024"),
        (["--kv-cache-gib", "0"], r"argument --kv-cache-gib: 0 must be in 1\.\.4096"),
        (["--kv-cache-gib", "1e12"], r"argument --kv-cache-gib: '1e12' is not an integer"),
        (["-k", "0"], r"argument -k/--num-speculative-tokens: 0 must be in 1\.\.64"),
        (["--startup-timeout", "nan"], r"'nan' is not a finite number"),
        (["--startup-timeout", "1e308"], r"argument --startup-timeout: 1e308 must be in 1\.\.604800"),
        (["--max-model-len", str(2**31)], r"argument --max-model-len: 2147483648 must be in 1\.\.1073741824"),
    ],
)
def test_bad_serve_flags_are_one_line_before_vllm_starts(argv, pattern, verifier, capsys):
    one_error(capsys, pattern, "serve", "--verifier", verifier, *argv)


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--max-prompts", "0"], r"argument --max-prompts: 0 must be in 1\.\.1000000000"),
        (["--max-new-tokens", "-4"], r"argument --max-new-tokens: -4 must be in 1\.\.1048576"),
        (["--tie-tolerance", "1e308"], r"argument --tie-tolerance: 1e308 must be in 0\.\.10000"),
        (["--tie-tolerance", "inf"], r"'inf' is not a finite number"),
    ],
)
def test_bad_evaluate_flags_are_one_line(argv, pattern, verifier, drafter, capsys):
    one_error(capsys, pattern, "evaluate", "--verifier", verifier, "--speculator", drafter, *argv)


def unwritable(folder: Path) -> bool:
    """Make `folder` unwritable even for root (the immutable attribute), or by mode for anyone else."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    return subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0


def writable_again(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_a_folder_without_write_permission_is_one_line(verifier, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    if not unwritable(locked):
        pytest.skip("chattr +i is refused on this file system, so root can write anywhere here")
    try:
        one_error(
            capsys,
            rf"\({locked / 'data'}\); check its permissions or write elsewhere",
            "prepare",
            "--source",
            "natural:eval",
            "--output",
            locked / "data",
        )
        one_error(
            capsys,
            r"check its permissions or write elsewhere",
            "init",
            "--verifier",
            verifier,
            "--output",
            locked / "drafter",
        )
    finally:
        writable_again(locked)
    assert list(locked.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 192 KiB tmpfs: a full disk after a few shards (needs root to mount; skipped, visibly, otherwise)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()[:80]}); a full disk needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_full_disk_is_one_line_and_leaves_no_half_written_file(store, peaked_verifier, small_disk, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    entries = json.loads((store / "manifest.json").read_text())["samples"]
    samples.write_text("".join(HiddenSample(store, entry).to_json() + "\n" for entry in entries))
    output = small_disk / "store"
    one_error(
        capsys,
        r"No space left on device \(.*\.safetensors\); free some space there or write elsewhere",
        "datagen",
        "--data",
        samples,
        "--verifier",
        peaked_verifier,
        "--output",
        output,
        "--aux-layer-ids",
        "1,4,6",
        "--storage",
        "float32",
    )
    shards = list(output.rglob("*.safetensors"))
    assert 0 < len(shards) < len(entries) and not (output / "manifest.json").exists()
    assert not [p for p in output.rglob("*") if p.name.endswith(".tmp")]  # no temporary file left behind
    from safetensors.torch import load_file

    for shard in shards:  # every shard that is there is whole
        assert load_file(str(shard))["aux_hidden_states"].shape[1:] == (3, 64)


# ----- two writers of one store --------------------------------------------------------------------


def test_two_datagens_on_one_store_wait_for_each_other_and_compute_each_sample_once(store, peaked_verifier, tmp_path):
    """The test holds the store's lock while two datagen processes start: both wait; once it lets go,
    one computes every sample and the other, after waiting for that one, computes none."""
    from speculators.atomic_io import exclusive_lock

    samples = tmp_path / "samples.jsonl"
    entries = json.loads((store / "manifest.json").read_text())["samples"]
    samples.write_text("".join(HiddenSample(store, entry).to_json() + "\n" for entry in entries))
    output = tmp_path / "store"
    command = [
        sys.executable,
        "-m",
        "speculators.cli",
        "datagen",
        "--data",
        str(samples),
        "--verifier",
        str(peaked_verifier),
        "--output",
        str(output),
        "--aux-layer-ids",
        "1,4,6",
        "--storage",
        "float32",
    ]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with exclusive_lock(output, "test"):
        processes = []
        for log in logs:
            with open(log, "w") as handle:
                processes.append(subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 120
        while not all("waiting for it to finish" in log.read_text() for log in logs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), [
                log.read_text()[-500:] for log in logs
            ]
            time.sleep(0.2)
        assert "is being written by pid" in logs[0].read_text()  # the holder is named
    for process in processes:
        assert process.wait(timeout=300) == 0
    reports = [json.loads(log.read_text()[log.read_text().index("{") :]) for log in logs]
    assert sorted(report["computed"] for report in reports) == [0, len(entries)]
    assert sorted(report["reused"] for report in reports) == [0, len(entries)]
    assert HiddenStateStore(output).verify() == [] and (output / ".lock").read_text() == ""


def test_the_lock_is_released_when_its_holder_dies(tmp_path):
    """flock: a writer killed with SIGKILL leaves no stale lock."""
    from speculators.atomic_io import exclusive_lock

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from speculators.atomic_io import exclusive_lock\n"
            f"with exclusive_lock({str(tmp_path)!r}, 'x'):\n    print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
    got = threading.Event()

    def take() -> None:
        with exclusive_lock(tmp_path, "x"):
            got.set()

    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    assert not got.wait(1.0)  # held by the other process
    holder.kill()
    holder.wait()
    assert got.wait(30)


def test_verifier_sources_that_are_not_models_are_one_line(tmp_path, capsys):
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(os.urandom(4096))
    one_error(capsys, rf"verifier file {garbage} is not a GGUF file \(no GGUF magic bytes\)", "verifier", garbage)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    no_tokenizer = rf"could not load the tokenizer of verifier {config_only} .*restore its tokenizer files"
    one_error(capsys, no_tokenizer, "verifier", config_only)
    one_error(capsys, r"verifier directory .* has no config.json", "verifier", tmp_path)


def test_a_samples_path_that_is_not_a_file_and_a_report_path_that_is_a_folder(verifier, drafter, tmp_path, capsys):
    one_error(
        capsys,
        r"/dev/null is not a file; pass the samples.jsonl",
        "datagen",
        "--data",
        "/dev/null",
        "--verifier",
        verifier,
        "--output",
        tmp_path / "s",
    )
    folder = tmp_path / "report"
    folder.mkdir()
    one_error(
        capsys,
        rf"{folder} is a folder; name a file to write",
        "evaluate",
        "--verifier",
        verifier,
        "--speculator",
        drafter,
        "--max-prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--output",
        folder,
    )
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_a_damaged_resume_checkpoint_or_vocabulary_is_one_line(store, peaked_verifier, tmp_path, capsys):
    output = tmp_path / "run"
    assert run(capsys, *train_args(store, peaked_verifier, output, "--max-steps", "2"))[0] == 0
    weights = output / "checkpoints" / "last" / "optimizer.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    one_error(
        capsys,
        rf"the resumable checkpoint {output / 'checkpoints' / 'last'} cannot be resumed by this run \(.*truncated or "
        rf"corrupt.*\); pass --restart to train {output} afresh, or train into a new --output$",
        *train_args(store, peaked_verifier, output, "--max-steps", "2"),
    )
    damaged = copy_store(store, tmp_path / "store")
    (damaged / "draft_vocab.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}")
    one_error(
        capsys,
        r"draft_vocab.safetensors is damaged or not a draft vocabulary .*run 'speculators vocab",
        *train_args(damaged, peaked_verifier, tmp_path / "other"),
    )


# ----- the command line's edge: what Python, the OS or a model's own files refuse ---------------------


def broken_verifier(verifier: Path, target: Path, damage) -> Path:
    """A copy of the tiny verifier with one file damaged (`damage(folder)`)."""
    shutil.copytree(verifier, target)
    damage(target)
    return target


def edit_config(**changes):
    def damage(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))

    return damage


def replace_file(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def symlink_loop(folder: Path) -> Path:
    (folder / "loop").symlink_to(folder / "loop")
    return folder / "loop" / "data"


def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "conversations.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    )
    return path


NO_TEMPLATE = r"verifier .*no-template has no chat template .*use its instruct \(chat\) model, or put its chat template"
BAD_TEMPLATE = r"the chat template of verifier .*bad-template fails on a user turn .*fix its chat_template\.jinja"
# kind -> (argv from the tiny verifier, (the peaked store, its verifier), an untrained drafter and a tmp folder;
# the error's pattern)
EDGE_CASES = {
    "path with a NUL byte": (
        lambda v, s, d, t: ["init", "--verifier", v, "--output", f"{t}/a\x00b"],
        r"^error: --output '.*/a\\x00b' holds a NUL byte \(\\x00\), which no file name or text here can hold",
    ),
    "path that is not UTF-8": (
        lambda v, s, d, t: ["tiny-verifier", "--family", "llama", "--output", f"{t}/caf\udce9"],
        r"^error: --output '.*/caf\\xe9' is not UTF-8 text .*rename the file to a UTF-8 name",
    ),
    "prompt text that is not UTF-8": (
        lambda v, s, d, t: ["verifier", v, "--prompt", "caf\udce9 au lait"],
        r"^error: --prompt 'caf\\xe9 au lait' is not UTF-8 text",
    ),
    "name too long": (
        lambda v, s, d, t: ["prepare", "--source", "demo:eval", "--output", f"{t}/{'n' * 300}/data"],
        r"File name too long \(.*/nnnn.*\.\.\.\); a name in it is longer than the file system allows",
    ),
    "a symlink loop": (
        lambda v, s, d, t: ["prepare", "--source", "demo:eval", "--output", symlink_loop(Path(t))],
        r"Too many levels of symbolic links \(.*/loop.*\); its symbolic links point at each other",
    ),
    "overflowing float flag": (
        lambda v, s, d, t: ["train", "--store", s[0], "--verifier", s[1], "--output", f"{t}/run", "--epochs", "1e308"],
        r"^error: --epochs",  # (too large to compute with; a bound of the setting words it its own way)
    ),
    "integer flag beyond 64 bits": (
        lambda v, s, d, t: ["init", "--verifier", v, "--output", f"{t}/d", "--seed", str(10**30)],
        r"argument --seed: 10{30} is beyond 64 bits",
    ),
    "config.json of wrong types": (
        lambda v, s, d, t: ["verifier", broken_verifier(v, Path(t) / "types", edit_config(hidden_size="big"))],
        r"could not read the verifier config of '.*types': .*'hidden_size' expected int, got str",
    ),
    "config.json that is a list": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(v, Path(t) / "list", lambda f: (f / "config.json").write_text("[]")),
        ],
        r"could not read the verifier config of '.*list'",
    ),
    "config.json of an unknown model_type": (
        lambda v, s, d, t: ["verifier", broken_verifier(v, Path(t) / "unknown", edit_config(model_type="nonesuch"))],
        r"could not read the verifier config of '.*unknown': .*model type `nonesuch`",
    ),
    "config.json with a non-finite number": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(
                v,
                Path(t) / "nan",
                lambda f: (f / "config.json").write_text((f / "config.json").read_text().replace("1e-06", "NaN")),
            ),
        ],
        r"the config of verifier '.*nan' holds values that are not finite numbers \(rms_norm_eps=nan\)",
    ),
    "tokenizer.json of another shape": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(v, Path(t) / "tok", lambda f: (f / "tokenizer.json").write_text('{"model": 3}')),
        ],
        r"could not load the tokenizer of verifier .*tok \('added_tokens'\); restore its tokenizer files",
    ),
    "tokenizer.json the tokenizers parser refuses": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(
                v,
                Path(t) / "rust",
                lambda f: (f / "tokenizer.json").write_text(
                    '{"added_tokens": [], "model": {"type": "BPE", "vocab": 3}}'
                ),
            ),
        ],
        r"could not load the tokenizer of verifier .*rust \(.*expected a map.*\); restore its tokenizer files",
    ),
    "safetensors weights that are garbage": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(v, Path(t) / "weights", lambda f: (f / "model.safetensors").write_bytes(b"\xff" * 4096)),
        ],
        r"could not load verifier from .*weights: a weights file \(\*\.safetensors\) is damaged \(.*header",
    ),
    "GGUF file that is garbage": (
        lambda v, s, d, t: ["verifier", written(Path(t, "v.gguf"), b"GGUF" + b"\x07" * 300)],
        r"verifier file .*v\.gguf is not a usable GGUF model \(.*\); re-download it",
    ),
    "GGUF file cut short": (
        lambda v, s, d, t: ["verifier", written(Path(t, "cut.gguf"), b"GGUF\x03\x00\x00\x00")],
        r"verifier file .*cut\.gguf is not a usable GGUF model \(.*buffer.*\); re-download it",
    ),
    "verifier --prompt without a chat template": (
        lambda v, s, d, t: [
            "verifier",
            broken_verifier(v, Path(t) / "no-template", lambda f: (f / "chat_template.jinja").unlink()),
            "--prompt",
            "hi",
        ],
        NO_TEMPLATE,
    ),
    "prepare without a chat template": (
        lambda v, s, d, t: [
            "prepare",
            "--source",
            prompt_file(Path(t)),
            "--output",
            f"{t}/data",
            "--verifier",
            broken_verifier(v, Path(t) / "no-template", lambda f: (f / "chat_template.jinja").unlink()),
        ],
        NO_TEMPLATE,
    ),
    "evaluate without a chat template": (
        lambda v, s, d, t: [
            "evaluate",
            "--verifier",
            broken_verifier(v, Path(t) / "no-template", lambda f: (f / "chat_template.jinja").unlink()),
            "--speculator",
            d,
            "--max-prompts",
            "1",
        ],
        NO_TEMPLATE,
    ),
    "evaluate with a chat template that fails": (
        lambda v, s, d, t: [
            "evaluate",
            "--verifier",
            broken_verifier(v, Path(t) / "bad-template", lambda f: (f / "chat_template.jinja").write_text("{% for %}")),
            "--speculator",
            d,
            "--max-prompts",
            "1",
        ],
        BAD_TEMPLATE,
    ),
    "an unknown --prompts source": (
        lambda v, s, d, t: ["evaluate", "--verifier", v, "--speculator", d, "--prompts", "nonesuch:x"],
        r"prompt source nonesuch:x does not exist; pass a file, hf:<dataset> or demo:train",
    ),
}


@pytest.mark.parametrize("kind", list(EDGE_CASES))
def test_input_that_python_the_os_or_a_model_file_refuses_is_one_line(
    kind, verifier, store, peaked_verifier, drafter, tmp_path, capsys
):
    """Each kind of input that used to escape as a traceback from inside Python, torch, tokenizers,
    safetensors, the GGUF reader or a chat template: one `error:` line naming the value, exit 2."""
    make_argv, pattern = EDGE_CASES[kind]
    argv = make_argv(verifier, (store, peaked_verifier), drafter, str(tmp_path))
    one_error(capsys, pattern, *argv)
    assert not (tmp_path / "run" / "drafter").exists() and not (tmp_path / "d").exists()  # nothing was written


def test_a_real_command_line_with_bytes_that_are_not_utf8_is_one_line(tmp_path):
    """Through the real argv (bytes, decoded with surrogateescape), in a process of its own."""
    output = os.fsencode(tmp_path) + b"/caf\xe9"
    done = subprocess.run(
        [sys.executable, "-m", "speculators.cli", "tiny-verifier", "--family", "llama", "--output", output],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith(
        "/caf\\xe9' is not UTF-8 text (bytes in another encoding); pass UTF-8 text, or rename the file to a UTF-8 name"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_traceback_behind_a_translated_error_is_shown_when_asked(verifier, tmp_path, monkeypatch, capsys):
    broken = broken_verifier(verifier, tmp_path / "tok", lambda f: (f / "tokenizer.json").write_text('{"model": 3}'))
    monkeypatch.setenv("SPECULATORS_TRACEBACK", "1")
    with pytest.raises(SpeculatorsError) as raised:
        main(["verifier", str(broken)])
    assert isinstance(raised.value.__cause__, KeyError)  # what transformers raised, kept as the cause
    with pytest.raises(OSError, match="File name too long"):  # (the edge's own translations too)
        main(["init", "--verifier", str(verifier), "--output", str(tmp_path / ("n" * 300))])


def test_an_overflow_names_the_flags_whose_numbers_are_too_large():
    """What the edge prints for an OverflowError from deep inside: the flags past 2^53 or 64 bits; with
    none, the traceback stays."""
    from speculators.errors import input_error_line

    try:
        int(float("inf"))
    except OverflowError as overflow:
        error = overflow
    flags = {"epochs": 1e308, "lr": 3e-4, "seed": 0, "progress": True, "store": "s"}
    assert input_error_line(error, flags) == (
        "--epochs 1e+308: too large to compute with (cannot convert float infinity to integer); give a smaller value"
    )
    assert input_error_line(error, {"lr": 3e-4}) is None  # (no flag to blame: a bug keeps its traceback)
    assert input_error_line(ValueError("a bug"), flags) is None and input_error_line(KeyError("x"), flags) is None
