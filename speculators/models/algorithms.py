"""The drafting algorithms, and where every stage finds an algorithm's parts: one registry.

A drafting algorithm (EAGLE-3, P-EAGLE, DFlash) is a model module under `speculators/models/` (its
config, its drafter, the names and shapes of its checkpoint) plus what the higher stages need of it: the
training objective the loop runs (`speculators.train`), the proposer the offline evaluator drafts with
(`speculators.eval`). The trainer, the evaluator, `validate`, `convert` and the bench reach a drafter only
through `algorithm_named` / `algorithm_of_checkpoint`, so a new algorithm is its modules and one entry
here, not a branch in each stage.

The parts are named by import path ("module:attribute") and imported on first use: the CLI and Dagster
start without torch, and a lower layer never imports a higher one (the trainer asks for its objective
from `speculators.train`, which is where the objective's module lives).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from speculators.errors import SpeculatorsError
from speculators.settings import DrafterAlgorithm, aux_layer_ids_problem, aux_layers_missing_problem


@dataclass(frozen=True)
class Algorithm:
    """One drafting algorithm: its name in config.json (`speculators_model_type`) and its parts."""

    name: DrafterAlgorithm
    summary: str
    parallel: bool  # drafts its K tokens in one drafter forward (P-EAGLE, DFlash), not K forwards (EAGLE-3)
    drafter: str  # the drafter class: from_pretrained(directory, dtype=..., verifier_embeddings=...)
    objective: str  # the training objective class (speculators.train.objectives.Objective)
    proposer: str  # the offline evaluator's proposer class (speculators.eval.evaluate.Proposer)
    # (verifier config, verifier name, DrafterShape) -> a new drafter's config, sized for that verifier
    config_for_verifier: str
    # (directory, drop_training_only) -> speculators.models.weights.Checkpoint: config and tensors, checked
    read_checkpoint: str
    # `speculators convert` of a foreign checkpoint of this algorithm: (raw config, tensors, source, settings,
    # verifier) -> speculators.checkpoint.convert_parallel.ParallelConversion; None: convert.py's EAGLE-3 path
    converter: str | None = None
    # Other algorithms whose drafters a run of this one may warm-start from; the drafter class's
    # `from_warm_start(drafter, mask_token_id, seed)` turns one into this algorithm's.
    warm_starts_from: tuple[str, ...] = ()
    # How many of the store's aux layers the drafter reads: EAGLE-3's fc takes exactly three (low, middle,
    # high); None: any number (DFlash projects however many its config names).
    aux_layers: int | None = 3

    def aux_layers_of_store(self, store_ids: list[int], default_ids: list[int]) -> list[int]:
        """The aux layers a new drafter reads by default from a store holding `store_ids`: all of them where
        the algorithm takes any number or the store holds exactly its count, else the verifier's default
        (`default_ids`) when the store holds those."""
        if self.aux_layers is None or len(store_ids) == self.aux_layers:
            return list(store_ids)
        if len(default_ids) == self.aux_layers and set(default_ids) <= set(store_ids):
            return list(default_ids)
        raise SpeculatorsError(
            f"the store keeps aux layers {store_ids} and {self.name} drafters read {self.aux_layers} of them; "
            f"pass --aux-layer-ids with {self.aux_layers} of those"
        )

    def aux_layers_problem(self, ids: list[int], store_ids: list[int]) -> str | None:
        """What is wrong with a drafter of this algorithm reading aux layers `ids` from a store holding
        `store_ids`, or None."""
        problem = aux_layer_ids_problem(ids, self.aux_layers)
        if problem:
            return problem if self.aux_layers is None else f"{problem} ({self.name} drafters read {self.aux_layers})"
        return aux_layers_missing_problem(ids, store_ids)

    def part(self, which: str) -> Any:
        """The part named by field `which` ("drafter", "objective", "proposer", ...), imported now."""
        path = getattr(self, which)
        if path is None:
            raise SpeculatorsError(f"the {self.name} algorithm has no {which}")
        module_name, _, attribute = path.partition(":")
        return getattr(importlib.import_module(module_name), attribute)


ALGORITHMS: dict[str, Algorithm] = {
    "eagle3": Algorithm(
        name="eagle3",
        summary="EAGLE-3: decoder layers over three verifier states, one draft token per drafter forward",
        parallel=False,
        drafter="speculators.models.eagle3:Eagle3Drafter",
        objective="speculators.train.objectives:TTTObjective",
        proposer="speculators.eval.evaluate:DrafterProposer",
        config_for_verifier="speculators.verifier.loading:draft_config_for_verifier",
        read_checkpoint="speculators.models.weights:read_checkpoint",
    ),
    "dflash": Algorithm(
        name="dflash",
        summary="DFlash: Qwen3 layers over the verifier's projected states draft a block of K mask slots at once",
        parallel=True,
        drafter="speculators.models.dflash:DFlashDrafter",
        objective="speculators.train.dflash_objective:DFlashObjective",
        proposer="speculators.eval.block_proposer:DFlashProposer",
        config_for_verifier="speculators.verifier.loading:dflash_config_for_verifier",
        read_checkpoint="speculators.models.dflash:read_dflash_checkpoint",
        converter="speculators.checkpoint.convert_parallel:dflash_from_foreign",  # z-lab's and the reference's
        aux_layers=None,  # (z-lab's recipe reads five)
    ),
    "peagle": Algorithm(
        name="peagle",
        summary="P-EAGLE: EAGLE-3's layers plus a learned mask_hidden, all K draft tokens in one drafter forward",
        parallel=True,
        drafter="speculators.models.peagle:PEagleDrafter",
        objective="speculators.train.peagle_objective:PEagleObjective",
        proposer="speculators.eval.parallel_proposer:PEagleProposer",
        config_for_verifier="speculators.verifier.loading:peagle_config_for_verifier",
        read_checkpoint="speculators.models.weights:read_checkpoint",
        converter="speculators.checkpoint.convert_parallel:peagle_from_reference",
        warm_starts_from=("eagle3",),  # EAGLE-3's layers, with a fresh mask_hidden
    ),
}


def algorithm_named(name: str) -> Algorithm:
    """The registered algorithm `name`; one sentence naming the ones there are otherwise."""
    if name not in ALGORITHMS:
        later = " (not built yet)" if name in get_args(DrafterAlgorithm) else ""
        raise SpeculatorsError(f"unknown drafting algorithm '{name}'{later}; use one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def algorithm_of_checkpoint(directory: str | Path) -> Algorithm:
    """The algorithm of the speculators checkpoint in `directory` (its config.json's speculators_model_type)."""
    from speculators.models.config import read_json_object

    path = Path(directory) / "config.json"
    raw = read_json_object(path)  # (bounded and strict: a damaged file is one CheckpointFormatError)
    name = raw.get("speculators_model_type")
    if not isinstance(name, str):
        raise SpeculatorsError(f"{path} names no speculators_model_type; pass a speculator checkpoint folder") from None
    return algorithm_named(name)


def read_speculator_checkpoint(directory: str | Path) -> Any:
    """The checked config and tensors (speculators.models.weights.Checkpoint) of the checkpoint in `directory`,
    read by the algorithm it names."""
    return algorithm_of_checkpoint(directory).part("read_checkpoint")(directory)
