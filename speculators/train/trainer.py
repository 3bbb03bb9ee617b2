"""`speculators train`: drafter training from a hidden-state store (EAGLE-3 with training-time test today).

The loop (`train_run`), readable top to bottom: the run set up or resumed, then per optimizer step the
step, a log line every --log-every steps, validation and checkpoints; the final drafter and the summary
at the end. What it calls lives beside it: run.py (the set-up and what the loop shares), step.py (one
optimizer step), objectives.py (the drafter's forward, loss and validation replay: where another
drafter plugs in), distributed.py (processes, device, precision, DDP / FSDP2), optim.py, checkpoints.py,
validation.py, metrics.py, resume.py. Launch with `torchrun --nproc-per-node N speculators train ...`
for DDP (gloo on CPU, NCCL on GPUs), or add `--fsdp` for FSDP2 sharding.

Outputs under --output:
    drafter/                 the final drafter (speculators format, validated)
    checkpoints/last/        resumable state every --checkpoint-every steps (drafter + trainer state)
    checkpoints/best/        the drafter with the best validation loss
    train_log.jsonl          one JSON line per log / eval event
    summary.json             final metrics, tokens/s, wall time
    training_curves.png      loss and per-step accuracy
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from speculators.atomic_io import exclusive_lock
from speculators.data.spool import STREAM_SPOOL_ENV, SUPERVISOR_ENV, Cursor, exit_with
from speculators.errors import SpeculatorsError
from speculators.settings import TrainConfig, TrainRecipe
from speculators.train.checkpoints import (
    gather_full_state,
    load_checkpoint,
    publish_drafter,
    save_run_checkpoints,
    start_afresh,
)
from speculators.train.distributed import end_distributed, training_device, uses_bf16, world_size
from speculators.train.metrics import LogWindow, MetricsLog, WallClock, plot_curves
from speculators.train.optim import lr_at
from speculators.train.records import Resumption, TrainingState, TrainingSummary
from speculators.train.resume import announce_resume, check_resume, recorded_state, run_record
from speculators.train.run import Run, start_run
from speculators.train.step import optimizer_step
from speculators.train.validation import run_validation

__all__ = ["TrainConfig", "TrainRecipe", "TrainingSummary", "train"]


def train(config: TrainConfig) -> TrainingSummary | None:
    """Train, holding the run folder's lock on rank 0: a second `train` into the same folder waits,
    then resumes from the first's last checkpoint (nothing is trained twice). The summary; None off rank 0."""

    if config.hidden_states == "streamed" and not os.environ.get(STREAM_SPOOL_ENV):
        from speculators.train.stream import run_streamed

        return run_streamed(config)  # (the supervisor: it starts this function again as its trainer)
    # (the other ranks follow rank 0 through the collectives; a streamed run's supervisor holds the lock)
    if os.environ.get(SUPERVISOR_ENV):
        exit_with(int(os.environ[SUPERVISOR_ENV]))  # (a SIGKILLed supervisor leaves no trainer behind)
    if int(os.environ.get("RANK", "0")) != 0 or os.environ.get(STREAM_SPOOL_ENV):
        return train_run(config)
    with exclusive_lock(config.output, "training run"):
        return train_run(config)


def train_run(config: TrainConfig) -> TrainingSummary | None:
    """The run from where it starts to its final drafter: one optimizer step at a time, a log line every
    --log-every steps, validation and checkpoints between steps. The summary; None off rank 0."""
    run, state = start_or_resume(config)
    clock, window = WallClock(state.wall_seconds), LogWindow()
    log_path = run.output / "train_log.jsonl"
    log = MetricsLog(log_path, run.rank, config.progress, run.total_steps, state.step)
    run.model.train()
    try:
        for step in range(state.step, run.total_steps):
            if run.train_packs.spool is not None:
                with window.paused():  # (tokens/s: the trainer's while fed; the waits are counted apart)
                    feed_step(run, step)
            optimizer_step(run, step, window)
            state.step = step + 1
            log.bar.update(1)
            if state.step % config.log_every == 0 or state.step == run.total_steps:
                metrics, tokens, seconds = window.close(run.world)
                state.tokens += tokens
                state.train_seconds += seconds
                log.train(
                    {
                        "event": "train",
                        "step": state.step,
                        "objective": config.objective,
                        "wall_seconds": clock.seconds(),
                        "lr": lr_at(step, run.total_steps, config),
                        "tokens_per_second": tokens / seconds,
                        **metrics,
                    },
                    epoch=state.step / run.steps_per_epoch,
                )
            with window.paused():
                validate_and_checkpoint(run, state, log, clock)
    except RuntimeError as error:
        if "out of memory" in str(error).lower() or "can't allocate" in str(error).lower():
            raise SpeculatorsError(
                f"ran out of memory with --token-budget {config.token_budget}; reduce it (or --ttt-steps)"
            ) from None
        raise
    finally:
        log.close()
    summary = finish(run, state, clock, log_path)
    end_distributed(run.world)
    return summary


def start_or_resume(config: TrainConfig) -> tuple[Run, TrainingState]:
    """The run set up, and where it starts: resumed from checkpoints/last (its record checked first), or
    step 0 (under --restart, its step-0 checkpoint replaces the earlier run's)."""
    last = Path(config.output) / "checkpoints" / "last"
    resuming = (last / "trainer_state.json").is_file() and not config.restart
    # Checked before anything is built or written: a refused resume leaves the run folder as it was.
    device = training_device(config)
    record = run_record(config, world_size(), "bf16" if uses_bf16(config, device) else "fp32")
    recorded = recorded_state(last, config.output).run if resuming else None
    changes = check_resume(last, recorded, record, config.output) if recorded is not None else {}
    run = start_run(config)
    state = TrainingState.start()
    if resuming:
        state = load_checkpoint(last, run.model, run.optimizers)
        state.resumes = [*state.resumes, Resumption(step=state.step, changes=changes, settings_checked=bool(recorded))]
        if run.rank == 0:
            announce_resume(last, state.step, changes, checked=recorded is not None)
    if state.step == 0 and (last / "trainer_state.json").is_file():
        start_afresh(run, state, record)
    state.run = record
    return run, state


def validate_and_checkpoint(run: Run, state: TrainingState, log: MetricsLog, clock: WallClock) -> None:
    """Every --eval-every steps: validation, and the best drafter kept; every --checkpoint-every steps
    (and at the end): the resumable checkpoint."""
    config, step = run.config, state.step
    evaluate = step % config.eval_every == 0 or step == run.total_steps
    save_last = step % config.checkpoint_every == 0 or step == run.total_steps
    improved = evaluate and validate(run, state, log, clock)
    if not (save_last or improved):
        return
    state.wall_seconds = clock.seconds()
    save_run_checkpoints(run, state, best=improved, last=save_last)
    if save_last and run.train_packs.spool is not None and run.rank == 0:
        # A resume starts here: the spool's units of earlier steps are never read again.
        spool, cursor = run.train_packs.spool, run.train_packs.spool.cursor()
        assert cursor is not None
        spool.write_cursor(cursor.model_copy(update={"checkpoint_step": step}))
        spool.delete_units_before(step)


def feed_step(run: Run, step: int) -> None:
    """A streamed run's states for step `step`: its spool unit opened (waited for), and rank 0's cursor moved
    on so the producers compute the steps ahead."""
    packs = run.train_packs
    assert packs.spool is not None
    if run.rank != 0:
        packs.open_unit(step, run.config.stream_timeout)
        return
    previous = packs.spool.cursor()
    checkpoint = previous.checkpoint_step if previous is not None and previous.checkpoint_step <= step else step
    cursor = Cursor(step=step, checkpoint_step=checkpoint, total_steps=run.total_steps, wait_seconds=packs.wait_seconds)
    packs.spool.write_cursor(cursor)
    waited = packs.wait_seconds
    packs.open_unit(step, run.config.stream_timeout)
    if packs.wait_seconds - waited > 0.01:  # (the supervisor's wait share counts this wait too)
        packs.spool.write_cursor(cursor.model_copy(update={"wait_seconds": packs.wait_seconds}))


def validate(run: Run, state: TrainingState, log: MetricsLog, clock: WallClock) -> bool:
    """A validation pass, logged; whether its loss is the best so far (then kept in `state`)."""
    k = run.drafter.config.speculative_tokens
    metrics = run_validation(
        run.model, run.objective, run.val_packs, run.config, run.device, run.rank, run.world, run.in_vocab
    )
    if metrics is None:
        return False
    record = {
        "event": "validation",
        "step": state.step,
        "objective": run.config.objective,
        "wall_seconds": clock.seconds(),
    }
    log.validation({**record, **metrics}, k)
    best = state.best_validation_loss
    improved = best is None or sum(metrics["loss"]) < best
    if improved:
        state.best_validation_loss, state.best_validation = sum(metrics["loss"]), metrics
    return improved


def finish(run: Run, state: TrainingState, clock: WallClock, log_path: Path) -> TrainingSummary | None:
    """The final drafter (validated), summary.json and the curves; the summary (None off rank 0)."""

    model_state, _ = gather_full_state(run.model, [])  # (collective)
    if run.rank != 0:
        return None
    output = run.output
    publish_drafter(run, model_state)
    last_train = [json.loads(x) for x in log_path.read_text().splitlines() if '"train"' in x][-1]
    summary = TrainingSummary(
        steps=state.step,
        epochs=state.step / run.steps_per_epoch,
        train_tokens=state.tokens,
        train_seconds=round(state.train_seconds, 2),
        wall_seconds=clock.seconds(),
        tokens_per_second=round(state.tokens / max(state.train_seconds, 1e-9), 1),
        world_size=run.world,
        final_train={k: v for k, v in last_train.items() if k not in ("event",)},
        best_validation_loss=state.best_validation_loss,
        best_validation=state.best_validation,
        drafter=str(output / "drafter"),
        config=run.config.model_dump(),
        objective=run.config.objective,
        resumed=state.resumes,
    )
    summary.write(output / "summary.json")
    plot_curves(log_path, output / "training_curves.png")
    return summary
