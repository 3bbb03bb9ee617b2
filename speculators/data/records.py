"""Typed records of the JSON files the data stage writes, for the readers of those files (the Dagster
code location first): `prepare_report.json` (`speculators prepare`), `datagen_report.json`
(`speculators datagen`) and `draft_vocab.json` (`speculators vocab`).

The writers write these files as they always have; a record names the keys its readers use and keeps
every other key (`extra="allow"`), so files of older and newer versions read alike. Each record names
its file (`FILE`), relative to the folder its command writes into.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class DataRecord(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptsSection(DataRecord):
    """prepare_report.json's `prompts`: the rows read, kept and refused (the prompt sources' report)."""

    rows_read: int
    kept: int
    validation: int = 0  # kept for validation only (absent in reports made before the split)
    duplicates: int
    rejected: dict[str, int] | int  # reason -> rows (a plain count in early reports)
    data_version: str
    per_source: list[dict[str, Any]] = []  # one entry per source (absent in reports made before weights)

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values()) if isinstance(self.rejected, dict) else self.rejected


class TokenStatistics(DataRecord):
    tokens: int
    supervised_tokens: int


class RegenerationSection(DataRecord):
    """How many answers the verifier wrote in this run, and how many an earlier run's resume file gave."""

    regenerated: int = 0
    resumed: int = 0


class TokenBudgetSection(DataRecord):
    """What `prepare --max-train-tokens` kept of the training samples, and what it left out."""

    max_train_tokens: int
    prefer: str
    kept: int
    kept_tokens: int
    left_out: int
    left_out_tokens: int


class TokenizationSection(DataRecord):
    """prepare_report.json's `tokenization` (written with a verifier): the samples and how their answers
    were made."""

    statistics: TokenStatistics
    regeneration: RegenerationSection = RegenerationSection()  # (absent where the verifier answered nothing)
    answers: str | None = None  # whose answers, in words (absent in early reports)
    clipped_answers: int = 0
    token_budget: TokenBudgetSection | None = None  # (only with --max-train-tokens)


class PreparedDataReport(DataRecord):
    """prepare_report.json: what `speculators prepare` read, kept and (with a verifier) tokenized."""

    FILE: ClassVar[str] = "prepare_report.json"

    prompts: PromptsSection
    tokenization: TokenizationSection | None = None  # only with a verifier


class DatagenReport(DataRecord):
    """datagen_report.json, beside the store: what one `speculators datagen` computed and reused."""

    FILE: ClassVar[str] = "datagen_report.json"

    mode: str = "store"  # store, or index (datagen --index-only: the states of only a probe computed)
    samples: int | None = None
    computed: int | None = None
    reused: int | None = None
    tokens_per_second: float | None = None  # of the computed tokens (None when nothing was computed)
    bytes_per_token: float | None = None  # an index's: of the shards it holds
    # an index's: the probe (samples computed for real, or already held), its capture tokens/s (None when the
    # store held every probe sample), its entries with and without states, and a full store's bytes (None
    # when no sample has states)
    probe_samples: int | None = None
    probe_tokens_per_second: float | None = None
    computed_samples: int | None = None
    index_samples: int | None = None
    full_store_bytes_estimate: int | None = None


class DraftVocabSummary(DataRecord):
    """draft_vocab.json, beside the store and its draft_vocab.safetensors: the vocabulary's facts."""

    FILE: ClassVar[str] = "draft_vocab.json"

    draft_vocab_size: int | None = None
    coverage: float = 0.0  # share of the supervised tokens inside the draft vocabulary
