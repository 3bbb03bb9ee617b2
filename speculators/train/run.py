"""A training run's set-up and what the loop and its helpers share (`Run`): the processes, the packed
store, the verifier's head (the targets), the drafter built for the verifier or warm-started, its
objective, the wrapped model and its optimizers, and the step counts."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from speculators.data.spool import STREAM_SPOOL_ENV, VALIDATION_UNIT
from speculators.errors import SpeculatorsError
from speculators.models.algorithms import algorithm_named, algorithm_of_checkpoint
from speculators.models.eagle3 import Eagle3Drafter
from speculators.settings import TrainConfig
from speculators.train.data import PackedStore
from speculators.train.distributed import init_distributed, uses_bf16, wrap_model
from speculators.train.objectives import objective_for
from speculators.train.optim import build_optimizer
from speculators.train.plan import TrainingPlan
from speculators.train.validation import greedy_in_draft_vocab
from speculators.train.vocab import load_draft_vocab
from speculators.verifier.loading import VerifierHead, checkpoint_verifier_name, default_aux_layer_ids, local_model_dir
from speculators.verifier.mask_token import default_mask_token_id

if TYPE_CHECKING:
    import torch
    from torch import nn

    from speculators.data.store import StoreManifest
    from speculators.train.objectives import Objective
    from speculators.verifier.loading import VerifierFacts


@dataclass
class Run:
    """What the loop and its helpers share: settings, the distributed layout, the model, the data."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    drafter: Eagle3Drafter  # the plain drafter: its config, lm_head and parameters
    objective: Objective  # the drafter's forward, loss and validation replay (built from its algorithm)
    model: nn.Module  # the objective's forward the loop calls, wrapped for DDP / FSDP2
    optimizers: list[torch.optim.Optimizer]
    train_packs: PackedStore
    val_packs: PackedStore
    in_vocab: dict[int, torch.Tensor]  # per validation pack: the verifier's greedy token is in the draft vocab
    plan: TrainingPlan  # which samples each optimizer step's packs hold (the producers' too, when streamed)
    steps_per_epoch: int
    total_steps: int

    @property
    def output(self) -> Path:
        return Path(self.config.output)


def packed_stores(config: TrainConfig) -> tuple[PackedStore, PackedStore]:
    """The training packs (scoring `loss_positions`) and the validation packs (answers only: the
    replay measures decoding, which drafts answers)."""

    store, budget, share = config.store, config.token_budget, config.validation_share
    spool = stream_spool(config)
    train_packs = PackedStore(
        store, budget, "train", share, config.seed, loss_positions=config.loss_positions, spool=spool
    )
    return train_packs, PackedStore(store, budget, "validation", share, seed=-1, spool=spool)


def stream_spool(config: TrainConfig) -> str | None:
    """The spool a streamed run reads its states from: its supervisor's (speculators.train.stream), or its own
    for a producer (which reads the index's entries and never a shard); None for a stored run."""
    if config.hidden_states != "streamed":
        return None
    return os.environ.get(STREAM_SPOOL_ENV) or config.spool or str(Path(config.output) / "spool")


def start_run(config: TrainConfig) -> Run:
    """Processes, data, verifier head, drafter, its objective, optimizers; the verifier's weights are let go."""
    import torch

    rank, world, device = init_distributed(config)
    torch.manual_seed(config.seed)
    train_packs, val_packs = packed_stores(config)
    manifest = train_packs.manifest
    if val_packs.spool is not None:  # (kept open to the end: every validation reads it)
        val_packs.open_unit(VALIDATION_UNIT, config.stream_timeout)
    vocab = load_draft_vocab(config.store)
    verifier = VerifierHead.from_source(config.verifier, dtype=manifest.verifier.dtype)
    check_store_fits_verifier(manifest, verifier, config.store)
    drafter = build_drafter(config, verifier, manifest, vocab).to(device)
    for packs in (train_packs, val_packs):  # (a store may keep more layers than this drafter reads)
        packs.read_aux_layers(drafter.config.eagle_aux_hidden_state_layer_ids)
    if uses_bf16(config, device) and not config.train_lm_head:
        drafter.lm_head.to(torch.bfloat16)  # frozen: autocast would re-cast it on every call
    head = (verifier.final_norm.float().to(device), verifier.lm_head_weight[vocab["selected_ids"]].float().to(device))
    in_vocab = greedy_in_draft_vocab(val_packs, verifier, vocab["selected_ids"], device, rank, world)
    del verifier
    objective = objective_for(config, drafter, head)
    model = wrap_model(objective.forward_module(drafter), drafter, world, device, config.fsdp)
    plan = training_plan(config, train_packs, world)
    steps_per_epoch, total_steps = plan.steps_per_epoch, plan.total_steps
    return Run(
        config,
        rank,
        world,
        device,
        drafter,
        objective,
        model,
        build_optimizer(drafter, config, device),
        train_packs,
        val_packs,
        in_vocab,
        plan,
        steps_per_epoch,
        total_steps,
    )


def training_plan(config: TrainConfig, train_packs: PackedStore, world: int) -> TrainingPlan:
    """The run's plan over the training packs' samples on `world` processes."""
    return TrainingPlan(
        lengths=train_packs.lengths,
        token_budget=config.token_budget,
        seed=config.seed,
        world=world,
        grad_accumulation=config.grad_accumulation,
        epochs=config.epochs,
        max_steps=config.max_steps,
    )


def build_drafter(
    config: TrainConfig, verifier: VerifierHead, manifest: StoreManifest, vocab: dict[str, torch.Tensor]
) -> Eagle3Drafter:
    """The drafter of --algorithm: warm-started, or new for the verifier over the store's vocab and aux layers."""
    algorithm = algorithm_named(config.algorithm)
    selected = vocab["selected_ids"]
    if config.warm_start:
        drafter = warm_start_drafter(config, manifest, selected, verifier)
    else:
        shape = config.drafter_shape(selected.numel(), drafter_aux_layers(config, manifest, verifier.num_layers))
        if algorithm.parallel:
            shape = replace(shape, mask_token_id=mask_token_of(config, verifier))
        name = checkpoint_verifier_name(config.verifier, verifier.name_or_path, config.verifier_name)
        drafter = algorithm.part("drafter")(algorithm.part("config_for_verifier")(verifier.config, name, shape))
        drafter.reset_parameters(seed=config.seed)
        drafter.init_draft_vocab(selected, verifier.lm_head_weight)
    drafter.attach_verifier_embeddings(verifier.embedding_weight.float())
    drafter.lm_head.weight.requires_grad_(config.train_lm_head)
    return drafter


def drafter_aux_layers(config: TrainConfig, manifest: StoreManifest, verifier_layers: int) -> list[int]:
    """The store's aux layers a new drafter reads: --aux-layer-ids, else the algorithm's default among the
    store's (Algorithm.aux_layers_of_store); one error where the algorithm or the store cannot take them."""
    algorithm, stored = algorithm_named(config.algorithm), manifest.aux_layer_ids
    if config.aux_layer_ids is None:
        return algorithm.aux_layers_of_store(stored, default_aux_layer_ids(verifier_layers))
    problem = algorithm.aux_layers_problem(config.aux_layer_ids, stored)
    if problem:
        raise SpeculatorsError(f"--aux-layer-ids: {problem}")
    return list(config.aux_layer_ids)


def mask_token_of(config: TrainConfig, verifier: VerifierHead) -> int:
    """A parallel drafter's mask token: --mask-token-id, else a special token of the verifier's tokenizer
    that chat text never holds (speculators.verifier.mask_token), the one default of every algorithm."""
    if config.mask_token_id is not None:
        return config.mask_token_id
    return default_mask_token_id(local_model_dir(verifier.name_or_path))


def warm_start_drafter(
    config: TrainConfig, manifest: StoreManifest, selected: torch.Tensor, verifier: VerifierHead
) -> Eagle3Drafter:
    """The --warm-start drafter, checked against this run's algorithm, store and settings; a drafter of an
    algorithm this one warm-starts from (P-EAGLE from EAGLE-3) becomes this algorithm's."""
    assert config.warm_start is not None
    algorithm, found = algorithm_named(config.algorithm), algorithm_of_checkpoint(config.warm_start)
    if found.name != algorithm.name and found.name not in algorithm.warm_starts_from:
        takes = ", ".join((algorithm.name, *algorithm.warm_starts_from))
        raise SpeculatorsError(
            f"warm start {config.warm_start} is a {found.name} drafter, and --algorithm {algorithm.name} starts "
            f"from {takes} drafters; pass --algorithm {found.name} or another warm start"
        )
    drafter = found.part("drafter").from_pretrained(config.warm_start, dtype="float32")
    reads = drafter.config.eagle_aux_hidden_state_layer_ids
    if not set(reads) <= set(manifest.aux_layer_ids):
        raise SpeculatorsError(
            f"warm start {config.warm_start} reads aux layers {reads} but the store keeps {manifest.aux_layer_ids}; "
            f"capture them into the store (datagen --aux-layer-ids) or start afresh"
        )
    if config.aux_layer_ids is not None and config.aux_layer_ids != reads:
        raise SpeculatorsError(
            f"--aux-layer-ids {config.aux_layer_ids} differs from the aux layers {reads} warm start "
            f"{config.warm_start} reads; leave --aux-layer-ids out (a warm start keeps its own) or start afresh"
        )
    if drafter.config.draft_vocab_size != selected.numel():
        raise SpeculatorsError(
            f"warm start {config.warm_start} has a draft vocab of {drafter.config.draft_vocab_size}, the store's "
            f"vocab has {selected.numel()}; rebuild it with --draft-vocab-size {drafter.config.draft_vocab_size}"
        )
    if config.fc_norm and not getattr(drafter.config, "fc_norm", True):
        raise SpeculatorsError(
            f"--fc-norm asks for per-aux-state norms but warm start {config.warm_start} was built with one "
            "norm over all three; leave --fc-norm out (the warm start's architecture is kept) or train anew"
        )
    drafter.set_vocab_mapping(selected)  # the store's vocabulary; lm_head rows stay the warm start's
    if found.name != algorithm.name:
        drafter = algorithm.part("drafter").from_warm_start(drafter, mask_token_of(config, verifier), config.seed)
    return drafter


def check_store_fits_verifier(manifest: StoreManifest, verifier: VerifierFacts, store: str) -> None:
    stored = manifest.verifier
    if max(manifest.aux_layer_ids) > verifier.num_layers:
        raise SpeculatorsError(
            f"store {store} holds aux layers {manifest.aux_layer_ids} but the verifier has {verifier.num_layers} "
            f"layers; pass the store's verifier ({stored.name_or_path})"
        )
    if stored.hidden_size != verifier.hidden_size or stored.vocab_size != verifier.vocab_size:
        raise SpeculatorsError(
            f"store {store} was captured from a verifier with hidden {stored.hidden_size} / vocab "
            f"{stored.vocab_size}, not {verifier.hidden_size} / {verifier.vocab_size}; pass the store's verifier "
            f"({stored.name_or_path})"
        )
    if stored.fingerprint != verifier.fingerprint:
        raise SpeculatorsError(
            f"store {store} was captured from verifier {stored.name_or_path} (fingerprint {stored.fingerprint}), "
            f"whose weights differ from {verifier.name_or_path}; pass the same verifier or re-run datagen"
        )
