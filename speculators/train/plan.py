"""The training plan: which samples form which pack, and which packs which optimizer step, for every
world size and gradient accumulation. The trainer reads its packs by it, and in streamed mode the
producers compute exactly the samples it names for the steps ahead, so nothing is skipped, duplicated
or reordered between them.

- An epoch's packs: the training samples in a seeded per-epoch order (`seed * 1_000_003 + epoch`;
  validation, seed < 0, in data order), packed greedily into sequences of at most `token_budget`
  tokens (a sample longer than the budget is cut to it).
- A step's packs: step s of epoch e = s // steps_per_epoch takes `world x grad_accumulation` packs;
  rank r's micro-batch m is pack `(in_epoch x grad_accumulation + m) x world + r` of that epoch's
  packs (modulo their count: another epoch's greedy packing may give a pack less than epoch 0).
- A step's unit (what a producer computes): every sample of its packs, in batches of at most
  `batch_size` samples sorted by (length, index): a function of the plan alone, so a recomputed unit
  sees the same batches.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from speculators.errors import INT64_MAX, SpeculatorsError

VALIDATION_UNIT = -1  # the validation samples' unit: computed first, kept for the whole run


def pack_plan(lengths: tuple[int, ...], token_budget: int, seed: int, epoch: int) -> list[list[int]]:
    """Sample indices per pack for samples of `lengths` tokens; shuffled per epoch unless `seed` < 0."""
    order = list(range(len(lengths)))
    if seed >= 0:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    packs: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index in order:
        length = min(lengths[index] - 1, token_budget)  # (a sample gives T - 1 shifted positions)
        if current and used + length > token_budget:
            packs.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        packs.append(current)
    return packs


def steps_of_epochs(epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of `epochs` passes: at least 1, and a count a step counter holds (--epochs 1e308
    would otherwise overflow, or train for ever)."""
    steps = epochs * steps_per_epoch
    if not steps < INT64_MAX:  # (also inf)
        raise SpeculatorsError(
            f"--epochs {epochs:g} makes {steps:g} optimizer steps ({steps_per_epoch} per epoch), more than a step "
            f"counter holds; give fewer --epochs, or --max-steps"
        )
    return max(1, int(steps))


@dataclass(frozen=True)
class TrainingPlan:
    """The packs of every optimizer step of a run over training samples of `lengths` tokens."""

    lengths: tuple[int, ...]  # the training samples' tokens, in the store's order
    token_budget: int
    seed: int
    world: int  # processes
    grad_accumulation: int  # packs per process per step
    epochs: float = 1.0
    max_steps: int | None = None

    @property
    def packs_per_step(self) -> int:
        return self.world * self.grad_accumulation

    def epoch_packs(self, epoch: int) -> list[list[int]]:
        return _cached_pack_plan(self.lengths, self.token_budget, self.seed, epoch)

    @property
    def steps_per_epoch(self) -> int:
        """Whole optimizer steps per epoch; one error when an epoch's packs do not fill a step."""
        packs = len(self.epoch_packs(0))
        if packs < self.packs_per_step:
            raise SpeculatorsError(
                f"the store has fewer training packs ({packs}) than one optimizer step uses ({self.packs_per_step}); "
                f"lower --token-budget or --grad-accumulation, or add data"
            )
        return packs // self.packs_per_step

    @property
    def total_steps(self) -> int:
        return self.max_steps or steps_of_epochs(self.epochs, self.steps_per_epoch)

    def pack_of(self, step: int, rank: int, micro: int) -> list[int]:
        """The sample indices of rank `rank`'s micro-batch `micro` at optimizer step `step`."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        packs = self.epoch_packs(epoch)
        index = (in_epoch * self.grad_accumulation + micro) * self.world + rank
        return packs[index % len(packs)]

    def step_packs(self, step: int) -> list[list[int]]:
        """Every pack of step `step`, rank by rank, micro-batch by micro-batch."""
        return [self.pack_of(step, r, m) for r in range(self.world) for m in range(self.grad_accumulation)]

    def step_samples(self, step: int) -> list[int]:
        """The distinct sample indices step `step` reads, ascending."""
        return sorted({i for pack in self.step_packs(step) for i in pack})

    def step_batches(self, step: int, batch_size: int) -> list[list[int]]:
        """The step's samples in capture batches (capture_batches)."""
        return capture_batches(self.step_samples(step), self.lengths, batch_size)


def capture_batches(indices: list[int], lengths: tuple[int, ...], batch_size: int) -> list[list[int]]:
    """Samples `indices` (of `lengths` tokens) in capture batches: sorted by (length, index), cut every
    `batch_size`; a function of the samples alone, so a recomputed unit sees the same batches."""
    ordered = sorted(indices, key=lambda i: (lengths[i], i))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


def replica_steps(replica: int, replicas: int, start: int, total_steps: int) -> range:
    """The steps producer `replica` of `replicas` computes from step `start` on: those with
    step % replicas == replica."""
    first = start + (replica - start) % replicas
    return range(first, total_steps, replicas)


@lru_cache(maxsize=4)
def _cached_pack_plan(lengths: tuple[int, ...], token_budget: int, seed: int, epoch: int) -> list[list[int]]:
    # (a step asks for its epoch's packs once per micro-batch; an epoch boundary keeps two epochs cached)
    return pack_plan(lengths, token_budget, seed, epoch)
