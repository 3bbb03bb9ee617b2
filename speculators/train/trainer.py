"""`speculators train`: EAGLE-3 drafter training with training-time test, from a hidden-state store.

One loop, readable top to bottom (`train`); distributed, precision, checkpoint and logging details
live in the small helpers around it. Launch with `torchrun --nproc-per-node N speculators train ...`
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
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import atomic_directory, exclusive_lock
from speculators.checkpoint.validation import validate_checkpoint
from speculators.errors import INT64_MAX, SpeculatorsError
from speculators.models.eagle3 import Eagle3Drafter, is_speculator_checkpoint
from speculators.models.ttt import replay_decoding, row_chunks, summarize, ttt_loss, verifier_target_logits
from speculators.models.weights import read_safetensors
from speculators.precision import check_cuda_device, native_bf16
from speculators.settings import TrainConfig, TrainRecipe
from speculators.train.data import PackedStore
from speculators.train.records import Resumption, RunRecord, TrainingState, TrainingSummary
from speculators.train.resume import changes_text, check_resume, recorded_state, run_record
from speculators.train.vocab import load_draft_vocab
from speculators.verifier.loading import VerifierHead, checkpoint_verifier_name, draft_config_for_verifier

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.checkpoint.state_dict import ValueType

    from speculators.data.store import StoreManifest
    from speculators.models.config import Eagle3Config
    from speculators.train.data import Pack
    from speculators.verifier.loading import VerifierFacts

__all__ = ["TrainConfig", "TrainRecipe", "TrainingSummary", "train"]


# ----- distributed and precision helpers ---------------------------------------------------------


def init_distributed(config: TrainConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun."""
    import torch
    import torch.distributed as dist

    world = world_size()
    rank = int(os.environ.get("RANK", "0"))
    device = training_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if config.fsdp and world == 1:
        raise SpeculatorsError("--fsdp shards over several processes; launch with torchrun --nproc-per-node N")
    return rank, world, device


def world_size() -> int:
    """The processes of the run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def training_device(config: TrainConfig) -> torch.device:
    """This process's device: --device, with auto and cuda meaning cuda:LOCAL_RANK where CUDA is present."""
    import torch

    if config.device == "auto":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    check_cuda_device(config.device)
    # --device cuda: this process's GPU (set_device needs an index)
    return torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if config.device == "cuda" else config.device)


def wrap_model(drafter: Eagle3Drafter, world: int, device: torch.device, fsdp: bool) -> nn.Module:
    """The module the loop calls: TTT forward (normed outputs), wrapped for DDP or FSDP2.

    Under FSDP2 each decoder layer and the lm_head are their own units (the lm_head is applied
    outside the forward, where the loss looks) and this wrapper is the root, so the fc and norms
    stay gathered for the whole TTT forward.
    """
    import torch

    class TTTForward(torch.nn.Module):
        def __init__(self, drafter: Eagle3Drafter):
            super().__init__()
            self.drafter = drafter

        def forward(
            self,
            input_ids: torch.Tensor,
            aux: torch.Tensor,
            steps: int,
            positions: torch.Tensor,
            documents: torch.Tensor,
            loss_mask: torch.Tensor,
        ) -> list[torch.Tensor]:
            return self.drafter.ttt_forward(input_ids, aux, steps, positions, documents, True, loss_mask)

    model = TTTForward(drafter)
    if world == 1:
        return model
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for layer in drafter.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(drafter.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)  # in place: the same module, now an FSDPModule too
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sums(sums: dict[str, torch.Tensor], world: int) -> dict[str, torch.Tensor]:
    if world == 1:
        return sums
    import torch.distributed as dist

    for value in sums.values():
        dist.all_reduce(value)
    return sums


def uses_bf16(config: TrainConfig, device: torch.device) -> bool:

    if config.precision != "auto":
        return config.precision == "bf16"
    return device.type in ("cpu", "cuda") and native_bf16(device.type)


def autocast_context(config: TrainConfig, device: torch.device) -> AbstractContextManager[None]:
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(config, device) else nullcontext()


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup, then linear decay to zero."""
    warmup = max(1, math.ceil(config.warmup * total))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    return config.lr * max(0.0, (total - step) / max(1, total - warmup))


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> list[torch.optim.Optimizer]:
    import torch

    from speculators.train.muon import Muon

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if config.optimizer == "muon":
        # Muon orthogonalises the hidden layers' matrices only; the output head (lm_head, trained under
        # --train-lm-head) is not a hidden layer (Muon's own guidance) and goes with the norms to AdamW.
        is_hidden_matrix = {n: p.dim() == 2 and not f".{n}".endswith(".lm_head.weight") for n, p in trainable}
        matrices = [p for n, p in trainable if is_hidden_matrix[n]]
        others = [p for n, p in trainable if not is_hidden_matrix[n]]
        # Muon scales its orthogonalised step to AdamW's update size, so one --lr serves both (PyTorch's default
        # scaling gives the drafter's matrices 5-7x smaller steps at the same lr); its iteration runs in the
        # dtype training computes in (bf16 on CPUs without it is ~130x slower than fp32).
        ns_dtype = torch.bfloat16 if uses_bf16(config, device) else torch.float32
        return [
            Muon(matrices, lr=config.lr, weight_decay=config.weight_decay, ns_dtype=ns_dtype),
            adamw(others, config),  # the head, norms and biases train as under --optimizer adamw
        ]
    return [adamw([p for _, p in trainable], config)]


def adamw(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    import torch

    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95), fused=True)


# ----- model construction and checks -------------------------------------------------------------


def build_drafter(
    config: TrainConfig, verifier: VerifierHead, manifest: StoreManifest, vocab: dict[str, torch.Tensor]
) -> Eagle3Drafter:

    selected = vocab["selected_ids"]
    if config.warm_start:
        drafter = Eagle3Drafter.from_pretrained(config.warm_start, dtype="float32")
        if drafter.config.eagle_aux_hidden_state_layer_ids != manifest.aux_layer_ids:
            raise SpeculatorsError(
                f"warm start {config.warm_start} reads aux layers {drafter.config.eagle_aux_hidden_state_layer_ids} "
                f"but the store holds {manifest.aux_layer_ids}"
            )
        if drafter.config.draft_vocab_size != selected.numel():
            raise SpeculatorsError(
                f"warm start {config.warm_start} has a draft vocab of {drafter.config.draft_vocab_size}, the store's "
                f"vocab has {selected.numel()}; rebuild it with --draft-vocab-size {drafter.config.draft_vocab_size}"
            )
        if config.fc_norm and not drafter.config.fc_norm:
            raise SpeculatorsError(
                f"--fc-norm asks for per-aux-state norms but warm start {config.warm_start} was built with one "
                "norm over all three; leave --fc-norm out (the warm start's architecture is kept) or train anew"
            )
        drafter.set_vocab_mapping(selected)  # the store's vocabulary; lm_head rows stay the warm start's
    else:
        draft_config = draft_config_for_verifier(
            verifier.config,
            checkpoint_verifier_name(config.verifier, verifier.name_or_path, config.verifier_name),
            config.drafter_shape(selected.numel(), manifest.aux_layer_ids),
        )
        drafter = Eagle3Drafter(draft_config)
        drafter.reset_parameters(seed=config.seed)
        drafter.init_draft_vocab(selected, verifier.lm_head_weight)
    drafter.attach_verifier_embeddings(verifier.embedding_weight.float())
    drafter.lm_head.weight.requires_grad_(config.train_lm_head)
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


# ----- checkpoints -------------------------------------------------------------------------------


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
    """A plain (unsharded) drafter holding `model_state`, for writing checkpoints."""

    drafter = Eagle3Drafter(config)
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

    saved = read_safetensors(directory / "drafter" / "model.safetensors")
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


# ----- evaluation, logging, plots ----------------------------------------------------------------


def validation_share_of(plan: list[list[int]], rank: int, world: int) -> list[int | None]:
    """The validation packs this rank scores, round by round: every rank runs the same number of
    forwards (FSDP2 gathers parameters in each); None marks a repeat of pack 0 that is not counted."""
    return [start + rank if start + rank < len(plan) else None for start in range(0, len(plan), world)]


def greedy_in_draft_vocab(
    packs: PackedStore, verifier: VerifierHead, selected_ids: torch.Tensor, device: torch.device, rank: int, world: int
) -> dict[int, torch.Tensor]:
    """Per validation pack this rank scores, bool [1, T]: the verifier's greedy token over its whole
    vocabulary (at each supervised position) is in the draft vocabulary. Decoding rejects the other
    drafts however well the draft distribution matches; computed once, the full lm_head is not kept."""
    import torch

    plan = packs.pack_plan(0) if packs.entries else []
    norm, lm_head = verifier.final_norm.float().to(device), verifier.lm_head_weight.to(device)
    in_draft = torch.zeros(verifier.vocab_size, dtype=torch.bool, device=device)
    in_draft[selected_ids.to(device)] = True
    result: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for index in validation_share_of(plan, rank, world):
            if index is None:
                continue
            pack = packs.load_pack(plan[index])
            states = pack.target_hidden_states[pack.loss_mask].to(device)
            greedy = torch.empty(states.shape[0], dtype=torch.long, device=device)
            for rows in row_chunks(states.shape[0]):
                greedy[rows] = (norm(states[rows].float()).to(lm_head.dtype) @ lm_head.T).argmax(-1)
            flags = torch.zeros(pack.loss_mask.shape, dtype=torch.bool, device=device)
            flags[pack.loss_mask.to(device)] = in_draft[greedy]
            result[index] = flags
    return result


def run_validation(
    model: nn.Module,
    lm_head: nn.Module,
    packs: PackedStore,
    head: tuple[nn.Module, torch.Tensor],
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
    in_vocab: dict[int, torch.Tensor],
    num_tokens: int,
) -> dict[str, Any] | None:
    """Validation metrics, with decoding replayed at K = `num_tokens`; every rank scores its share of
    the packs (collective)."""
    import torch

    plan = packs.pack_plan(0) if packs.entries else []
    if not plan:
        return None
    # DDP's forward broadcasts buffers (a collective); validation needs none, so use the inner module.
    forward = getattr(model, "module", model)
    sums = {
        k: torch.zeros(config.ttt_steps, dtype=torch.float64, device=device)
        for k in ("kl", "count", "correct", "cond_correct", "cond_count")
    }
    sums["replay_rounds"] = torch.zeros(1, dtype=torch.float64, device=device)
    sums["replay_accepted"] = torch.zeros(num_tokens, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad(), autocast_context(config, device):
        for index in validation_share_of(plan, rank, world):
            pack = to_device(packs.load_pack(plan[index if index is not None else 0]), device)
            normed = forward_pack(forward, pack, config.ttt_steps)
            targets = verifier_target_logits(pack.target_hidden_states[pack.loss_mask], *head)
            hits: list[torch.Tensor] = []
            _, step_sums = ttt_loss(
                normed, targets, pack.loss_mask, pack.document_ids, config.step_decay, lm_head=lm_head, hits=hits
            )
            if index is not None:
                step_sums.update(replay_decoding(hits, pack.loss_mask, pack.document_ids, num_tokens, in_vocab[index]))
                sums = {k: sums[k] + v.to(device) for k, v in step_sums.items()}
    model.train()
    return summarize(all_reduce_sums(sums, world))


def forward_pack(model: torch.nn.Module, pack: Pack, steps: int) -> list[torch.Tensor]:
    """The TTT forward (normed outputs of every step) of one pack, through the wrapped model."""
    return model(pack.input_ids, pack.aux_hidden_states, steps, pack.position_ids, pack.document_ids, pack.loss_mask)


def with_aux_noise(pack: Pack, scale: float, seed: int, draw: int) -> Pack:
    """The pack with Gaussian noise on its aux states, `scale` x each state's RMS (per token and layer:
    the layers' scales differ by orders of magnitude). Seeded per draw, so a resumed run adds the same."""
    from dataclasses import replace

    import torch

    aux = pack.aux_hidden_states.float()
    generator = torch.Generator(device=aux.device).manual_seed(seed * 1_000_003 + draw)
    noise = torch.randn(aux.shape, generator=generator, device=aux.device, dtype=aux.dtype)
    rms = aux.pow(2).mean(-1, keepdim=True).sqrt()
    noisy = aux + noise.mul_(rms * scale)
    return replace(pack, aux_hidden_states=noisy.to(pack.aux_hidden_states.dtype))


def to_device(pack: Pack, device: torch.device) -> Pack:
    from dataclasses import fields, replace

    return replace(pack, **{f.name: getattr(pack, f.name).to(device) for f in fields(pack)})


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


# ----- the run, the log window, the metrics log ---------------------------------------------------


@dataclass
class Run:
    """What the loop and its helpers share: settings, the distributed layout, the model, the data."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    drafter: Eagle3Drafter  # the plain drafter: its config, lm_head and parameters
    model: nn.Module  # the TTT forward the loop calls, wrapped for DDP / FSDP2
    optimizers: list[torch.optim.Optimizer]
    head: tuple[nn.Module, torch.Tensor]  # the verifier's final norm and lm_head rows of the draft vocab: the targets
    train_packs: PackedStore
    val_packs: PackedStore
    in_vocab: dict[int, torch.Tensor]  # per validation pack: the verifier's greedy token is in the draft vocab
    steps_per_epoch: int
    total_steps: int

    @property
    def output(self) -> Path:
        return Path(self.config.output)


def packed_stores(config: TrainConfig) -> tuple[PackedStore, PackedStore]:
    """The training packs (scoring `loss_positions`) and the validation packs (answers only: the
    replay measures decoding, which drafts answers)."""

    store, budget, share = config.store, config.token_budget, config.validation_share
    train_packs = PackedStore(store, budget, "train", share, config.seed, loss_positions=config.loss_positions)
    return train_packs, PackedStore(store, budget, "validation", share, seed=-1)


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


def start_run(config: TrainConfig) -> Run:
    """Processes, data, verifier head, drafter, optimizers; the verifier's weights are let go."""
    import torch

    rank, world, device = init_distributed(config)
    torch.manual_seed(config.seed)
    train_packs, val_packs = packed_stores(config)
    manifest = train_packs.manifest
    vocab = load_draft_vocab(config.store)
    verifier = VerifierHead.from_source(config.verifier, dtype=manifest.verifier.dtype)
    check_store_fits_verifier(manifest, verifier, config.store)
    drafter = build_drafter(config, verifier, manifest, vocab).to(device)
    if uses_bf16(config, device) and not config.train_lm_head:
        drafter.lm_head.to(torch.bfloat16)  # frozen: autocast would re-cast it on every call
    head = (verifier.final_norm.float().to(device), verifier.lm_head_weight[vocab["selected_ids"]].float().to(device))
    in_vocab = greedy_in_draft_vocab(val_packs, verifier, vocab["selected_ids"], device, rank, world)
    del verifier
    model = wrap_model(drafter, world, device, config.fsdp)
    packs_per_step = world * config.grad_accumulation
    steps_per_epoch = len(train_packs.pack_plan(0)) // packs_per_step
    if steps_per_epoch == 0:
        raise SpeculatorsError(
            f"the store has fewer training packs ({len(train_packs.pack_plan(0))}) than one optimizer step uses "
            f"({packs_per_step}); lower --token-budget or --grad-accumulation, or add data"
        )
    total_steps = config.max_steps or steps_of_epochs(config.epochs, steps_per_epoch)
    return Run(
        config,
        rank,
        world,
        device,
        drafter,
        model,
        build_optimizer(drafter, config, device),
        head,
        train_packs,
        val_packs,
        in_vocab,
        steps_per_epoch,
        total_steps,
    )


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


# ----- one optimizer step, validation and checkpoints, the summary ---------------------------------


def optimizer_step(run: Run, step: int, window: LogWindow) -> None:
    """`grad_accumulation` packs per rank, their gradients clipped and applied at step `step`'s lr."""
    import torch

    config, world, model = run.config, run.world, run.model
    epoch, in_epoch = divmod(step, run.steps_per_epoch)
    plan = run.train_packs.pack_plan(epoch)
    for optimizer in run.optimizers:
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_at(step, run.total_steps, config)
    losses: list[tuple[torch.Tensor, list[int], Pack]] = []
    for micro in range(config.grad_accumulation):
        pack_index = (in_epoch * config.grad_accumulation + micro) * world + run.rank
        # Greedy packing of another epoch's order may give a pack less than epoch 0 did.
        entries = plan[pack_index % len(plan)]
        pack = to_device(run.train_packs.load_pack(entries), run.device)
        if config.aux_noise:  # seeded by the pack's place in the run: a resumed run draws the same
            draw = (step * config.grad_accumulation + micro) * world + run.rank
            pack = with_aux_noise(pack, config.aux_noise, config.seed, draw)
        sync = micro == config.grad_accumulation - 1 or world == 1
        no_sync = getattr(model, "no_sync", None)  # DDP's
        with nullcontext() if sync or no_sync is None else no_sync(), autocast_context(config, run.device):
            normed = forward_pack(model, pack, config.ttt_steps)
            # first-step: step 0 (computed on every position anyway) scores them all; later steps the answers
            first = torch.ones_like(pack.loss_mask) if config.loss_positions == "first-step" else None
            needed = pack.loss_mask if first is None else first
            targets = verifier_target_logits(pack.target_hidden_states[needed], *run.head)
            loss, sums = ttt_loss(
                normed,
                targets,
                pack.loss_mask,
                pack.document_ids,
                config.step_decay,
                lm_head=run.drafter.lm_head,
                first_step_mask=first,
            )
            (loss / config.grad_accumulation).backward()
        window.add(sums, pack.num_tokens)
        losses.append((loss.detach(), entries, pack))
    norm = torch.nn.utils.clip_grad_norm_([p for p in run.drafter.parameters() if p.requires_grad], config.grad_clip)
    stop_if_not_finite(run, step, norm, losses)
    for optimizer in run.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def stop_if_not_finite(
    run: Run, step: int, norm: torch.Tensor, losses: list[tuple[torch.Tensor, list[int], Pack]]
) -> None:
    """Stop at the first step whose loss or gradient is not finite, before the optimizer applies it:
    one NaN would otherwise spread through every weight and train a drafter of NaNs. Every rank
    decides alike (one flag all-reduced: one synchronisation per step), and the error names the
    samples whose stored states are not finite, or says that the weights diverged."""
    import torch

    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # (an FSDP2 DTensor)
    finite = torch.isfinite(norm) & torch.stack([torch.isfinite(loss) for loss, _, _ in losses]).all()
    bad = (~finite).to(torch.float32).reshape(1)
    if run.world > 1:
        import torch.distributed as dist

        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if not bad.item():
        return
    entries = run.train_packs.entries
    broken = [
        entries[index].id
        for _, indices, pack in losses
        for document, index in enumerate(indices)
        if not pack_document_finite(pack, document)
    ]
    where = f"training stopped at step {step + 1}: the loss or its gradient is not finite (gradient norm {norm.item()})"
    if broken:
        raise SpeculatorsError(
            f"{where}; the stored hidden states of sample(s) {', '.join(broken[:5])} are not finite: check the store "
            f"with 'speculators verify-store {run.config.store}' and re-run datagen for them"
        )
    samples = ", ".join(entries[index].id for _, indices, _ in losses for index in indices[:5])
    raise SpeculatorsError(
        f"{where} on samples whose stored states are finite ({samples}): the weights diverged; lower --lr "
        f"(now {run.config.lr:g}) or --grad-clip (now {run.config.grad_clip:g})"
    )


def pack_document_finite(pack: Pack, document: int) -> bool:
    import torch

    rows = pack.document_ids[0] == document
    return bool(
        torch.isfinite(pack.aux_hidden_states[0, rows]).all()
        and torch.isfinite(pack.target_hidden_states[0, rows]).all()
    )


def validate_and_checkpoint(run: Run, state: TrainingState, log: MetricsLog, clock: WallClock) -> None:
    """Every --eval-every steps: validation, and the best drafter kept; every --checkpoint-every steps
    (and at the end): the resumable checkpoint."""
    config, step = run.config, state.step
    evaluate = step % config.eval_every == 0 or step == run.total_steps
    save_last = step % config.checkpoint_every == 0 or step == run.total_steps
    improved = False
    if evaluate:
        k = run.drafter.config.speculative_tokens
        metrics = run_validation(
            run.model,
            run.drafter.lm_head,
            run.val_packs,
            run.head,
            config,
            run.device,
            run.rank,
            run.world,
            run.in_vocab,
            k,
        )
        if metrics is not None:
            log.validation({"event": "validation", "step": step, "wall_seconds": clock.seconds(), **metrics}, k)
            best = state.best_validation_loss
            improved = best is None or sum(metrics["loss"]) < best
            if improved:
                state.best_validation_loss, state.best_validation = sum(metrics["loss"]), metrics
    if not (save_last or improved):
        return
    state.wall_seconds = clock.seconds()
    model_state, optimizer_states = gather_full_state(run.model, run.optimizers)  # (collective)
    if run.rank == 0:
        snapshot = drafter_from_state(run.drafter.config, model_state)
        if improved:
            snapshot.save_pretrained(run.output / "checkpoints" / "best")
        if save_last:
            save_checkpoint(run.output / "checkpoints" / "last", snapshot, optimizer_states, state)


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


def finish(run: Run, state: TrainingState, clock: WallClock, log_path: Path) -> TrainingSummary | None:
    """The final drafter (validated), summary.json and the curves; the summary (None off rank 0)."""

    model_state, _ = gather_full_state(run.model, [])  # (collective)
    if run.rank != 0:
        return None
    output = run.output
    # Validated before it is swapped into place: a drafter that fails (non-finite weights included) is
    # never published.
    with atomic_directory(output / "drafter", is_speculator_checkpoint) as staged:
        drafter_from_state(run.drafter.config, model_state).save_pretrained(staged, dtype="bfloat16")
        report = validate_checkpoint(staged, verifier=run.config.verifier)
        if not report.ok:
            raise SpeculatorsError(f"the trained drafter failed validation: {'; '.join(report.problems)}")
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
        resumed=state.resumes,
    )
    summary.write(output / "summary.json")
    plot_curves(log_path, output / "training_curves.png")
    return summary


# ----- the loop ----------------------------------------------------------------------------------


def train(config: TrainConfig) -> TrainingSummary | None:
    """Train, holding the run folder's lock on rank 0: a second `train` into the same folder waits,
    then resumes from the first's last checkpoint (nothing is trained twice). The summary; None off rank 0."""

    if int(os.environ.get("RANK", "0")) != 0:  # (the other ranks follow rank 0 through the collectives)
        return train_run(config)
    with exclusive_lock(config.output, "training run"):
        return train_run(config)


def train_run(config: TrainConfig) -> TrainingSummary | None:
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
    clock, window = WallClock(state.wall_seconds), LogWindow()
    log_path = run.output / "train_log.jsonl"
    log = MetricsLog(log_path, run.rank, config.progress, run.total_steps, state.step)
    run.model.train()
    try:
        for step in range(state.step, run.total_steps):
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
    if run.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return summary
