"""User-facing errors: one clear sentence naming the bad value and the fix.

Messages are bounded: a bad file can name millions of tensors or hold a megabyte-long value, and a
message that echoes all of it is no longer one line a person reads. `shorten` caps one text,
`name_some` cuts a list of names to a few examples, `CheckpointFormatError` shows its first problems.

The edge of both command lines (`speculators`, `speculators-assets`) is here too: `argv_problem`
refuses text no file name or tokenizer takes before anything runs, and `input_error_line` turns the
few kinds of exception that only a user's input raises (a path the OS refuses, a NUL byte, text that
is not UTF-8, a number too large to compute with, a chat template that fails) into one line; every
other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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


# ----- the command line's edge ---------------------------------------------------------------------

# What a failed file operation asks the user to do, by errno; any other OSError is a bug and keeps its traceback.
OS_ERROR_FIXES = {
    errno.ENOSPC: "free some space there or write elsewhere",
    errno.EDQUOT: "free some space there or write elsewhere",
    errno.EACCES: "check its permissions or write elsewhere",
    errno.EPERM: "check its permissions or write elsewhere",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "it is a folder: name a file",
    errno.EEXIST: "something else already has that name: choose another",
    errno.ENAMETOOLONG: "a name in it is longer than the file system allows (255 bytes on most): choose a shorter one",
    errno.ELOOP: "its symbolic links point at each other: check the path",
}
# Integers beyond 64 bits: torch, numpy and the OS take no larger one (a seed of 10**30 fails deep inside).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A float flag past this has no exact integer (2^53), and a count or step computed from it overflows.
LARGEST_EXACT_FLOAT = 2.0**53


def os_error_of(error: BaseException, path: object = None) -> OSError | None:
    """The OSError behind a failed write: itself, or the one a Rust writer (safetensors) names only in
    its message, "...: No space left on device (os error 28)"; None for any other error."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"\(os error (\d+)\)", str(error))
    if found is None:
        return None
    number = int(found.group(1))
    return OSError(number, os.strerror(number), None if path is None else str(path))


def os_error_line(error: BaseException) -> str | None:
    """One line for a file operation that failed for a reason outside the program (a full disk, no
    permission, a name too long), naming the path; None for anything else."""
    refused = os_error_of(error)
    fix = None if refused is None else OS_ERROR_FIXES.get(refused.errno or 0)
    if refused is None or fix is None:
        return None
    path = printable(str(refused.filename), 200) if refused.filename is not None else "while writing a file"
    return f"{refused.strerror or refused} ({path}); {fix}"


def printable(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` shortened, with what a terminal cannot show written as escapes: a NUL byte as \\x00, a
    byte that was not UTF-8 (Python's surrogate escape) as \\xff, any other lone surrogate as \\udXXX."""

    def escape(char: str) -> str:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            return f"\\x{code - 0xDC00:02x}"
        if 0xD800 <= code <= 0xDFFF:
            return f"\\u{code:04x}"
        return char if char.isprintable() else f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return shorten("".join(escape(char) for char in text[: limit * 4]), limit)


def not_utf8(text: str) -> bool:
    """Whether `text` holds a lone surrogate: bytes that were not UTF-8 (an argv or file name Python
    decoded with surrogateescape), which no tokenizer, JSON writer or Rust library takes."""
    return any(0xD800 <= ord(char) <= 0xDFFF for char in text)


def argv_problem(argv: Sequence[str]) -> str | None:
    """What makes a command line unusable before it is parsed, naming the flag and the value: a NUL byte
    (no file name holds one, and the OS refuses it deep inside any command) or text that is not UTF-8
    (a file name in another encoding: safetensors, tokenizers and JSON readers refuse it halfway); None
    when every argument is text."""
    for index, argument in enumerate(argv):
        if "\x00" not in argument and not not_utf8(argument):
            continue
        if argument.startswith("--") and "=" in argument:
            flag, _, value = argument.partition("=")
        else:
            before = argv[index - 1] if index else ""
            flag, value = (before if before.startswith("-") else "the argument"), argument
        shown = printable(value, 200)
        if "\x00" in argument:
            return f"{flag} '{shown}' holds a NUL byte (\\x00), which no file name or text here can hold; remove it"
        return (
            f"{flag} '{shown}' is not UTF-8 text (bytes in another encoding); pass UTF-8 text, or rename the "
            f"file to a UTF-8 name"
        )
    return None


def number_flags(values: Mapping[str, Any]) -> dict[str, int | float]:
    """The numbers among parsed flags (argparse's `vars(args)`): flag -> value."""
    return {
        "--" + name.replace("_", "-"): value
        for name, value in values.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def overflow_line(error: OverflowError, values: Mapping[str, Any]) -> str | None:
    """An overflow names the flags whose numbers are too large to compute with (a float past 2^53, an
    integer past 64 bits); None when no flag's is (then it is a bug, or a file's number that its loader
    should have refused: its traceback says where)."""
    reason = shorten(str(error) or type(error).__name__, 120)
    huge = {
        flag: value
        for flag, value in number_flags(values).items()
        if (isinstance(value, float) and abs(value) > LARGEST_EXACT_FLOAT)
        or (isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX)
    }
    if not huge:
        return None
    named = ", ".join(f"{flag} {value:g}" for flag, value in huge.items())
    return f"{named}: too large to compute with ({reason}); give a smaller value"


def is_template_error(error: BaseException) -> bool:
    """A Jinja chat template that failed (its syntax, or a `raise_exception` in it): a verifier's file."""
    jinja = sys.modules.get("jinja2.exceptions")  # (loaded with any chat template; never imported here)
    return jinja is not None and isinstance(error, jinja.TemplateError)


def input_error_line(error: BaseException, values: Mapping[str, Any] | None = None) -> str | None:
    """One line for an exception that only the user's input raises, or None for a bug (which keeps its
    traceback). `values`: the parsed flags, for naming the one a number came from."""
    if (line := os_error_line(error)) is not None:
        return line
    if isinstance(error, ValueError) and str(error) == "embedded null byte":  # (CPython's os functions)
        return (
            "a path this command was given holds a NUL byte (\\x00), which no file name can hold; check the "
            "paths in its flags and files"
        )
    if isinstance(error, UnicodeEncodeError):
        return (
            f"the text '{printable(error.object, 120)}' is not UTF-8 (bytes in another encoding, or a lone "
            f"surrogate escape); pass UTF-8 text and UTF-8 file names"
        )
    if isinstance(error, OverflowError):
        return overflow_line(error, values or {})
    if is_template_error(error):
        return (
            f"the verifier's chat template fails ({printable(str(error) or type(error).__name__, 160)}); fix its "
            f"chat_template.jinja (or tokenizer_config.json's chat_template), or use the model's original files"
        )
    return None


def user_error_line(error: Exception, values: Mapping[str, Any] | None = None) -> str | None:
    """The one line a command line prints for `error`: a SpeculatorsError's sentence, or the line for
    an exception only the user's input raises. None where the traceback is to be shown instead: a bug,
    or, with SPECULATORS_TRACEBACK=1, any error translated from another (what raised it, and where)."""
    traceback_asked = bool(os.environ.get("SPECULATORS_TRACEBACK"))
    if isinstance(error, SpeculatorsError):
        return None if traceback_asked and error.__cause__ is not None else str(error)
    line = input_error_line(error, values)
    return None if traceback_asked else line
