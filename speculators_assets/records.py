"""The code location's own records, the JSON files its steps write under the storage root for the steps
that follow (`stamp.json`, `current.json`, `accepted.json`), and how the workload reads and writes any
typed record: the library's (speculators.data.records, speculators.checkpoint.records,
speculators.eval.records) and these.

A record names its file (`FILE`) and keeps keys it does not name (`extra="allow"`), so files of older
and newer versions read alike; writing one writes the bytes the workload has always written (the
fields in their order, two-space-indented JSON). Import-light: pydantic only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

Record = TypeVar("Record", bound=BaseModel)


class StepRecord(BaseModel):
    model_config = ConfigDict(extra="allow")

    FILE: ClassVar[str]


class PromptsStamp(StepRecord):
    """raw_prompts' stamp.json: the key of the conversations there, and the prompt sources' fingerprint
    (what the retraining schedule compares)."""

    FILE: ClassVar[str] = "stamp.json"

    key: str
    source_fingerprint: str | None = None


class StoreStamp(StepRecord):
    """verifier_hidden_states' stamp.json: the key of the prepared data, store and vocabulary there."""

    FILE: ClassVar[str] = "stamp.json"

    key: str
    written: str  # local time, "%Y-%m-%d %H:%M:%S"


class CurrentDrafter(StepRecord):
    """trained_drafter's current.json: the drafter the last materialization trained or reused."""

    FILE: ClassVar[str] = "current.json"

    # Anything a file of the shared volume holds: the reader checks it is an artifact key before the
    # key becomes a path (workload.recorded_drafter).
    key: Any = None
    drafter: str | None = None
    source_fingerprint: str | None = None


class AcceptedDrafter(StepRecord):
    """accepted.json in a published checkpoint: the drafter's key and acceptance when the gates passed."""

    FILE: ClassVar[str] = "accepted.json"

    key: str
    acceptance_length: float
    verifier: str | None = None
    accepted_at: float | None = None  # seconds since the epoch


def read_record(model: type[Record], folder: Path, name: str | None = None) -> Record | None:
    """`folder`/`model.FILE` (or `name`) read as `model`; None where it is missing, unreadable or not such
    a record."""
    path = folder / (name or model.FILE)  # type: ignore[attr-defined]
    try:
        return model.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict[str, Any]) -> None:
    from speculators.atomic_io import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def write_record(record: StepRecord, folder: Path) -> None:
    write_json(folder / record.FILE, record.model_dump())
