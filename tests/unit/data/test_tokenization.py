"""Loss masks exactly on assistant tokens, for the chat templates of each family; clipping and rejections."""

from __future__ import annotations

import pytest

from speculators.data.rows import RowRejected
from speculators.data.tokenization import token_statistics, tokenize_conversation
from speculators.verifier.tiny import build_tokenizer

TWO_TURNS = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "The model explains the next token."},
    {"role": "assistant", "content": "A drafter predicts two numbers quickly."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "The verifier checks every word."},
]
# What the model generates for an assistant turn, per family (template tokens it emits included).
EXPECTED_SPANS = {
    "llama": ["A drafter predicts two numbers quickly.<|eot_id|>", "The verifier checks every word.<|eot_id|>"],
    "qwen3": ["A drafter predicts two numbers quickly.<|im_end|>", "The verifier checks every word.<|im_end|>"],
    "qwen3_moe": ["A drafter predicts two numbers quickly.<|im_end|>", "The verifier checks every word.<|im_end|>"],
    "gpt_oss": [
        "<|channel|>final<|message|>A drafter predicts two numbers quickly.<|end|>",
        "<|channel|>final<|message|>The verifier checks every word.<|end|>",
    ],
}


def masked_spans(tokenizer, sample):
    spans, current = [], []
    for token, flag in zip(sample.input_ids, sample.loss_mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(span) for span in spans]


@pytest.mark.parametrize("family", sorted(EXPECTED_SPANS))
def test_loss_mask_covers_exactly_the_assistant_turns(family):
    tokenizer = build_tokenizer(family)
    sample = tokenize_conversation(tokenizer, "x", TWO_TURNS, max_length=4096)
    assert sample.input_ids == tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    assert masked_spans(tokenizer, sample) == EXPECTED_SPANS[family]


def test_mistral_template_masks_answer_and_eos():
    tokenizer = build_tokenizer("mistral")
    sample = tokenize_conversation(tokenizer, "x", TWO_TURNS[1:], max_length=4096)
    assert masked_spans(tokenizer, sample) == [
        "A drafter predicts two numbers quickly.</s>",
        "The verifier checks every word.</s>",
    ]


def test_a_template_that_rewrites_history_falls_back_to_offsets():
    """Like Qwen3's: reasoning markers only on the final assistant turn, so earlier renders are not prefixes."""
    tokenizer = build_tokenizer("qwen3")
    tokenizer.chat_template = (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' and loop.last %}"
        "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    sample = tokenize_conversation(tokenizer, "x", TWO_TURNS, max_length=4096)
    assert masked_spans(tokenizer, sample) == EXPECTED_SPANS["qwen3"]


def test_clipping_and_rejections():
    tokenizer = build_tokenizer("llama")
    full = tokenize_conversation(tokenizer, "x", TWO_TURNS, max_length=4096)
    first_answer = full.loss_mask.index(1)
    clipped = tokenize_conversation(tokenizer, "x", TWO_TURNS, max_length=first_answer + 3)
    assert len(clipped.input_ids) == first_answer + 3 and clipped.supervised_tokens == 3
    with pytest.raises(RowRejected, match="over-length"):
        tokenize_conversation(tokenizer, "x", TWO_TURNS, max_length=first_answer)
    with pytest.raises(RowRejected, match="no assistant token"):
        tokenize_conversation(tokenizer, "x", TWO_TURNS[:2], max_length=4096)
    stats = token_statistics([full, clipped])
    assert stats["samples"] == 2 and stats["supervised_tokens"] == full.supervised_tokens + 3
    assert stats["tokens"] == len(full.input_ids) + len(clipped.input_ids)
