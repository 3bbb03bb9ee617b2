"""Typed records of a checkpoint's files for readers outside the format's own code (the Dagster code
location): what `speculators validate --json` prints, and the few facts of `config.json` a reader
needs without validating the format.

Both keep every key they do not name (`extra="allow"`). `CheckpointFacts` is lenient on purpose: it
reads a config that `speculators validate` may have found invalid (models/config.py's `Eagle3Config`
is the format, with its checks).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict


class CheckpointRecord(BaseModel):
    model_config = ConfigDict(extra="allow")


class ValidationResult(CheckpointRecord):
    """`speculators validate --json`'s output: the verdict, its problems and notes, the summary."""

    FILE: ClassVar[str] = "validation.json"  # where the Dagster code location keeps it, in the checkpoint

    ok: bool
    problems: list[str]
    notes: list[str]
    summary: dict[str, str] = {}


class ProposalFacts(CheckpointRecord):
    speculative_tokens: int


class SpeculatorsFacts(CheckpointRecord):
    proposal_methods: list[ProposalFacts]


class CheckpointFacts(CheckpointRecord):
    """config.json as a reader outside the format sees it: K, the draft vocab size, the aux layer ids."""

    FILE: ClassVar[str] = "config.json"

    draft_vocab_size: int
    eagle_aux_hidden_state_layer_ids: list[int] | None = None  # EAGLE-3's and P-EAGLE's key
    aux_hidden_state_layer_ids: list[int] | None = None  # DFlash's
    speculators_config: SpeculatorsFacts

    @property
    def aux_layer_ids(self) -> list[int] | None:
        """The verifier layers the drafter reads, under whichever key its algorithm writes them."""
        return self.eagle_aux_hidden_state_layer_ids or self.aux_hidden_state_layer_ids

    @property
    def speculative_tokens(self) -> int:
        """K of the first proposal method (the one vLLM runs)."""
        return self.speculators_config.proposal_methods[0].speculative_tokens
