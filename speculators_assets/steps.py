"""The five pipeline steps, described once, upstream first.

Each step is one Dagster asset per variant (partition) and one function of the Pipes workload,
registered for its name (workload.py's `@registered`, with the records it reads and writes). Code
names a step by its constant here (`RAW_PROMPTS`, ...), never by a literal. Everything else is
derived from `STEPS`: the assets and their check specs (definitions.py), the step names a variant's
`compute:` may set (variants.py), the workload's registry (every step must have its function) and
the tests. Import-light: no Dagster, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """An asset check the step's workload reports; a failed blocking check stops the run."""

    name: str
    description: str
    blocking: bool = False


@dataclass(frozen=True)
class StepSpec:
    name: str  # asset key; the workload function registered for it runs the step
    description: str
    kinds: frozenset[str]
    upstream: str | None = None  # the step whose artifacts this one reads
    gpu_pool: bool = False  # holds a slot of the `gpu` concurrency pool
    checks: tuple[Check, ...] = ()


RAW_PROMPTS = "raw_prompts"
VERIFIER_HIDDEN_STATES = "verifier_hidden_states"
TRAINED_DRAFTER = "trained_drafter"
SPECULATOR_CHECKPOINT = "speculator_checkpoint"
BENCHMARK_REPORT = "benchmark_report"

STEPS: tuple[StepSpec, ...] = (
    StepSpec(
        name=RAW_PROMPTS,
        description="The variant's prompt sources, normalised into conversations (rows counted, data version).",
        kinds=frozenset({"python", "json"}),
    ),
    StepSpec(
        name=VERIFIER_HIDDEN_STATES,
        description="On-policy answers by the verifier, tokenized with loss masks; the verifier's aux hidden "
        "states in the content-addressed store (streamed variants: an index of it and a probe of real shards); "
        "the draft vocabulary.",
        kinds=frozenset({"pytorch", "vllm", "safetensors"}),
        upstream=RAW_PROMPTS,
        gpu_pool=True,
        checks=(
            Check("counts_match_prepared_data", "store samples = prepared samples"),
            Check("values_finite", "every shard re-read: checksum, shapes, finite values", blocking=True),
            Check("draft_vocab_coverage", "the draft vocab covers enough supervised tokens"),
        ),
    ),
    StepSpec(
        name=TRAINED_DRAFTER,
        description="The drafter (EAGLE-3, P-EAGLE or DFlash) trained with training-time test, warm-started from "
        "the last accepted one; streamed variants compute the hidden states during training (verifier replicas "
        "beside the trainer).",
        kinds=frozenset({"pytorch"}),
        upstream=VERIFIER_HIDDEN_STATES,
        gpu_pool=True,
        checks=(
            Check("acceptance_floor", "validation acceptance estimate >= the variant's floor", blocking=True),
            Check("no_regression", "not worse than the last accepted drafter beyond tolerance", blocking=True),
        ),
    ),
    StepSpec(
        name=SPECULATOR_CHECKPOINT,
        description="The validated, vLLM-ready speculator checkpoint; published to .../latest when the gates pass.",
        kinds=frozenset({"vllm", "safetensors"}),
        upstream=TRAINED_DRAFTER,
        checks=(Check("passes_validate", "speculators validate against the verifier; K as set", blocking=True),),
    ),
    StepSpec(
        name=BENCHMARK_REPORT,
        description="vLLM + GuideLLM: the verifier alone vs with the speculator, acceptance and latency.",
        kinds=frozenset({"vllm", "guidellm"}),
        upstream=SPECULATOR_CHECKPOINT,
        gpu_pool=True,
        checks=(
            Check(
                "faster_at_serving_concurrency",
                "the drafter is not slower than the verifier alone at the variant's declared serving concurrency",
            ),
            Check("quiet_machine", "no other work took over a tenth of a core during any speed measurement"),
            Check("lossless_outputs", "greedy token ids equal the baseline's up to near-ties"),
            Check("report_complete", "every report file written"),
        ),
    ),
)

NAMES: tuple[str, ...] = tuple(step.name for step in STEPS)  # the lineage, upstream first
BY_NAME: dict[str, StepSpec] = {step.name: step for step in STEPS}


def _validate(steps: tuple[StepSpec, ...]) -> None:
    """Unique names; each upstream is an earlier step; check names unique within a step."""
    seen: set[str] = set()
    for step in steps:
        if step.name in seen:
            raise ValueError(f"step {step.name} is described twice")
        if step.upstream is not None and step.upstream not in seen:
            raise ValueError(f"step {step.name}'s upstream {step.upstream} is not an earlier step")
        names = [check.name for check in step.checks]
        if len(set(names)) != len(names):
            raise ValueError(f"step {step.name} declares a check twice: {names}")
        seen.add(step.name)


_validate(STEPS)
