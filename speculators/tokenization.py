"""Conversations -> token ids + loss mask (1 on assistant tokens only) with the verifier's chat template.

For each assistant turn the conversation is rendered up to the turn with the generation prompt and
again with the turn; the tokens between the two are the turn (what the model would generate,
including template tokens such as a channel header), cut after its end-of-turn token. Templates
that rewrite earlier turns once a later one exists (e.g. reasoning stripped from history) fall back
to locating each assistant text by character offsets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from speculators.errors import SpeculatorsError
from speculators.prompts import RowRejected

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from speculators.vision import ImageInputs

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


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase,
    sample_id: str,
    messages: list[dict[str, Any]],
    max_length: int,
    image_inputs: ImageInputs | None = None,
) -> TokenizedSample:
    """Token ids and assistant-only loss mask, clipped to `max_length`; RowRejected if nothing is
    supervised. Conversations with images need the verifier's `image_inputs`: each image's
    placeholder is expanded to its token count (never supervised)."""
    from speculators.vision import image_parts

    images = image_parts(messages)
    if images and image_inputs is None:
        raise RowRejected("images in a conversation for a text-only verifier")
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
        raise RowRejected(f"over-length (the prompt alone exceeds max length {max_length})")
    return TokenizedSample(sample_id, full[:max_length], mask[:max_length])


def expand_images(image_inputs: ImageInputs, sample: TokenizedSample, max_length: int) -> TokenizedSample:
    """A sample whose ids hold one placeholder per image -> placeholders expanded to each image's
    token count, clipped to `max_length` without cutting an image (a cut image and the images after
    it are dropped with the tokens)."""
    from speculators.vision import load_image

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
        raise RowRejected(f"over-length (the prompt alone exceeds max length {max_length})")
    return TokenizedSample(sample.id, ids[:length], mask[:length], sample.images[:kept])


def read_samples(path: str | Path) -> list[TokenizedSample]:
    path = Path(path)
    if not path.is_file():
        raise SpeculatorsError(f"{path} does not exist; run 'speculators prepare --verifier ...' first")
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                sample = TokenizedSample.from_row(json.loads(line))
            except (json.JSONDecodeError, KeyError):
                raise SpeculatorsError(f"{path}:{number} is not a tokenized sample; re-run prepare") from None
            if len(sample.input_ids) != len(sample.loss_mask):
                raise SpeculatorsError(f"{path}:{number} has {len(sample.input_ids)} ids but a longer/shorter mask")
            samples.append(sample)
    return samples


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
