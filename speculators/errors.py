"""User-facing errors: one clear sentence naming the bad value and the fix.

Messages are bounded: a bad file can name millions of tensors or hold a megabyte-long value, and a
message that echoes all of it is no longer one line a person reads. `shorten` caps one text,
`name_some` cuts a list of names to a few examples, `CheckpointFormatError` shows its first problems.
"""

from __future__ import annotations

from collections.abc import Iterable

MAX_MESSAGE_CHARS = 300  # one problem, one value quoted in a message
MAX_NAMED = 5  # examples named from a list before "and N more"
MAX_PROBLEMS = 20  # problems a checkpoint error (and so `validate`'s report) keeps
MAX_PROBLEMS_SHOWN = 3  # problems in a CheckpointFormatError's one-line message


def shorten(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` on one line, cut to `limit` characters (with '...' where it was cut)."""
    flat = " ".join(text[: limit * 4].split())  # never scan more of a huge value than can be shown
    if len(flat) <= limit and len(text) <= limit * 4:
        return flat
    return flat[: limit - 3].rstrip() + "..."


def name_some(names: Iterable[object], limit: int = MAX_NAMED) -> str:
    """'a, b, c and 12 more': the first `limit` names of a list, each shortened, and how many more."""
    items = list(names)
    shown = ", ".join(shorten(str(name), 80) for name in items[:limit])
    more = len(items) - limit
    return f"{shown} and {more} more" if more > 0 else shown


def bounded_problems(problems: Iterable[str]) -> list[str]:
    """Each problem shortened; past MAX_PROBLEMS, one last line says how many more there were."""
    items = [shorten(problem) for problem in problems]
    if len(items) <= MAX_PROBLEMS:
        return items
    return [*items[: MAX_PROBLEMS - 1], f"and {len(items) - MAX_PROBLEMS + 1} more problems"]


class SpeculatorsError(Exception):
    """A mistake the user can fix (bad path, bad flag, inconsistent checkpoint).

    The CLI prints these as one line without a traceback; anything else is a bug.
    """


class CheckpointFormatError(SpeculatorsError):
    """A speculator checkpoint that does not follow the speculators format.

    `problems` keeps every problem (bounded: `bounded_problems`), for `speculators validate`'s report;
    the message shows the first few, so a command that refuses the checkpoint prints one short line.
    """

    def __init__(self, problems: Iterable[str], path: str | None = None):
        every = list(problems)
        self.problems = bounded_problems(every)
        where = f" {shorten(path, 200)}" if path else ""
        detail = "; ".join(self.problems[:MAX_PROBLEMS_SHOWN])
        hidden = len(every) - MAX_PROBLEMS_SHOWN
        if hidden > 0:
            detail += f"; and {hidden} more (`speculators validate` lists them)"
        super().__init__(f"checkpoint{where} is not a valid speculator: {detail}")
