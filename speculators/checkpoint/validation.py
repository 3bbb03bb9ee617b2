"""`speculators validate`: a checkpoint against the format and, optionally, against its verifier."""

from __future__ import annotations

from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.checkpoint.acceptance_profile import (
    PROFILE_FILE,
    profile_problems,
    profile_summary,
    read_profile,
    verifier_identity,
)
from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.algorithms import algorithm_of_checkpoint
from speculators.models.config import NORM_FLAGS, Eagle3Config
from speculators.models.weights import read_checkpoint
from speculators.verifier.architectures import text_config_of
from speculators.verifier.loading import default_aux_layer_ids, load_verifier_config

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig


def check_against_verifier(config: Eagle3Config, verifier_config: PreTrainedConfig, has_embeddings: bool) -> list[str]:
    """Problems between a drafter config and the verifier's transformers config."""
    problems = []

    text = text_config_of(verifier_config)
    hidden, vocab, layers = text.hidden_size, text.vocab_size, text.num_hidden_layers
    if config.verifier_hidden_size != hidden:
        problems.append(
            f"the drafter expects verifier hidden size {config.verifier_hidden_size} "
            f"(fc width {config.num_aux_states * config.verifier_hidden_size}) but the verifier's is {hidden}"
        )
    if config.verifier_vocab_size != vocab:
        problems.append(
            f"the drafter's verifier vocab (transformer_layer_config.vocab_size, t2d length) is "
            f"{config.verifier_vocab_size} but the verifier's is {vocab}"
        )
    ids = config.eagle_aux_hidden_state_layer_ids
    if ids is None:
        try:
            default_aux_layer_ids(layers)
        except SpeculatorsError as error:
            problems.append(str(error))
    else:
        bad = [i for i in ids if i > layers]
        if bad:
            problems.append(f"aux layer ids {bad} exceed the verifier's {layers} layers (ids run 0..{layers})")
    if not has_embeddings and hidden != config.hidden_size:
        problems.append(
            f"the checkpoint has no embed_tokens.weight, so vLLM shares the verifier's embeddings, but "
            f"their width {hidden} differs from the draft hidden size {config.hidden_size}; save embeddings"
        )
    return problems


@dataclass
class ValidationReport:
    directory: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        lines = [f"checkpoint: {self.directory}"]
        lines += [f"  {key}: {value}" for key, value in self.summary.items()]
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  PROBLEM: {problem}" for problem in self.problems]
        lines.append("result: valid" if self.ok else f"result: INVALID ({len(self.problems)} problem(s))")
        return "\n".join(lines)


# A parallel drafter's block facts (DFlash's config), shown where the config has them.
BLOCK_FACTS = {"block size": "block_size", "mask token": "mask_token_id"}


def summarize(config: Eagle3Config, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    parameters = sum(t.numel() for name, t in tensors.items() if name not in ("d2t", "t2d", "embed_tokens.weight"))
    norms = [f"{flag}={getattr(config, flag)}" for flag in NORM_FLAGS if hasattr(config, flag)]  # (EAGLE-3's)
    block = {name: getattr(config, key) for name, key in BLOCK_FACTS.items() if hasattr(config, key)}
    return {
        "algorithm": config.speculators_model_type,
        "draft layers": f"{config.num_draft_layers} x {config.draft_layer_type}",
        "hidden size": config.hidden_size,
        "verifier hidden size": config.verifier_hidden_size,
        "draft vocab": f"{config.draft_vocab_size} of {config.verifier_vocab_size}",
        "aux layer ids": config.eagle_aux_hidden_state_layer_ids or "verifier default",
        **({"norms": ", ".join(norms)} if norms else {}),
        **block,  # (DFlash's block: the bonus token and the mask slots)
        "speculative tokens": config.speculative_tokens,
        "dtype": config.dtype,
        "parameters": f"{parameters:,}",
        "embeddings saved": "embed_tokens.weight" in tensors,
        "verifier": config.speculators_config.verifier.name_or_path,
    }


def validate_checkpoint(directory: str | Path, verifier: str | None = None) -> ValidationReport:
    """Check format, tensors (finite values included), vocab mapping, and (given a verifier) its sizes.

    A bad checkpoint is a report with problems, never an exception; only a usage mistake raises a
    SpeculatorsError (a directory that does not exist, a verifier that is not a model).
    """
    report = ValidationReport(directory=Path(directory))
    reader = read_checkpoint
    with suppress(SpeculatorsError):  # (no algorithm named: the EAGLE-3 reader reports what is wrong)
        reader = algorithm_of_checkpoint(directory).part("read_checkpoint")
    try:
        checkpoint = reader(directory, drop_training_only=False)
    except CheckpointFormatError as error:
        report.problems.extend(error.problems)
        return report
    report.notes.extend(checkpoint.notes)
    report.summary = summarize(checkpoint.config, checkpoint.tensors)
    if verifier is not None:
        verifier_config, location = load_verifier_config(verifier)
        report.summary["checked against verifier"] = location
        report.problems.extend(
            check_against_verifier(checkpoint.config, verifier_config, "embed_tokens.weight" in checkpoint.tensors)
        )
    check_profile(report, checkpoint.config, verifier)
    return report


def check_profile(report: ValidationReport, config: Eagle3Config, verifier: str | None) -> None:
    """The acceptance profile beside config.json (acceptance_profile.py), where there is one: its summary
    line, and each of its problems (against the checkpoint and, given one, the verifier's weights)."""
    try:
        profile = read_profile(report.directory)
    except SpeculatorsError as error:
        report.summary["acceptance profile"] = "unreadable"
        report.problems.append(f"{PROFILE_FILE}: {error}")
        return
    if profile is None:
        report.summary["acceptance profile"] = "none"
        return
    report.summary["acceptance profile"] = profile_summary(profile)
    fingerprint = verifier_identity(verifier)[0] if verifier is not None else None
    report.problems.extend(f"{PROFILE_FILE}: {problem}" for problem in profile_problems(profile, config, fingerprint))
