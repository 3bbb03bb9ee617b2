"""Durable writes: a temporary name in the same directory, fsync, then rename into place.

A crash never leaves a half-written file under the final name, so a later step that finds the file
can trust it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from speculators.errors import SpeculatorsError, os_error_of


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it is renamed to `path`."""
    final = Path(path)
    if final.is_dir():
        raise SpeculatorsError(f"{final} is a folder; name a file to write")
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
    """Run `writer(tmp_path)` and rename the result into place; a write the OS refused (a full disk) is
    an OSError naming `path`, whatever library wrote."""
    with atomic_path(path) as tmp:
        try:
            writer(tmp)
        except Exception as error:
            refused = os_error_of(error, path)
            if refused is None or refused is error:
                raise
            raise refused from error
    return Path(path)


def entry_names(folder: Path) -> set[str]:
    return {entry.name for entry in folder.iterdir()}


def holds_json_key(folder: Path, file: str, key: str) -> bool:
    """Whether `folder/file` is a JSON object with `key`: how a folder is recognised as an artifact of
    ours (a speculators checkpoint's config.json has `speculators_model_type`)."""
    try:
        data = json.loads((folder / file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and key in data


def check_replaceable(final: Path, replaceable: Callable[[Path], bool], overwrite: bool) -> None:
    """Refuse, before any work, an output that would replace something the user made: a file, or a
    non-empty folder that is not this kind of artifact (unless `overwrite`)."""
    if final.exists() and not final.is_dir():
        raise SpeculatorsError(f"output {final} is a file, not a folder; name a new or empty folder for the output")
    if overwrite or not final.exists() or not entry_names(final) or replaceable(final):
        return
    examples = ", ".join(sorted(entry_names(final))[:3])
    raise SpeculatorsError(
        f"output folder {final} holds files that are not this kind of artifact ({examples}); name a new or empty "
        f"folder, or pass --overwrite to replace it"
    )


@contextmanager
def atomic_directory(
    path: str | Path, replaceable: Callable[[Path], bool] = lambda _: False, overwrite: bool = False
) -> Iterator[Path]:
    """Build a whole directory under a temporary name, then swap it into place.

    An existing folder at `path` is replaced only when it is empty, when `replaceable` recognises it as
    the same kind of artifact and the new one writes every name it holds, or with `overwrite`: a
    user's own files are never deleted or moved aside unasked, and a file at `path` is refused.
    """
    final = Path(path)
    check_replaceable(final, replaceable, overwrite)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if not final.exists():
            os.replace(tmp, final)
            return
        extra = entry_names(final) - entry_names(tmp)
        if extra and not overwrite:
            raise SpeculatorsError(
                f"output folder {final} also holds {', '.join(sorted(extra)[:3])}, which the new artifact does not "
                f"write; move them away, or pass --overwrite to replace the whole folder"
            )
        # An empty folder of a fresh name to rename the old one onto: nothing that exists is ever removed
        # but the artifact being replaced.
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def exclusive_lock(folder: str | Path, what: str) -> Iterator[None]:
    """Hold `folder`/.lock for the block, so that two writers of one folder never do the same work twice:
    the second waits (saying for whom) and then finds the first's work done. An flock is released by
    the kernel when its holder exits, even on SIGKILL, so a crash never leaves a stale lock. A folder
    the block made and left holding nothing but the lock is removed again (a run that failed on its
    input leaves no empty output behind)."""
    import socket
    import time

    folder = Path(folder)
    made = not folder.exists()
    descriptor = locked_file(folder / ".lock", what)
    try:
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, holder.encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(descriptor, 0)  # an idle lock file is empty: its bytes never change a folder's hash
            if made and entry_names(folder) == {".lock"}:
                (folder / ".lock").unlink()  # (a waiter on it notices: locked_file)
                folder.rmdir()
    finally:
        os.close(descriptor)  # (releases the flock)


def locked_file(path: Path, what: str) -> int:
    """A descriptor of `path` (made with its folder when missing) holding its exclusive flock, waited
    for when another process holds it. The lock is the file at `path` when the flock is granted: a
    holder that removed it meanwhile (exclusive_lock's clean-up) sends this one round again."""
    import fcntl

    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder went away between the two calls
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 400, 0).decode(errors="replace").strip() or "another process"
            print(f"{what} {path.parent} is being written by {holder}; waiting for it to finish", flush=True)
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(descriptor).st_ino:
            return descriptor
        os.close(descriptor)
