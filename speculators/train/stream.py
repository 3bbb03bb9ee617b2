"""Streamed training: the verifier's hidden states computed during training, into a bounded spool, by producer
processes that follow the trainer's own plan (speculators/train/plan.py), instead of read from a computed store.

`speculators train --hidden-states streamed --store <index> ...` is the **supervisor** (`run_streamed`): it holds
the run folder's lock, writes the spool's stream.json, starts `--stream-replicas` **producers**
(`python -m speculators.cli stream --spool DIR --replica r/R`) on the first devices and one **trainer** (the same
`speculators train` command, under torchrun when --trainer-processes > 1, told by SPECULATORS_STREAM_SPOOL to
read through the spool) on the rest, prints a progress line every few seconds, restarts a producer that dies
(--producer-restarts), and at the end writes the `stream` part of summary.json, fills what --keep wrote into the
store's manifest and deletes the spool.

Producer r computes the units (steps) s % R == r from the trainer's last checkpoint on (replica 0 first the
validation unit), each at most --lookahead-steps ahead of the trainer and while the spool's bytes stay under
--spool-gib (the unit the trainer waits for is always computed); a unit already in the spool is skipped, so a
restarted producer or a resumed run recomputes only what is gone. Samples the store already holds (computed in
the index, or written there by --keep) are read from it, not computed. The layout: speculators/data/spool.py.

Fault injection (tests): SPECULATORS_STREAM_FAIL=producer makes every producer fail at its start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import exclusive_lock
from speculators.data.capture import drafter_positions
from speculators.data.spool import (
    STREAM_SPOOL_ENV,
    SUPERVISOR_ENV,
    VALIDATION_UNIT,
    Cursor,
    Spool,
    UnitRecord,
    UnitSample,
    exit_with,
    refuse_foreign_spool,
    unit_name,
)
from speculators.data.store import HiddenStateStore, SampleEntry, StoreManifest, StoreTotals
from speculators.data.tokenization import TokenizedSample
from speculators.errors import SpeculatorsError
from speculators.flags import to_argv
from speculators.serving.engine import cpu_core_lists, gpu_count
from speculators.settings import TrainConfig
from speculators.train.data import PackedStore
from speculators.train.plan import TrainingPlan, capture_batches, replica_steps
from speculators.train.records import TrainingSummary
from speculators.train.resume import store_content
from speculators.train.run import packed_stores, stream_spool, training_plan

if TYPE_CHECKING:
    import torch

FAIL_ENV = "SPECULATORS_STREAM_FAIL"  # fault injection: "producer" makes every producer fail at its start
GIB = 1 << 30
PROGRESS_SECONDS = 5.0
SHARD_OVERHEAD = 2048  # a shard's safetensors header, and its lines in the unit's manifest.json and unit.json
UNIT_OVERHEAD = 8192  # a unit's manifest.json and unit.json beyond their samples' lines


# ----- what the supervisor and the producers share ------------------------------------------------------


@dataclass
class StreamPlan:
    """The run's packs and units, from the index's manifest alone (no shard is read)."""

    config: TrainConfig
    world: int
    train: PackedStore
    validation: PackedStore
    plan: TrainingPlan

    @classmethod
    def of(cls, config: TrainConfig, world: int) -> StreamPlan:
        train, validation = packed_stores(config)  # (a streamed run's: on the spool, no index refused)
        return cls(config, world, train, validation, training_plan(config, train, world))

    def unit_batches(self, unit: int) -> tuple[PackedStore, list[list[int]]]:
        """The unit's split and its capture batches: the plan's for a step; the validation samples' alike
        for the validation unit."""
        size = self.config.stream_batch_size
        if unit != VALIDATION_UNIT:
            return self.train, self.plan.step_batches(unit, size)
        validation = self.validation
        return validation, capture_batches(list(range(len(validation.entries))), validation.lengths, size)

    @property
    def bytes_per_token(self) -> int:
        manifest = self.train.manifest
        slots, hidden = len(manifest.aux_layer_ids) + 1, manifest.verifier.hidden_size
        element = {"float32": 4, "bfloat16": 2}.get(manifest.storage, 1)
        scales = 4 * slots if manifest.storage == "fp8_e4m3" else 0
        return slots * hidden * element + scales + 9  # (+ input_ids and loss_mask)

    def unit_estimate(self, unit: int) -> int:
        """The bytes unit `unit` takes in the spool (every sample computed: an upper bound)."""
        packs, batches = self.unit_batches(unit)
        samples = [i for batch in batches for i in batch]
        tokens = sum(packs.entries[i].num_tokens for i in samples)
        return tokens * self.bytes_per_token + SHARD_OVERHEAD * len(samples) + UNIT_OVERHEAD

    def largest_unit(self) -> int:
        """The largest training unit's estimate (over the first two epochs' steps: later epochs pack alike)."""
        steps = min(self.plan.total_steps, 2 * self.plan.steps_per_epoch)
        return max(self.unit_estimate(s) for s in range(steps))


def keep_limit(keep: str) -> float:
    return 0.0 if keep == "none" else float("inf") if keep == "all" else float(keep) * GIB


def read_stream_file(spool: Spool) -> dict[str, Any]:
    data = spool.read_json("stream.json")
    if data is None:
        raise SpeculatorsError(f"{spool.root} is not a streamed run's spool (no stream.json); start the run again")
    return data


# ----- the producer ------------------------------------------------------------------------------------


def sample_tokens(store: HiddenStateStore, entry: SampleEntry) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """A sample's token ids, loss mask and image parts: from its shard where the store holds one, else from the
    index's tokens file. (A shard keeps no image parts: a sample with images that the store holds, in a batch
    with samples it lacks, is not yet supported; streamed vision-language training is untested.)"""
    if entry.computed and store.has(entry.key):
        ids, mask = store.read_tokens(entry, verify=False)
        return ids, mask, []
    return store.index_sample(entry)


class Producer:
    """Producer `replica` of `replicas`: computes its units into the spool (run)."""

    def __init__(self, spool_dir: str | Path, replica: int, replicas: int):
        self.spool = Spool(spool_dir)
        stream = read_stream_file(self.spool)
        self.config = TrainConfig.model_validate(stream["config"])
        self.replica, self.replicas = replica, replicas
        self.devices = stream["devices"]["producers"][replica]
        self.cap = int(stream["spool_cap_bytes"])
        self.streamed = StreamPlan.of(self.config, int(stream["world"]))
        self.reserve = replicas * self.streamed.largest_unit()
        self.counters = self.spool.producer_counters(replica)  # (continued across restarts)
        self.store = self.streamed.train.store
        self.keep = keep_limit(self.config.keep)
        self.capture: Any = None
        self.verifier: Any = None  # (loaded with the capture, on first need)

    def run(self) -> None:
        self.spool.forget_replica(self.replica, self.replicas)
        cursor = self.spool.cursor()
        start = cursor.checkpoint_step if cursor else 0
        units = [VALIDATION_UNIT] if self.replica == 0 else []
        units += list(replica_steps(self.replica, self.replicas, start, self.streamed.plan.total_steps))
        try:
            for unit in units:
                if self.spool.unit_ready(unit):
                    continue
                estimate = self.streamed.unit_estimate(unit)
                self.wait_for_room(unit, estimate)
                self.compute_unit(unit)
        finally:
            close = getattr(self.capture, "close", None)  # a vLLM engine's
            if close is not None:
                close()

    def wait_for_room(self, unit: int, estimate: int) -> None:
        """Until the unit may be claimed: within the look-ahead of the trainer's step, under the byte cap."""
        lookahead = self.config.lookahead_steps
        last_write = time.monotonic()
        while True:
            cursor = self.spool.cursor()
            step = cursor.step if cursor else 0
            forced = unit == VALIDATION_UNIT or unit <= step
            started = time.monotonic()
            if forced or unit < step + lookahead:
                if self.spool.try_claim(unit, estimate, self.cap, self.reserve, forced):
                    return
                time.sleep(0.2)  # (each room check walks the spool's files)
                self.counters.waiting_room_seconds += time.monotonic() - started
            else:
                time.sleep(0.05)
                self.counters.waiting_trainer_seconds += time.monotonic() - started
            if time.monotonic() - last_write > PROGRESS_SECONDS:
                self.spool.write_producer_counters(self.replica, self.counters)
                last_write = time.monotonic()

    def start_capture(self) -> Any:
        """The verifier, on this producer's devices, as datagen runs it (same capture code, same dtype)."""
        from speculators.data.capture import make_capture_fn
        from speculators.precision import compute_dtype
        from speculators.verifier.loading import VerifierFacts, load_verifier

        manifest, config = self.store.manifest(), self.config
        backend = config.stream_backend
        dtype = manifest.verifier.dtype if config.stream_dtype == "auto" else config.stream_dtype
        dtype = compute_dtype(dtype, "vllm" if backend == "vllm" else "auto", manifest.verifier.quantization)
        quantization = manifest.verifier.quantization
        capture_ids = [*manifest.aux_layer_ids, manifest.target_layer_id]
        max_length = max(e.num_tokens for e in manifest.samples)
        verifier: Any
        if backend == "transformers":
            device = "cuda" if gpu_count() else "cpu"
            verifier = load_verifier(config.verifier, dtype=dtype, device=device, quantization=quantization)
        else:
            verifier = VerifierFacts.from_source(config.verifier, dtype=dtype, quantization=quantization)
        if verifier.fingerprint != manifest.verifier.fingerprint:
            raise SpeculatorsError(
                f"index {config.store} was written for verifier {manifest.verifier.name_or_path} (fingerprint "
                f"{manifest.verifier.fingerprint}), not {config.verifier}; pass the index's verifier"
            )
        self.verifier = verifier
        return make_capture_fn(
            backend,
            verifier,
            capture_ids,
            max_length,
            config.stream_tensor_parallel_size,
            config.stream_batch_size,
            storage=manifest.storage,  # (cast in vLLM's worker before the copy: the bytes the store keeps)
        )

    def stored_checksum(self, entry: SampleEntry) -> tuple[str, int] | None:
        """Where the store holds the sample already (computed in the index, or kept by this run): its checksum
        and bytes."""
        if entry.computed and self.store.has(entry.key):
            assert entry.checksum is not None
            return entry.checksum, entry.bytes
        kept = self.spool.kept().shards.get(entry.key) if self.keep else None
        if kept is not None and self.store.has(entry.key):
            return str(kept[0]), int(kept[1])
        return None

    def compute_unit(self, unit: int) -> None:
        import torch

        started = time.monotonic()
        packs, batches = self.streamed.unit_batches(unit)
        partial = self.spool.partial_dir(unit)
        here = HiddenStateStore(partial)
        storage = packs.manifest.storage
        samples: list[UnitSample] = []
        written: list[SampleEntry] = []
        tokens = 0
        for batch in batches:
            entries = [packs.entries[i] for i in batch]
            found = {i: self.stored_checksum(e) for i, e in zip(batch, entries, strict=True)}
            for i, entry in zip(batch, entries, strict=True):
                if found[i] is not None:
                    checksum, size = found[i]  # type: ignore[misc]
                    samples.append(UnitSample(index=i, key=entry.key, place="store", checksum=checksum, bytes=size))
                    self.counters.samples_from_store += 1
            if all(found[i] is not None for i in batch):
                continue
            if self.capture is None:
                self.capture = self.start_capture()
            samples_of = [sample_tokens(self.store, e) for e in entries]
            states = self.capture([ids.tolist() for ids, _, _ in samples_of], [images for _, _, images in samples_of])
            for row, (i, entry) in enumerate(zip(batch, entries, strict=True)):
                if found[i] is not None:  # (a batch is computed whole, as datagen does: the same states)
                    continue
                ids, mask, images = samples_of[row]
                tokenized = TokenizedSample(entry.id, ids.tolist(), mask.int().tolist(), images)
                checksum, size = here.write_sample(
                    entry.key,
                    entry.id,
                    ids,
                    mask.to(torch.bool),
                    states[row][:, :-1],
                    states[row][:, -1],
                    storage,
                    drafter_positions(self.verifier, tokenized),
                )
                samples.append(UnitSample(index=i, key=entry.key, place="unit", checksum=checksum, bytes=size))
                written.append(entry.model_copy(update={"checksum": checksum, "bytes": size}))
                tokens += entry.num_tokens
                self.counters.samples += 1
                self.counters.tokens += entry.num_tokens
                self.counters.bytes += size
                if self.keep and self.spool.keep_shard(
                    here.shard_path(entry.key), self.store.shard_path(entry.key), entry.key, checksum, size, self.keep
                ):
                    self.counters.kept_samples += 1
                    self.counters.kept_bytes += size
            self.spool.write_producer_counters(self.replica, self.counters)
        manifest = packs.manifest.model_copy(update={"samples": written, "totals": StoreTotals.over(written)})
        here.write_manifest(manifest)
        seconds = time.monotonic() - started
        record = UnitRecord(
            unit=unit,
            samples=sorted(samples, key=lambda s: s.index),
            tokens=tokens,
            seconds=round(seconds, 3),
            replica=self.replica,
        )
        self.spool.publish_unit(partial, record)
        self.counters.units += 1
        self.counters.computing_seconds += seconds
        self.spool.write_producer_counters(self.replica, self.counters)


def run_producer(spool_dir: str | Path, replica: int, replicas: int) -> None:
    """`speculators stream --spool DIR --replica r/R`: one producer of a streamed run (started by its supervisor)."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # (kill -USR1 <pid>: where a stuck producer is, in its log)
    parent = os.environ.get(SUPERVISOR_ENV)
    if parent:
        exit_with(int(parent))
    if os.environ.get(FAIL_ENV) == "producer":
        raise SpeculatorsError(f"producer {replica} failed on purpose ({FAIL_ENV}=producer, a test's fault)")
    producer = Producer(spool_dir, replica, replicas)
    pin_producer(producer.devices, producer.config.stream_backend)
    producer.run()


def pin_producer(devices: dict[str, Any], backend: str) -> None:
    """A transformers producer on a CPU keeps to its cores (vLLM's CPU workers bind by their environment)."""
    cores = devices.get("cores")
    if cores and backend == "transformers":
        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


# ----- the supervisor ----------------------------------------------------------------------------------


def run_streamed(config: TrainConfig) -> TrainingSummary:
    """`speculators train --hidden-states streamed`: producers and a trainer, supervised to the end."""
    if os.environ.get("RANK") or os.environ.get("LOCAL_RANK"):
        raise SpeculatorsError(
            "--hidden-states streamed starts its own trainer processes; run it without torchrun (give "
            "--trainer-processes N for N of them)"
        )
    with exclusive_lock(config.output, "training run"):
        return Supervisor(config).run()


@dataclass
class Child:
    name: str
    command: list[str]
    env: dict[str, str]
    log: Path
    cores: list[int] | None = None
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self) -> None:
        cores = self.cores

        def pin() -> None:  # (in the child, before it runs: it and its children keep to these cores)
            if cores:
                os.sched_setaffinity(0, cores)

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as handle:
            self.process = subprocess.Popen(
                self.command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                start_new_session=True,  # (stopped as a group: torchrun's ranks with it)
                preexec_fn=pin,
            )

    def poll(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def error_line(self) -> str:
        """Its log's last `error: ` line, else how it ended."""
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        found = next((line.removeprefix("error: ") for line in reversed(lines) if line.startswith("error: ")), None)
        code = self.process.returncode if self.process is not None else None
        if found:
            return found
        if code is not None and code < 0:
            return f"killed by signal {-code}"
        return lines[-1] if lines else f"exit code {code}"


@dataclass
class Supervisor:
    config: TrainConfig
    started: float = field(default_factory=time.monotonic)
    peak_bytes: int = 0

    def run(self) -> TrainingSummary:
        config = self.config
        output = Path(config.output)
        located = stream_spool(config)  # (--spool, else <output>/spool: the trainer's and the producers' too)
        assert located is not None  # (a supervisor's run is streamed)
        spool_dir = Path(located)
        refuse_foreign_spool(spool_dir)
        made = not spool_dir.exists()
        spool = Spool(spool_dir)
        streamed = StreamPlan.of(config, config.trainer_processes)
        cap = int(config.spool_gib * GIB)
        self.check_cap(streamed, cap)
        producer_devices, trainer_env, trainer_cores = self.devices()
        start = self.resume_step(output, streamed.plan.total_steps)
        made = self.prepare_spool(spool, streamed, producer_devices, cap, start, made)
        logs = output / "stream"
        replicas = config.stream_replicas
        producers = [
            Child(
                f"producer {r}",
                [
                    sys.executable,
                    "-m",
                    "speculators.cli",
                    "stream",
                    "--spool",
                    str(spool_dir),
                    "--replica",
                    f"{r}/{replicas}",
                ],
                {**producer_devices[r]["env"], SUPERVISOR_ENV: str(os.getpid())},
                logs / f"producer-{r}.log",
                producer_devices[r].get("cores"),
            )
            for r in range(replicas)
        ]
        trainer = Child(
            "trainer",
            self.trainer_command(),
            {**trainer_env, STREAM_SPOOL_ENV: str(spool_dir), SUPERVISOR_ENV: str(os.getpid())},
            logs / "trainer.log",
            trainer_cores,
        )
        succeeded = False
        try:
            for child in [*producers, trainer]:
                child.start()
            (logs / "pids.json").write_text(
                json.dumps({c.name: c.process.pid for c in [*producers, trainer] if c.process}) + "\n"
            )
            self.monitor(spool, streamed, producers, trainer, cap)
            succeeded = True
        finally:
            for child in [trainer, *producers]:
                child.stop()
            kept = self.merge_kept(spool, streamed)
        summary = self.write_summary(spool, streamed, producers, cap, kept)
        if succeeded:
            remove_spool(spool_dir, made)
        return summary

    def check_cap(self, streamed: StreamPlan, cap: int) -> None:
        """A cap that cannot hold the units between two checkpoints, the look-ahead and the units in flight
        would stall the run: refused at start."""
        config = self.config
        largest, validation = streamed.largest_unit(), streamed.unit_estimate(VALIDATION_UNIT)
        units = config.checkpoint_every + config.lookahead_steps + config.stream_replicas
        need = units * largest + validation
        if need > cap:
            raise SpeculatorsError(
                f"--spool-gib {config.spool_gib:g} cannot hold {units} units of up to {largest / GIB:.3g} GiB "
                f"(--checkpoint-every {config.checkpoint_every} + --lookahead-steps {config.lookahead_steps} + "
                f"{config.stream_replicas} in flight) and the validation unit: {need / GIB:.3g} GiB; raise "
                f"--spool-gib or lower --checkpoint-every"
            )

    def devices(self) -> tuple[list[dict[str, Any]], dict[str, str], list[int] | None]:
        """Per producer its devices (env, and its cores on a CPU); the trainer's env and cores: the producers
        take the first replicas x tensor-parallel GPUs (or cores), the trainer the rest."""
        config = self.config
        replicas, tp = config.stream_replicas, config.stream_tensor_parallel_size
        need = replicas * tp
        count = gpu_count()
        if count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            gpus = visible.split(",") if visible else [str(i) for i in range(count)]
            left = gpus[need:]
            if len(left) < config.trainer_processes:
                raise SpeculatorsError(
                    f"{replicas} producer(s) x tensor parallel {tp} take {need} of the {len(gpus)} GPUs, leaving "
                    f"{len(left)} for --trainer-processes {config.trainer_processes}; lower --stream-replicas or "
                    f"--stream-tensor-parallel-size"
                )
            on_gpus: list[dict[str, Any]] = [
                {"env": {"CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])}} for r in range(replicas)
            ]
            return on_gpus, {"CUDA_VISIBLE_DEVICES": ",".join(left)}, None
        cores = sorted(os.sched_getaffinity(0))
        left_cores = cores[need:]
        if not left_cores:
            raise SpeculatorsError(
                f"{replicas} producer(s) x tensor parallel {tp} take {need} of the {len(cores)} CPU cores, leaving "
                f"none for the trainer; lower --stream-replicas or --stream-tensor-parallel-size"
            )
        producers: list[dict[str, Any]] = []
        for r in range(replicas):
            own = cores[r * tp : (r + 1) * tp]
            env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(cpu_core_lists(tp, own)), "OMP_NUM_THREADS": str(len(own))}
            producers.append({"env": env, "cores": own})
        threads = max(1, len(left_cores) // config.trainer_processes)
        return producers, {"OMP_NUM_THREADS": str(threads)}, left_cores

    def resume_step(self, output: Path, total_steps: int) -> int:
        """Where the trainer starts: checkpoints/last's step (0 under --restart or without one)."""
        state = output / "checkpoints" / "last" / "trainer_state.json"
        if self.config.restart or not state.is_file():
            return 0
        try:
            return min(int(json.loads(state.read_text())["step"]), total_steps)
        except (ValueError, KeyError):
            return 0

    def prepare_spool(
        self, spool: Spool, streamed: StreamPlan, devices: list[dict[str, Any]], cap: int, start: int, made: bool
    ) -> bool:
        """stream.json and the cursor at the resumed step; the units of another plan (or of a --restart) and
        what crashed processes left half-written go."""
        config = self.config
        # What the units hold: another value of any of these makes other units (they are computed afresh).
        plan_key = [
            store_content(config.store, streamed=True),
            config.token_budget,
            config.seed,
            config.validation_share,
            config.trainer_processes * config.grad_accumulation,
            config.epochs,
            config.max_steps,
            config.stream_batch_size,
        ]
        previous = spool.read_json("stream.json")
        made = bool(previous.get("made_folder")) if previous else made  # (a rerun keeps the first run's word)
        if previous is None or previous.get("plan") != plan_key or config.restart:
            for name in ("units", "claims", "producers", "kept.json", "cursor.json"):
                path = spool.root / name
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        shutil.rmtree(spool.root / "claims", ignore_errors=True)
        for partial in spool.units.glob(".partial-*") if spool.units.is_dir() else []:
            shutil.rmtree(partial, ignore_errors=True)
        (spool.root / "failed.json").unlink(missing_ok=True)
        spool.delete_units_before(start)
        spool.root.mkdir(parents=True, exist_ok=True)
        spool.write_json(
            "stream.json",
            {
                "config": config.model_dump(mode="json"),
                "world": config.trainer_processes,
                "devices": {"producers": devices},
                "spool_cap_bytes": cap,
                "plan": plan_key,
                "made_folder": made,
            },
        )
        spool.write_cursor(Cursor(step=start, checkpoint_step=start, total_steps=streamed.plan.total_steps))
        return made

    def trainer_command(self) -> list[str]:
        argv = ["-m", "speculators.cli", "train", *to_argv(self.config)]
        if self.config.trainer_processes == 1:
            return [sys.executable, *argv]
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", "--nproc-per-node", str(self.config.trainer_processes), *argv]

    def monitor(self, spool: Spool, streamed: StreamPlan, producers: list[Child], trainer: Child, cap: int) -> None:
        """Until the trainer ends: producers restarted when they die (then the run stopped with the error line),
        the spool's peak measured, a progress line every few seconds, the trainer's log echoed."""
        config = self.config
        echoed = 0
        last_line = 0.0
        while True:
            # (a walk over the spool's files, 5 times a second: a peak between two walks goes unseen, while the
            # producers' room checks hold the bytes under the cap)
            self.peak_bytes = max(self.peak_bytes, spool.bytes_used())
            echoed = echo_new(trainer.log, echoed)
            for producer in producers:
                code = producer.poll()
                if code is None or code == 0:
                    continue
                if producer.restarts < config.producer_restarts:
                    producer.restarts += 1
                    print(
                        f"stream: {producer.name} stopped ({producer.error_line()}); restart "
                        f"{producer.restarts} of {config.producer_restarts}",
                        flush=True,
                    )
                    producer.start()
                    continue
                line = (
                    f"{producer.name} of the streamed run failed ({producer.error_line()}) after "
                    f"{producer.restarts} restart(s); see {producer.log}"
                )
                spool.write_json("failed.json", {"error": line})
                trainer.stop()
                raise SpeculatorsError(line)
            code = trainer.poll()
            if code is not None:
                echo_new(trainer.log, echoed)
                if code != 0:
                    raise SpeculatorsError(
                        f"the trainer of the streamed run failed ({trainer.error_line()}); see {trainer.log}, then "
                        f"run the same command again to resume from its last checkpoint"
                    )
                return
            if time.monotonic() - last_line > PROGRESS_SECONDS:
                print(self.progress_line(spool, streamed, producers, cap), flush=True)
                last_line = time.monotonic()
            time.sleep(0.2)

    def progress_line(self, spool: Spool, streamed: StreamPlan, producers: list[Child], cap: int) -> str:
        cursor = spool.cursor()
        step = cursor.step if cursor else 0
        ahead = min(streamed.plan.total_steps, step + self.config.lookahead_steps + len(producers))
        ready = sum(1 for s in range(step, ahead) if spool.unit_ready(s))
        counters = [spool.producer_counters(r) for r in range(len(producers))]
        trainer_wait = cursor.wait_seconds if cursor else 0.0
        wall = max(time.monotonic() - self.started, 1e-9)
        busy = sum(c.computing_seconds for c in counters)
        idle = sum(c.waiting_trainer_seconds + c.waiting_room_seconds for c in counters)
        restarts = sum(p.restarts for p in producers)
        return (
            f"stream: step {step}/{streamed.plan.total_steps}, {ready} unit(s) ready ahead, spool "
            f"{spool.bytes_used() / GIB:.3g}/{cap / GIB:.3g} GiB; trainer waits {trainer_wait / wall:.0%}, "
            f"producers wait {idle / max(busy + idle, 1e-9):.0%}; {restarts} restart(s)"
        )

    def merge_kept(self, spool: Spool, streamed: StreamPlan) -> dict[str, list[Any]]:
        """The shards --keep wrote into the store, filled into its manifest (under the store's lock)."""
        kept = spool.kept().shards
        if not kept:
            return kept
        store = streamed.train.store
        with exclusive_lock(store.root, "hidden-state store"):
            manifest = StoreManifest.read(store.manifest_path)
            samples = [
                e.model_copy(update={"checksum": kept[e.key][0], "bytes": kept[e.key][1]})
                if e.key in kept and not e.computed and store.has(e.key)
                else e
                for e in manifest.samples
            ]
            manifest = manifest.model_copy(update={"samples": samples, "totals": StoreTotals.over(samples)})
            store.write_manifest(manifest)
        return kept

    def write_summary(
        self, spool: Spool, streamed: StreamPlan, producers: list[Child], cap: int, kept: dict[str, list[Any]]
    ) -> TrainingSummary:
        """summary.json's `stream` part (the trainer wrote the rest)."""
        config = self.config
        counters = [spool.producer_counters(r) for r in range(len(producers))]
        cursor = spool.cursor()
        computed_tokens = sum(c.tokens for c in counters)
        train_tokens = sum(e.num_tokens for e in streamed.train.entries)
        busy = sum(c.computing_seconds for c in counters)
        idle = sum(c.waiting_trainer_seconds + c.waiting_room_seconds for c in counters)
        wall = max(time.monotonic() - self.started, 1e-9)
        kept_bytes = sum(int(size) for _, size in kept.values())
        stream = {
            "mode": "streamed",
            "backend": config.stream_backend,
            "replicas": config.stream_replicas,
            "trainer_processes": config.trainer_processes,
            "units_computed": sum(c.units for c in counters),
            "samples_computed": sum(c.samples for c in counters),
            "tokens_computed": computed_tokens,
            "samples_from_store": sum(c.samples_from_store for c in counters),
            "verifier_passes": round(computed_tokens / max(train_tokens, 1), 4),
            "capture_tokens_per_second": round(computed_tokens / busy, 1) if busy else None,
            "trainer_wait_share": round((cursor.wait_seconds if cursor else 0.0) / wall, 4),
            "producer_wait_share": round(idle / max(busy + idle, 1e-9), 4),
            "spool_peak_bytes": self.peak_bytes,
            "spool_cap_bytes": cap,
            "kept_samples": len(kept),
            "kept_bytes": kept_bytes,
            "producer_restarts": sum(p.restarts for p in producers),
            "store_bytes_written": kept_bytes,
        }
        path = Path(config.output) / "summary.json"
        summary = TrainingSummary.read(path)
        summary.stream = stream
        summary.write(path)
        return summary


def echo_new(log: Path, offset: int) -> int:
    """Print what `log` gained since `offset`; the new offset."""
    try:
        with open(log, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
    return offset + len(data)


def remove_spool(spool_dir: Path, made: bool) -> None:
    """The spool at the end: the folder when this run made it, else only what the run put in it."""
    if made:
        shutil.rmtree(spool_dir, ignore_errors=True)
        return
    for path in spool_dir.iterdir():
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


__all__ = ["Producer", "StreamPlan", "run_producer", "run_streamed", "unit_name"]
