"""Checkpoints of a training run: the resumable checkpoint (drafter, optimizer tensors and trainer state,
written atomically; restored on every rank), the full-state gather under DDP / FSDP2 it is written
from, checkpoints/best, the step-0 checkpoint of a restart, and the final drafter, validated before it
is published.

Under --output:
    checkpoints/last/        resumable state every --checkpoint-every steps (drafter + trainer state)
    checkpoints/best/        the drafter with the best validation loss
    drafter/                 the final drafter (speculators format, validated)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import atomic_directory
from speculators.checkpoint.validation import validate_checkpoint
from speculators.errors import SpeculatorsError
from speculators.models.algorithms import algorithm_of_checkpoint
from speculators.models.eagle3 import Eagle3Drafter, is_speculator_checkpoint
from speculators.models.weights import read_safetensors
from speculators.train.records import RunRecord, TrainingState

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import ValueType

    from speculators.models.config import Eagle3Config
    from speculators.train.run import Run


def drafter_key(fqn: str) -> str:
    """The drafter's own parameter name from a wrapped model's fully qualified name."""
    return fqn.removeprefix("module.").removeprefix("drafter.")


def gather_full_state(
    model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> tuple[dict[str, ValueType], list[dict[str, Any]]]:
    """Unsharded model and optimizer state on CPU (collective under DDP/FSDP; full on rank 0)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = {drafter_key(k): v for k, v in get_model_state_dict(model, options=options).items()}
    optimizer_states = [get_optimizer_state_dict(model, optimizer, options=options) for optimizer in optimizers]
    return model_state, optimizer_states


def drafter_from_state(config: Eagle3Config, model_state: dict[str, ValueType]) -> Eagle3Drafter:
    """A plain (unsharded) drafter of `config`'s algorithm holding `model_state`, for writing checkpoints."""
    from speculators.models.algorithms import algorithm_named

    drafter = algorithm_named(config.speculators_model_type).part("drafter")(config)
    weights = {k: v for k, v in model_state.items() if not k.startswith("embed_tokens.")}
    drafter.load_state_dict(weights, strict=True)
    return drafter


def save_checkpoint(
    directory: Path, drafter: Eagle3Drafter, optimizer_states: list[dict[str, Any]], state: TrainingState
) -> None:
    """Drafter (speculators format) + optimizer tensors (safetensors) + trainer state (JSON), atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, float] = {}
    groups: list[Any] = []  # each optimizer's param groups (JSON)
    for index, optimizer_state in enumerate(optimizer_states):
        for fqn, param_state in optimizer_state["state"].items():
            for key, value in param_state.items():
                name = f"{index}/{fqn}/{key}"
                if hasattr(value, "dim") and value.dim() > 0:
                    tensors[name] = value.detach().contiguous().cpu()
                else:
                    scalars[name] = float(value)
        groups.append(optimizer_state["param_groups"])
    with atomic_directory(directory, lambda old: (old / "trainer_state.json").is_file()) as tmp:
        drafter.save_pretrained(tmp / "drafter", dtype="float32")
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state.write(tmp / "trainer_state.json", scalars, groups)


def load_checkpoint(directory: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> TrainingState:
    """Restore model and optimizer state on every rank (each reads the full checkpoint); a damaged
    checkpoint, or one of a run with another drafter shape or optimizer, is one error."""
    try:
        return restore_checkpoint(directory, model, optimizers)
    except (SpeculatorsError, KeyError, ValueError, RuntimeError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise SpeculatorsError(
            f"the resumable checkpoint {directory} cannot be resumed by this run ({reason}); pass --restart to train "
            f"{directory.parent.parent} afresh, or train into a new --output"
        ) from None


def restore_checkpoint(directory: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> TrainingState:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # The drafter as its algorithm reads it, under the module's parameter names (a DFlash checkpoint repeats
    # its tied key norm per layer and keeps the mask embedding beside the safetensors).
    found = algorithm_of_checkpoint(directory / "drafter")
    state = found.part("drafter").from_pretrained(directory / "drafter", dtype="float32").state_dict()
    saved = {name: tensor for name, tensor in state.items() if not name.startswith("embed_tokens.")}
    names = {drafter_key(k): k for k in get_model_state_dict(model)}
    model_state: dict[str, ValueType] = {names[k]: v for k, v in saved.items()}
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_state, options=full)
    state = TrainingState.read(directory / "trainer_state.json")
    if state.step == 0:  # a restart's first checkpoint: the optimizers start as built (see start_afresh)
        return state
    if len(state.optimizer_param_groups) < len(optimizers):
        raise SpeculatorsError(
            f"it holds {len(state.optimizer_param_groups)} optimizers, this run has {len(optimizers)}"
        )
    tensors = read_safetensors(directory / "optimizer.safetensors")
    for index, optimizer in enumerate(optimizers):
        per_param: dict[str, dict[str, torch.Tensor]] = {}
        for name, value in [*tensors.items(), *((k, torch.tensor(v)) for k, v in state.optimizer_scalars.items())]:
            owner, fqn, key = name.split("/")
            if int(owner) == index:
                per_param.setdefault(fqn, {})[key] = value
        saved_state = {"state": per_param, "param_groups": state.optimizer_param_groups[index]}
        set_optimizer_state_dict(
            model, optimizer, optim_state_dict=saved_state, options=StateDictOptions(full_state_dict=True)
        )
    return state


def save_run_checkpoints(run: Run, state: TrainingState, best: bool, last: bool) -> None:
    """checkpoints/best (the drafter, on a better validation loss) and checkpoints/last (resumable), from
    the full state gathered on rank 0."""
    model_state, optimizer_states = gather_full_state(run.model, run.optimizers)  # (collective)
    if run.rank == 0:
        snapshot = drafter_from_state(run.drafter.config, model_state)
        if best:
            snapshot.save_pretrained(run.output / "checkpoints" / "best")
        if last:
            save_checkpoint(run.output / "checkpoints" / "last", snapshot, optimizer_states, state)


def start_afresh(run: Run, state: TrainingState, record: RunRecord) -> None:
    """--restart over an earlier run (or a resume of a restart at its step 0). The earlier run's summary
    goes first (a finished run that is resumed writes it again), then this run's step-0 checkpoint
    replaces checkpoints/last atomically, and only then does the earlier run's best drafter go;
    train_log.jsonl starts over with step 0. A kill before the swap leaves the earlier run resumable;
    after it, a plain rerun resumes this one (and removes what is left of the earlier)."""
    output = run.output
    state.run = record
    if run.rank == 0:
        (output / "summary.json").unlink(missing_ok=True)
    # The optimizers have no state before their first step, and stay so: reading it would initialise it
    # with a zero step (torch's _init_optim_state), which shifts AdamW's bias correction.
    model_state, _ = gather_full_state(run.model, [])  # (collective)
    if run.rank == 0:
        snapshot = drafter_from_state(run.drafter.config, model_state)
        save_checkpoint(output / "checkpoints" / "last", snapshot, [], state)
        if (output / "checkpoints" / "best").is_dir():
            shutil.rmtree(output / "checkpoints" / "best")


def publish_drafter(run: Run, model_state: dict[str, ValueType]) -> None:
    """The final drafter (bf16) under <output>/drafter. Validated before it is swapped into place: a
    drafter that fails (non-finite weights included) is never published."""
    with atomic_directory(run.output / "drafter", is_speculator_checkpoint) as staged:
        drafter_from_state(run.drafter.config, model_state).save_pretrained(staged, dtype="bfloat16")
        report = validate_checkpoint(staged, verifier=run.config.verifier)
        if not report.ok:
            raise SpeculatorsError(f"the trained drafter failed validation: {'; '.join(report.problems)}")
