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
from speculators.flags import flag_of, from_args, is_positional, to_argv
from speculators_assets import variants

COMMANDS = {
    "validate": settings.ValidateSettings,
    "convert": settings.ConvertSettings,
    "verifier": settings.VerifierSettings,
    "init": settings.InitSettings,
    "tiny-verifier": settings.TinyVerifierSettings,
    "prepare": settings.PrepareSettings,
    "datagen": settings.CaptureSettings,
    "vocab": settings.VocabSettings,
    "train": settings.TrainConfig,
    "evaluate": settings.EvaluateSettings,
    "compare": settings.CompareSettings,
    "serve": settings.ServeSettings,
    "follow": settings.FollowSettings,
    "bench": settings.BenchSettings,
    "verify-store": settings.VerifyStoreSettings,
}


INTERNAL_COMMANDS = {"stream"}  # a streamed run's producer: started by its supervisor, flags --spool and --replica


def test_every_command_has_its_settings_model():
    assert set(build_parser()._subparsers._group_actions[0].choices) == set(COMMANDS) | INTERNAL_COMMANDS


def changed_value(name: str, info) -> object:
    """A value of the field's type that differs from its default (and passes its constraints)."""
    if name == "algorithm":  # one that takes the changed --fc-norm (a dflash drafter has no aux-state norm)
        return "peagle"
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
    if name == "block_size":  # DFlash's block: the bonus token and the changed --speculative-tokens (3)
        return 4
    if name == "keep":  # none, all or GiB
        return "12.5"
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
        if is_positional(info):
            assert argv[1] == str(getattr(changed, name)), f"{name} missing from {argv}"
            continue
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
    named = {name for name in required if not is_positional(model.model_fields[name])}
    assert flags == {flag_of(name, model.model_fields[name]) for name in named}  # defaults are not repeated


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


def test_serve_and_the_librarys_server_are_one_record():
    """`speculators serve`'s flags, ServerSettings and bench's servers share the fields and defaults of
    settings.Server (its engine profile is what a variant's benchmark section sets)."""
    from speculators.serving.serve import ServerSettings

    shared = set(settings.Server.model_fields)
    served = from_args(settings.ServeSettings, build_parser().parse_args(["serve"]))
    assert served.model_dump(include=shared) == ServerSettings().model_dump(include=shared)
    assert ServerSettings("v", port=0).verifier == "v" and ServerSettings(verifier=None).verifier is None
    assert set(settings.ServerProfile.model_fields) <= set(settings.BenchProfile.model_fields)
    assert set(settings.ServerLaunch.model_fields) <= set(settings.BenchSettings.model_fields)
    with pytest.raises(ValueError, match="port"):
        ServerSettings("v", port=70000)


def test_the_dtype_and_storage_tables_are_their_literal_types():
    from speculators.data.store import STORAGE_FORMATS
    from speculators.models.config import DTYPE_NAMES
    from speculators.models.eagle3 import TORCH_DTYPES
    from speculators.precision import COMPUTE_DTYPES
    from speculators.verifier.tiny import FAMILIES

    assert tuple(TORCH_DTYPES) == DTYPE_NAMES == typing.get_args(settings.CheckpointDtype)
    assert ("auto", *DTYPE_NAMES) == COMPUTE_DTYPES
    assert typing.get_args(settings.StorageFormat) == STORAGE_FORMATS
    assert typing.get_args(settings.TinyFamily) == FAMILIES


@pytest.mark.parametrize(
    ("argv", "name", "value"),
    [
        (["evaluate", "--verifier", "v", "--no-stop-at-eos"], "stop_at_eos", False),
        (["evaluate", "--verifier", "v"], "stop_at_eos", True),
        (["validate", "c", "--json"], "as_json", True),
        (["serve", "--enforce-eager", "--quiet"], "quiet", True),
        (["serve", "--log-file", "l.log"], "log_path", "l.log"),
        (["convert", "s", "--verifier", "v", "--output", "o", "--keep-embeddings"], "keep_embeddings", True),
        (["convert", "s", "--verifier", "v", "--output", "o", "--no-fc-norm"], "fc_norm", False),
        (["init", "--verifier", "v", "--output", "o", "--overwrite"], "overwrite", True),
        (["tiny-verifier", "--family", "llama", "--output", "o", "--mistral-format"], "mistral_format", True),
        (["verify-store", "s"], "store", "s"),
    ],
)
def test_the_flags_spellings_keep_their_meaning(argv, name, value):
    model = COMMANDS[argv[0]]
    assert getattr(from_args(model, build_parser().parse_args(argv)), name) == value


def test_a_bound_checked_as_the_flag_is_parsed_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--verifier", "v", "--speculator", "s", "--output", "o", "-k", "0"])
    assert "argument -k/--num-speculative-tokens: 0 must be in 1..64" in capsys.readouterr().err


def settings_models() -> list[type[BaseModel]]:
    """Every settings model of the library and every model of a variant file."""
    library = [
        kind
        for kind in vars(settings).values()
        if isinstance(kind, type) and issubclass(kind, BaseModel) and kind.__module__ == settings.__name__
    ]
    variant = [
        kind
        for kind in vars(variants).values()
        if isinstance(kind, type) and issubclass(kind, BaseModel) and kind.__module__ == variants.__name__
    ]
    return library + variant


# Numeric fields bounded by a check of their own rather than by the field's ge/le, and that check's case.
BOUNDED_ELSEWHERE = {"aux_layer_ids": settings.aux_layer_ids_problem}


def numeric_fields(model: type[BaseModel]) -> list[tuple[str, list[object]]]:
    """(name, bound metadata) of each int or float field of `model`, or of a list of them (the item's
    own Annotated bounds count)."""
    found = []
    for name, info in model.model_fields.items():
        kind, metadata = info.annotation, list(info.metadata)
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if typing.get_origin(kind) is list:
            kind = typing.get_args(kind)[0]
        if typing.get_origin(kind) is typing.Annotated:
            kind, *extra = typing.get_args(kind)
            metadata += [m for field in extra for m in getattr(field, "metadata", [field])]
        if kind in (int, float):
            found.append((name, metadata))
    return found


@pytest.mark.parametrize("model", settings_models(), ids=lambda model: model.__name__)
def test_every_numeric_setting_has_a_lower_and_an_upper_bound(model: type[BaseModel]):
    """A flag or a variant key that takes a number is bounded both ways by what its step can run, so a
    new field without bounds fails here (`epochs: 1e308` overflowed the step count after the data step)."""
    for name, metadata in numeric_fields(model):
        if name in BOUNDED_ELSEWHERE:
            continue
        lower = [m for m in metadata if getattr(m, "ge", None) is not None or getattr(m, "gt", None) is not None]
        upper = [m for m in metadata if getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None]
        assert lower and upper, f"{model.__name__}.{name} needs ge/gt and le/lt bounds (speculators/settings.py)"


def test_the_numeric_fields_are_found_and_the_ones_bounded_elsewhere_are_bounded():
    fields = {name for model in settings_models() for name, _ in numeric_fields(model)}
    assert {"epochs", "draft_vocab_size", "gpus", "concurrency", "source_weights", "port"} <= fields
    assert set(BOUNDED_ELSEWHERE) <= fields
    for count in (3, None):  # (an EAGLE-3 drafter's three; a store's or a DFlash drafter's any number)
        assert settings.aux_layer_ids_problem([2, 15, settings.MAX_VERIFIER_LAYERS], count) == (
            f"aux layer ids [2, 15, {settings.MAX_VERIFIER_LAYERS}] must be layer ids below "
            f"{settings.MAX_VERIFIER_LAYERS}, e.g. 2,15,27"
        )
        assert settings.aux_layer_ids_problem([2, 15, settings.MAX_VERIFIER_LAYERS - 1], count) is None
    assert (
        settings.aux_layer_ids_problem([2, 15], 3)
        == "aux layer ids [2, 15] must be 3 distinct non-negative layer ids, e.g. 2,15,27"
    )
    assert settings.aux_layer_ids_problem([1, 2, 3, 4, 5], None) is None
    assert settings.aux_layer_ids_problem(list(range(settings.MAX_AUX_LAYERS + 1)), None) == (
        f"aux layer ids {list(range(settings.MAX_AUX_LAYERS + 1))} must be 1 to {settings.MAX_AUX_LAYERS} distinct "
        "non-negative layer ids, e.g. 2,15,27"
    )


def test_the_checkpoint_format_and_the_settings_share_their_size_bounds():
    from speculators.models import config

    assert (config.MAX_VOCAB_SIZE, config.MAX_WIDTH, config.MAX_DRAFT_LAYERS) == (2**22, 2**20, 32)
    assert settings.InitSettings.model_fields["draft_vocab_size"].metadata[-1].le == config.MAX_VOCAB_SIZE
    assert variants.DrafterSettings.model_fields["num_draft_layers"].metadata[-1].le == config.MAX_DRAFT_LAYERS
