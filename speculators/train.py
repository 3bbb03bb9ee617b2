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
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from speculators.errors import SpeculatorsError
from speculators.settings import TrainConfig, TrainRecipe

__all__ = ["TrainConfig", "TrainRecipe", "train"]


# ----- distributed and precision helpers ---------------------------------------------------------


def init_distributed(config: TrainConfig) -> tuple[int, int, Any]:
    """(rank, world size, device); starts the process group under torchrun."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if config.device == "auto":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if config.fsdp and world == 1:
        raise SpeculatorsError("--fsdp shards over several processes; launch with torchrun --nproc-per-node N")
    return rank, world, device


def wrap_model(drafter: Any, world: int, device: Any, fsdp: bool) -> Any:
    """The module the loop calls: TTT forward (normed outputs), wrapped for DDP or FSDP2.

    Under FSDP2 each decoder layer and the lm_head are their own units (the lm_head is applied
    outside the forward, where the loss looks) and this wrapper is the root, so the fc and norms
    stay gathered for the whole TTT forward.
    """
    import torch

    class TTTForward(torch.nn.Module):
        def __init__(self, drafter: Any):
            super().__init__()
            self.drafter = drafter

        def forward(self, input_ids: Any, aux: Any, steps: int, positions: Any, documents: Any, loss_mask: Any) -> Any:
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
        return fully_shard(model, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_sums(sums: dict[str, Any], world: int) -> dict[str, Any]:
    if world == 1:
        return sums
    import torch.distributed as dist

    for value in sums.values():
        dist.all_reduce(value)
    return sums


def uses_bf16(config: TrainConfig, device: Any) -> bool:
    from speculators.precision import native_bf16

    if config.precision != "auto":
        return config.precision == "bf16"
    return device.type in ("cpu", "cuda") and native_bf16(device.type)


def autocast_context(config: TrainConfig, device: Any) -> Any:
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16) if uses_bf16(config, device) else nullcontext()


def lr_at(step: int, total: int, config: TrainConfig) -> float:
    """Linear warmup, then linear decay to zero."""
    warmup = max(1, math.ceil(config.warmup * total))
    if step < warmup:
        return config.lr * (step + 1) / warmup
    return config.lr * max(0.0, (total - step) / max(1, total - warmup))


def build_optimizer(model: Any, config: TrainConfig) -> list[Any]:
    import torch

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if config.optimizer == "muon":
        matrices = [p for n, p in trainable if p.dim() == 2]
        others = [p for n, p in trainable if p.dim() != 2]
        return [
            torch.optim.Muon(matrices, lr=config.lr, weight_decay=config.weight_decay),
            torch.optim.AdamW(others, lr=config.lr, weight_decay=0.0),
        ]
    return [torch.optim.AdamW([p for _, p in trainable], lr=config.lr, weight_decay=config.weight_decay,
                              betas=(0.9, 0.95), fused=True)]  # fmt: skip


# ----- model construction and checks -------------------------------------------------------------


def build_drafter(config: TrainConfig, verifier: Any, manifest: dict[str, Any], vocab: dict[str, Any]) -> Any:

    from speculators.models.eagle3 import Eagle3Drafter
    from speculators.verifier import checkpoint_verifier_name, draft_config_for_verifier

    selected = vocab["selected_ids"]
    if config.warm_start:
        drafter = Eagle3Drafter.from_pretrained(config.warm_start, dtype="float32")
        if drafter.config.eagle_aux_hidden_state_layer_ids != manifest["aux_layer_ids"]:
            raise SpeculatorsError(
                f"warm start {config.warm_start} reads aux layers {drafter.config.eagle_aux_hidden_state_layer_ids} "
                f"but the store holds {manifest['aux_layer_ids']}"
            )
        if drafter.config.draft_vocab_size != selected.numel():
            raise SpeculatorsError(
                f"warm start {config.warm_start} has a draft vocab of {drafter.config.draft_vocab_size}, the store's "
                f"vocab has {selected.numel()}; rebuild it with --draft-vocab-size {drafter.config.draft_vocab_size}"
            )
        drafter.set_vocab_mapping(selected)  # the store's vocabulary; lm_head rows stay the warm start's
    else:
        draft_config = draft_config_for_verifier(
            verifier.config, checkpoint_verifier_name(config.verifier, verifier.name_or_path, config.verifier_name),
            draft_vocab_size=selected.numel(),
            aux_layer_ids=manifest["aux_layer_ids"], draft_layer_type=config.draft_layer_type,
            num_draft_layers=config.num_draft_layers, speculative_tokens=config.speculative_tokens or config.ttt_steps,
        )  # fmt: skip
        drafter = Eagle3Drafter(draft_config)
        drafter.reset_parameters(seed=config.seed)
        drafter.init_draft_vocab(selected, verifier.lm_head_weight)
    drafter.attach_verifier_embeddings(verifier.embedding_weight.float())
    drafter.lm_head.weight.requires_grad_(config.train_lm_head)
    return drafter


def check_store_fits_verifier(manifest: dict[str, Any], verifier: Any, store: str) -> None:
    stored = manifest["verifier"]
    if max(manifest["aux_layer_ids"]) > verifier.num_layers:
        raise SpeculatorsError(
            f"store {store} holds aux layers {manifest['aux_layer_ids']} but the verifier has {verifier.num_layers} "
            f"layers; pass the store's verifier ({stored['name_or_path']})"
        )
    if stored["hidden_size"] != verifier.hidden_size or stored["vocab_size"] != verifier.vocab_size:
        raise SpeculatorsError(
            f"store {store} was captured from a verifier with hidden {stored['hidden_size']} / vocab "
            f"{stored['vocab_size']}, not {verifier.hidden_size} / {verifier.vocab_size}; pass the store's verifier "
            f"({stored['name_or_path']})"
        )
    if stored["fingerprint"] != verifier.fingerprint:
        raise SpeculatorsError(
            f"store {store} was captured from verifier {stored['name_or_path']} (fingerprint {stored['fingerprint']}), "
            f"whose weights differ from {verifier.name_or_path}; pass the same verifier or re-run datagen"
        )


# ----- checkpoints -------------------------------------------------------------------------------


def drafter_key(fqn: str) -> str:
    """The drafter's own parameter name from a wrapped model's fully qualified name."""
    return fqn.removeprefix("module.").removeprefix("drafter.")


def gather_full_state(model: Any, optimizers: list[Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
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


def drafter_from_state(config: Any, model_state: dict[str, Any]) -> Any:
    """A plain (unsharded) drafter holding `model_state`, for writing checkpoints."""
    from speculators.models.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter(config)
    weights = {k: v for k, v in model_state.items() if not k.startswith("embed_tokens.")}
    drafter.load_state_dict(weights, strict=True)
    return drafter


def save_checkpoint(
    directory: Path, drafter: Any, optimizer_states: list[dict[str, Any]], state: dict[str, Any]
) -> None:
    """Drafter (speculators format) + optimizer tensors (safetensors) + trainer state (JSON), atomically."""
    from safetensors.torch import save_file

    from speculators.atomic_io import atomic_directory

    tensors, scalars, groups = {}, {}, []
    for index, optimizer_state in enumerate(optimizer_states):
        for fqn, param_state in optimizer_state["state"].items():
            for key, value in param_state.items():
                name = f"{index}/{fqn}/{key}"
                if hasattr(value, "dim") and value.dim() > 0:
                    tensors[name] = value.detach().contiguous().cpu()
                else:
                    scalars[name] = float(value)
        groups.append(optimizer_state["param_groups"])
    with atomic_directory(directory) as tmp:
        drafter.save_pretrained(tmp / "drafter", dtype="float32")
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        trainer_state = {**state, "optimizer_scalars": scalars, "optimizer_param_groups": groups}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))


def load_checkpoint(directory: Path, model: Any, optimizers: list[Any]) -> dict[str, Any]:
    """Restore model and optimizer state on every rank (each reads the full checkpoint)."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = load_file(str(directory / "drafter" / "model.safetensors"))
    names = {drafter_key(k): k for k in get_model_state_dict(model)}
    model_state = {names[k]: v for k, v in saved.items()}
    full = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_state, options=full)
    state = json.loads((directory / "trainer_state.json").read_text())
    tensors = load_file(str(directory / "optimizer.safetensors"))
    for index, optimizer in enumerate(optimizers):
        per_param: dict[str, dict[str, Any]] = {}
        for name, value in [*tensors.items(), *((k, torch.tensor(v)) for k, v in state["optimizer_scalars"].items())]:
            owner, fqn, key = name.split("/")
            if int(owner) == index:
                per_param.setdefault(fqn, {})[key] = value
        saved_state = {"state": per_param, "param_groups": state["optimizer_param_groups"][index]}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=saved_state,
                                 options=StateDictOptions(full_state_dict=True))  # fmt: skip
    return state


# ----- evaluation, logging, plots ----------------------------------------------------------------


def validation_share_of(plan: list[Any], rank: int, world: int) -> list[int | None]:
    """The validation packs this rank scores, round by round: every rank runs the same number of
    forwards (FSDP2 gathers parameters in each); None marks a repeat of pack 0 that is not counted."""
    return [start + rank if start + rank < len(plan) else None for start in range(0, len(plan), world)]


def greedy_in_draft_vocab(packs: Any, verifier: Any, selected_ids: Any, device: Any, rank: int,
                          world: int) -> dict[int, Any]:  # fmt: skip
    """Per validation pack this rank scores, bool [1, T]: the verifier's greedy token over its whole
    vocabulary (at each supervised position) is in the draft vocabulary. Decoding rejects the other
    drafts however well the draft distribution matches; computed once, the full lm_head is not kept."""
    import torch

    from speculators.ttt import row_chunks

    plan = packs.pack_plan(0) if packs.entries else []
    norm, lm_head = verifier.final_norm.float().to(device), verifier.lm_head_weight.to(device)
    in_draft = torch.zeros(verifier.vocab_size, dtype=torch.bool, device=device)
    in_draft[selected_ids.to(device)] = True
    result = {}
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


def run_validation(model: Any, lm_head: Any, packs: Any, head: tuple[Any, Any], config: TrainConfig, device: Any,
                   rank: int, world: int, in_vocab: dict[int, Any], num_tokens: int) -> dict | None:  # fmt: skip
    """Validation metrics, with decoding replayed at K = `num_tokens`; every rank scores its share of
    the packs (collective)."""
    import torch

    from speculators.ttt import replay_decoding, summarize, ttt_loss, verifier_target_logits

    plan = packs.pack_plan(0) if packs.entries else []
    if not plan:
        return None
    # DDP's forward broadcasts buffers (a collective); validation needs none, so use the inner module.
    forward = getattr(model, "module", model)
    sums = {k: torch.zeros(config.ttt_steps, dtype=torch.float64, device=device)
            for k in ("kl", "count", "correct", "cond_correct", "cond_count")}  # fmt: skip
    sums["replay_rounds"] = torch.zeros(1, dtype=torch.float64, device=device)
    sums["replay_accepted"] = torch.zeros(num_tokens, dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad(), autocast_context(config, device):
        for index in validation_share_of(plan, rank, world):
            pack = to_device(packs.load_pack(plan[index if index is not None else 0]), device)
            normed = forward(pack.input_ids, pack.aux_hidden_states, config.ttt_steps, pack.position_ids,
                             pack.document_ids, pack.loss_mask)  # fmt: skip
            targets = verifier_target_logits(pack.target_hidden_states[pack.loss_mask], *head)
            hits: list[Any] = []
            _, step_sums = ttt_loss(normed, targets, pack.loss_mask, pack.document_ids, config.step_decay,
                                    lm_head=lm_head, hits=hits)  # fmt: skip
            if index is not None:
                step_sums.update(replay_decoding(hits, pack.loss_mask, pack.document_ids, num_tokens, in_vocab[index]))
                sums = {k: sums[k] + v.to(device) for k, v in step_sums.items()}
    model.train()
    return summarize(all_reduce_sums(sums, world))


def with_aux_noise(pack: Any, scale: float, seed: int, draw: int) -> Any:
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


def to_device(pack: Any, device: Any) -> Any:
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


def summary_acceptance(summary: dict[str, Any]) -> tuple[float, str]:
    """(acceptance length, what it is) from a training summary: decoding replayed on the validation
    samples when there are any, else the training window's per-token estimate."""
    best = summary.get("best_validation") or {}
    if "replayed_acceptance_length" in best:
        return float(best["replayed_acceptance_length"]), "replayed on validation samples"
    train = summary.get("final_train") or {}
    return float(train.get("acceptance_length", 0.0)), "training estimate (no validation samples)"


# ----- the loop ----------------------------------------------------------------------------------


def train(config: TrainConfig) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    from speculators.training_data import PackedStore
    from speculators.ttt import summarize, ttt_loss, verifier_target_logits
    from speculators.validation import validate_checkpoint
    from speculators.verifier import VerifierHead
    from speculators.vocab import load_draft_vocab

    rank, world, device = init_distributed(config)
    torch.manual_seed(config.seed)
    output = Path(config.output)
    train_packs = PackedStore(config.store, config.token_budget, "train", config.validation_share, config.seed)
    val_packs = PackedStore(config.store, config.token_budget, "validation", config.validation_share, seed=-1)
    manifest = train_packs.manifest
    vocab = load_draft_vocab(config.store)
    verifier = VerifierHead.from_source(config.verifier, dtype=manifest["verifier"]["dtype"])
    check_store_fits_verifier(manifest, verifier, config.store)
    drafter = build_drafter(config, verifier, manifest, vocab).to(device)
    if uses_bf16(config, device) and not config.train_lm_head:
        drafter.lm_head.to(torch.bfloat16)  # frozen: autocast would re-cast it on every call
    head = (verifier.final_norm.float().to(device), verifier.lm_head_weight[vocab["selected_ids"]].float().to(device))
    in_vocab = greedy_in_draft_vocab(val_packs, verifier, vocab["selected_ids"], device, rank, world)
    del verifier
    replay_k = drafter.config.speculative_tokens
    model = wrap_model(drafter, world, device, config.fsdp)
    optimizers = build_optimizer(drafter, config)

    packs_per_step = world * config.grad_accumulation
    steps_per_epoch = len(train_packs.pack_plan(0)) // packs_per_step
    if steps_per_epoch == 0:
        raise SpeculatorsError(
            f"the store has fewer training packs ({len(train_packs.pack_plan(0))}) than one optimizer step uses "
            f"({packs_per_step}); lower --token-budget or --grad-accumulation, or add data"
        )
    total_steps = config.max_steps or max(1, int(config.epochs * steps_per_epoch))
    state = {"step": 0, "best_validation_loss": None, "tokens": 0, "train_seconds": 0.0}
    last = output / "checkpoints" / "last"
    if (last / "trainer_state.json").is_file():
        state = load_checkpoint(last, model, optimizers)
        if rank == 0:
            print(f"resuming from {last} at step {state['step']}", flush=True)
    log_path = output / "train_log.jsonl"
    if rank == 0:
        output.mkdir(parents=True, exist_ok=True)
        if state["step"] == 0:
            log_path.write_text("")
    log = open(log_path, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115 (held for the loop)

    window_sums, window_tokens, window_start, window_paused = None, 0, time.perf_counter(), 0.0
    run_started, wall_before = time.perf_counter(), state.get("wall_seconds", 0.0)

    def wall_seconds() -> float:  # wall time of the whole run, across resumes
        return round(wall_before + time.perf_counter() - run_started, 2)

    model.train()
    bar = tqdm(total=total_steps, initial=state["step"], desc="training", unit="step",
               disable=not config.progress or rank != 0)  # fmt: skip
    try:
        for step in range(state["step"], total_steps):
            epoch, in_epoch = divmod(step, steps_per_epoch)
            plan = train_packs.pack_plan(epoch)
            for group in optimizers:
                for param_group in group.param_groups:
                    param_group["lr"] = lr_at(step, total_steps, config)
            for micro in range(config.grad_accumulation):
                pack_index = (in_epoch * config.grad_accumulation + micro) * world + rank
                # Greedy packing of another epoch's order may give a pack less than epoch 0 did.
                pack = to_device(train_packs.load_pack(plan[pack_index % len(plan)]), device)
                if config.aux_noise:  # seeded by the pack's place in the run: a resumed run draws the same
                    draw = step * packs_per_step + micro * world + rank
                    pack = with_aux_noise(pack, config.aux_noise, config.seed, draw)
                sync = micro == config.grad_accumulation - 1 or world == 1
                with (nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync()), \
                        autocast_context(config, device):  # fmt: skip
                    normed = model(pack.input_ids, pack.aux_hidden_states, config.ttt_steps, pack.position_ids,
                                   pack.document_ids, pack.loss_mask)  # fmt: skip
                    targets = verifier_target_logits(pack.target_hidden_states[pack.loss_mask], *head)
                    loss, sums = ttt_loss(normed, targets, pack.loss_mask, pack.document_ids, config.step_decay,
                                          lm_head=drafter.lm_head)  # fmt: skip
                    (loss / config.grad_accumulation).backward()
                window_sums = sums if window_sums is None else {k: window_sums[k] + v for k, v in sums.items()}
                window_tokens += pack.num_tokens
            torch.nn.utils.clip_grad_norm_([p for p in drafter.parameters() if p.requires_grad], config.grad_clip)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            state["step"] = step + 1
            bar.update(1)

            if state["step"] % config.log_every == 0 or state["step"] == total_steps:
                window_sums["tokens"] = torch.tensor([float(window_tokens)], dtype=torch.float64)
                window_sums = all_reduce_sums(window_sums, world)
                seconds = time.perf_counter() - window_start - window_paused
                tokens = int(window_sums.pop("tokens").item())
                state["tokens"] += tokens
                state["train_seconds"] += seconds
                metrics = summarize(window_sums)
                record = {"event": "train", "step": state["step"], "wall_seconds": wall_seconds(),
                          "lr": lr_at(step, total_steps, config), "tokens_per_second": tokens / seconds,
                          **metrics}  # fmt: skip
                if log:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.set_postfix(loss=f"{sum(metrics['loss']):.3f}", acc0=f"{metrics['full_acc'][0]:.3f}",
                                tok_s=f"{tokens / seconds:.0f}")  # fmt: skip
                if not config.progress and rank == 0:  # logs (Dagster, pods) get a line instead of a bar
                    print(f"step {state['step']}/{total_steps} (epoch {state['step'] / steps_per_epoch:.2f}): loss "
                          f"{sum(metrics['loss']):.3f}, accuracy per TTT step "
                          f"{' / '.join(f'{a:.3f}' for a in metrics['full_acc'])}, {tokens / seconds:.0f} tokens/s",
                          flush=True)  # fmt: skip
                window_sums, window_tokens, window_start, window_paused = None, 0, time.perf_counter(), 0.0

            paused_from = time.perf_counter()  # validation and saving are not training throughput
            evaluate = state["step"] % config.eval_every == 0 or state["step"] == total_steps
            checkpoint = state["step"] % config.checkpoint_every == 0 or state["step"] == total_steps
            if evaluate:
                metrics = run_validation(model, drafter.lm_head, val_packs, head, config, device, rank, world,
                                         in_vocab, replay_k)  # fmt: skip
                improved = metrics is not None and (
                    state["best_validation_loss"] is None or sum(metrics["loss"]) < state["best_validation_loss"]
                )
                if metrics is not None and log:
                    log.write(json.dumps({"event": "validation", "step": state["step"],
                                          "wall_seconds": wall_seconds(), **metrics}) + "\n")  # fmt: skip
                    log.flush()
                    if not config.progress:
                        print(f"validation at step {state['step']}: accuracy per TTT step "
                              f"{' / '.join(f'{a:.3f}' for a in metrics['full_acc'])}, replayed acceptance "
                              f"length {metrics['replayed_acceptance_length']:.2f} at K={replay_k} (estimate "
                              f"{metrics['acceptance_length']:.2f})", flush=True)  # fmt: skip
                if improved:
                    state["best_validation_loss"] = sum(metrics["loss"])
                    state["best_validation"] = metrics
                checkpoint = checkpoint or improved
            if checkpoint:
                state["wall_seconds"] = wall_seconds()
                model_state, optimizer_states = gather_full_state(model, optimizers)
                if rank == 0:
                    snapshot = drafter_from_state(drafter.config, model_state)
                    if evaluate and improved:
                        snapshot.save_pretrained(output / "checkpoints" / "best")
                    if state["step"] % config.checkpoint_every == 0 or state["step"] == total_steps:
                        save_checkpoint(last, snapshot, optimizer_states, state)
            window_paused += time.perf_counter() - paused_from
    except RuntimeError as error:
        if "out of memory" in str(error).lower() or "can't allocate" in str(error).lower():
            raise SpeculatorsError(
                f"ran out of memory with --token-budget {config.token_budget}; reduce it (or --ttt-steps)"
            ) from None
        raise
    finally:
        bar.close()
        if log:
            log.close()

    summary: dict[str, Any] = {}
    model_state, _ = gather_full_state(model, [])
    if rank == 0:
        drafter_from_state(drafter.config, model_state).save_pretrained(output / "drafter", dtype="bfloat16")
        report = validate_checkpoint(output / "drafter", verifier=config.verifier)
        if not report.ok:
            raise SpeculatorsError(f"the trained drafter failed validation: {'; '.join(report.problems)}")
        last_train = [json.loads(x) for x in log_path.read_text().splitlines() if '"train"' in x][-1]
        summary = {
            "steps": state["step"],
            "epochs": state["step"] / steps_per_epoch,
            "train_tokens": state["tokens"],
            "train_seconds": round(state["train_seconds"], 2),
            "wall_seconds": wall_seconds(),
            "tokens_per_second": round(state["tokens"] / max(state["train_seconds"], 1e-9), 1),
            "world_size": world,
            "final_train": {k: v for k, v in last_train.items() if k not in ("event",)},
            "best_validation_loss": state["best_validation_loss"],
            "best_validation": state.get("best_validation"),
            "drafter": str(output / "drafter"),
            "config": config.model_dump(),
        }
        (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_curves(log_path, output / "training_curves.png")
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return summary
