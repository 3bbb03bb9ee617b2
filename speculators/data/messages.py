"""Source rows, in the shapes understood, -> normalised messages (known roles, text and image parts).

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

A row that cannot become messages raises RowRejected with the reason the report shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from speculators.data.rows import RowRejected
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
