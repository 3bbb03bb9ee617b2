"""Settings models as the one source of a command's flags.

A command's settings are a pydantic model (`TrainConfig`, `PrepareSettings`, `CaptureSettings`,
`BenchSettings`); its fields' names, types, defaults, constraints and descriptions make the argparse
flags (`add_flags`), the parsed flags make the model back (`from_args`), and a model becomes the
command line that reproduces it (`to_argv`: what the Dagster workload runs and prints).

Per field, `json_schema_extra` may set `flag` (the flag's name when it differs from the field's:
`sources` -> `--source`), `short` (e.g. `-k`), `repeat` (a list given by repeating the flag, not
comma-separated), `example` and `what` (of a comma-separated list, for its error), `metavar`,
`positional` (an argument without a flag: `validate CHECKPOINT`) and `parse_check` (the field's ge/le
bounds checked as argparse parses the flag, `number`'s error, rather than by the model's validation).
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from speculators.errors import INT64_MAX, INT64_MIN, SpeculatorsError, shorten


def field_extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def flag_of(name: str, info: FieldInfo) -> str:
    return "--" + str(field_extra(info).get("flag", name)).replace("_", "-")


def unwrap(annotation: Any) -> Any:
    """The type inside `X | None` and `Annotated[X, ...]`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(inner) == 1:
            annotation = inner[0]
    if typing.get_origin(annotation) is Annotated:  # e.g. Annotated[int, Field(ge=1)]: pydantic checks the bound
        annotation = typing.get_args(annotation)[0]
    return annotation


def comma_list(kind: Any, what: str, example: str) -> Any:
    """An argparse type: `2,15,27` -> [2, 15, 27], a bad list one error naming `what` and an example."""
    kind = unwrap(kind)

    def parse(text: str) -> list[Any]:
        try:
            return [kind(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"'{text}' is not a comma-separated list of {what}, e.g. {example}"
            ) from None

    return parse


def number(kind: type[int] | type[float], low: float | None = None, high: float | None = None) -> Any:
    """An argparse type: a finite number within [low, high], an integer within 64 bits, else one error
    naming the range (argparse names the flag in front of it)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"'{shorten(text, 80)}' is not {what}") from None
        if kind is int and not INT64_MIN <= value <= INT64_MAX:  # (torch and the OS take none larger)
            raise argparse.ArgumentTypeError(f"{shorten(text, 40)} is beyond 64 bits (at most {INT64_MAX:,})")
        if value != value or value in (float("inf"), float("-inf")):  # (NaN is unequal to itself)
            raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} must be {range_text(low, high)}")
        return value

    return parse


def range_text(low: float | None, high: float | None) -> str:
    """'in 1..4194304', 'at least 1' or 'at most 8': the bounds as a person reads them (4194304, not
    4.1943e+06)."""

    def text(bound: float) -> str:
        return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"

    if low is not None and high is not None:
        return f"in {text(low)}..{text(high)}"
    return f"at least {text(low)}" if low is not None else f"at most {text(high)}" if high is not None else "a number"


def is_positional(info: FieldInfo) -> bool:
    return bool(field_extra(info).get("positional"))


def bounds(info: FieldInfo) -> tuple[float | None, float | None]:
    """The field's inclusive bounds (ge, le): what `number` checks of a `parse_check` flag."""
    low = next((m.ge for m in info.metadata if hasattr(m, "ge")), None)
    high = next((m.le for m in info.metadata if hasattr(m, "le")), None)
    return low, high


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return ""
    value = info.get_default(call_default_factory=True)
    if value is None or value == [] or value is False:
        return ""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return f" (default {value})"


def fields_in_order(model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """The model's fields, required ones first (inherited fields come first in pydantic's order)."""
    fields = list(model.model_fields.items())
    return [f for f in fields if f[1].is_required()] + [f for f in fields if not f[1].is_required()]


def add_flags(parser: argparse.ArgumentParser, model: type[BaseModel], exclude: Sequence[str] = ()) -> None:
    """One flag per field of `model` (but `exclude`), with the field's default."""
    for name, info in fields_in_order(model):
        if name in exclude:
            continue
        extra = field_extra(info)
        kind = unwrap(info.annotation)
        # (a positional argument's dest is its name; required unless it has a default)
        options: dict[str, Any] = {} if is_positional(info) else {"dest": name, "required": info.is_required()}
        if not info.is_required():
            options["default"] = info.get_default(call_default_factory=True)
            if is_positional(info):
                options["nargs"] = "?"
        options["help"] = (info.description or "") + default_text(info)
        if is_positional(info):
            if extra.get("metavar"):
                options["metavar"] = extra["metavar"]
        elif kind is not bool and typing.get_origin(kind) is not Literal:
            options["metavar"] = extra.get("metavar") or flag_of(name, info)[2:].upper().replace("-", "_")
        if extra.get("parse_check"):  # (argparse names the flag in front of the error)
            options["type"] = number(kind, *bounds(info))
        elif kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            choices = typing.get_args(kind)
            options["choices"], options["type"] = choices, type(choices[0])
        elif kind is int:  # (an integer beyond 64 bits fails deep inside torch: refused as it is parsed)
            options["type"] = number(int)
        elif typing.get_origin(kind) is list:
            (item,) = typing.get_args(kind)
            if extra.get("repeat"):
                options["action"], options["type"] = "append", item
            else:
                # (argparse names the flag in front of the error)
                what = extra.get("what", unwrap(item).__name__)
                options["type"] = comma_list(item, what, extra.get("example", "2,4"))
        else:
            options["type"] = kind
        names = [extra["short"], flag_of(name, info)] if extra.get("short") else [flag_of(name, info)]
        parser.add_argument(*([name] if is_positional(info) else names), **options)


def describe(error: ValidationError, model: type[BaseModel]) -> str:
    first = error.errors()[0]
    if not first["loc"]:  # a check across fields (a model validator): its own message says it all
        return str(first["msg"]).removeprefix("Value error, ")
    name = str(first["loc"][0])
    info = model.model_fields.get(name)
    where = name if info is None else name.upper() if is_positional(info) else flag_of(name, info)
    value = first.get("input")
    message = str(first["msg"])
    # A field validator's own sentence stands as written; pydantic's built-in messages read lower-cased.
    message = message.removeprefix("Value error, ") if message.startswith("Value error, ") else message.lower()
    return f"{where} {value!r}: {message}" if value is not None else f"{where}: {message}"


def build(model: type[BaseModel], values: dict[str, Any]) -> Any:
    """`model(**values)`, its validation error as one sentence naming the flag and the bad value."""
    try:
        return model(**values)
    except ValidationError as error:
        raise SpeculatorsError(describe(error, model)) from None


def from_args(model: type[BaseModel], args: argparse.Namespace, **values: Any) -> Any:
    """The model from flags parsed with `add_flags`, `values` replacing some."""
    given = {name: getattr(args, name) for name in model.model_fields if hasattr(args, name)}
    return build(model, {**given, **values})


def to_argv(settings: BaseModel) -> list[str]:
    """The flags that rebuild `settings` through `add_flags`/`from_args`, required ones first: every
    field given when the model was made, and every other field whose value is not its default."""
    argv: list[str] = []
    fields = fields_in_order(type(settings))
    for name, info in [f for f in fields if is_positional(f[1])] + [f for f in fields if not is_positional(f[1])]:
        value = getattr(settings, name)
        default = None if info.is_required() else info.get_default(call_default_factory=True)
        if name not in settings.model_fields_set and value == default:
            continue
        if is_positional(info):  # (positional arguments first: a flag's list value may look like one)
            if value is not None:
                argv.append(str(value))
            continue
        if value is None:  # a flag cannot say None: only a field whose default is None may hold it
            if default is None:
                continue
            raise SpeculatorsError(f"{flag_of(name, info)} has no command-line form for None; leave it at its default")
        flag = flag_of(name, info)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            if field_extra(info).get("repeat"):
                for item in value:
                    argv += [flag, str(item)]
            else:
                argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv
