"""On-policy data: the verifier regenerates the assistant turns, and its token ids are kept as they are.

Re-rendering generated text through the chat template changes ids (measured: 13% of SmolLM2
responses) and adds end-of-turn tokens to truncated answers, so a sample is assembled from the
template's prompt ids plus the generated ids. Later turns of a multi-turn conversation are
generated after the earlier generated ones; the template text between turns (the next user turn)
is tokenized on its own. A turn cut by the token limit ends its conversation there, and so does a
conversation whose ids reach the token limit (nothing generated after it would be kept).

The text the template and tokenizer see is bounded as in speculators.data.tokenization: a first prompt
whose text alone passes `text_limit` is rejected as over-length without being tokenized, and later
user turns are clipped there (the source's assistant text, replaced by generated text, is not
counted).

Backends: `transformers` (batched, KV cache, CPU or GPU) and `vllm` (offline engine, the CUDA or
CPU build). Resumable: finished samples are appended to `<output>.partial` and skipped on a rerun.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from speculators.data.conversation import Conversation
from speculators.data.rows import RowRejected
from speculators.data.tokenization import (
    LongestPrompt,
    OverLength,
    TokenizedSample,
    clip_messages,
    expand_images,
    over_length,
    render_ids,
    render_text,
    text_length,
    text_limit,
    turn_end_ids,
)
from speculators.errors import SpeculatorsError
from speculators.serving.engine import decoding_enforce_eager, shutdown_engine, verifier_engine_kwargs
from speculators.serving.multinode import start_offline_engine
from speculators.verifier.vision import image_parts, load_image

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from speculators.settings import MultiNode
    from speculators.verifier.vision import ImageInputs

# prompts (token id lists) -> generated id lists
GenerateFn = Callable[[list[list[int]]], list[list[int]]]
# prompts holding one placeholder per image, and each prompt's image parts -> generated id lists
ImageGenerateFn = Callable[[list[list[int]], list[list[dict[str, str]]]], list[list[int]]]


@runtime_checkable
class StepGenerate(Protocol):
    """An engine that takes prompts one at a time and returns answers as they finish (vLLM's offline
    engine, step by step): regeneration keeps it full, sending a conversation's next turn, or the next
    conversation, the moment an answer ends, instead of waiting for a whole batch's longest answer."""

    def add(self, prompt_ids: list[int], images: list[dict[str, str]] | None = None) -> str:
        """Queue one prompt; its request id."""
        ...

    def step(self) -> list[tuple[str, list[int]]]:
        """One engine step: (request id, answer ids) of the requests it finished."""
        ...


@dataclass
class RegenerationReport:
    regenerated: int = 0
    resumed: int = 0
    truncated_turns: int = 0
    dropped_turns: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)
    generated_tokens: int = 0
    seconds: float = 0.0
    longest_over_length: LongestPrompt = field(default_factory=LongestPrompt)  # of the rows rejected as over-length

    def to_dict(self) -> dict[str, Any]:
        return {
            "regenerated": self.regenerated,
            "resumed": self.resumed,
            "truncated_turns": self.truncated_turns,
            "dropped_later_turns": dict(self.dropped_turns),
            "rejected": dict(self.rejected),
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": round(self.generated_tokens / self.seconds, 1) if self.seconds else None,
            "longest_over_length": self.longest_over_length.to_dict(),
        }


@dataclass
class ConversationState:
    conversation: Conversation
    ids: list[int]
    mask: list[int]
    history: list[dict[str, Any]]  # messages so far, assistant turns holding the generated text
    next_message: int  # index of the next assistant turn to generate in conversation.messages
    done: bool = False
    rejected: str | None = None
    prompt_size: tuple[int, str] | None = None  # an over-length prompt's size: (count, "tokens" or "characters")


def transformers_generate_fn(
    model: Any, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int, temperature: float, seed: int
) -> GenerateFn:
    """Batched generation with a transformers causal LM (`model`: a PreTrainedModel with GenerationMixin,
    whose generate() transformers types for neither class alone)."""
    import torch

    ends = sorted(turn_end_ids(tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        batch = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(batch)
        for row, prompt in enumerate(prompts):  # left padding: generation continues every row at the end
            batch[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        options = {
            "do_sample": temperature > 0,
            "max_new_tokens": max_new_tokens,
            "eos_token_id": ends,
            "pad_token_id": pad,
        }
        if temperature > 0:
            torch.manual_seed(seed)
            options["temperature"] = temperature
        with torch.inference_mode():
            out = model.generate(input_ids=batch.to(model.device), attention_mask=attention.to(model.device), **options)
        generated = []
        for row in out[:, width:].tolist():
            stop = next((i for i, token in enumerate(row) if token in ends), None)
            generated.append(row if stop is None else row[: stop + 1])
        return generated

    return generate


def transformers_image_generate_fn(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    image_inputs: ImageInputs,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> ImageGenerateFn:
    """Generation with a transformers vision-language model, one prompt at a time (each with its
    own pixel inputs and M-RoPE positions; no padding to get right)."""
    import torch

    ends = sorted(turn_end_ids(tokenizer))

    def generate(prompts: list[list[int]], images: list[list[dict[str, str]]]) -> list[list[int]]:
        generated = []
        for prompt, parts in zip(prompts, images, strict=True):
            pictures = [load_image(part) for part in parts]
            ids, _ = image_inputs.expand(prompt, [0] * len(prompt), [image_inputs.grid(p) for p in pictures])
            input_ids = torch.tensor([ids], device=model.device)
            extra = {}
            if pictures:
                extra = {k: v.to(model.device) for k, v in image_inputs.pixel_inputs(pictures).items()}
                extra["mm_token_type_ids"] = image_inputs.token_types(input_ids)
            options: dict[str, Any] = {"do_sample": temperature > 0, "max_new_tokens": max_new_tokens}
            if temperature > 0:
                torch.manual_seed(seed)
                options["temperature"] = temperature
            with torch.inference_mode():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    eos_token_id=ends,
                    pad_token_id=ends[0],
                    **extra,
                    **options,
                )
            row = out[0, len(ids) :].tolist()
            stop = next((i for i, token in enumerate(row) if token in ends), None)
            generated.append(row if stop is None else row[: stop + 1])
        return generated

    return generate


def regeneration_engine_kwargs(
    model_dir: str,
    seed: int,
    dtype: str,
    max_model_len: int,
    tensor_parallel_size: int = 1,
    quantization: str | None = None,
    nodes: MultiNode | None = None,
) -> dict[str, Any]:
    """The regeneration engine's `LLM()` arguments on this node (serving.engine.verifier_engine_kwargs):
    the run's seed, and eager mode only where decoding_enforce_eager says (no hooks here: CUDA graphs on
    GPUs); no compilation config of its own (an MLA verifier's CPU rotary workaround, as for capture)."""

    return verifier_engine_kwargs(
        model_dir,
        dtype,
        quantization,
        seed=seed,
        enforce_eager=decoding_enforce_eager(),
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        nodes=nodes,
    )


class VllmGenerate:
    """Prompt ids -> answer ids with vLLM's offline engine; `close` stops the engine's processes now
    (at interpreter exit vLLM force-kills them, printing to the terminal). Over several nodes (`nodes`),
    this is node rank 0's engine; the others follow its arguments (speculators/serving/multinode.py)."""

    def __init__(
        self,
        model_dir: str,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        dtype: str,
        ends: set[int],
        max_model_len: int,
        tensor_parallel_size: int = 1,
        quantization: str | None = None,
        nodes: MultiNode | None = None,
    ):

        kwargs = regeneration_engine_kwargs(
            model_dir, seed, dtype, max_model_len, tensor_parallel_size, quantization, nodes
        )
        self.llm = start_offline_engine(kwargs, nodes)
        self.max_new_tokens, self.temperature, self.seed, self.ends = max_new_tokens, temperature, seed, ends
        self.added = 0  # requests added step by step (their sampling seeds: seed + this count)

    def sampling(self, index: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            max_tokens=self.max_new_tokens,
            seed=self.seed + index,
            stop_token_ids=sorted(self.ends),
            skip_special_tokens=False,
        )

    def __call__(self, prompts: list[list[int]], images: list[list[dict[str, str]]] | None = None) -> list[list[int]]:
        """`images`: each prompt's image parts, its ids holding one placeholder per image (vLLM
        expands placeholders itself and runs the vision tower on `multi_modal_data`)."""
        requests = [engine_prompt(p, parts) for p, parts in zip(prompts, images or [[] for _ in prompts], strict=True)]
        params = [self.sampling(i) for i in range(len(prompts))]
        return [answer_ids(out) for out in self.llm.generate(requests, params, use_tqdm=False)]

    def add(self, prompt_ids: list[int], images: list[dict[str, str]] | None = None) -> str:
        from vllm.sampling_params import RequestOutputKind

        params = self.sampling(self.added)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # (the answer once, when it ends)
        self.added += 1
        request_id = f"regen-{self.added}"  # (outputs carry it; add_request returns vLLM's internal id)
        self.llm.llm_engine.add_request(request_id, engine_prompt(prompt_ids, images), params)
        return request_id

    def step(self) -> list[tuple[str, list[int]]]:
        return [(out.request_id, answer_ids(out)) for out in self.llm.llm_engine.step() if out.finished]

    def close(self) -> None:

        shutdown_engine(self.llm)
        del self.llm


def engine_prompt(prompt_ids: list[int], images: list[dict[str, str]] | None) -> Any:
    """vLLM's prompt of token ids, with the images of a prompt holding their placeholders."""
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=prompt_ids)
    if images:
        prompt["multi_modal_data"] = {"image": [load_image(part) for part in images]}
    return prompt


def answer_ids(output: Any) -> list[int]:
    """A finished request's answer ids, its stop token included (vLLM reports a stop token without
    always keeping it in token_ids)."""
    ids = list(output.outputs[0].token_ids)
    stop = output.outputs[0].stop_reason
    if isinstance(stop, int) and (not ids or ids[-1] != stop):
        ids.append(stop)
    return ids


def server_generate_fn(
    url: str,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    ends: set[int],
    model: str | None = None,
    concurrency: int = 8,
    api_key: str | None = None,
    timeout: float = 600.0,
) -> GenerateFn:
    """Generation through an OpenAI-compatible vLLM server (`/v1/completions` with token-id prompts).

    Token ids come back exactly (`return_token_ids`), so nothing is re-tokenized.
    """
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def call(path: str, payload: dict | None = None) -> dict:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(base + path, data=data, headers=headers, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as error:
            detail = error.read().decode(errors="replace")[:300] if isinstance(error, urllib.error.HTTPError) else error
            raise SpeculatorsError(f"the vLLM server at {base} failed on {path}: {detail}") from None

    served = model or call("/v1/models")["data"][0]["id"]

    def one(index_prompt: tuple[int, list[int]]) -> list[int]:
        index, prompt = index_prompt
        body = {
            "model": served,
            "prompt": prompt,
            "max_tokens": max_new_tokens,
            "temperature": temperature,
            "seed": seed + index,
            "stop_token_ids": sorted(ends),
            "skip_special_tokens": False,
            "return_token_ids": True,
        }
        choice = call("/v1/completions", body)["choices"][0]
        ids = list(choice.get("token_ids") or [])
        stop = choice.get("stop_reason")
        if isinstance(stop, int) and (not ids or ids[-1] != stop):
            ids.append(stop)  # a stop token the server reports without keeping it in token_ids
        return ids

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, enumerate(prompts)))

    return generate


def continuation_ids(
    tokenizer: PreTrainedTokenizerBase, history: list[dict[str, str]], upto: list[dict[str, str]]
) -> list[int] | None:
    """Ids of the template text after the last generated turn's end token up to the next generation prompt.

    None when the template re-renders earlier turns differently once a later turn exists.
    """
    done = render_text(tokenizer, history, add_generation_prompt=False)
    following = render_text(tokenizer, upto, add_generation_prompt=True)
    content_end = done.rfind(history[-1]["content"]) + len(history[-1]["content"])
    ends = [cast(str, tokenizer.convert_ids_to_tokens(i)) for i in turn_end_ids(tokenizer)]  # (one id, one token)
    positions = [done.find(token, content_end) for token in ends if done.find(token, content_end) >= 0]
    if not positions:
        return None
    cut = min(positions)
    cut += next(len(token) for token in ends if done.find(token, content_end) == cut)
    if following[:cut] != done[:cut]:
        return None
    return list(tokenizer(following[cut:], add_special_tokens=False)["input_ids"])


def start_state(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, max_length: int
) -> ConversationState | None:
    """The first prompt of a conversation (images: one placeholder each, as the template renders), its
    later turns clipped to what `max_length` tokens can hold; a state rejected as over-length, never
    tokenized, when the prompt's text alone is past that."""
    messages = conversation.messages
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first is None:
        return None
    # Generate in place of the assistant turn after each user turn; prompt = everything before it.
    next_assistant = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "assistant"), None)
    upto = next_assistant if next_assistant is not None else len(messages)
    limit = text_limit(tokenizer, max_length)
    characters = sum(text_length(m["content"]) for m in messages[:upto])
    if upto > max_length or characters > limit:
        rejected = over_length(max_length)
        return ConversationState(conversation, [], [], [], upto, True, rejected, (characters, "characters"))
    clipped = clip_messages(messages, limit, max_length, uncounted=("assistant",))
    if clipped is not messages:
        conversation = Conversation(conversation.id, clipped, conversation.category)
    prompt = clipped[:upto]
    ids = render_ids(tokenizer, prompt, add_generation_prompt=True)
    return ConversationState(conversation, ids, [0] * len(ids), list(prompt), upto)


def advance(
    state: ConversationState,
    generated: list[int],
    tokenizer: PreTrainedTokenizerBase,
    ends: set[int],
    report: RegenerationReport,
    max_length: int,
) -> None:
    state.ids += generated
    state.mask += [1] * len(generated)
    report.generated_tokens += len(generated)
    messages = state.conversation.messages
    later_users = [i for i in range(state.next_message, len(messages)) if messages[i]["role"] == "user"]
    if not generated or generated[-1] not in ends:
        report.truncated_turns += 1
        state.done = True
        if later_users:
            report.dropped_turns["turn cut by the token limit"] += 1
        return
    if not later_users or len(state.ids) >= max_length:
        state.done = True
        return
    text = cast(str, tokenizer.decode(generated[:-1], skip_special_tokens=True)).strip()  # (one sequence, one text)
    history = [*state.history, {"role": "assistant", "content": text}]
    next_user = later_users[0]
    next_assistant = next(
        (i for i in range(next_user, len(messages)) if messages[i]["role"] == "assistant"), len(messages)
    )
    upto = history + [m for m in messages[next_user:next_assistant] if m["role"] != "assistant"]
    suffix = continuation_ids(tokenizer, history, upto)
    if suffix is None:
        report.dropped_turns["template re-renders earlier turns"] += 1
        state.done = True
        return
    state.ids += suffix
    state.mask += [0] * len(suffix)
    state.history = upto
    state.next_message = next_assistant
    state.done = len(state.ids) >= max_length  # an answer from here on would be cut off the sample


def read_partial(path: Path) -> dict[str, TokenizedSample]:
    """Finished samples of an interrupted run; a torn last line (killed mid-write) is ignored."""
    done: dict[str, TokenizedSample] = {}
    if not path.exists():
        return done
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                sample = TokenizedSample.from_row(json.loads(line))
                done[sample.id] = sample
            except (json.JSONDecodeError, KeyError):
                continue
    return done


def regenerate(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    generate: GenerateFn | ImageGenerateFn | StepGenerate,
    partial_path: Path,
    max_length: int,
    batch_size: int = 8,
    progress: bool = True,
    image_inputs: ImageInputs | None = None,
) -> tuple[list[TokenizedSample], RegenerationReport]:
    """Samples in `conversations` order with verifier-generated assistant turns. With
    `image_inputs` (a vision-language verifier) `generate` also takes each prompt's image parts.
    `batch_size` conversations are in flight: a `StepGenerate` engine gets the next turn or the next
    conversation as soon as an answer ends; a batch function answers one turn of a batch at a time."""
    from tqdm import tqdm

    report = RegenerationReport()
    done = read_partial(partial_path)
    report.resumed = sum(1 for c in conversations if c.id in done)
    todo = [c for c in conversations if c.id not in done]
    ends = turn_end_ids(tokenizer)
    started = time.perf_counter()
    partial_path.parent.mkdir(parents=True, exist_ok=True)
    with (
        open(partial_path, "a", encoding="utf-8") as partial,
        tqdm(total=len(todo), desc="regenerating", unit="conv", disable=not progress) as bar,
    ):

        def begin(conversation: Conversation) -> ConversationState | None:
            """The conversation's first prompt, or None when it ends before one (finished as rejected)."""
            state = start_state(tokenizer, conversation, max_length)
            if state is None:
                report.rejected["no user turn"] += 1
                bar.update(1)
                return None
            if image_inputs is None and image_parts(state.conversation.messages):
                state.done, state.rejected = True, "images in a conversation for a text-only verifier"
            elif state.rejected is None and len(state.ids) >= max_length:
                state.done, state.rejected = True, over_length(max_length)
                state.prompt_size = (len(state.ids), "tokens")
            if state.done:
                finish(state)
                return None
            return state

        def answered(state: ConversationState, ids: list[int]) -> None:
            advance(state, ids, tokenizer, ends, report, max_length)
            if state.done:
                finish(state)

        def finish(state: ConversationState) -> None:
            """The sample of a finished conversation appended to the resume file (or its rejection counted)."""
            sample = finished_sample(state, max_length, image_inputs)
            if state.rejected is not None:
                report.rejected[state.rejected] += 1
                if state.prompt_size is not None:
                    report.longest_over_length.note(state.conversation.id, *state.prompt_size)
            else:
                partial.write(sample.to_json() + "\n")
                partial.flush()
                done[sample.id] = sample
                report.regenerated += 1
            bar.update(1)
            bar.set_postfix(tok_s=f"{report.generated_tokens / max(time.perf_counter() - started, 1e-9):.0f}")

        if isinstance(generate, StepGenerate):
            answer_continuously(todo, generate, batch_size, begin, answered)
        else:
            answer_in_batches(todo, generate, batch_size, begin, answered, image_inputs is not None)
    report.seconds = time.perf_counter() - started
    return [done[c.id] for c in conversations if c.id in done], report


def finished_sample(state: ConversationState, max_length: int, image_inputs: ImageInputs | None) -> TokenizedSample:
    """The sample of a finished conversation, cut to `max_length` (its images expanded with `image_inputs`);
    a reason found on the way not to keep it is set on the state (`rejected`, and `prompt_size` when too long)."""
    sample = TokenizedSample(state.conversation.id, state.ids[:max_length], state.mask[:max_length])
    images = image_parts(state.history)
    if state.rejected is None and images and image_inputs is not None:
        try:
            full = TokenizedSample(state.conversation.id, state.ids, state.mask, images)
            sample = expand_images(image_inputs, full, max_length)
        except RowRejected as reason:
            state.rejected = str(reason)
            if isinstance(reason, OverLength):
                state.prompt_size = (reason.size, reason.unit)
    if state.rejected is None and not any(sample.loss_mask):
        state.rejected = "no assistant token after tokenization"
    return sample


def answer_continuously(
    todo: list[Conversation],
    engine: StepGenerate,
    in_flight: int,
    begin: Callable[[Conversation], ConversationState | None],
    answered: Callable[[ConversationState, list[int]], None],
) -> None:
    """`in_flight` conversations in the engine at once, each turn's prompt sent when the last answer
    ends, a new conversation admitted whenever one finishes: no step waits for a batch's longest answer."""

    waiting = iter(todo)
    live: dict[str, ConversationState] = {}

    def send(state: ConversationState) -> None:
        live[engine.add(state.ids, image_parts(state.history) or None)] = state

    def admit() -> None:
        while len(live) < in_flight:
            conversation = next(waiting, None)
            if conversation is None:
                return
            state = begin(conversation)
            if state is not None:
                send(state)

    admit()
    while live:
        for request_id, ids in engine.step():
            state = live.pop(request_id)
            answered(state, ids)
            if not state.done:
                send(state)
        admit()


def answer_in_batches(
    todo: list[Conversation],
    generate: GenerateFn | ImageGenerateFn,
    batch_size: int,
    begin: Callable[[Conversation], ConversationState | None],
    answered: Callable[[ConversationState, list[int]], None],
    with_images: bool,
) -> None:
    """`batch_size` conversations at a time, one turn of all of them per call."""

    for offset in range(0, len(todo), batch_size):
        active = [state for c in todo[offset : offset + batch_size] if (state := begin(c)) is not None]
        while active:
            if not with_images:
                generated = cast(GenerateFn, generate)([s.ids for s in active])
            else:
                prompt_images = [image_parts(s.history) for s in active]
                generated = cast(ImageGenerateFn, generate)([s.ids for s in active], prompt_images)
            for state, ids in zip(active, generated, strict=True):
                answered(state, ids)
            active = [s for s in active if not s.done]
