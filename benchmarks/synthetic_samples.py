"""Benchmark samples: demo prompts with a synthetic answer (the prompt repeated), tokenized with the
verifier's chat template. Capture and storage costs depend on token counts, not on the content."""

from __future__ import annotations

from typing import Any

from speculators.data.demo_prompts import demo_prompts
from speculators.data.tokenization import TokenizedSample, tokenize_conversation


def synthetic_samples(tokenizer: Any, count: int, max_length: int, repeats: int) -> list[TokenizedSample]:
    return [
        tokenize_conversation(
            tokenizer,
            f"s{i}",
            [{"role": "user", "content": p}, {"role": "assistant", "content": (p + " ") * repeats}],
            max_length,
        )
        for i, p in enumerate(demo_prompts("train")[:count])
    ]
