"""Conversations -> token ids + loss mask (1 on assistant tokens only) with the verifier's chat template.

For each assistant turn the conversation is rendered up to the turn with the generation prompt and
again with the turn; the tokens between the two are the turn (what the model would generate,
including template tokens such as a channel header), cut after its end-of-turn token. Templates
that rewrite earlier turns once a later one exists (e.g. reasoning stripped from history) fall back
to locating each assistant text by character offsets.

Work per conversation is bounded before the chat template and the tokenizer see it: no token of the
verifier's tokenizer covers more than L characters (L = its longest token string, added tokens
included; a byte-level vocabulary spells one byte per character), so message text past
`max_length * L` characters can never be inside the first `max_length` tokens. `clip_messages` cuts
the messages there plus TEXT_MARGIN_CHARS (so the words the cut splits lie past those tokens) and
keeps at most `max_length` messages (each renders at least one token); a conversation within that
bound is tokenized exactly as it would be whole. (The bound assumes the chat template renders each
message's text; a template that drops earlier text, such as reasoning in history, can only lose
conversations longer than the bound.) Regeneration applies the same bound to the prompt turns.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from speculators.data.rows import RowRejected
from speculators.errors import SpeculatorsError
from speculators.verifier.vision import image_parts, load_image

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from speculators.verifier.vision import ImageInputs

END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<|return|>",
    "</s>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|end_of_text|>",
)
# Characters kept past max_length * (longest token): the tokens a clip changes lie beyond max_length.
TEXT_MARGIN_CHARS = 1024
# tokenizer -> its longest token string's length (computed once per tokenizer; entries go with it)
LONGEST_TOKEN_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


@dataclass
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    # The image parts (vision.image_part) whose expanded placeholders are in input_ids, in order.
    images: list[dict[str, str]] = field(default_factory=list)

    @property
    def supervised_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> str:
        row: dict[str, Any] = {"id": self.id, "input_ids": self.input_ids, "loss_mask": self.loss_mask}
        if self.images:  # text-only samples keep their bytes
            row["images"] = self.images
        return json.dumps(row)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TokenizedSample:
        return cls(row["id"], row["input_ids"], row["loss_mask"], row.get("images") or [])


def turn_end_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    # (one token converts to one id; transformers types the call for a token or a list of them)
    vocab = tokenizer.get_vocab()
    ids = {cast(int, tokenizer.convert_tokens_to_ids(token)) for token in END_OF_TURN_TOKENS if token in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def render_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
    )


def render_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return cast(str, text)  # (tokenize=False renders text)


def cut_after_turn_end(span: list[int], ends: set[int]) -> int:
    """Length of `span` up to and including its last end-of-turn token (all of it if none)."""
    positions = [i for i, token in enumerate(span) if token in ends]
    return positions[-1] + 1 if positions else len(span)


def mask_by_prefixes(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], full: list[int]
) -> list[int] | None:
    ends = turn_end_ids(tokenizer)
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_ids(tokenizer, messages[:index], add_generation_prompt=True)
        with_turn = render_ids(tokenizer, messages[: index + 1], add_generation_prompt=False)
        if with_turn[: len(before)] != before or full[: len(with_turn)] != with_turn:
            return None
        end = len(before) + cut_after_turn_end(with_turn[len(before) :], ends)
        mask[len(before) : end] = [1] * (end - len(before))
    return mask


def mask_by_offsets(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    text = render_text(tokenizer, messages, add_generation_prompt=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    ends = turn_end_ids(tokenizer)
    mask = [0] * len(ids)
    cursor = 0
    for message in messages:
        start = text.find(message["content"], cursor)
        if start < 0:
            continue
        stop = start + len(message["content"])
        cursor = stop
        if message["role"] != "assistant":
            continue
        inside = [i for i, (a, b) in enumerate(offsets) if a < stop and b > start]
        if not inside:
            continue
        last = inside[-1]
        if last + 1 < len(ids) and ids[last + 1] in ends:  # the model also predicts the end of its turn
            last += 1
        for i in range(inside[0], last + 1):
            mask[i] = 1
    return ids, mask


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters one token of `tokenizer` covers: its longest token string, added tokens
    included (cached per tokenizer: reading a 150k vocabulary takes tens of milliseconds)."""
    known = LONGEST_TOKEN_CHARS.get(tokenizer)
    if known is not None:
        return known
    decoder = getattr(type(tokenizer), "added_tokens_decoder", None)
    # (mistral-common's tokenizer has none, as a method that raises: its special tokens are in get_vocab())
    tokens = tokenizer.added_tokens_decoder.values() if isinstance(decoder, property) else []
    added = [getattr(token, "content", str(token)) for token in tokens]
    longest = max(map(len, [*tokenizer.get_vocab(), *added]), default=1)
    LONGEST_TOKEN_CHARS[tokenizer] = longest
    return longest


def text_limit(tokenizer: PreTrainedTokenizerBase, max_length: int) -> int:
    """Characters of message text past which nothing can be inside the first `max_length` tokens."""
    return max_length * longest_token_chars(tokenizer) + TEXT_MARGIN_CHARS


def text_length(content: Any) -> int:
    """Characters of text in a normalised message's content (a string, or parts whose images have none)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content if part.get("type") == "text")


def clip_content(content: Any, room: int) -> Any:
    """A message's content cut after `room` characters of text (image parts after the cut dropped)."""
    if isinstance(content, str):
        return content[:room]
    parts = []
    for part in content:
        if room <= 0:
            break
        if part.get("type") == "text":
            part = {**part, "text": part["text"][:room]}
            room -= len(part["text"])
        parts.append(part)
    return parts


def clip_messages(
    messages: list[dict[str, Any]], limit: int, max_messages: int, uncounted: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The messages cut where their text passes `limit` characters (later messages dropped), at most
    `max_messages` of them; `messages` itself when nothing is cut. Messages of the `uncounted` roles
    are kept whole without counting (regeneration replaces the assistant turns' text)."""
    kept: list[dict[str, Any]] = []
    used = 0
    for message in messages[:max_messages]:
        size = 0 if message["role"] in uncounted else text_length(message["content"])
        if used + size > limit:
            content = clip_content(message["content"], limit - used)
            if content:
                kept.append({**message, "content": content})
            return kept
        kept.append(message)
        used += size
    return messages if len(kept) == len(messages) else kept


def over_length(max_length: int) -> str:
    return f"over-length (the prompt alone exceeds max length {max_length})"


class OverLength(RowRejected):
    """A row rejected as over-length, with its prompt's size: `tokens`, or `characters` where its text was
    clipped before tokenizing (it never reached the tokenizer). Counted under `over_length`'s reason."""

    def __init__(self, max_length: int, size: int, unit: str):
        super().__init__(over_length(max_length))
        self.size, self.unit = size, unit


def prompt_characters(messages: list[dict[str, Any]]) -> int:
    """Characters of text before the first assistant turn: the size of a prompt too long to tokenize."""
    first_answer = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return sum(text_length(m["content"]) for m in messages[:first_answer])


@dataclass
class LongestPrompt:
    """The longest prompt of the rows rejected as over-length: what a run that kept none of its rows names.
    A prompt measured in characters (clipped before tokenizing) outranks one measured in tokens."""

    sample_id: str = ""
    size: int = 0
    unit: str = ""  # "tokens" or "characters"; "" while no row was over-length

    def note(self, sample_id: str, size: int, unit: str) -> None:
        if not self.unit or (unit == "characters", size) > (self.unit == "characters", self.size):
            self.sample_id, self.size, self.unit = sample_id, size, unit

    def to_dict(self) -> dict[str, Any] | None:
        """As prepare_report.json records it (None while no row was over-length)."""
        return {"id": self.sample_id, "size": self.size, "unit": self.unit} if self.unit else None

    def merge(self, recorded: dict[str, Any] | None) -> None:
        """Take in another run's to_dict() (a regeneration replica's)."""
        if recorded:
            self.note(str(recorded["id"]), int(recorded["size"]), str(recorded["unit"]))

    def advice(self, max_length: int) -> str:
        """What to tell a user whose rows were all over-length: the longest and the --max-length it needs."""
        if self.unit == "tokens":
            return (
                f"the longest, row {self.sample_id}, has a {self.size}-token prompt; raise --max-length to at least "
                f"{self.size + 1}"
            )
        return (
            f"the longest, row {self.sample_id}, has {self.size} characters of prompt (clipped before tokenizing); "
            f"raise --max-length well past {max_length}"
        )


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    sample_id: str,
    messages: list[dict[str, Any]],
    max_length: int,
    image_inputs: ImageInputs | None = None,
) -> TokenizedSample:
    """Token ids and assistant-only loss mask, clipped to `max_length`; RowRejected if nothing is
    supervised. Conversations with images need the verifier's `image_inputs`: each image's
    placeholder is expanded to its token count (never supervised). Text past what `max_length` tokens
    can hold is clipped before the template renders it (see the module's docstring)."""

    if image_inputs is None and image_parts(messages):
        raise RowRejected("images in a conversation for a text-only verifier")
    clipped = clip_messages(messages, text_limit(tokenizer, max_length), max_length)
    if not any(m["role"] == "assistant" for m in clipped) and any(m["role"] == "assistant" for m in messages):
        raise OverLength(max_length, prompt_characters(messages), "characters")
    messages = clipped
    images = image_parts(messages)
    full = render_ids(tokenizer, messages, add_generation_prompt=False)
    mask = mask_by_prefixes(tokenizer, messages, full)
    if mask is None:
        if images:
            raise RowRejected("the chat template re-renders earlier turns, which image conversations cannot use")
        full, mask = mask_by_offsets(tokenizer, messages)
    if not any(mask):
        raise RowRejected("no assistant token after tokenization")
    if images:
        assert image_inputs is not None
        return expand_images(image_inputs, TokenizedSample(sample_id, full, mask, images), max_length)
    first_supervised = mask.index(1)
    if first_supervised >= max_length:
        raise OverLength(max_length, first_supervised, "tokens")
    return TokenizedSample(sample_id, full[:max_length], mask[:max_length])


def expand_images(image_inputs: ImageInputs, sample: TokenizedSample, max_length: int) -> TokenizedSample:
    """A sample whose ids hold one placeholder per image -> placeholders expanded to each image's
    token count, clipped to `max_length` without cutting an image (a cut image and the images after
    it are dropped with the tokens)."""

    try:
        grids = [image_inputs.grid(load_image(part)) for part in sample.images]
    except SpeculatorsError as error:
        raise RowRejected(str(error)) from None
    ids, mask = image_inputs.expand(sample.input_ids, sample.loss_mask, grids)
    length, kept, position = min(len(ids), max_length), 0, 0
    pad = image_inputs.tokens.image_token_id
    for grid in grids:
        start = ids.index(pad, position)
        end = start + image_inputs.token_count(grid)
        if end > length:
            length = min(length, start)
            break
        kept, position = kept + 1, end
    if 1 not in mask[:length]:
        raise OverLength(max_length, mask.index(1) if 1 in mask else len(ids), "tokens")
    return TokenizedSample(sample.id, ids[:length], mask[:length], sample.images[:kept])


def clip_answers(sample: TokenizedSample, max_answer_tokens: int) -> TokenizedSample | None:
    """The sample cut after the first `max_answer_tokens` tokens of its first longer answer (an answer is
    a run of supervised tokens), as regeneration ends a conversation at an answer that reaches its budget;
    None where no answer is longer."""
    run = 0
    for index, supervised in enumerate(sample.loss_mask):
        run = run + 1 if supervised else 0
        if run > max_answer_tokens:
            return TokenizedSample(sample.id, sample.input_ids[:index], sample.loss_mask[:index], sample.images)
    return None


def read_samples(path: str | Path) -> list[TokenizedSample]:
    path = Path(path)
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise SpeculatorsError(
            f"{path} {what}; pass the samples.jsonl that 'speculators prepare --verifier ...' writes"
        )
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            problem = sample_row_problem(row)
            if problem:
                raise SpeculatorsError(f"{path}:{number} is not a tokenized sample ({problem}); re-run prepare")
            samples.append(TokenizedSample.from_row(row))
    return samples


def sample_row_problem(row: Any) -> str | None:
    """What makes a samples.jsonl row unusable, or None: the capture would otherwise index the verifier's
    embeddings with it (a negative id reads the wrong row, a string is a list of characters)."""
    if not isinstance(row, dict):
        return "not a JSON object"
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(row.get("id"), str):
        return "no string 'id'"
    if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
        return "'input_ids' is not a non-empty list of integers"
    if min(ids) < 0:
        return f"token id {min(ids)} is negative"
    if not isinstance(mask, list) or not all(m in (0, 1) and type(m) in (int, bool) for m in mask):
        return "'loss_mask' is not a list of 0/1"
    if len(mask) != len(ids):
        return f"{len(ids)} input_ids but {len(mask)} loss_mask entries"
    if not isinstance(row.get("images") or [], list):
        return "'images' is not a list"
    return None


def token_statistics(samples: list[TokenizedSample]) -> dict[str, Any]:
    lengths = sorted(len(s.input_ids) for s in samples)
    supervised = sum(s.supervised_tokens for s in samples)
    total = sum(lengths)
    if not lengths:
        return {"samples": 0, "tokens": 0, "supervised_tokens": 0}
    return {
        "samples": len(samples),
        "tokens": total,
        "supervised_tokens": supervised,
        "supervised_share": round(supervised / total, 4),
        "length_min": lengths[0],
        "length_median": lengths[len(lengths) // 2],
        "length_max": lengths[-1],
    }
