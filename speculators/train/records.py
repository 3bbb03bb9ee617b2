"""The records `speculators train` writes: the resumable training state (with the record of the run
that wrote it, which a resume checks) and the training summary.

Both are read back by attribute (the trainer on resume; the command line and the Dagster code
location from the summary) and written as the JSON they have always been: the same keys in the same
order. Keys a record does not name (of older or newer files) are kept, never refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, PrivateAttr


class RunRecord(BaseModel):
    """What shaped a run, recorded in its resumable checkpoint: a resume compares its own with it
    (speculators/train/resume.py says what may change)."""

    model_config = ConfigDict(extra="allow")

    settings: dict[str, Any]  # the run's TrainConfig fields as JSON (its --output and --restart left out)
    world_size: int  # processes it trained on (WORLD_SIZE): each takes its share of every step's packs
    compute_dtype: str  # "bf16" or "fp32": --precision as resolved on the device it ran on
    store_content: str  # identity of the store's data: its samples' keys and checksums, the draft vocabulary
    warm_start_content: str | None  # identity of the --warm-start drafter's config and weights, None without one


class Resumption(BaseModel):
    """One resume of a run: where it resumed and which settings that may change did."""

    step: int  # the step it resumed at
    changes: dict[str, list[Any]]  # flag -> [before, after], of the settings that may change between resumes
    settings_checked: bool = True  # False: the checkpoint predates run records, nothing could be compared


class TrainingState(BaseModel):
    """checkpoints/last/trainer_state.json: where a run is, to resume it (the tensors are beside it)."""

    model_config = ConfigDict(extra="allow")

    step: int = 0  # optimizer steps done
    best_validation_loss: float | None = None  # the lowest validation loss so far (sum over TTT steps)
    tokens: int = 0  # training tokens seen (all ranks)
    train_seconds: float = 0.0  # seconds spent in training steps (validation and saving left out)
    best_validation: dict[str, Any] | None = None  # the validation metrics of that best; absent before one
    wall_seconds: float = 0.0  # wall time of the run, across resumes (absent in early checkpoints)
    optimizer_scalars: dict[str, float] = {}  # "<optimizer>/<param>/<key>" -> each scalar of the optimizers' state
    optimizer_param_groups: list[Any] = []  # each optimizer's param groups
    run: RunRecord | None = None  # what shaped the run (absent in checkpoints written before resumes checked it)
    resumes: list[Resumption] = []  # each resume so far, in order
    # The keys in the order they were first set (a file's: its own): the order they are written in.
    _order: list[str] = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any, /) -> None:
        self._order = [name for name in type(self).model_fields if name in self.model_fields_set]
        self._order += list(self.__pydantic_extra__ or {})

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in type(self).model_fields and name not in self._order:
            self._order.append(name)

    @classmethod
    def start(cls) -> Self:
        """The state of a run that has not trained yet."""
        return cls(step=0, best_validation_loss=None, tokens=0, train_seconds=0.0)

    @classmethod
    def read(cls, path: Path) -> Self:
        data = json.loads(path.read_text())
        state = cls.model_validate(data)
        state._order = list(data)
        return state

    def write(self, path: Path, optimizer_scalars: dict[str, float], optimizer_param_groups: list[Any]) -> None:
        """The state with the optimizers' (one-space-indented JSON, no final newline)."""
        data = self.model_dump()
        state = {name: data[name] for name in self._order}
        state |= {"optimizer_scalars": optimizer_scalars, "optimizer_param_groups": optimizer_param_groups}
        path.write_text(json.dumps(state, indent=1))


class TrainingSummary(BaseModel):
    """<output>/summary.json: what a finished run did and how well its drafter drafts."""

    model_config = ConfigDict(extra="allow")

    steps: int  # optimizer steps trained
    epochs: float  # the same in epochs of the training packs
    train_tokens: int  # training tokens seen (all ranks)
    train_seconds: float  # seconds spent in training steps
    wall_seconds: float | None = None  # wall time of the run, across resumes (absent in early summaries)
    tokens_per_second: float  # training throughput: train_tokens / train_seconds
    world_size: int  # processes trained on
    final_train: dict[str, Any]  # the last train log line's metrics (its "event" left out)
    best_validation_loss: float | None = None  # the lowest validation loss, None without validation samples
    best_validation: dict[str, Any] | None = None  # that validation's metrics, None without validation samples
    drafter: str  # the final drafter's folder
    config: dict[str, Any]  # the run's settings (TrainConfig) as its last resume gave them
    objective: dict[str, str] | None = None  # the loss and position weights trained on (absent in early summaries)
    resumed: list[Resumption] = []  # each resume of the run: its step and what changed
    # streamed runs (speculators.train.stream): the producers' and the spool's counts, None for a stored run
    stream: dict[str, Any] | None = None

    @classmethod
    def read(cls, path: Path) -> Self:
        return cls.model_validate(json.loads(path.read_text()))

    def write(self, path: Path) -> None:
        """Two-space-indented JSON and a newline."""
        path.write_text(json.dumps(self.model_dump(), indent=2) + "\n")

    def acceptance(self) -> tuple[float, str]:
        """(acceptance length, what it is): decoding replayed on the validation samples when there are
        any, else the training window's per-token estimate."""
        best = self.best_validation or {}
        if "replayed_acceptance_length" in best:
            return float(best["replayed_acceptance_length"]), "replayed on validation samples"
        return float(self.final_train.get("acceptance_length", 0.0)), "training estimate (no validation samples)"
