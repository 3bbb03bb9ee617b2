"""The settings models are the one source of the commands' flags: every field is a flag, a model
serialised into a command line parses back to the same model, and the variants' sections are the
same fields."""

from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel

from speculators import settings
from speculators.cli import build_parser, main
from speculators.flags import flag_of, from_args, to_argv
from speculators_assets import variants

COMMANDS = {
    "prepare": settings.PrepareSettings,
    "datagen": settings.CaptureSettings,
    "train": settings.TrainConfig,
    "bench": settings.BenchSettings,
}


def changed_value(name: str, info) -> object:
    """A value of the field's type that differs from its default (and passes its constraints)."""
    kind = info.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    default = None if info.is_required() else info.get_default(call_default_factory=True)
    if kind is bool:
        return not default
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in reversed(typing.get_args(kind)) if choice != default)
    if name == "source_weights":  # one per source (the two below)
        return [3.0, 1.0]
    if name == "device":  # a device the settings accept: auto, cpu, cuda or cuda:N
        return "cuda:1"
    if name == "node_rank":  # a rank among the changed --nnodes (3), which also divide the changed TP x DP
        return 1
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        item = typing.get_args(item)[0] if typing.get_origin(item) is typing.Annotated else item
        return [f"{name}-a", f"{name}-b"] if item is str else [3, 5, 7]
    if kind is int:
        return (default or 1) + 2
    if kind is float:
        return round((default or 0.25) / 2 + 0.125, 4)
    return f"{name}-value"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_model_serialised_into_flags_parses_back_to_itself(command):
    """Every field of the model (but bench's passthrough vLLM flags) has a flag whose value survives."""
    model = COMMANDS[command]
    fields = {name: info for name, info in model.model_fields.items() if name != "vllm_args"}
    changed = model(**{name: changed_value(name, info) for name, info in fields.items()})
    argv = [command, *to_argv(changed)]
    for name, info in fields.items():
        flag = flag_of(name, info)
        assert flag in argv or flag.replace("--", "--no-", 1) in argv, f"{flag} missing from {argv}"
    args = build_parser().parse_args(argv)
    assert from_args(model, args, **({"vllm_args": []} if command == "bench" else {})) == changed


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flags_left_out_take_the_models_defaults(command):
    model = COMMANDS[command]
    required = {name: changed_value(name, info) for name, info in model.model_fields.items() if info.is_required()}
    minimal = model(**required)
    args = build_parser().parse_args([command, *to_argv(minimal)])
    assert from_args(model, args) == minimal
    flags = {token for token in to_argv(minimal) if token.startswith("--")}
    assert flags == {flag_of(name, model.model_fields[name]) for name in required}  # defaults are not repeated


def test_help_shows_the_fields_description_and_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--step-decay STEP_DECAY loss weight gamma**s of TTT step s (default 1.0)" in text
    assert "--progress, --no-progress" in text


def test_a_value_outside_a_fields_constraints_is_one_error_line(capsys):
    code = main(["train", "--store", "s", "--verifier", "v", "--output", "o", "--ttt-steps", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "error: --ttt-steps 0: input should be greater than or equal to 1"
    code = main(["bench", "--verifier", "v", "--speculator", "s", "--output", "o", "--concurrency", "2,0"])
    assert code == 2 and "--concurrency" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("section", "library"),
    [
        (variants.TrainingSettings, settings.TrainRecipe),
        (variants.BenchmarkSettings, settings.BenchProfile),
        (variants.DatagenSettings, settings.RegenerationSettings),
        (variants.DatagenSettings, settings.StoreFormat),
        (variants.PromptSettings, settings.PromptSources),
    ],
)
def test_a_variants_sections_are_the_librarys_fields(section: type[BaseModel], library: type[BaseModel]):
    """Same names, types, defaults and constraints: a default changes in one place."""
    for name, info in library.model_fields.items():
        mine = section.model_fields[name]
        if (section, name) == (variants.DatagenSettings, "regenerate"):
            assert mine.default is True and info.default is False  # the pipeline's answers are on-policy
            continue
        assert (mine.annotation, mine.metadata, mine.description) == (info.annotation, info.metadata, info.description)
        assert mine.get_default(call_default_factory=True) == info.get_default(call_default_factory=True)


def test_a_variant_section_still_rejects_unknown_keys():
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        variants.TrainingSettings(learning_rate=1)
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        variants.DatagenSettings(tensor_parallel_size=2)  # the compute profile's, not the section's
