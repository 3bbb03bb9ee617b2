"""What a training run reports: the log window (loss sums, tokens and training seconds between log
lines), the metrics log (train_log.jsonl and the console), the run's wall clock across resumes, and the
loss and accuracy curves (training_curves.png)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.models.ttt import summarize
from speculators.train.distributed import all_reduce_sums

if TYPE_CHECKING:
    import torch


class LogWindow:
    """Loss sums, tokens and training seconds since the last log line; `paused` time (validation,
    saving) is not training throughput."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.sums: dict[str, torch.Tensor] | None = None
        self.tokens, self.started, self.paused_seconds = 0, time.perf_counter(), 0.0

    def add(self, sums: dict[str, torch.Tensor], tokens: int) -> None:
        self.sums = sums if self.sums is None else {k: self.sums[k] + v for k, v in sums.items()}
        self.tokens += tokens

    @contextmanager
    def paused(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - started

    def close(self, world: int) -> tuple[dict[str, Any], int, float]:
        """(metrics, tokens, seconds) over every rank (collective); the next window starts now."""
        import torch

        assert self.sums is not None, "a log window closes after at least one step"
        self.sums["tokens"] = torch.tensor([float(self.tokens)], dtype=torch.float64)
        sums = all_reduce_sums(self.sums, world)
        seconds = time.perf_counter() - self.started - self.paused_seconds
        tokens = int(sums.pop("tokens").item())
        self.start()
        return summarize(sums), tokens, seconds


class MetricsLog:
    """Rank 0's train_log.jsonl (one JSON line per event) and the console: a progress bar, or without
    --progress (Dagster, pods) one line per event."""

    def __init__(self, path: Path, rank: int, progress: bool, total_steps: int, step: int):
        from tqdm import tqdm

        self.path, self.total_steps, self.lines = path, total_steps, not progress and rank == 0
        self.file = None
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "w" if step == 0 else "a", encoding="utf-8")  # noqa: SIM115 (held for the run)
        self.bar = tqdm(total=total_steps, initial=step, desc="training", unit="step", disable=not progress or rank)

    def write(self, record: dict[str, Any]) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def train(self, record: dict[str, Any], epoch: float) -> None:
        self.write(record)
        loss, accuracy, speed = sum(record["loss"]), record["full_acc"], record["tokens_per_second"]
        self.bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{accuracy[0]:.3f}", tok_s=f"{speed:.0f}")
        if self.lines:
            print(
                f"step {record['step']}/{self.total_steps} (epoch {epoch:.2f}): loss {loss:.3f}, accuracy per TTT "
                f"step {' / '.join(f'{a:.3f}' for a in accuracy)}, {speed:.0f} tokens/s",
                flush=True,
            )

    def validation(self, record: dict[str, Any], k: int) -> None:
        self.write(record)
        if self.lines:
            print(
                f"validation at step {record['step']}: accuracy per TTT step "
                f"{' / '.join(f'{a:.3f}' for a in record['full_acc'])}, replayed acceptance length "
                f"{record['replayed_acceptance_length']:.2f} at K={k} (estimate "
                f"{record['acceptance_length']:.2f})",
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()
        if self.file:
            self.file.close()


class WallClock:
    """Wall time of the whole run, across resumes."""

    def __init__(self, before: float):
        self.before, self.started = before, time.perf_counter()

    def seconds(self) -> float:
        return round(self.before + time.perf_counter() - self.started, 2)


def plot_curves(log_path: Path, output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines()]
    train = [r for r in rows if r["event"] == "train"]
    val = [r for r in rows if r["event"] == "validation"]
    figure, (loss_axis, acc_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind, series, style in (("train", train, "-"), ("validation", val, "o--")):
        if not series:
            continue
        steps = [r["step"] for r in series]
        loss_axis.plot(steps, [sum(r["loss"]) for r in series], style, label=f"{kind} total loss")
        for s in range(len(series[0]["full_acc"])):
            acc_axis.plot(steps, [r["full_acc"][s] for r in series], style, label=f"{kind} step {s} accuracy")
    loss_axis.set(xlabel="optimizer step", ylabel="KL (sum over TTT steps)", title="loss")
    acc_axis.set(xlabel="optimizer step", ylabel="argmax agreement", title="per-step accuracy", ylim=(0, 1))
    loss_axis.legend(), acc_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
