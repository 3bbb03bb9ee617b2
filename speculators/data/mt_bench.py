"""MT-Bench's questions, two user turns each: the second is asked after the verifier's own first answer.

The questions come from the packaged `mt-bench` data set (speculators.data.packaged). As a prompt
source it gives each question's first turn (`MtBenchQuestion.first_turn`); evaluation and benchmarks
ask the second with `MtBenchQuestion.second_turn(answer)`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any

from speculators.data.conversation import Conversation
from speculators.data.packaged import MT_BENCH, PACKAGED_SOURCES, packaged_file
from speculators.data.rows import iter_file_rows
from speculators.errors import SpeculatorsError


@dataclass(frozen=True)
class MtBenchQuestion:
    """One MT-Bench question: two user turns, the second asked after the model's own first answer."""

    question_id: int
    category: str
    turns: tuple[str, str]

    @property
    def id(self) -> str:
        return f"mt-bench-{self.question_id}"

    def first_turn(self) -> Conversation:
        """The turn-1 prompt: the first question alone."""
        return Conversation(f"{self.id}-turn1", [{"role": "user", "content": self.turns[0]}], self.category)

    def second_turn(self, answer: str) -> Conversation:
        """The turn-2 prompt: the first question, `answer` (the verifier's own greedy answer to it, as
        text: what a chat client sends back, and how FastChat and EAGLE build MT-Bench's second turn),
        the second question."""
        messages = [
            {"role": "user", "content": self.turns[0]},
            {"role": "assistant", "content": answer.strip()},
            {"role": "user", "content": self.turns[1]},
        ]
        return Conversation(f"{self.id}-turn2", messages, self.category)


def mt_bench_questions(max_questions: int | None = None) -> list[MtBenchQuestion]:
    """MT-Bench's questions, taken round-robin over the categories (the first of each category, then
    the second of each, ...; in the file's order within a category), so that the first N cover every
    category as evenly as N allows. Turn 1 of each is `first_turn()`; turn 2 is `second_turn(answer)`
    once the verifier has answered turn 1."""
    path = packaged_file(MT_BENCH)
    by_category: dict[str, list[MtBenchQuestion]] = defaultdict(list)
    for location, row in iter_file_rows(path):
        question = mt_bench_question(row)
        if question is None:
            raise SpeculatorsError(
                f"{location} of {path} is not an MT-Bench question; reinstall ({PACKAGED_SOURCES[MT_BENCH].install})"
            )
        by_category[question.category].append(question)
    ordered = [q for rank in zip_longest(*by_category.values()) for q in rank if q is not None]
    return ordered[:max_questions]


def mt_bench_question(row: Any) -> MtBenchQuestion | None:
    """A question.jsonl row as a question, or None when it is not one."""
    if not isinstance(row, dict):
        return None
    turns, category, number = row.get("turns"), row.get("category"), row.get("question_id")
    if not (isinstance(turns, list) and len(turns) == 2 and all(isinstance(t, str) and t.strip() for t in turns)):
        return None
    if not isinstance(category, str) or not isinstance(number, int):
        return None
    return MtBenchQuestion(number, category, (turns[0], turns[1]))
