"""The spool of a streamed training run: where producers put the hidden states of the steps ahead for the
trainer, bounded in bytes and in steps (speculators/train/stream.py runs the processes around it).

    <spool>/stream.json                  the run's settings (the supervisor writes it at start)
    <spool>/cursor.json                  {"step", "checkpoint_step", "total_steps", "wait_seconds"}: trainer
                                         rank 0, each step
    <spool>/units/<unit>/                a finished unit (f"{step:09d}", or "validation"): a small store
                                         (manifest.json + shards/) and unit.json (UnitRecord)
    <spool>/units/.partial-<unit>-<pid>/ a unit being written, renamed into place whole
    <spool>/claims/<unit>.json           a unit being computed, with its estimated bytes (counted against the cap)
    <spool>/producers/<r>.json           producer r's counters (ProducerCounters)
    <spool>/kept.json                    the --keep ledger: shards written into the store (KeptLedger)
    <spool>/failed.json                  {"error": line}: the supervisor gave up on a producer
    <spool>/lock                         flock: room decisions and the keep ledger

Everything is a file written to a temporary name and renamed, so each process reads whole records, and a
crash of any of them leaves a spool the others (or a rerun) continue from.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from speculators.atomic_io import write_text_atomic
from speculators.errors import SpeculatorsError

VALIDATION_UNIT = -1  # (speculators.train.plan's: the validation samples, computed first, kept to the end)
STREAM_SPOOL_ENV = "SPECULATORS_STREAM_SPOOL"  # set for the trainer a supervisor starts: it reads this spool
SUPERVISOR_ENV = "SPECULATORS_STREAM_PARENT"  # the supervisor's pid: its producers and trainer exit when it is gone


def unit_name(unit: int) -> str:
    return "validation" if unit == VALIDATION_UNIT else f"{unit:09d}"


class UnitSample(BaseModel):
    index: int  # the sample's index among its split's entries (the plan's index)
    key: str  # its content key
    place: str  # "unit": its shard is in the unit; "store": in --store (computed there, or kept)
    checksum: str  # its shard's sha256
    bytes: int


class UnitRecord(BaseModel):
    """units/<unit>/unit.json: what a finished unit holds and where each sample's shard is."""

    unit: int
    samples: list[UnitSample]
    tokens: int  # tokens computed into the unit
    seconds: float  # seconds its computation took
    replica: int  # the producer that computed it


class Cursor(BaseModel):
    step: int  # the step the trainer reads next
    checkpoint_step: int  # the step of its last checkpoints/last (a resume starts there)
    total_steps: int
    wait_seconds: float = 0.0  # trainer rank 0's seconds waiting for units in this run so far


class ProducerCounters(BaseModel):
    computing_seconds: float = 0.0
    waiting_trainer_seconds: float = 0.0  # the look-ahead was full
    waiting_room_seconds: float = 0.0  # the spool's bytes were at the cap
    units: int = 0
    samples: int = 0  # computed
    tokens: int = 0  # computed
    bytes: int = 0  # written into units
    samples_from_store: int = 0  # read from --store instead
    kept_samples: int = 0
    kept_bytes: int = 0


class KeptLedger(BaseModel):
    bytes: int = 0
    shards: dict[str, list[Any]] = {}  # key -> [checksum, bytes] of the shards written into the store


class Spool:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    # ----- places -----------------------------------------------------------------------------------

    @property
    def units(self) -> Path:
        return self.root / "units"

    def unit_dir(self, unit: int) -> Path:
        return self.units / unit_name(unit)

    def unit_ready(self, unit: int) -> bool:
        return (self.unit_dir(unit) / "unit.json").is_file()

    def claim_path(self, unit: int) -> Path:
        return self.root / "claims" / f"{unit_name(unit)}.json"

    def producer_path(self, replica: int) -> Path:
        return self.root / "producers" / f"{replica}.json"

    # ----- records ----------------------------------------------------------------------------------

    def write_json(self, name: str, data: Any) -> None:
        write_text_atomic(self.root / name, json.dumps(data, indent=1) + "\n")

    def read_json(self, name: str) -> Any:
        try:
            return json.loads((self.root / name).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def cursor(self) -> Cursor | None:
        data = self.read_json("cursor.json")
        return Cursor.model_validate(data) if data else None

    def write_cursor(self, cursor: Cursor) -> None:
        self.write_json("cursor.json", cursor.model_dump())

    def failure(self) -> str | None:
        data = self.read_json("failed.json")
        return data["error"] if data else None

    def unit_record(self, unit: int) -> UnitRecord:
        return UnitRecord.model_validate_json((self.unit_dir(unit) / "unit.json").read_text())

    def producer_counters(self, replica: int) -> ProducerCounters:
        data = self.read_json(f"producers/{replica}.json")
        return ProducerCounters.model_validate(data) if data else ProducerCounters()

    def write_producer_counters(self, replica: int, counters: ProducerCounters) -> None:
        self.producer_path(replica).parent.mkdir(parents=True, exist_ok=True)
        self.write_json(f"producers/{replica}.json", counters.model_dump())

    def kept(self) -> KeptLedger:
        data = self.read_json("kept.json")
        return KeptLedger.model_validate(data) if data else KeptLedger()

    # ----- units ------------------------------------------------------------------------------------

    def partial_dir(self, unit: int) -> Path:
        path = self.units / f".partial-{unit_name(unit)}-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def publish_unit(self, partial: Path, record: UnitRecord) -> None:
        """The unit written in `partial` renamed into place whole, its claim released."""
        (partial / "unit.json").write_text(record.model_dump_json(indent=1) + "\n")
        target = self.unit_dir(record.unit)
        if target.exists():  # (a unit another attempt finished meanwhile: the same samples)
            shutil.rmtree(partial)
        else:
            os.rename(partial, target)
        self.claim_path(record.unit).unlink(missing_ok=True)

    def forget_replica(self, replica: int, replicas: int) -> None:
        """A (re)starting producer's leftovers: its claims and half-written units (only replica r computes
        the units s % R == r, and the validation unit is replica 0's)."""
        for claim in (self.root / "claims").glob("*.json"):
            unit = VALIDATION_UNIT if claim.stem == "validation" else int(claim.stem)
            if (unit == VALIDATION_UNIT and replica == 0) or (unit >= 0 and unit % replicas == replica):
                claim.unlink(missing_ok=True)
                for partial in self.units.glob(f".partial-{claim.stem}-*"):
                    shutil.rmtree(partial, ignore_errors=True)

    def delete_units_before(self, step: int) -> None:
        """GC after a checkpoint at `step`: a resume starts there, so the units of earlier steps are never read."""
        if not self.units.is_dir():
            return
        for path in self.units.iterdir():
            if path.name[:1].isdigit() and int(path.name) < step:
                shutil.rmtree(path, ignore_errors=True)

    # ----- bytes and room ---------------------------------------------------------------------------

    def bytes_used(self) -> int:
        """Bytes of the finished and half-written units, plus the claims' estimates for what is not written yet."""
        used = folder_bytes(self.units)
        claims = self.root / "claims"
        if claims.is_dir():
            for claim in claims.glob("*.json"):
                try:
                    data = json.loads(claim.read_text())
                except (FileNotFoundError, ValueError):
                    continue
                written = sum(folder_bytes(d) for d in self.units.glob(f".partial-{claim.stem}-*"))
                used += max(0, int(data["bytes"]) - written)
        return used

    @contextmanager
    def locked(self) -> Iterator[None]:
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)

    def try_claim(self, unit: int, estimate: int, cap: int, reserve: int, forced: bool) -> bool:
        """Claim `unit` when its estimated bytes fit under the cap with a reserve for the units in flight (or
        when `forced`: the unit the trainer needs now, which is always computed, so nothing waits for ever)."""
        with self.locked():
            if not forced and self.bytes_used() + estimate + reserve > cap:
                return False
            self.claim_path(unit).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.claim_path(unit), json.dumps({"bytes": estimate, "pid": os.getpid()}) + "\n")
            return True

    # ----- keep -------------------------------------------------------------------------------------

    def keep_shard(self, shard: Path, store_shard: Path, key: str, checksum: str, size: int, limit: float) -> bool:
        """Write a unit's shard into the store as well (a hard link, else a copy; renamed into place) while the
        kept bytes stay under `limit`; whether the store holds it now."""
        with self.locked():
            ledger = self.kept()
            if key in ledger.shards:
                return True
            if ledger.bytes + size > limit:
                return False
            store_shard.parent.mkdir(parents=True, exist_ok=True)
            tmp = store_shard.with_name(f".{store_shard.name}.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            try:
                os.link(shard, tmp)
            except OSError:  # (another file system: the spool on tmpfs)
                shutil.copyfile(shard, tmp)
            os.replace(tmp, store_shard)
            ledger.shards[key] = [checksum, size]
            ledger.bytes += size
            self.write_json("kept.json", ledger.model_dump())
            return True


def refuse_foreign_spool(spool: Path) -> None:
    """A --spool folder must be new, empty or a spool (it is deleted at the end): one holding other files is
    refused in one line."""
    if not spool.exists():
        return
    if not spool.is_dir():
        raise SpeculatorsError(f"--spool {spool} is a file; name a new or empty folder")
    names = {p.name for p in spool.iterdir()}
    if names and "stream.json" not in names:
        shown = ", ".join(sorted(names)[:3])
        raise SpeculatorsError(
            f"--spool {spool} holds other files ({shown}) and a spool is deleted when its run ends; name a new or "
            f"empty folder"
        )


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under `folder`; what another process deletes meanwhile (GC) counts as gone."""
    total = 0
    for parent, _, files in os.walk(folder):  # (os.walk skips a folder deleted under it; rglob raises)
        for name in files:
            with suppress(FileNotFoundError):
                total += os.stat(os.path.join(parent, name)).st_size
    return total


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def exit_with(pid: int) -> None:
    """Exit this process when process `pid` (a supervisor) is gone: a SIGKILLed supervisor leaves no producer
    or trainer behind (a thread polls; os._exit ends the process whatever its main thread is doing)."""
    import threading
    import time

    def watch() -> None:
        while process_alive(pid):
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()


def wait_for_unit(spool: Spool, unit: int, timeout: float) -> float:
    """Wait until `unit` is finished; the seconds waited. One error when the supervisor gave up on a producer
    (failed.json), or when no producer made progress (no counter, claim or unit changed) for `timeout` seconds."""
    import time

    started = last_progress = time.monotonic()
    seen: tuple[Any, ...] = ()
    while not spool.unit_ready(unit):
        failure = spool.failure()
        if failure:
            raise SpeculatorsError(failure)
        now = time.monotonic()
        state = progress_signature(spool)
        if state != seen:
            seen, last_progress = state, now
        elif now - last_progress > timeout:
            raise SpeculatorsError(
                f"the trainer waited {now - last_progress:.0f} s for the states of {unit_name(unit)} in spool "
                f"{spool.root} while no producer made progress; see the producers' logs, or raise --stream-timeout"
            )
        time.sleep(0.05)
    return time.monotonic() - started


def progress_signature(spool: Spool) -> tuple[Any, ...]:
    """What changes while a producer works: its counters, claims and (half-)written units."""
    found: list[Any] = []
    for folder in (spool.root / "producers", spool.root / "claims", spool.units):
        if folder.is_dir():
            for path in folder.iterdir():
                with suppress(FileNotFoundError):
                    found.append((path.name, path.stat().st_mtime_ns))
    for partial in spool.units.glob(".partial-*") if spool.units.is_dir() else []:
        found.append(folder_bytes(partial))
    return tuple(sorted(map(str, found)))
