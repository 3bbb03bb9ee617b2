"""Rows read from JSONL, JSON and Parquet files, at bounded cost: a row that cannot be read is a RowRejected.

Hostile or careless files cost bounded work and memory per row:
- a JSONL line longer than MAX_ROW_BYTES (8 MiB) is a rejected row ("row larger than 8 MiB"), read in
  chunks and skipped to its newline without ever being held;
- a .json file is read element by element, never whole: a top-level list, or an object holding
  exactly one list of rows (another member is skipped; a second list is an error when it is
  reached). An element over MAX_ROW_BYTES is a rejected row and the elements after it are read; a
  file that ends inside its list (a truncated download) gives its complete rows and then one
  rejected row "truncated JSON at end of file". An element that is not valid JSON but whose
  brackets and strings close is a rejected row ("malformed JSON (...)"); text between elements that
  is not a comma, or a stray bracket, is one error naming the file and line (nothing to
  resynchronise on);
- a source path that is not a regular file (a FIFO, a device such as /dev/zero, a socket) is one
  error naming it, checked before it is opened.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any, NoReturn

from speculators.errors import SpeculatorsError
from speculators.verifier import vision

MAX_ROW_BYTES = 8 * 1024 * 1024  # a JSONL line or .json element longer than this is a rejected row
READ_CHUNK_BYTES = 1 << 20  # source files are read in pieces of this size
TRUNCATED_JSON = "truncated JSON at end of file"


class RowRejected(Exception):
    """A row that cannot become a conversation; the message is the reason shown in the report."""


def iter_file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, row) for each row of a JSONL / JSON / Parquet file; a row that is not JSON, is larger
    than MAX_ROW_BYTES or is cut off by the end of the file is a RowRejected. A file that cannot be read
    at all (not a regular file, not UTF-8, not JSON between its rows) is one error naming it."""
    try:
        yield from read_file_rows(path)
    except UnicodeDecodeError:
        raise SpeculatorsError(
            f"{path} is not UTF-8 text; pass a .jsonl/.json file of rows or a .parquet file"
        ) from None
    except OSError as error:
        raise SpeculatorsError(f"{path} cannot be read ({error.strerror or error}); check the path") from None


def read_file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with open_source_file(path) as handle:
            for number, line in jsonl_lines(handle):
                location = f"{path.name}:{number}"
                if line is None:
                    yield location, RowRejected(row_too_large())
                    continue
                text = line.decode("utf-8")
                if text.strip():
                    yield location, decoded_row(text)
    elif suffix == ".json":
        with open_source_file(path) as handle:
            yield from json_rows(handle, path)
    elif suffix == ".parquet":
        import datasets
        import pyarrow.parquet

        open_source_file(path).close()  # (pyarrow opens it by name: a FIFO must not get that far)
        try:  # checked by pyarrow first: datasets would log its own line about a broken file
            pyarrow.parquet.ParquetFile(str(path))
            table = datasets.Dataset.from_parquet(str(path))
        except Exception as error:  # pyarrow and datasets raise many kinds for a broken file
            reason = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
            raise SpeculatorsError(f"{path} is not a readable Parquet file ({reason}); check or re-export it") from None
        for index, row in enumerate(table):
            yield f"{path.name}[{index}]", row
    else:
        raise SpeculatorsError(f"{path} is not .jsonl, .json or .parquet; convert it or pass a dataset name")


def open_source_file(path: Path) -> IO[bytes]:
    """A source file opened for reading, or one error naming it when it is not a regular file (a FIFO
    would block the run, /dev/zero would fill memory)."""
    try:
        return vision.open_regular_file(path)
    except vision.NotARegularFile as error:
        raise SpeculatorsError(
            f"prompt source {path} is {error.kind}, not a regular file; pass a .jsonl, .json or .parquet file "
            f"or a folder of them"
        ) from None


def row_too_large() -> str:
    return f"row larger than {vision.size_text(MAX_ROW_BYTES)}"


def decoded_row(text: str) -> Any:
    """One row's JSON text -> its value, or a RowRejected saying why it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        return RowRejected(f"malformed JSON ({error.msg})")
    except ValueError as error:  # e.g. an integer longer than Python converts
        return RowRejected(f"malformed JSON ({str(error).splitlines()[0][:80]})")
    except RecursionError:
        return RowRejected("malformed JSON (nested too deeply)")


def jsonl_lines(handle: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of each line, None for a line over MAX_ROW_BYTES: read in chunks, so an
    oversized line is skipped to its newline without ever being held."""
    number, pending, oversized = 0, bytearray(), False
    while chunk := handle.read(READ_CHUNK_BYTES):
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            number += 1
            if oversized or len(pending) + end - start > MAX_ROW_BYTES:
                yield number, None
            elif pending:
                pending += chunk[start:end]
                yield number, bytes(pending)
            else:
                yield number, chunk[start:end]
            pending.clear()
            oversized, start = False, end + 1
        if not oversized and len(pending) + len(chunk) - start > MAX_ROW_BYTES:
            pending.clear()
            oversized = True
        elif not oversized:
            pending += chunk[start:]
    if pending or oversized:
        yield number + 1, None if oversized else bytes(pending)


# .json files, element by element: bytes are scanned for the structure (JSON's structural characters
# are ASCII, never part of a UTF-8 sequence) and each complete element is decoded on its own.
STRUCTURE = re.compile(rb'["\[\]{}]')
STRING_STOP = re.compile(rb'["\\]')
SCALAR_END = re.compile(rb"[\s,\]}]")
NOT_WHITESPACE = re.compile(rb"\S")
QUOTE, BACKSLASH = ord('"'), ord("\\")
COMMA, COLON = ord(","), ord(":")
OPEN_LIST, CLOSE_LIST, OPEN_OBJECT, CLOSE_OBJECT = ord("["), ord("]"), ord("{"), ord("}")


class ValueScanner:
    """Where one JSON value ends, in bytes given piece by piece: tracks strings, escapes and nesting
    depth only (whether the value is valid is json.loads' to say)."""

    def __init__(self, first: int):
        self.scalar = first not in (QUOTE, OPEN_LIST, OPEN_OBJECT)
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, data: bytearray, pos: int) -> int | None:
        """The index just past the value's end, scanning from `pos`; None when it goes on past `data`."""
        if self.scalar:
            match = SCALAR_END.search(data, pos)
            return match.start() if match else None
        while True:
            if self.in_string:
                if self.escaped:
                    if pos >= len(data):
                        return None
                    pos, self.escaped = pos + 1, False
                match = STRING_STOP.search(data, pos)
                if match is None:
                    return None
                pos = match.end()
                if data[match.start()] == BACKSLASH:
                    self.escaped = True
                    continue
                self.in_string = False
                if self.depth == 0:
                    return pos
                continue
            match = STRUCTURE.search(data, pos)
            if match is None:
                return None
            pos = match.end()
            byte = data[match.start()]
            if byte == QUOTE:
                self.in_string = True
            elif byte in (OPEN_LIST, OPEN_OBJECT):
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return pos


class JsonStream:
    """A JSON file read in chunks: a buffer that holds at most one element (or a chunk), the position
    in it, and the line that position is on (for errors)."""

    def __init__(self, handle: IO[bytes], path: Path):
        self.handle, self.path = handle, path
        self.buffer = bytearray()
        self.pos = 0
        self.lines_dropped = 0

    def more(self) -> bool:
        """Drops what is before the position and reads the next chunk; False at the end of the file."""
        self.lines_dropped += self.buffer.count(b"\n", 0, self.pos)
        del self.buffer[: self.pos]
        self.pos = 0
        chunk = self.handle.read(READ_CHUNK_BYTES)
        self.buffer += chunk
        return bool(chunk)

    def peek(self) -> int | None:
        """The next byte that is not whitespace (the position moves to it); None at the end of the file."""
        while True:
            match = NOT_WHITESPACE.search(self.buffer, self.pos)
            if match:
                self.pos = match.start()
                return self.buffer[self.pos]
            self.pos = len(self.buffer)
            if not self.more():
                return None

    def fail(self, problem: str) -> NoReturn:
        line = self.lines_dropped + self.buffer.count(b"\n", 0, self.pos) + 1
        raise SpeculatorsError(f"{self.path} is not valid JSON (line {line}: {problem}); fix or re-export it")

    def value(self) -> tuple[bytes | None, bool]:
        """The bytes of the JSON value at the position, or None when it is longer than MAX_ROW_BYTES (then
        skipped as it is scanned, never held); and False when the file ends inside it."""
        first = self.buffer[self.pos]
        if first in (COMMA, COLON, CLOSE_LIST, CLOSE_OBJECT):
            self.fail(f"unexpected '{chr(first)}'")
        scanner, start, scanned, skipped = ValueScanner(first), self.pos, self.pos, False
        while True:
            end = scanner.scan(self.buffer, scanned)
            if end is not None:
                self.pos = end
                return (None if skipped or end - start > MAX_ROW_BYTES else bytes(self.buffer[start:end])), True
            scanned = len(self.buffer)
            skipped = skipped or scanned - start > MAX_ROW_BYTES
            self.pos = scanned if skipped else start  # what more() may drop
            kept_from = self.pos
            if not self.more():
                return None, False
            start, scanned = start - kept_from, scanned - kept_from


def json_rows(handle: IO[bytes], path: Path) -> Iterator[tuple[str, Any]]:
    """(location, row) of a .json file: a list of rows, or an object holding exactly one list of rows."""
    stream = JsonStream(handle, path)
    first = stream.peek()
    if first == codecs.BOM_UTF8[0] and stream.buffer.startswith(codecs.BOM_UTF8):
        stream.pos += len(codecs.BOM_UTF8)
        first = stream.peek()
    if first == OPEN_LIST:
        truncated = yield from json_list_rows(stream, path.name)
    elif first == OPEN_OBJECT:
        truncated = yield from json_object_rows(stream, path.name)
    elif first is None:
        raise SpeculatorsError(f"{path} is empty; pass a JSON list of rows")
    else:
        raise SpeculatorsError(f"{path} is not a JSON list of rows or an object holding one; pass a list")
    if not truncated and stream.peek() is not None:
        stream.fail("more data after the rows")


def json_list_rows(stream: JsonStream, name: str) -> Generator[tuple[str, Any], None, bool]:
    """The rows of the list at the position; returns whether the file ended inside it (then the last
    row yielded is the one TRUNCATED_JSON rejection)."""
    stream.pos += 1
    index, following = 0, stream.peek()
    if following == CLOSE_LIST:
        stream.pos += 1
        return False
    while True:
        if following is None:
            yield f"{name}[{index}]", RowRejected(TRUNCATED_JSON)
            return True
        data, complete = stream.value()
        if not complete:
            yield f"{name}[{index}]", RowRejected(TRUNCATED_JSON)
            return True
        yield f"{name}[{index}]", RowRejected(row_too_large()) if data is None else decoded_row(data.decode("utf-8"))
        index, following = index + 1, stream.peek()
        if following == CLOSE_LIST:
            stream.pos += 1
            return False
        if following == COMMA:
            stream.pos += 1
            following = stream.peek()
            if following == CLOSE_LIST:
                stream.fail("a comma before ']'")
        elif following is not None:
            stream.fail(f"expected ',' or ']' after row {index - 1}")


def json_object_rows(stream: JsonStream, name: str) -> Generator[tuple[str, Any], None, bool]:
    """The rows of the one list among the members of the object at the position (other members are
    skipped unread); returns whether the file ended inside the object."""
    stream.pos += 1
    lists, following = 0, stream.peek()
    while following != CLOSE_OBJECT:
        if following is None:
            break
        if following != QUOTE:
            stream.fail("expected a member name")
        if not stream.value()[1] or not step_over(stream, COLON, "expected ':' after a member name"):
            break
        following = stream.peek()
        if following == OPEN_LIST:
            lists += 1
            if lists > 1:
                raise SpeculatorsError(one_list_problem(stream.path))
            if (yield from json_list_rows(stream, name)):
                return True
        elif following is None or not stream.value()[1]:  # another member's value, skipped
            break
        following = stream.peek()
        if following == COMMA:
            stream.pos += 1
            following = stream.peek()
            if following == CLOSE_OBJECT:
                stream.fail("a comma before '}'")
        elif following not in (CLOSE_OBJECT, None):
            stream.fail("expected ',' or '}' after a member")
    else:
        stream.pos += 1
        if lists != 1:
            raise SpeculatorsError(one_list_problem(stream.path))
        return False
    yield f"{name} (end of file)", RowRejected(TRUNCATED_JSON)
    return True


def step_over(stream: JsonStream, byte: int, problem: str) -> bool:
    """Moves past `byte`, the next byte that is not whitespace; False at the end of the file, the
    error `problem` for any other byte."""
    following = stream.peek()
    if following is None:
        return False
    if following != byte:
        stream.fail(problem)
    stream.pos += 1
    return True


def one_list_problem(path: Path) -> str:
    return f"{path} is a JSON object without exactly one list of rows; pass a list"
