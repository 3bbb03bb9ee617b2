"""`speculators evaluate`: speculative decoding in plain PyTorch, its acceptance, speed and lossless check.

The verifier (transformers, with a KV cache) verifies K drafted tokens per step: it runs the last
accepted token and the K drafts in one pass, accepts the longest prefix of drafts that equals its
own greedy choice and adds one token of its own (chain drafting, greedy acceptance, as vLLM does at
temperature 0). The EAGLE-3 drafter proposes from the aux states captured in that same pass.

Lossless check, prompt by prompt, against the verifier's plain greedy decoding: identical; diverged
at a numerical near-tie (the two tokens are the verifier's top two and their logits differ by at
most the tolerance; verifying K+1 tokens at once rounds differently from one at a time); or
diverged, which is a bug (speculators.eval.lossless: the rule `speculators bench` judges by too).

MT-Bench (`evaluate_mt_bench`) is run in two turns, as the field reports it: turn 2 is asked after the
verifier's own greedy turn-1 answer. Prompts that carry a category (MT-Bench's, or a `category` in a
prompt file's rows) get acceptance and speed-up per category and per turn (`per_category`, and a
table laid out like the EAGLE and SpecForge papers': one column per category, then overall).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, get_args

from speculators.atomic_io import write_text_atomic
from speculators.checkpoint.validation import check_against_verifier
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH
from speculators.data.prompt_set import load_prompts
from speculators.data.tokenization import render_ids, turn_end_ids
from speculators.errors import SpeculatorsError
from speculators.eval.lossless import DEFAULT_TIE_ULPS, LosslessJudge, top_candidates, top_two
from speculators.models.algorithms import algorithm_of_checkpoint
from speculators.models.eagle3 import DraftKVCache, Eagle3Drafter
from speculators.precision import with_compute_dtype
from speculators.settings import EvaluateSettings, ProposerKind
from speculators.verifier.loading import has_chat_template, load_verifier, require_chat_template
from speculators.verifier.quantization import path_noise
from speculators.verifier.vision import image_parts, load_image

if TYPE_CHECKING:
    import torch
    from PIL import Image
    from transformers import PreTrainedTokenizerBase
    from transformers.cache_utils import Cache

    from speculators.data.conversation import Conversation
    from speculators.data.mt_bench import MtBenchQuestion
    from speculators.verifier.loading import Verifier

# (id, prompt ids) or, for a prompt with images, (id, prompt ids, image parts)
EvalPrompt = tuple[str, list[int]] | tuple[str, list[int], list[dict[str, str]]]

TurnResults = TypeVar("TurnResults")  # what a decoding of one MT-Bench turn returns (mt_bench_turns)

# The `evaluate` command's defaults (its settings model), which the Python API below shares.
DEFAULTS = {name: field.default for name, field in EvaluateSettings.model_fields.items()}


class LosslessError(SpeculatorsError):
    """Speculative decoding changed the output beyond a numerical near-tie."""


# ----- proposers -----------------------------------------------------------------------------------


class Proposer(Protocol):
    name: str

    @property
    def aux_layer_ids(self) -> Sequence[int]:
        """The verifier layers whose states `propose` reads (none for the oracles)."""

    def start(self, prompt_ids: list[int], reference: list[int], positions: list[int] | None = None) -> None:
        """A new prompt; `reference` is the verifier's own greedy continuation (oracles use it);
        `positions`: the drafter positions of the prompt's tokens when they are not 0..T-1 (images)."""

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        """Draft `num_tokens` ids after `tokens`; `new_aux` [1, m, A*H] are the verifier's aux states
        of the m positions before the last token that this proposer has not seen yet (None when it
        reads no aux layers)."""


class DrafterProposer:
    """An EAGLE-3 drafter with its own KV cache, kept in step with the verified sequence."""

    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter):
        layer_ids = drafter.config.eagle_aux_hidden_state_layer_ids
        if layer_ids is None:
            raise SpeculatorsError("the drafter's config names no aux layer ids; set its verifier's default ones")
        self.drafter = drafter
        self.aux_layer_ids = list(layer_ids)
        self.cache: DraftKVCache | None = None
        self.positions: list[int] | None = None

    def start(self, prompt_ids: list[int], reference: list[int], positions: list[int] | None = None) -> None:

        self.cache = DraftKVCache(self.drafter.config.num_draft_layers)
        self.positions = positions

    def position_ids(self, start: int, count: int) -> torch.Tensor | None:
        """Drafter positions of tokens start..start+count-1 as training saw them (stored positions
        plus one; after the prompt they advance by one per token), or None for 0..T-1 (text)."""
        import torch

        if self.positions is None:
            return None
        prompt, end = self.positions, len(self.positions)
        values = [prompt[u] if u < end else prompt[-1] + u - end + 1 for u in range(start, start + count)]
        return torch.tensor([values]) + 1

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        import torch

        assert self.cache is not None, "start() comes before propose()"
        assert new_aux is not None, "the drafter reads aux layers"
        next_ids = torch.tensor([tokens[-new_aux.shape[1] :]])
        dtype = self.drafter.fc.weight.dtype
        positions = self.position_ids(len(tokens) - 1 - new_aux.shape[1], new_aux.shape[1])
        drafted = self.drafter.propose(new_aux.to(dtype), next_ids, self.cache, num_tokens, positions)
        # Keep only positions fed with verified states; the drafted chain is redone next step.
        self.cache.crop(len(tokens) - 1)
        return drafted[0].tolist()


class OracleProposer:
    """Drafts the verifier's own greedy continuation: every draft is accepted (acceptance K+1)."""

    name = "oracle"
    aux_layer_ids: tuple[int, ...] = ()  # needs no verifier states

    def start(self, prompt_ids: list[int], reference: list[int], positions: list[int] | None = None) -> None:
        self.sequence = list(prompt_ids) + list(reference)

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        drafted = self.sequence[len(tokens) : len(tokens) + num_tokens]
        return drafted + [0] * (num_tokens - len(drafted))


class WrongProposer(OracleProposer):
    """Drafts a token that is never the verifier's choice: nothing is accepted (acceptance 1.0)."""

    name = "always-wrong"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, tokens: list[int], new_aux: torch.Tensor | None, num_tokens: int) -> list[int]:
        return [(token + 1) % self.vocab_size for token in super().propose(tokens, new_aux, num_tokens)]


# ----- generation ----------------------------------------------------------------------------------


@dataclass
class Generation:
    tokens: list[int]
    # Per generated token: the verifier's top two (id, logit) at that position.
    top2: list[tuple[int, float, int, float]]
    seconds: float
    # Per generated token: the verifier's largest few (id, logit), for splits past the second (top_candidates).
    candidates: list[list[tuple[int, float]]] = field(default_factory=list)
    steps: int = 0  # verifier passes after the prefill
    drafts: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


def verifier_pass(
    verifier: Verifier,
    input_ids: list[int],
    cache: Cache | None,
    captured: dict[int, torch.Tensor],
    layer_ids: Sequence[int],
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, Cache, torch.Tensor | None]:
    """Logits [T, V], the KV cache, and aux states [1, T, A*H] (None without layer ids) of one pass.
    `vision`: a vision-language verifier's pixel inputs, on the prompt's (first) pass."""
    import torch

    base = verifier.adapter.base_model(verifier.model)
    if cache is None and hasattr(base, "rope_deltas"):
        base.rope_deltas = None  # type: ignore[assignment]  # M-RoPE offsets: this prompt's, not an earlier one's
    out = verifier.model(input_ids=torch.tensor([input_ids]), past_key_values=cache, use_cache=True, **(vision or {}))
    aux = torch.cat([captured[i] for i in layer_ids], dim=-1) if layer_ids else None
    return out.logits[0], out.past_key_values, aux


def pixel_inputs(
    verifier: Verifier, prompt_ids: list[int], images: Sequence[Image.Image]
) -> dict[str, torch.Tensor] | None:
    """The prompt pass's pixel inputs and token types (None for a prompt without images)."""
    import torch

    if not images:
        return None
    inputs = verifier.image_inputs
    vision = inputs.pixel_inputs(list(images))
    vision["mm_token_type_ids"] = inputs.token_types(torch.tensor([prompt_ids]))
    return vision


def greedy_generate(
    verifier: Verifier,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: set[int],
    extra_tokens: int = 0,
    images: Sequence[Image.Image] = (),
) -> Generation:
    """Plain greedy decoding, one token per pass; `extra_tokens` more are generated untimed."""
    import torch

    vision = pixel_inputs(verifier, prompt_ids, images)  # before the clock: image preprocessing is not decoding
    started = time.perf_counter()
    generation = Generation(tokens=[], top2=[], seconds=0.0)
    cache: Cache | None = None
    step_input = list(prompt_ids)
    with torch.inference_mode():
        while len(generation.tokens) < max_new_tokens + extra_tokens:
            logits, cache, _ = verifier_pass(verifier, step_input, cache, {}, [], vision)
            vision = None
            best = top_two(logits[-1:])[0]
            generation.tokens.append(best[0])
            generation.top2.append(best)
            generation.candidates.extend(top_candidates(logits[-1:]))
            if len(generation.tokens) == max_new_tokens:
                generation.seconds = time.perf_counter() - started
            if best[0] in stop_ids:
                break
            step_input = [best[0]]
    if not generation.seconds:
        generation.seconds = time.perf_counter() - started
    return generation


def speculative_generate(
    verifier: Verifier,
    prompt_ids: list[int],
    proposer: Proposer,
    num_tokens: int,
    max_new_tokens: int,
    stop_ids: set[int],
    reference: list[int],
    images: Sequence[Image.Image] = (),
) -> Generation:
    """Chain drafting with greedy acceptance; statistics as vLLM counts them."""
    import torch

    positions = None
    if images:  # vLLM gives the drafter the temporal row of the verifier's M-RoPE positions
        inputs = verifier.image_inputs
        positions = inputs.drafter_positions(prompt_ids, [inputs.grid(image) for image in images])
    vision = pixel_inputs(verifier, prompt_ids, images)  # before the clock, as in greedy_generate
    started = time.perf_counter()
    generation = Generation(tokens=[], top2=[], seconds=0.0, accepted_per_position=[0] * num_tokens)
    layer_ids = proposer.aux_layer_ids
    proposer.start(prompt_ids, reference, positions)
    tokens = list(prompt_ids)
    with verifier.capturing(layer_ids) as captured, torch.inference_mode():
        logits, cache, new_aux = verifier_pass(verifier, tokens, None, captured, layer_ids, vision)
        first = top_two(logits[-1:])[0]
        tokens.append(first[0])
        generation.tokens.append(first[0])
        generation.top2.append(first)
        generation.candidates.extend(top_candidates(logits[-1:]))
        while len(generation.tokens) < max_new_tokens and generation.tokens[-1] not in stop_ids:
            drafts = proposer.propose(tokens, new_aux, num_tokens)
            logits, cache, new_aux = verifier_pass(verifier, [tokens[-1], *drafts], cache, captured, layer_ids)
            best, candidates = top_two(logits), top_candidates(logits)
            choices = [row[0] for row in best]
            accepted = 0
            while accepted < num_tokens and drafts[accepted] == choices[accepted]:
                accepted += 1
            generation.steps += 1
            generation.drafts += 1
            rejected = num_tokens - accepted  # keep the last token and the accepted drafts
            if rejected:
                cache.crop(-rejected)
            if new_aux is not None:
                new_aux = new_aux[:, : accepted + 1]
            for position in range(accepted + 1):
                token = choices[position]
                tokens.append(token)
                generation.tokens.append(token)
                generation.top2.append(best[position])
                generation.candidates.append(candidates[position])
                if position < accepted:  # counted only when output: not past a stop token or the budget
                    generation.accepted_per_position[position] += 1
                if len(generation.tokens) == max_new_tokens or token in stop_ids:
                    break
    generation.seconds = time.perf_counter() - started
    return generation


# ----- lossless check ------------------------------------------------------------------------------


@dataclass
class Comparison:
    status: str  # identical | near_tie | diverged
    position: int | None = None
    baseline_token: int | None = None
    speculative_token: int | None = None
    margin: float | None = None
    tolerance: float | None = None
    path_noise: float | None = None  # an FP8 verifier's evaluation-order noise (order_noise), if it decided


def compare_outputs(
    baseline: Generation,
    speculative: Generation,
    dtype: torch.dtype,
    tie_tolerance: float | None = None,
) -> Comparison:
    """Classify speculative output against the baseline's (both cut at the same token budget) by the
    lossless judge (speculators.eval.lossless), from the two decoders' own logits at the split: where the
    other decoder's token is one decoder's second (or among its few largest logits, `candidates`), it lies
    that gap below that decoder's top logit (the smaller gap where both are)."""
    expected, judge = baseline.tokens, LosslessJudge(dtype, tie_tolerance)
    if speculative.tokens == expected:
        return Comparison("identical")
    position = judge.split(expected, speculative.tokens)
    if position is None:  # one stopped where the other did not, same tokens
        return Comparison("diverged", min(len(expected), len(speculative.tokens)))
    b_top, b_logit, b_second, b_second_logit = baseline.top2[position]
    s_top, s_logit, s_second, s_second_logit = speculative.top2[position]
    gaps = []
    if b_second == s_top:
        gaps.append((b_logit - b_second_logit, b_logit))
    if s_second == b_top:
        gaps.append((s_logit - s_second_logit, s_logit))
    # Past the second: a tie of three or more at the top (bf16), each decoder free to pick any of them.
    for own, own_logit, other_top in ((baseline, b_logit, s_top), (speculative, s_logit, b_top)):
        if position < len(own.candidates):
            gaps += [(own_logit - logit, own_logit) for token, logit in own.candidates[position] if token == other_top]
    comparison = Comparison("diverged", position, b_top, s_top)
    if gaps:
        margin, logit = min(gaps)
        comparison.margin, comparison.tolerance = margin, judge.tolerance_at(logit)
        comparison.status = judge.status([0.0, margin], comparison.tolerance)
    return comparison


# ----- evaluation over a prompt set ----------------------------------------------------------------


@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    generated: int
    steps: int
    drafts: int
    accepted: int
    baseline_seconds: float
    speculative_seconds: float
    accepted_per_position: list[int]
    comparison: Comparison
    greedy_ids: list[int] = field(default_factory=list)  # the verifier's plain greedy answer
    category: str | None = None  # the conversation's (MT-Bench: writing, math, ...)
    turn: int | None = None  # the prompt asks for the answer to its n-th user turn
    prompt_ids: list[int] = field(default_factory=list)  # what both decoders were given


NO_CATEGORY = "(no category)"  # the column of prompts without one, beside categorised prompts


def totals_of(results: Sequence[PromptResult], settings: dict[str, Any]) -> dict[str, Any]:
    """Acceptance, speed and lossless counts summed over `results` (a report's, or a category's)."""
    k = settings["num_speculative_tokens"]
    drafts = sum(r.drafts for r in results)
    per_position = [0] * k
    for r in results:
        for i, count in enumerate(r.accepted_per_position):
            per_position[i] += count
    accepted = sum(per_position)
    generated = sum(r.generated for r in results)
    baseline_tokens = sum(min(r.generated, settings["max_new_tokens"]) for r in results)
    base_s = sum(r.baseline_seconds for r in results)
    spec_s = sum(r.speculative_seconds for r in results)
    counts = {status: 0 for status in ("identical", "near_tie", "diverged")}
    for r in results:
        counts[r.comparison.status] += 1
    base_tps = baseline_tokens / base_s if base_s else 0.0
    spec_tps = generated / spec_s if spec_s else 0.0
    return {
        "prompts": len(results),
        "generated_tokens": generated,
        "verifier_steps": sum(r.steps for r in results),
        "drafts": drafts,
        "draft_tokens": drafts * k,
        "accepted_tokens": accepted,
        "accepted_per_position": per_position,
        "acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        "acceptance_per_position": [count / drafts if drafts else 0.0 for count in per_position],
        "tokens_per_second": {
            "baseline": base_tps,
            "speculative": spec_tps,
            "speedup": spec_tps / base_tps if base_tps else 0.0,
        },
        "lossless": {**counts, "ok": counts["diverged"] == 0},
    }


@dataclass
class EvaluationReport:
    settings: dict[str, Any]
    results: list[PromptResult] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        return totals_of(self.results, self.settings)

    def per_category(self) -> dict[str, Any] | None:
        """Totals per category, in the order categories first appear, then `overall` (every prompt),
        each with `per_turn` (turn -> totals) when the prompts ask for more than one turn; None when no
        prompt has a category."""
        names = list(dict.fromkeys(r.category or NO_CATEGORY for r in self.results))
        if names in ([], [NO_CATEGORY]):
            return None
        turns = sorted({r.turn for r in self.results if r.turn is not None})

        def column(results: list[PromptResult]) -> dict[str, Any]:
            totals = totals_of(results, self.settings)
            if len(turns) > 1:
                totals["per_turn"] = {
                    str(turn): totals_of([r for r in results if r.turn == turn], self.settings) for turn in turns
                }
            return totals

        columns = {name: column([r for r in self.results if (r.category or NO_CATEGORY) == name]) for name in names}
        return {**columns, "overall": column(self.results)}

    def to_dict(self) -> dict[str, Any]:
        per_category = self.per_category()
        return {
            "settings": self.settings,
            **self.totals(),
            **({"per_category": per_category} if per_category else {}),
            "per_prompt": [{**asdict(r), "comparison": asdict(r.comparison)} for r in self.results],
        }

    def render(self) -> str:
        t = self.totals()
        rates = " / ".join(f"{rate:.3f}" for rate in t["acceptance_per_position"])
        tps = t["tokens_per_second"]
        lossless = t["lossless"]
        lines = [
            f"proposer {self.settings['proposer']}, K={self.settings['num_speculative_tokens']}, "
            f"{t['prompts']} prompts, {t['generated_tokens']} tokens in {t['verifier_steps']} verifier steps",
            f"acceptance length {t['acceptance_length']:.3f} (per position {rates}); "
            f"{t['accepted_tokens']} of {t['draft_tokens']} drafted tokens accepted",
            f"tokens/s: baseline {tps['baseline']:.1f}, speculative {tps['speculative']:.1f} ({tps['speedup']:.2f}x)",
            f"lossless: {lossless['identical']} identical, {lossless['near_tie']} diverged at a near-tie, "
            f"{lossless['diverged']} diverged",
        ]
        per_category = self.per_category()
        if per_category:
            columns = {name: table_column(totals) for name, totals in per_category.items()}
            lines += ["", category_table(columns, self.settings["num_speculative_tokens"])]
        for r in self.results:
            c = r.comparison
            if c.status != "identical":
                margin = "" if c.margin is None else f", {c.margin:.3g} below the top (tolerance {c.tolerance:.3g})"
                lines.append(
                    f"  {c.status}: prompt {r.id} at generated token {c.position}: baseline "
                    f"{c.baseline_token}, speculative {c.speculative_token}{margin}"
                )
        return "\n".join(lines)

    def raise_for_divergence(self) -> None:
        bad = [r for r in self.results if r.comparison.status == "diverged"]
        if bad:
            first = bad[0]
            raise LosslessError(
                f"speculative decoding changed the output of {len(bad)} prompt(s), first prompt {first.id} at "
                f"generated token {first.comparison.position} (baseline {first.comparison.baseline_token}, "
                f"speculative {first.comparison.speculative_token}) beyond a numerical near-tie; this is a bug"
            )


def table_column(totals: dict[str, Any]) -> dict[str, Any]:
    """One column of category_table from totals_of's totals (with its `per_turn`, if any)."""
    return {
        "prompts": totals["prompts"],
        "acceptance_length": totals["acceptance_length"] if totals["drafts"] else None,
        "per_turn": {
            turn: part["acceptance_length"] if part["drafts"] else None
            for turn, part in totals.get("per_turn", {}).items()
        },
        "acceptance_per_position": totals["acceptance_per_position"] if totals["drafts"] else [],
        "speedup": totals["tokens_per_second"]["speedup"] or None,
    }


def category_table(columns: dict[str, dict[str, Any]], k: int, speedup_label: str = "speed-up (tokens/s)") -> str:
    """A Markdown table as the EAGLE and SpecForge papers lay theirs out: one column per category, then
    overall; rows: prompts, acceptance length (and per turn), acceptance rate per draft position,
    speed-up. Each column: `prompts`, `acceptance_length`, `per_turn` ({turn: acceptance length}),
    `acceptance_per_position`, `speedup` (None where there is no value)."""

    def cells(label: str, values: Iterable[float | None], spec: str, suffix: str = "") -> list[str]:
        return [label, *("-" if value is None else format(value, spec) + suffix for value in values)]

    names = list(columns)
    turns = list(dict.fromkeys(turn for column in columns.values() for turn in column.get("per_turn", {})))
    rows = [
        ["prompts", *(str(columns[n]["prompts"]) for n in names)],
        cells("acceptance length", (columns[n]["acceptance_length"] for n in names), ".2f"),
    ]
    for turn in turns:
        values = (columns[n].get("per_turn", {}).get(turn) for n in names)
        rows.append(cells(f"acceptance length, turn {turn}", values, ".2f"))
    for position in range(k):
        rates = [columns[n]["acceptance_per_position"] for n in names]
        values = (column[position] if len(column) > position else None for column in rates)
        rows.append(cells(f"acceptance rate, draft {position + 1}", values, ".3f"))
    rows.append(cells(speedup_label, (columns[n]["speedup"] for n in names), ".2f", "x"))
    return "\n".join(
        [
            "| | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names),
            *("| " + " | ".join(row) + " |" for row in rows),
        ]
    )


def evaluate(
    verifier: Verifier,
    prompts: Sequence[EvalPrompt],
    proposer: Proposer,
    num_speculative_tokens: int,
    max_new_tokens: int = DEFAULTS["max_new_tokens"],
    stop_at_eos: bool = True,
    tie_tolerance: float | None = None,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> EvaluationReport:
    """Baseline greedy decoding and speculative decoding for each (id, prompt ids[, image parts]);
    compared. A prompt with images holds their expanded placeholders (tokenize_prompts)."""

    if num_speculative_tokens < 1:
        raise SpeculatorsError(f"num_speculative_tokens {num_speculative_tokens} must be at least 1")
    if max_new_tokens < 1:
        raise SpeculatorsError(f"max_new_tokens {max_new_tokens} must be at least 1")
    dtype = verifier.model.dtype
    stop_ids = turn_end_ids(verifier.tokenizer) if stop_at_eos else set()
    report = EvaluationReport(
        settings={
            "proposer": proposer.name,
            "num_speculative_tokens": num_speculative_tokens,
            "max_new_tokens": max_new_tokens,
            "dtype": str(dtype).removeprefix("torch."),
            "stop_at_eos": stop_at_eos,
            "tie_tolerance": f"{DEFAULT_TIE_ULPS} ulps of the top logit" if tie_tolerance is None else tie_tolerance,
            **(settings or {}),
        }
    )
    noise = 0.0  # an FP8 verifier's: the most the two decoders' logits differed where they agreed

    for index, prompt in enumerate(prompts):
        result, prompt_noise = evaluate_prompt(
            verifier, prompt, proposer, num_speculative_tokens, max_new_tokens, stop_ids, tie_tolerance
        )
        report.results.append(result)
        if prompt_noise is not None:
            noise = max(noise, prompt_noise)
        if progress:
            acceptance = 1 + result.accepted / result.drafts if result.drafts else 0.0
            print(
                f"  [{index + 1}/{len(prompts)}] {result.id}: {result.generated} tokens, acceptance "
                f"{acceptance:.2f}, {result.comparison.status}",
                flush=True,
            )
    if verifier.quantization:
        within = settle_fp8_splits(report, noise, verifier, [p[1] for p in prompts], num_speculative_tokens + 1)
        report.settings["fp8_order_noise"] = noise
        if progress and within:
            print(
                f"  {within} split(s) lie within the FP8 verifier's own evaluation-order noise ({noise:.4f}): "
                f"near-ties",
                flush=True,
            )
    return report


def evaluate_prompt(
    verifier: Verifier,
    prompt: EvalPrompt,
    proposer: Proposer,
    num_speculative_tokens: int,
    max_new_tokens: int,
    stop_ids: set[int],
    tie_tolerance: float | None,
) -> tuple[PromptResult, float | None]:
    """One (id, prompt ids[, image parts]): the verifier's greedy answer, the speculative one, compared;
    with an FP8 verifier also the two decoders' evaluation-order noise on it (order_noise), else None."""

    prompt_id, prompt_ids, *with_images = prompt
    images = [load_image(part) for part in (with_images[0] if with_images else [])]
    # K extra reference tokens let an oracle draft past the budget; they are not timed.
    baseline = greedy_generate(
        verifier, prompt_ids, max_new_tokens, stop_ids, extra_tokens=num_speculative_tokens, images=images
    )
    speculative = speculative_generate(
        verifier,
        prompt_ids,
        proposer,
        num_speculative_tokens,
        max_new_tokens,
        stop_ids,
        reference=baseline.tokens,
        images=images,
    )
    baseline.tokens, baseline.top2 = baseline.tokens[:max_new_tokens], baseline.top2[:max_new_tokens]
    baseline.candidates = baseline.candidates[:max_new_tokens]
    result = PromptResult(
        id=prompt_id,
        prompt_tokens=len(prompt_ids),
        generated=len(speculative.tokens),
        steps=speculative.steps,
        drafts=speculative.drafts,
        accepted=sum(speculative.accepted_per_position),
        baseline_seconds=baseline.seconds,
        speculative_seconds=speculative.seconds,
        accepted_per_position=speculative.accepted_per_position,
        comparison=compare_outputs(baseline, speculative, verifier.model.dtype, tie_tolerance),
        greedy_ids=list(baseline.tokens),
        prompt_ids=list(prompt_ids),
    )
    return result, order_noise(baseline, speculative) if verifier.quantization else None


def order_noise(baseline: Generation, speculative: Generation) -> float:
    """The most the two decoders' logits for the same token differ over the positions where their
    tokens still agree: how much the order of evaluation alone (one token per pass against K+1 per
    verification) moves this verifier's logits. In fp32 that is rounding (1e-5); an FP8 verifier's
    activations are quantized per token, and an input that moves by an ulp can flip an fp8 rounding,
    which moves the activation by up to 1/16 and cascades (quantization.path_noise)."""
    worst = 0.0
    for b, s in zip(baseline.top2, speculative.top2, strict=False):
        if b[0] != s[0]:
            break
        worst = max(worst, abs(b[1] - s[1]), abs(b[3] - s[3]) if b[2] == s[2] else 0.0)
    return worst


def settle_fp8_splits(
    report: EvaluationReport, noise: float, verifier: Verifier, prompts: list[list[int]], max_chunk: int = 1
) -> int:
    """Count as near-ties the splits whose margin lies within an FP8 verifier's own noise (both
    decoders run the same quantized model): the most the decoders' logits differed where they agreed
    over the run (`noise`), or, beyond that, what the two evaluation orders give at the split's own
    context (quantization.path_noise: one token at a time against one pass and chunks of up to
    `max_chunk`, the speculative decoder's K+1, tokens)."""

    settled = 0
    for result, prompt_ids in zip(report.results, prompts, strict=True):
        c = result.comparison
        if c.status != "diverged" or c.margin is None or c.position is None:
            continue
        tolerance = noise
        if c.margin > tolerance:
            context = [*prompt_ids, *result.greedy_ids[: c.position]]
            tolerance = max(tolerance, path_noise(verifier.model, context, max_chunk=max_chunk))
        c.path_noise, c.tolerance = tolerance, max(c.tolerance or 0.0, tolerance)
        if LosslessJudge.status([0.0, c.margin], tolerance) == "near_tie":
            c.status = "near_tie"
            settled += 1
    return settled


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation], verifier: Verifier | None = None
) -> list[EvalPrompt]:
    """(id, prompt ids) per conversation; with images (a vision-language `verifier`) also the image
    parts, their placeholders expanded to each image's token count."""

    if not has_chat_template(tokenizer):
        raise SpeculatorsError("the verifier's tokenizer has no chat template; prompts cannot be rendered for it")
    prompts: list[EvalPrompt] = []
    for conversation in conversations:
        ids = render_ids(tokenizer, conversation.messages, add_generation_prompt=True)
        parts = image_parts(conversation.messages)
        if not parts:
            prompts.append((conversation.id, ids))
            continue
        if verifier is None or not verifier.is_vision_language:
            raise SpeculatorsError(f"prompt {conversation.id} has images; evaluate it with a vision-language verifier")
        inputs = verifier.image_inputs
        ids, _ = inputs.expand(ids, [0] * len(ids), [inputs.grid(load_image(part)) for part in parts])
        prompts.append((conversation.id, ids, parts))
    return prompts


def label_results(results: Sequence[Any], conversations: Sequence[Conversation]) -> None:
    """Each result (evaluate's PromptResult, compare's ComparedPrompt) gets its conversation's category and
    turn (the number of user turns it holds)."""
    for result, conversation in zip(results, conversations, strict=True):
        result.category = conversation.category
        result.turn = sum(message["role"] == "user" for message in conversation.messages)


def answer_text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    """A greedy answer's text as a chat server returns it: without its end-of-turn token and special
    tokens (what a client appends to the conversation for the next turn)."""

    ends, ids = turn_end_ids(tokenizer), list(ids)
    while ids and ids[-1] in ends:
        ids.pop()
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def evaluate_mt_bench(
    verifier: Verifier,
    questions: Sequence[MtBenchQuestion],
    proposer: Proposer,
    num_speculative_tokens: int,
    max_new_tokens: int = DEFAULTS["max_new_tokens"],
    stop_at_eos: bool = True,
    tie_tolerance: float | None = None,
    settings: dict[str, Any] | None = None,
    progress: bool = True,
) -> EvaluationReport:
    """MT-Bench in two turns, as the EAGLE and SpecForge papers measure it: every question's turn 1 is
    decoded (baseline and speculative), then turn 2 with the verifier's own greedy turn-1 answer in its
    context. The answer goes back as text, re-rendered by the chat template (MtBenchQuestion.second_turn),
    not as the generated ids: that is what a chat client sends, what `speculators bench` sends to vLLM and
    how FastChat and EAGLE build turn 2, so the three measure the same turn-2 prompts. Results are by
    question, turn 1 then turn 2, each with its category and turn."""

    def decode(conversations: list[Conversation]) -> tuple[EvaluationReport, list[list[int]]]:
        prompts = tokenize_prompts(verifier.tokenizer, conversations, verifier)
        report = evaluate(
            verifier,
            prompts,
            proposer,
            num_speculative_tokens,
            max_new_tokens,
            stop_at_eos,
            tie_tolerance,
            settings,
            progress,
        )
        label_results(report.results, conversations)
        return report, [result.greedy_ids for result in report.results]

    turns = mt_bench_turns(verifier.tokenizer, questions, decode, progress)
    merged = EvaluationReport(
        settings={**turns[0].settings, "mt_bench_questions": len(questions)},
        results=[result for pair in zip(turns[0].results, turns[1].results, strict=True) for result in pair],
    )
    noise = [report.settings["fp8_order_noise"] for report in turns if "fp8_order_noise" in report.settings]
    if noise:
        merged.settings["fp8_order_noise"] = max(noise)
    return merged


def mt_bench_turns(
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[MtBenchQuestion],
    decode: Callable[[list[Conversation]], tuple[TurnResults, list[list[int]]]],
    progress: bool = True,
) -> tuple[TurnResults, TurnResults]:
    """MT-Bench's two turns through `decode` (conversations -> its results and the verifier's greedy answer
    ids, in order): turn 1 of every question, then turn 2 after the verifier's own turn-1 answer as text
    (answer_text, MtBenchQuestion.second_turn). The one rule `evaluate` and `compare` build turn 2 by."""
    if progress:
        print(f"MT-Bench turn 1 of {len(questions)} questions", flush=True)
    first, answers = decode([question.first_turn() for question in questions])
    texts = [answer_text(tokenizer, answer) for answer in answers]
    if progress:
        print(f"MT-Bench turn 2 of {len(questions)} questions", flush=True)
    second, _ = decode([question.second_turn(text) for question, text in zip(questions, texts, strict=True)])
    return first, second


def load_proposer(kind: str, verifier: Verifier, speculator: str | None, dtype: str) -> Proposer:
    """A speculator checkpoint's drafter (`speculator`, the default, takes the algorithm the checkpoint names;
    `eagle3`, `peagle` or `dflash` asks for that one), `oracle` or `always-wrong`."""
    if kind == "oracle":
        return OracleProposer()
    if kind == "always-wrong":
        return WrongProposer(verifier.vocab_size)
    if kind not in get_args(ProposerKind):
        raise SpeculatorsError(f"proposer '{kind}' is not one of {', '.join(get_args(ProposerKind))}")
    if speculator is None:
        raise SpeculatorsError(f"the {kind} proposer needs a speculator checkpoint; pass --speculator DIR")
    algorithm = algorithm_of_checkpoint(speculator)
    if kind not in ("speculator", algorithm.name):
        raise SpeculatorsError(
            f"--proposer {kind} asks for a {kind} drafter but {speculator} is a {algorithm.name} checkpoint; pass "
            f"--proposer {algorithm.name}"
        )
    checkpoint = algorithm.part("read_checkpoint")(speculator)
    problems = check_against_verifier(
        checkpoint.config, verifier.config, has_embeddings="embed_tokens.weight" in checkpoint.tensors
    )
    if problems:
        raise SpeculatorsError(f"speculator {speculator} does not fit verifier {verifier.source}: {problems[0]}")
    drafter_class = algorithm.part("drafter")
    drafter = drafter_class.from_pretrained(speculator, verifier_embeddings=verifier.embedding_weight, dtype=dtype)
    if drafter.config.eagle_aux_hidden_state_layer_ids is None:
        drafter.config.eagle_aux_hidden_state_layer_ids = verifier.default_aux_layer_ids
    proposer: Proposer = algorithm.part("proposer")(drafter.eval())
    return proposer


def run_evaluation(settings: EvaluateSettings) -> EvaluationReport:
    """Load everything, evaluate, write the report JSON (if `output`): the `evaluate` command. With
    `quantization`, both decoders run the same FP8 verifier (speculators/verifier/quantization.py). With
    prompts `mt-bench`, `max_prompts` counts questions, each asked in two turns (evaluate_mt_bench)."""

    s = with_compute_dtype(settings, on_vllm=False)  # (the CLI resolved it already)
    verifier = load_verifier(s.verifier, dtype=s.dtype, quantization=s.quantization)
    require_chat_template(verifier.tokenizer, s.verifier)  # (before the drafter loads: prompts are rendered)
    proposer = load_proposer(s.proposer, verifier, s.speculator, s.dtype)
    num_speculative_tokens = s.num_speculative_tokens
    if num_speculative_tokens is None:  # the checkpoint's K for a drafter, else 3
        num_speculative_tokens = 3
        if hasattr(proposer, "drafter"):  # (a drafter's proposer)
            num_speculative_tokens = proposer.drafter.config.speculative_tokens
    recorded = {
        "verifier": s.verifier,
        "speculator": s.speculator,
        "prompts": s.prompts,
        "quantization": s.quantization,
    }
    arithmetic = f"verifier in {s.dtype}" + (f" with {s.quantization} FP8 projections" if s.quantization else "")
    if s.prompts == MT_BENCH:
        questions = mt_bench_questions(s.max_prompts)
        print(
            f"evaluating {proposer.name} (K={num_speculative_tokens}) on {len(questions)} MT-Bench questions, two "
            f"turns each, at most {s.max_new_tokens} new tokens per turn, {arithmetic}",
            flush=True,
        )
        report = evaluate_mt_bench(
            verifier,
            questions,
            proposer,
            num_speculative_tokens,
            s.max_new_tokens,
            s.stop_at_eos,
            s.tie_tolerance,
            recorded,
        )
    else:
        conversations = load_prompts(s.prompts, s.max_prompts)
        prompts = tokenize_prompts(verifier.tokenizer, conversations, verifier)
        print(
            f"evaluating {proposer.name} (K={num_speculative_tokens}) on {len(prompts)} prompts from "
            f"{s.prompts}, {s.max_new_tokens} new tokens each, {arithmetic}",
            flush=True,
        )
        report = evaluate(
            verifier,
            prompts,
            proposer,
            num_speculative_tokens,
            s.max_new_tokens,
            s.stop_at_eos,
            s.tie_tolerance,
            recorded,
        )
        label_results(report.results, conversations)
    if s.output is not None:
        import json

        write_text_atomic(Path(s.output), json.dumps(report.to_dict(), indent=2) + "\n")
    return report
