"""Honest resumes: what a resumable checkpoint records of its run, what a resume may change, and the line
that announces a resume.

`speculators train` resumes from <output>/checkpoints/last. A resume continues one run; it must never
mix two, so the checkpoint records what shaped its run (records.RunRecord) and a resume compares its
own settings with it before anything is loaded or written. Every TrainConfig field is in exactly one
class below (tests/unit/train/test_train.py fails on a field that is in none):

- SHAPES_THE_RUN: a change is refused in one line naming the flag, the old value, the new one and
  `--restart`, the flag that trains the folder afresh.
- BY_CONTENT: paths whose content shapes the run (the store's data, the warm start's weights, the
  verifier's): another content is refused, the same content under another path is a change that may
  be made (a moved volume).
- MAY_CHANGE: settings that leave the trained weights as they are; the resume names each change in
  its progress line and summary.json records it.
- NOT_COMPARED: the run folder itself, and --restart.

Beside the fields, the number of processes (WORLD_SIZE) shapes the run with --grad-accumulation: step s
takes packs (s x accumulation + micro) x world + rank (step.optimizer_step), and draws its aux noise
by the same index, so what a step sees depends on their product alone (N processes train as one with
--grad-accumulation N, tested). Another product is refused; the same product over other processes is
a change that may be made (a run started on 2 GPUs resumes on 1 with --grad-accumulation doubled).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from speculators.data.store import StoreManifest, file_sha256
from speculators.errors import SpeculatorsError
from speculators.flags import flag_of
from speculators.settings import StreamSettings, TrainConfig
from speculators.train.records import RunRecord, TrainingState
from speculators.verifier.loading import add_sampled_file

# A streamed run's states are computed as it goes: how they are computed changes their values (at rounding
# level: another backend, dtype, batch or sharding), so a resume keeps it; where they wait and how far ahead
# they are computed leave them as they are.
STATES_COMPUTATION = frozenset({"stream_backend", "stream_dtype", "stream_batch_size", "stream_tensor_parallel_size"})
SHAPES_THE_RUN = frozenset(
    {
        # the loss and what it scores
        "ttt_steps",
        "step_decay",
        "loss",
        "lk_eta",
        "position_weights",
        "aux_noise",
        "loss_positions",
        # the data each step sees, and how many steps there are (the lr schedule spans them)
        "token_budget",
        "grad_accumulation",  # compared as packs per step: x WORLD_SIZE
        "epochs",
        "max_steps",
        "seed",
        "validation_share",
        # the optimizer and its schedule
        "lr",
        "warmup",
        "weight_decay",
        "grad_clip",
        "optimizer",
        "precision",  # compared as resolved on the device (auto: bf16 where native), see RunRecord.compute_dtype
        # P-EAGLE's depth sampling and mask token
        "cod_ratio",
        "cod_ratio_min",
        "mask_token_id",
        # the drafter: what trains, and its shape
        "algorithm",
        "train_lm_head",
        "fc_norm",
        "num_draft_layers",
        "draft_layer_type",
        "aux_layer_ids",
        # the K the validation replay measures at: the best drafter's recorded acceptance is at it
        "speculative_tokens",
        # DFlash: the block, the anchors drawn per pack, the slot weights and the mask slots' token
        "block_size",
        "max_anchors",
        "dflash_loss",
        "dflash_gamma",
    }
    | STATES_COMPUTATION
)
BY_CONTENT = frozenset({"store", "verifier", "warm_start"})
# Validation and checkpoints neither read the random state nor touch the weights, so the schedules only
# change which steps are scored (and so which of them checkpoints/best keeps) and where a kill resumes;
# DDP and FSDP2 compute the same steps and checkpoints hold full tensors; the verifier name is metadata.
# The streamed mode's settings (StreamSettings) say where and how the states are computed, not which: a
# streamed run reads the bytes a stored run would, in the same order.
MAY_CHANGE = frozenset(
    {"log_every", "eval_every", "checkpoint_every", "progress", "device", "fsdp", "verifier_name"}
    | (set(StreamSettings.model_fields) - STATES_COMPUTATION)
)
NOT_COMPARED = frozenset({"output", "restart"})


def value_text(value: Any) -> str:
    """A setting's value as a change note shows it."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def flag_phrase(name: str, value: Any) -> str:
    """A setting as the flags that give it: `--lr 0.001`, `--fc-norm`, `--no-fc-norm`, `no --max-steps`."""
    flag = flag_of(name, TrainConfig.model_fields[name])
    if value is None:
        return f"no {flag}"
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    return f"{flag} {value_text(value)}"


def store_content(store: str | Path, streamed: bool = False) -> str:
    """Identity of a store's data: its verifier's fingerprint, the samples in data order (ids, content
    keys, shard checksums), the aux layers and storage, and the draft vocabulary's bytes. A store moved
    elsewhere keeps its identity; one with a sample more, less or recomputed, or a rebuilt vocabulary,
    does not. An index (datagen --index-only) has an identity too: its entries without states hash as
    'none', so it differs from the complete store of the same data. `streamed`: the checksums left out (a
    streamed run computes the states it reads, and its --keep fills checksums into the store's manifest: the
    keys, content addresses, still name the data)."""
    folder = Path(store)
    manifest = StoreManifest.read(folder / "manifest.json")
    digest = hashlib.sha256()
    header = [manifest.verifier.fingerprint, manifest.aux_layer_ids, manifest.target_layer_id, manifest.storage]
    digest.update(json.dumps(header).encode())
    for entry in manifest.samples:
        checksum = "streamed" if streamed else entry.checksum or "none"  # (none: an index entry)
        digest.update(f"\n{entry.id}|{entry.key}|{checksum}".encode())
    vocab = folder / "draft_vocab.safetensors"
    digest.update(f"\nvocab:{file_sha256(vocab) if vocab.is_file() else 'none'}".encode())
    return digest.hexdigest()[:24]


def drafter_content(folder: str | Path) -> str:
    """Identity of a drafter checkpoint (a warm start): its config, and its weights' size and 16 blocks
    of 64 KiB spread over them (as a verifier's fingerprint samples its weights)."""
    directory = Path(folder)
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.json")) + sorted(directory.glob("*.safetensors")):
        add_sampled_file(digest, path, separator="\n")
    return digest.hexdigest()[:24]


def run_record(config: TrainConfig, world_size: int, compute_dtype: str) -> RunRecord:
    """The record of the run `config` starts on `world_size` processes computing in `compute_dtype`."""
    warm = config.warm_start
    return RunRecord(
        settings=config.model_dump(mode="json", exclude=set(NOT_COMPARED)),
        world_size=world_size,
        compute_dtype=compute_dtype,
        store_content=store_content(config.store, streamed=config.hidden_states == "streamed"),
        warm_start_content=drafter_content(warm) if warm and Path(warm).is_dir() else None,
    )


def recorded_state(last: Path, output: str) -> TrainingState:
    """The trainer state of checkpoints/last, read before anything of the run is built; one line if unreadable."""
    try:
        return TrainingState.read(last / "trainer_state.json")
    except (OSError, ValueError) as error:  # (pydantic's ValidationError is a ValueError)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise SpeculatorsError(
            f"the resumable checkpoint {last} cannot be resumed by this run ({reason}); pass --restart to train "
            f"{output} afresh, or train into a new --output"
        ) from None


def refuse(last: Path, output: str, trained: str, asks: str, fix: str) -> SpeculatorsError:
    return SpeculatorsError(
        f"{last} was trained {trained}, this run {asks}; {fix}, or pass --restart to train {output} afresh"
    )


def refuse_change(last: Path, output: str, name: str, old: Any, new: Any) -> SpeculatorsError:
    return refuse(
        last,
        output,
        f"with {flag_phrase(name, old)}",
        f"asks for {flag_phrase(name, new)}",
        f"resume with {flag_phrase(name, old)}",
    )


def check_resume(last: Path, recorded: RunRecord, current: RunRecord, output: str) -> dict[str, list[Any]]:
    """The changes a resume may make (flag -> [before, after]); a change to what shaped the run is
    refused in one line (the first such change, in the order of TrainConfig's fields)."""
    # (a setting added after the checkpoint was written: the run had its default, which is what it did then)
    defaults = {name: info.get_default(call_default_factory=True) for name, info in TrainConfig.model_fields.items()}
    before, after = {**defaults, **recorded.settings}, current.settings
    packs_before = recorded.world_size * before["grad_accumulation"]
    packs_after = current.world_size * after["grad_accumulation"]
    if packs_before != packs_after:
        raise refuse(
            last,
            output,
            f"on {packs_before} packs per step ({recorded.world_size} process(es) x --grad-accumulation "
            f"{before['grad_accumulation']})",
            f"takes {packs_after} ({current.world_size} x {after['grad_accumulation']})",
            f"resume with processes (torchrun --nproc-per-node) x --grad-accumulation = {packs_before}",
        )
    if recorded.store_content != current.store_content:
        raise refuse(
            last,
            output,
            f"on the data of --store {before['store']} (content {recorded.store_content})",
            f"reads other data from --store {after['store']} (content {current.store_content}: samples or draft "
            "vocabulary changed)",
            "resume on the data it was trained on",
        )
    changes: dict[str, list[Any]] = {}
    for name in TrainConfig.model_fields:
        if name in NOT_COMPARED:
            continue
        old, new = before[name], after[name]
        if name == "warm_start":
            if recorded.warm_start_content != current.warm_start_content and old is not None and new is not None:
                raise refuse(
                    last,
                    output,
                    f"from --warm-start {old} (weights {recorded.warm_start_content})",
                    f"starts from --warm-start {new} (weights {current.warm_start_content})",
                    "resume with the drafter it started from",
                )
            if recorded.warm_start_content != current.warm_start_content:  # one of them without a warm start
                raise refuse_change(last, output, name, old, new)
        elif name == "precision":  # the same compute dtype under another name (auto, bf16) may change
            if recorded.compute_dtype != current.compute_dtype:
                raise refuse(
                    last,
                    output,
                    f"with {flag_phrase(name, old)} (computing in {recorded.compute_dtype})",
                    f"asks for {flag_phrase(name, new)} (computing in {current.compute_dtype})",
                    f"resume with --precision {recorded.compute_dtype}",
                )
        elif name == "grad_accumulation":  # (compared as packs per step with the world size, above)
            pass
        elif old != new and name in SHAPES_THE_RUN:
            raise refuse_change(last, output, name, old, new)
        if old != new:  # MAY_CHANGE, a path of BY_CONTENT with the same content, or precision by another name
            changes[flag_of(name, TrainConfig.model_fields[name])] = [old, new]
    if recorded.world_size != current.world_size:
        changes["WORLD_SIZE"] = [recorded.world_size, current.world_size]
    return changes


def changes_text(changes: dict[str, list[Any]]) -> str:
    """`--log-every 10 -> 5, --no-progress`-style notes of the changes a resume made."""
    return ", ".join(f"{flag} {value_text(old)} -> {value_text(new)}" for flag, (old, new) in changes.items())


def announce_resume(last: Path, step: int, changes: dict[str, list[Any]], checked: bool) -> None:
    """The resume's progress line: its step and the settings changed since (or that none could be checked)."""
    if not checked:
        print(
            f"warning: {last} was written before checkpoints recorded their run's settings; resuming at step {step} "
            "without checking that the settings, the store's data, the warm start and WORLD_SIZE are the ones it "
            "was trained with (pass --restart to train afresh if any changed)",
            file=sys.stderr,
            flush=True,
        )
        return
    since = f"; changed since: {changes_text(changes)}" if changes else ""
    print(f"resuming from {last} at step {step}{since}", flush=True)
