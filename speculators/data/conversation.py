"""The conversation record: normalised messages under a content-hash id, and what is read off it.

A conversation's id hashes its normalised messages (an image counts by its bytes' digest), so the same
conversation has the same id whatever source it came from; conversations of validation sources carry
VALIDATION_PREFIX in front of it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from speculators.errors import SpeculatorsError

# Conversation ids from validation sources start with this; training never uses such samples.
VALIDATION_PREFIX = "validation-"


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


def prompt_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to its last user turn: what a client sends to get the next answer (image
    parts included; `vision.openai_messages` turns them into what an OpenAI-compatible server takes)."""
    last_user = max((i for i, message in enumerate(messages) if message["role"] == "user"), default=None)
    if last_user is None:
        raise SpeculatorsError("a conversation without a user turn cannot be used as a prompt")
    return messages[: last_user + 1]
