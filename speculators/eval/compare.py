"""Several drafters' acceptance on the same prompts in one run, replayed on the verifier's own greedy answers.

With greedy acceptance, speculative decoding emits exactly the verifier's greedy tokens, so how many drafts a
verifier step accepts depends only on the drafter's proposals against that answer. `compare_prompts` decodes
each prompt's greedy answer once (one token per pass, as `evaluate`'s baseline), runs the verifier once over
prompt + answer capturing every aux layer any of the drafters reads, then walks each drafter through speculative
decoding on that answer (`replay_generate`): at each step the drafter gets the states of the positions verified
since its last step, as the verification pass would have given them, and drafts K tokens, accepted while they
equal the answer's. Steps and accepted drafts per position are the ones `speculative_generate` counts (a test
checks them equal, prompt by prompt); the verifier's cost is paid once for every drafter instead of once each.

What a replay does not do: judge losslessness (no speculative output exists; `speculators evaluate` does) or time
decoding (it times each drafter's proposals: its cost per verifier step). Each drafter's acceptance length is
compared with the baseline drafter's by a paired bootstrap over questions (an MT-Bench question's two turns
resample together) or prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import write_text_atomic
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH
from speculators.data.prompt_set import load_prompts
from speculators.data.tokenization import turn_end_ids
from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import (
    NO_CATEGORY,
    EvalPrompt,
    Proposer,
    greedy_generate,
    label_results,
    load_proposer,
    mt_bench_turns,
    tokenize_prompts,
)
from speculators.precision import with_compute_dtype
from speculators.settings import CompareSettings
from speculators.verifier.loading import load_verifier, require_chat_template

if TYPE_CHECKING:
    import torch

    from speculators.data.conversation import Conversation
    from speculators.verifier.loading import Verifier

BOOTSTRAP_LEVEL = 0.95


@dataclass
class Replay:
    """One drafter on one answer: verifier steps, accepted drafts per position, its proposals' seconds."""

    steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    propose_seconds: float = 0.0


@dataclass
class ComparedPrompt:
    prompt_set: str
    id: str
    unit: str  # what the bootstrap resamples: the MT-Bench question, else the prompt
    prompt_tokens: int
    generated: int  # the answer's tokens within the budget (the same for every drafter)
    category: str | None = None
    turn: int | None = None
    drafters: dict[str, Replay] = field(default_factory=dict)


@dataclass
class Drafter:
    name: str
    speculator: str
    proposer: Proposer
    num_tokens: int


def replay_generate(
    proposer: Proposer,
    prompt_ids: list[int],
    answer: list[int],
    aux_states: Callable[[int, int], torch.Tensor | None],
    num_tokens: int,
    max_new_tokens: int,
    stop_ids: set[int],
) -> Replay:
    """Speculative decoding of `answer` (the verifier's greedy tokens after `prompt_ids`, with K more past the
    budget unless it stops) with `proposer`, counted as speculative_generate counts it. `aux_states(start, end)`
    gives the verifier's states [1, end - start, A*H] of sequence positions start..end-1 (None: none read)."""
    replay = Replay(accepted_per_position=[0] * num_tokens)
    proposer.start(prompt_ids, answer)
    tokens = [*prompt_ids, answer[0]]
    new_aux = aux_states(0, len(prompt_ids))  # the prompt pass's states
    generated = 1

    def choice(index: int) -> int:  # the verifier's token at answer index `index` (-1 past a stopped answer)
        return answer[index] if index < len(answer) else -1

    while generated < max_new_tokens and tokens[-1] not in stop_ids:
        started = time.perf_counter()
        drafts = proposer.propose(tokens, new_aux, num_tokens)
        replay.propose_seconds += time.perf_counter() - started
        verified = len(tokens) - 1  # the verification pass reads [tokens[-1], *drafts] from here
        choices = [choice(verified - len(prompt_ids) + 1 + p) for p in range(num_tokens + 1)]
        accepted = 0
        while accepted < num_tokens and drafts[accepted] == choices[accepted]:
            accepted += 1
        replay.steps += 1
        new_aux = aux_states(verified, verified + accepted + 1)
        for position in range(accepted + 1):
            token = choices[position]
            tokens.append(token)
            generated += 1
            if position < accepted:  # counted only when output: not past a stop token or the budget
                replay.accepted_per_position[position] += 1
            if generated == max_new_tokens or token in stop_ids:
                break
    return replay


def compare_prompts(
    verifier: Verifier,
    prompts: Sequence[EvalPrompt],
    drafters: Sequence[Drafter],
    prompt_set: str,
    max_new_tokens: int,
    stop_ids: set[int],
    units: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[list[ComparedPrompt], list[list[int]]]:
    """Each prompt's greedy answer once, then every drafter replayed on it; also the answers (within budget)."""
    import torch

    layer_ids = sorted({layer for d in drafters for layer in d.proposer.aux_layer_ids})
    extra = max(d.num_tokens for d in drafters)
    results, answers = [], []
    for index, prompt in enumerate(prompts):
        prompt_id, prompt_ids, *with_images = prompt
        if with_images:
            raise SpeculatorsError(
                f"prompt {prompt_id} has images, which compare does not replay; evaluate it with speculators evaluate"
            )
        answer = greedy_generate(verifier, prompt_ids, max_new_tokens, stop_ids, extra_tokens=extra).tokens
        with verifier.capturing(layer_ids) as captured, torch.inference_mode():
            verifier.model(input_ids=torch.tensor([[*prompt_ids, *answer]]))
            states = {layer: captured[layer] for layer in layer_ids}
        result = ComparedPrompt(
            prompt_set,
            prompt_id,
            units[index] if units else prompt_id,
            len(prompt_ids),
            min(len(answer), max_new_tokens),
        )
        for drafter in drafters:
            reader = states_reader(states, list(drafter.proposer.aux_layer_ids))
            with torch.inference_mode():
                result.drafters[drafter.name] = replay_generate(
                    drafter.proposer, prompt_ids, answer, reader, drafter.num_tokens, max_new_tokens, stop_ids
                )
        results.append(result)
        answers.append(answer[:max_new_tokens])
        if progress:
            lengths = ", ".join(f"{name} {acceptance_length([result], name):.2f}" for name in result.drafters)
            print(f"  [{index + 1}/{len(prompts)}] {prompt_id}: {result.generated} tokens; {lengths}", flush=True)
    return results, answers


def states_reader(states: dict[int, torch.Tensor], layers: list[int]) -> Callable[[int, int], torch.Tensor | None]:
    """replay_generate's `aux_states` over one pass's captured states [1, T, H] per layer: `layers`' states of
    positions start..end-1, concatenated in the drafter's order (None for a drafter that reads none)."""
    import torch

    def read(start: int, end: int) -> torch.Tensor | None:
        return torch.cat([states[layer][:, start:end] for layer in layers], dim=-1) if layers else None

    return read


# ----- statistics ----------------------------------------------------------------------------------


def acceptance_length(results: Sequence[ComparedPrompt], name: str) -> float:
    """Tokens per verifier step of drafter `name` over `results` (1 + accepted drafts / steps)."""
    steps = sum(r.drafters[name].steps for r in results)
    accepted = sum(sum(r.drafters[name].accepted_per_position) for r in results)
    return 1 + accepted / steps if steps else 0.0


def paired_interval(
    results: Sequence[ComparedPrompt], name: str, baseline: str, resamples: int, seed: int
) -> tuple[float, float]:
    """The BOOTSTRAP_LEVEL percentile interval of acceptance_length(name) / acceptance_length(baseline), the
    units (questions or prompts) resampled with replacement, the same draw for both drafters."""
    import numpy as np

    units = list(dict.fromkeys(r.unit for r in results))
    index = {unit: i for i, unit in enumerate(units)}
    sums = np.zeros((len(units), 4))  # accepted and steps of `name`, then of `baseline`, per unit
    for r in results:
        a, b = r.drafters[name], r.drafters[baseline]
        sums[index[r.unit]] += (sum(a.accepted_per_position), a.steps, sum(b.accepted_per_position), b.steps)
    draws = np.random.default_rng(seed).integers(0, len(units), size=(resamples, len(units)))
    totals = sums[draws].sum(axis=1)  # [resamples, 4]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (1 + totals[:, 0] / totals[:, 1]) / (1 + totals[:, 2] / totals[:, 3])
    ratios = ratios[np.isfinite(ratios)]
    tail = (1 - BOOTSTRAP_LEVEL) / 2 * 100
    low, high = np.percentile(ratios, [tail, 100 - tail]) if ratios.size else (float("nan"), float("nan"))
    return float(low), float(high)


def drafter_totals(results: Sequence[ComparedPrompt], drafter: Drafter) -> dict[str, Any]:
    name = drafter.name
    steps = sum(r.drafters[name].steps for r in results)
    per_position = [sum(r.drafters[name].accepted_per_position[p] for r in results) for p in range(drafter.num_tokens)]
    categories = list(dict.fromkeys(r.category or NO_CATEGORY for r in results))
    turns = sorted({r.turn for r in results if r.turn is not None})
    seconds = sum(r.drafters[name].propose_seconds for r in results)
    return {
        "k": drafter.num_tokens,
        "acceptance_length": acceptance_length(results, name),
        "acceptance_per_position": [count / steps if steps else 0.0 for count in per_position],
        "verifier_steps": steps,
        "accepted_tokens": sum(per_position),
        "generated_tokens": sum(r.generated for r in results),
        "per_category": {
            c: acceptance_length([r for r in results if (r.category or NO_CATEGORY) == c], name) for c in categories
        }
        if categories != [NO_CATEGORY]
        else {},
        "per_turn": {str(t): acceptance_length([r for r in results if r.turn == t], name) for t in turns}
        if len(turns) > 1
        else {},
        "drafter_ms_per_step": 1000 * seconds / steps if steps else 0.0,
    }


@dataclass
class ComparisonReport:
    settings: dict[str, Any]
    drafters: list[Drafter]
    baseline: str
    results: list[ComparedPrompt] = field(default_factory=list)

    def prompt_sets(self) -> list[str]:
        return list(dict.fromkeys(r.prompt_set for r in self.results))

    def summary(self, prompt_set: str) -> dict[str, Any]:
        """Per drafter: its totals on `prompt_set`, and its ratio to the baseline with the paired interval."""
        results = [r for r in self.results if r.prompt_set == prompt_set]
        base = acceptance_length(results, self.baseline)
        drafters = {}
        for drafter in self.drafters:
            totals = drafter_totals(results, drafter)
            ratio = totals["acceptance_length"] / base if base else 0.0
            low, high = paired_interval(
                results, drafter.name, self.baseline, self.settings["resamples"], self.settings["seed"]
            )
            totals["versus_baseline"] = {"ratio": ratio, "low": low, "high": high}
            drafters[drafter.name] = totals
        return {
            "prompts": len(results),
            "units": len({r.unit for r in results}),
            "drafters": drafters,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "baseline": self.baseline,
            "drafters": {
                d.name: {"speculator": d.speculator, "algorithm": d.proposer.name, "k": d.num_tokens}
                for d in self.drafters
            },
            "prompt_sets": {name: self.summary(name) for name in self.prompt_sets()},
            "per_prompt": [
                {**asdict(r), "drafters": {name: asdict(replay) for name, replay in r.drafters.items()}}
                for r in self.results
            ],
        }

    def render(self) -> str:
        level = f"{BOOTSTRAP_LEVEL:.0%}"
        lines = []
        for prompt_set in self.prompt_sets():
            summary = self.summary(prompt_set)
            lines += [
                f"{prompt_set}: {summary['prompts']} prompts ({summary['units']} resampled units), acceptance "
                f"replayed on the verifier's greedy answers; / {self.baseline} with its paired {level} interval",
                "",
                "| drafter | algorithm | K | acceptance length | / baseline | per position | drafter ms per step |",
                "|---|---|---:|---:|---:|---|---:|",
            ]
            for drafter in self.drafters:
                t = summary["drafters"][drafter.name]
                versus = t["versus_baseline"]
                rates = " / ".join(f"{rate:.3f}" for rate in t["acceptance_per_position"])
                lines.append(
                    f"| {drafter.name} | {drafter.proposer.name} | {t['k']} | {t['acceptance_length']:.3f} | "
                    f"{versus['ratio']:.3f}x ({versus['low']:.3f}-{versus['high']:.3f}) | {rates} | "
                    f"{t['drafter_ms_per_step']:.1f} |"
                )
            categories = list(summary["drafters"][self.baseline]["per_category"])
            turns = list(summary["drafters"][self.baseline]["per_turn"])
            if categories or turns:
                columns = [*categories, *(f"turn {turn}" for turn in turns)]
                lines += ["", "| drafter | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
                for drafter in self.drafters:
                    t = summary["drafters"][drafter.name]
                    values = [*(t["per_category"][c] for c in categories), *(t["per_turn"][u] for u in turns)]
                    lines.append(f"| {drafter.name} | " + " | ".join(f"{v:.3f}" for v in values) + " |")
            lines.append("")
        return "\n".join(lines).rstrip()


# ----- the command ---------------------------------------------------------------------------------


def parse_speculators(specs: Sequence[str]) -> list[tuple[str, str]]:
    """`NAME=DIR` (or `DIR`, named by its folder) -> (name, dir); names must be distinct."""
    named = []
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep:
            name, directory = Path(spec.rstrip("/")).name, spec
        if not name or not directory:
            raise SpeculatorsError(f"--speculator '{spec}' is not NAME=DIR or DIR; pass e.g. --speculator kl=runs/kl")
        named.append((name, directory))
    names = [name for name, _ in named]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise SpeculatorsError(f"drafter name '{repeated[0]}' is given twice; name each --speculator NAME=DIR apart")
    return named


def run_comparison(settings: CompareSettings, progress: bool = True) -> ComparisonReport:
    """Load the verifier and every drafter, replay each on every prompt set's greedy answers, write the report
    JSON (if `output`): the `compare` command."""
    s = with_compute_dtype(settings, on_vllm=False)
    named = parse_speculators(s.speculators)
    baseline = s.baseline or named[0][0]
    if baseline not in {name for name, _ in named}:
        raise SpeculatorsError(
            f"--baseline '{baseline}' names no drafter; pass one of {', '.join(name for name, _ in named)}"
        )
    sources = list(s.prompts) or [MT_BENCH]
    repeated = sorted({source for source in sources if sources.count(source) > 1})
    if repeated:
        raise SpeculatorsError(f"--prompts {repeated[0]} is given twice; name each prompt source once")
    verifier = load_verifier(s.verifier, dtype=s.dtype, quantization=s.quantization)
    require_chat_template(verifier.tokenizer, s.verifier)
    drafters = []
    for name, directory in named:
        proposer = load_proposer("speculator", verifier, directory, s.dtype)
        own = proposer.drafter.config.speculative_tokens  # type: ignore[attr-defined]  # (a drafter's proposer)
        k = s.num_speculative_tokens or own
        if proposer.name == "dflash" and k > own:
            raise SpeculatorsError(
                f"-k {k} is more than DFlash drafter {name}'s block holds ({own}); pass -k {own} or fewer"
            )
        drafters.append(Drafter(name, directory, proposer, k))
    report = ComparisonReport(
        settings={
            "verifier": s.verifier,
            "quantization": s.quantization,
            "prompts": sources,
            "max_prompts": s.max_prompts,
            "max_new_tokens": s.max_new_tokens,
            "dtype": s.dtype,
            "stop_at_eos": s.stop_at_eos,
            "resamples": s.resamples,
            "seed": s.seed,
            "bootstrap_level": BOOTSTRAP_LEVEL,
            "method": "replayed on the verifier's greedy answers",
        },
        drafters=drafters,
        baseline=baseline,
    )
    stop_ids = turn_end_ids(verifier.tokenizer) if s.stop_at_eos else set()
    for source in sources:
        report.results += compare_source(
            verifier, source, drafters, s.max_prompts, s.max_new_tokens, stop_ids, progress
        )
    if s.output is not None:
        write_text_atomic(Path(s.output), json.dumps(report.to_dict(), indent=2) + "\n")
    return report


def compare_source(
    verifier: Verifier,
    source: str,
    drafters: Sequence[Drafter],
    max_prompts: int,
    max_new_tokens: int,
    stop_ids: set[int],
    progress: bool,
) -> list[ComparedPrompt]:
    """One prompt source's results: MT-Bench in two turns (turn 2 after the verifier's own greedy turn-1
    answer, as `evaluate` builds it), any other source's prompts as they are."""

    def run(conversations: list[Conversation], units: list[str] | None) -> tuple[list[ComparedPrompt], list[list[int]]]:
        prompts = tokenize_prompts(verifier.tokenizer, conversations, verifier)
        results, answers = compare_prompts(
            verifier, prompts, drafters, source, max_new_tokens, stop_ids, units, progress
        )
        label_results(results, conversations)
        return results, answers

    if source != MT_BENCH:
        conversations = load_prompts(source, max_prompts)
        if progress:
            print(f"{source}: {len(conversations)} prompts, at most {max_new_tokens} new tokens", flush=True)
        return run(conversations, None)[0]
    questions = mt_bench_questions(max_prompts)
    units = [question.id for question in questions]
    first, second = mt_bench_turns(verifier.tokenizer, questions, lambda turn: run(turn, units), progress)
    return [result for pair in zip(first, second, strict=True) for result in pair]
