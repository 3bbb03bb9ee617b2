"""Durable writes: a temporary name in the same directory, fsync, then rename into place.

A crash never leaves a half-written file under the final name, so a later step that finds the file
can trust it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed to `path`."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_jsonl_atomic(path: str | Path, rows: Iterable[Any]) -> Path:
    """One JSON line per row (rows provide `to_json()`), written atomically."""
    return write_text_atomic(path, "".join(row.to_json() + "\n" for row in rows))


def write_with(path: str | Path, writer: Callable[[Path], None]) -> Path:
    """Run `writer(tmp_path)` and rename the result into place."""
    with atomic_path(path) as tmp:
        writer(tmp)
    return Path(path)


@contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Build a whole directory under a temporary name, then swap it into place."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
