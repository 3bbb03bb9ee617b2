"""What bench measures against a running vLLM server with its own client: the prompts both servers
answer (their files for GuideLLM, MT-Bench's turn 2 built from the baseline's own turn-1 answers), chat
requests and the server's idle state, the per-category pass (every prompt with a category timed, each
reply's own spec-decode statistics summed per category and turn) and each prompt's greedy output with
its token ids (what the lossless comparison reads)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import write_text_atomic
from speculators.data.conversation import conversation_id
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH
from speculators.data.prompt_set import data_version, load_prompts
from speculators.errors import SpeculatorsError
from speculators.serving.serve import acceptance_from_counters, added_spec_decode, request_spec_decode
from speculators.verifier.vision import openai_messages

if TYPE_CHECKING:
    from speculators.data.conversation import Conversation
    from speculators.data.mt_bench import MtBenchQuestion
    from speculators.serving.serve import VllmServer
    from speculators.settings import BenchSettings

# The two servers, in the order bench starts them: the verifier alone, then with the speculator.
ROLES = ("baseline", "speculator")
# Requests in flight in the per-category pass and when the baseline answers MT-Bench's first turns: a few,
# so the pass costs less than a synchronous profile of the same prompts. (A constant, not a BenchProfile setting: a new
# field would change every variant's benchmark_report key, which hashes the benchmark settings.)
CATEGORY_STREAMS = 4


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
