"""`speculators prepare`: prompt sources -> conversations.jsonl, and with a verifier samples.jsonl.

Without `regenerate` the sources' own answers are tokenized with the verifier's chat template (and
with `regenerate_validation` the verifier answers the validation prompts alone); with it the verifier
writes the answers (transformers, vLLM's offline engine, data-parallel vLLM replicas
behind one server, or a running server). Regeneration resumes: answers are appended to
samples.partial.jsonl as they come, and a rerun with the same settings regenerates only the
conversations that are new (`regeneration_key`).

Outputs under `output`: conversations.jsonl, samples.jsonl (with a verifier), prepare_report.json
(rows read, kept, rejected and why; token statistics), regeneration-vllm.log (vLLM's offline engine).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, closing, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import exclusive_lock, write_jsonl_atomic, write_text_atomic
from speculators.data.capture import Replica, raise_for_failed_replicas, replica_devices, start_replica
from speculators.data.conversation import VALIDATION_PREFIX
from speculators.data.prompt_set import prepare_conversations
from speculators.data.regenerate import (
    VllmGenerate,
    regenerate,
    server_generate_fn,
    transformers_generate_fn,
    transformers_image_generate_fn,
)
from speculators.data.rows import RowRejected
from speculators.data.sources import source_image_root
from speculators.data.tokenization import (
    LongestPrompt,
    OverLength,
    clip_answers,
    over_length,
    read_samples,
    token_statistics,
    tokenize_conversation,
    turn_end_ids,
)
from speculators.errors import SpeculatorsError, shorten
from speculators.flags import to_argv
from speculators.precision import with_compute_dtype
from speculators.serving.engine import decoding_enforce_eager, vllm_log
from speculators.serving.serve import ServerSettings, VllmServer
from speculators.settings import PrepareSettings, SamplePreference, node_group_of
from speculators.verifier.loading import (
    load_tokenizer,
    load_verifier,
    load_verifier_config,
    local_model_dir,
    require_chat_template,
)
from speculators.verifier.vision import ImageInputs, is_vision_language

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

    from speculators.data.conversation import Conversation
    from speculators.data.prompt_set import PrepareReport
    from speculators.data.regenerate import ImageGenerateFn
    from speculators.data.tokenization import TokenizedSample


def run_prepare(settings: PrepareSettings) -> dict[str, Any]:
    """Conversations, then (with a verifier) samples; returns prepare_report.json's content. The output
    folder's lock is held throughout: a second prepare into it waits, then reuses the first's answers."""

    settings = with_compute_dtype(settings, on_vllm=settings.backend == "vllm")  # (the CLI resolved it already)
    with exclusive_lock(settings.output, "prepared data"):
        return prepare_into(settings)


def prepare_into(settings: PrepareSettings) -> dict[str, Any]:

    s, output = settings, Path(settings.output)
    require_assistant = not s.regenerate if s.require_assistant is None else s.require_assistant
    answer_validation = s.regenerate if s.regenerate_validation is None else s.regenerate_validation
    if s.regenerate and not answer_validation:
        raise SpeculatorsError(
            "--no-regenerate-validation with --regenerate: the verifier answers every row, validation included; "
            "drop --no-regenerate-validation, or pass --no-regenerate to keep the rows' own answers"
        )
    conversations, report = prepare_conversations(
        s.sources,
        require_assistant=require_assistant,
        max_samples=s.max_samples,
        hf_subset=s.hf_subset,
        hf_split=s.hf_split,
        seed=s.seed,
        validation_sources=s.validation_sources,
        source_weights=s.source_weights,
        image_roots=s.image_roots,
        max_user_turns=s.max_user_turns,
        validation_require_assistant=False if answer_validation else None,
    )
    print(report.summary())
    if not conversations and not is_replica():  # (before anything is written: the output stays as it was)
        raise SpeculatorsError(no_conversation(s.sources, report))
    result: dict[str, Any] = {"prompts": report.to_dict()}
    partial = output / "samples.partial.jsonl"
    resumable = partial.exists()  # (an earlier run's answers: kept whatever this one finds)
    if s.verifier:
        validation = [c for c in conversations if c.id.startswith(VALIDATION_PREFIX)]
        if s.regenerate or (answer_validation and validation):
            # Without --regenerate only the validation prompts are the verifier's to answer.
            answered = conversations if s.regenerate else validation
            with vllm_log(output / "regeneration-vllm.log", offline_vllm_engine(s)):
                samples, details = regenerate_samples(s, answered, output)
            if not s.regenerate:
                samples, details = with_own_answers(s, conversations, samples, details)
        else:
            samples, details = tokenize_samples(s, conversations)
        if not samples and not is_replica():
            if not resumable and partial.is_file() and not partial.stat().st_size:
                partial.unlink()  # (the resume file this run opened, holding no answer)
            raise SpeculatorsError(no_sample(len(conversations), details, s.max_length))
        if s.max_train_tokens is not None and not is_replica():  # (a replica's share: its parent chooses)
            samples, details["token_budget"] = within_token_budget(samples, s.max_train_tokens, s.prefer)
    write_jsonl_atomic(output / "conversations.jsonl", conversations)
    if s.verifier:
        result["tokenization"] = write_samples(output, samples, details)
    write_text_atomic(output / "prepare_report.json", json.dumps(result, indent=2) + "\n")
    print(f"wrote {output / 'conversations.jsonl'}" + (f" and {output / 'samples.jsonl'}" if s.verifier else ""))
    return result


# A regeneration replica (regenerate_on_replicas) prepares a share of the rows into its own folder: a share
# with nothing left in it is no error there; the parent judges the merged result.
REPLICA_ENVIRONMENT = "SPECULATORS_PREPARE_REPLICA"


def is_replica() -> bool:
    return os.environ.get(REPLICA_ENVIRONMENT) == "1"


def reasons_text(rejected: dict[str, int], limit: int = 3) -> str:
    """'5 no assistant turn, 2 row is not an object and 1 more reason': the most common reasons first."""
    ranked = sorted(rejected.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{count} {reason}" for reason, count in ranked[:limit])
    more = len(ranked) - limit
    return shown + (f" and {more} more reason{'s' if more > 1 else ''}" if more > 0 else "")


def no_conversation(sources: list[str], report: PrepareReport) -> str:
    """The one line for sources of which no row was kept: how many were read and why they were rejected."""
    where = shorten(", ".join(sources), 200)
    if not report.rows_read:
        return f"no rows in {where}; name a source that holds conversations (nothing was written)"
    why = reasons_text(dict(report.rejected)) or "none rejected"
    fix = "fix the source"
    if report.rejected.get("no assistant turn"):
        fix += ", or let the verifier answer prompt-only rows (--verifier V --regenerate)"
    return (
        f"no usable conversation in {where}: {report.rows_read} rows read, {sum(report.rejected.values())} rejected "
        f"({why}), {report.duplicates} duplicates; {fix} (nothing was written)"
    )


def no_sample(conversations: int, details: dict[str, Any], max_length: int) -> str:
    """The one line for conversations of which none could become a sample: every one over --max-length
    (naming the longest and the limit it needs), or rejected for the reasons counted."""
    rejected: dict[str, int] = details.get("rejected", {})
    longest = LongestPrompt()
    longest.merge(details.get("longest_over_length"))
    over = rejected.get(over_length(max_length), 0)
    if over == conversations and longest.unit:
        return (
            f"every one of the {conversations} conversations is over --max-length {max_length} (its prompt alone "
            f"fills it): {longest.advice(max_length)}, or shorten the source's prompts (nothing was written)"
        )
    advice = f"; {longest.advice(max_length)}" if longest.unit else ""
    return (
        f"none of the {conversations} conversations became a sample ({reasons_text(rejected) or 'none rejected'})"
        f"{advice}; fix the source (nothing was written)"
    )


def offline_vllm_engine(settings: PrepareSettings) -> bool:
    """Regeneration runs vLLM's offline engine in this process (a server logs to its own file)."""
    served = settings.server_url or settings.data_parallel_size > 1
    return settings.backend == "vllm" and not served


# ----- tokenizing the sources' own answers ---------------------------------------------------------


def tokenize_samples(
    settings: PrepareSettings, conversations: list[Conversation]
) -> tuple[list[TokenizedSample], dict[str, Any]]:

    config, location = load_verifier_config(str(settings.verifier))
    tokenizer = load_tokenizer(location)
    require_chat_template(tokenizer, str(settings.verifier))
    images = verifier_image_inputs(config, location)
    samples, rejected, clipped, longest = [], Counter[str](), 0, LongestPrompt()
    for conversation in conversations:
        try:
            sample = tokenize_conversation(
                tokenizer, conversation.id, conversation.messages, settings.max_length, images
            )
        except RowRejected as reason:
            rejected[str(reason)] += 1
            if isinstance(reason, OverLength):
                longest.note(conversation.id, reason.size, reason.unit)
            continue
        shorter = clip_answers(sample, settings.max_answer_tokens) if settings.max_answer_tokens else None
        clipped += shorter is not None
        samples.append(shorter or sample)
    details: dict[str, Any] = {"rejected": dict(rejected), "longest_over_length": longest.to_dict()}
    if settings.max_answer_tokens:
        details["clipped_answers"] = clipped
        print(f"  {clipped} of {len(samples)} samples clipped at an answer over {settings.max_answer_tokens} tokens")
    return samples, details


def with_own_answers(
    settings: PrepareSettings,
    conversations: list[Conversation],
    validation: list[TokenizedSample],
    details: dict[str, Any],
) -> tuple[list[TokenizedSample], dict[str, Any]]:
    """The training conversations with their own answers beside the regenerated validation samples, in
    conversation order; the report says which answers are whose."""
    training = [c for c in conversations if not c.id.startswith(VALIDATION_PREFIX)]
    own, tokenized = tokenize_samples(settings, training)
    by_id = {sample.id: sample for sample in [*own, *validation]}
    samples = [by_id[c.id] for c in conversations if c.id in by_id]
    rejected = Counter(details["rejected"]) + Counter(tokenized["rejected"])
    longest = LongestPrompt()
    for part in (details, tokenized):
        longest.merge(part.get("longest_over_length"))
    answers = "training rows: their own answers; validation rows: the verifier's (regenerated)"
    return samples, {
        **tokenized,
        **details,
        "answers": answers,
        "rejected": dict(rejected),
        "longest_over_length": longest.to_dict(),
    }


def within_token_budget(
    samples: list[TokenizedSample], max_train_tokens: int, prefer: SamplePreference
) -> tuple[list[TokenizedSample], dict[str, Any]]:
    """The training samples --max-train-tokens keeps (in their order, `prefer`'s first: the one that crosses
    the budget is the last), every validation sample, and the report of what was left out."""
    training = [sample for sample in samples if not sample.id.startswith(VALIDATION_PREFIX)]
    ranked = sorted(training, key=lambda sample: len(sample.input_ids)) if prefer == "shortest" else training
    kept_ids, tokens = set(), 0
    for sample in ranked:  # (sorted() is stable: equal lengths keep the sources' order)
        if tokens >= max_train_tokens:
            break
        kept_ids.add(sample.id)
        tokens += len(sample.input_ids)
    kept = [s for s in samples if s.id in kept_ids or s.id.startswith(VALIDATION_PREFIX)]
    report = {
        "max_train_tokens": max_train_tokens,
        "prefer": prefer,
        "training_samples": len(training),
        "kept": len(kept_ids),
        "kept_tokens": tokens,
        "left_out": len(training) - len(kept_ids),
        "left_out_tokens": sum(len(s.input_ids) for s in training) - tokens,
    }
    which = "the shortest " if prefer == "shortest" else "the first "
    print(
        f"  kept {which}{len(kept_ids)} of {len(training)} training samples: {tokens} tokens for --max-train-tokens "
        f"{max_train_tokens} ({report['left_out']} samples, {report['left_out_tokens']} tokens left out)"
    )
    if tokens < max_train_tokens:
        print(f"  every training sample fits --max-train-tokens {max_train_tokens}: raise --max-samples for more")
    return kept, report


def verifier_image_inputs(config: PreTrainedConfig, location: str) -> ImageInputs | None:
    """The image processor of a vision-language verifier (None for a text-only one)."""

    return ImageInputs(local_model_dir(location), config) if is_vision_language(config.model_type) else None


def write_samples(output: Path, samples: list[TokenizedSample], details: dict[str, Any]) -> dict[str, Any]:

    write_jsonl_atomic(output / "samples.jsonl", samples)
    (output / "samples.partial.jsonl").unlink(missing_ok=True)
    details["statistics"] = stats = token_statistics(samples)
    for reason, count in sorted(details["rejected"].items()):
        print(f"  tokenization rejected {count}: {reason}")
    print(f"tokenized {stats['samples']} samples: {stats['tokens']} tokens, {stats['supervised_tokens']} supervised")
    return details


# ----- regenerating the answers with the verifier --------------------------------------------------


def regeneration_key(settings: PrepareSettings) -> str:
    """What makes regenerated answers reusable: same verifier, budget and sampling, and which rows the
    verifier answered (a run that regenerated only the validation rows holds other rows' own answers,
    which a full regeneration must not take for the verifier's)."""
    s = settings
    key = [str(s.verifier), s.max_new_tokens, s.temperature, s.seed, s.max_length, s.dtype]
    if not s.regenerate:
        key.append("validation rows only")
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def reuse_earlier_samples(output: Path, key: str) -> None:
    """Seed the resume file with the answers of an earlier run with the same settings, so a rerun
    regenerates only new conversations (removed ones are simply not written)."""
    report, samples, partial = (
        output / "prepare_report.json",
        output / "samples.jsonl",
        output / "samples.partial.jsonl",
    )
    if partial.exists() or not (report.is_file() and samples.is_file()):
        return
    earlier = json.loads(report.read_text()).get("tokenization", {}).get("regeneration_key")
    if earlier == key:
        write_text_atomic(partial, samples.read_text())


def regenerate_samples(
    settings: PrepareSettings, conversations: list[Conversation], output: Path
) -> tuple[list[TokenizedSample], dict[str, Any]]:

    config, location = load_verifier_config(str(settings.verifier))
    images = verifier_image_inputs(config, location)
    key = regeneration_key(settings)
    check_node_group(settings, images is not None)
    if settings.data_parallel_size > 1 and not settings.server_url and (images or settings.backend != "vllm"):
        return regenerate_on_replicas(settings, conversations, output, key)
    tokenizer, generate, server = answer_generator(settings, output, images)
    reuse_earlier_samples(output, key)
    with server:
        samples, report = regenerate(
            conversations,
            tokenizer,
            generate,
            output / "samples.partial.jsonl",
            settings.max_length,
            batch_size=requests_in_flight(settings),
            image_inputs=images,
        )
    regeneration = report.to_dict()
    return samples, {
        "regeneration": regeneration,
        "rejected": regeneration["rejected"],
        "longest_over_length": regeneration.pop("longest_over_length"),
        "regeneration_key": key,
    }


def check_node_group(settings: PrepareSettings, images: bool) -> None:
    """Regeneration over several nodes (--nnodes) is one vLLM engine over them, started here: refused in
    one sentence where this prepare would start none, or only engines on this node."""
    s = settings
    if not s.multi_node:
        return
    if s.backend != "vllm" or s.server_url:
        raise SpeculatorsError(
            "--nnodes starts vLLM's engine over several nodes here: it needs --backend vllm and no --server-url"
        )
    if s.data_parallel_size > 1 and images:
        raise SpeculatorsError(
            f"regenerating image conversations with --data-parallel-size {s.data_parallel_size} runs one offline "
            f"engine per replica on this node's GPUs, not an engine over --nnodes {s.nnodes}; use "
            f"--data-parallel-size 1"
        )


Generate = Callable[[list[list[int]]], list[list[int]]]


def regenerate_on_replicas(
    settings: PrepareSettings, conversations: list[Conversation], output: Path, key: str
) -> tuple[list[TokenizedSample], dict[str, Any]]:
    """`data_parallel_size` replica processes, each a plain `speculators prepare` of every n-th
    conversation on its own GPUs (CUDA_VISIBLE_DEVICES; CPU cores for vLLM's CPU build) with its
    own offline engine or transformers model, then their samples merged in conversation order. Used
    where vLLM's data-parallel server cannot serve: conversations with images (its token-id API
    takes none) and the transformers backend. Each replica resumes on its own, so a rerun after a
    failure regenerates only what is missing."""
    import sys

    s, replicas = settings, settings.data_parallel_size
    # The replicas re-read conversations whose images lie in the sources' folders (or the user's roots).
    sources = [*s.validation_sources, *s.sources]
    roots = list(dict.fromkeys([*s.image_roots, *(str(source_image_root(source)) for source in sources)]))
    folders = [output / "replicas" / str(index) for index in range(replicas)]
    processes: list[Replica] = []
    for index, (folder, env) in enumerate(zip(folders, replica_devices(replicas, s.tensor_parallel_size), strict=True)):
        folder.mkdir(parents=True, exist_ok=True)
        write_jsonl_atomic(folder / "conversations-in.jsonl", conversations[index::replicas])
        one = s.model_copy(
            update={
                "sources": [str(folder / "conversations-in.jsonl")],
                "regenerate": True,  # (the parent gives each replica only the rows the verifier answers)
                "validation_sources": [],
                "max_samples": None,
                "source_weights": None,
                "max_user_turns": None,  # (cut once, by the parent)
                "output": str(folder),
                "data_parallel_size": 1,
                "image_roots": roots,
            }
        )
        command = [sys.executable, "-m", "speculators.cli", "prepare", *to_argv(one)]
        env = {**env, REPLICA_ENVIRONMENT: "1"}
        processes.append(start_replica("regeneration replica", index, command, env, folder / "prepare.log"))
    for _, _, process in processes:
        process.wait()
    raise_for_failed_replicas("regeneration", processes)
    by_id = {sample.id: sample for folder in folders for sample in read_samples(folder / "samples.jsonl")}
    samples = [by_id[c.id] for c in conversations if c.id in by_id]
    write_jsonl_atomic(output / "samples.partial.jsonl", samples)  # what a single-process rerun resumes from
    rejected: Counter[str] = Counter()
    regeneration: Counter[str] = Counter()
    longest = LongestPrompt()
    for folder in folders:
        tokenization = json.loads((folder / "prepare_report.json").read_text())["tokenization"]
        rejected.update(tokenization["rejected"])
        longest.merge(tokenization.get("longest_over_length"))
        regeneration.update(
            {k: v for k, v in tokenization["regeneration"].items() if isinstance(v, int) and not isinstance(v, bool)}
        )
    details = {
        "regeneration": {**regeneration, "replicas": replicas},
        "rejected": dict(rejected),
        "longest_over_length": longest.to_dict(),
        "regeneration_key": key,
    }
    return samples, details


def requests_in_flight(settings: PrepareSettings) -> int:
    """Conversations regenerated at once: `batch_size` per engine, so a server with data-parallel
    replicas gets that many per replica (with only `batch_size` in flight, each of N replicas ran a
    batch of batch_size / N)."""
    if settings.backend != "vllm":
        return settings.regeneration_batch()
    return settings.regeneration_batch() * settings.data_parallel_size


def answer_generator(
    settings: PrepareSettings, output: Path, images: ImageInputs | None = None
) -> tuple[PreTrainedTokenizerBase, Generate | ImageGenerateFn, AbstractContextManager[Any]]:
    """(tokenizer, prompt ids -> answer ids, the server to run while generating) for the backend;
    with `images` (a vision-language verifier) the generator also takes each prompt's images."""
    s = settings
    if s.backend != "vllm":
        return transformers_answer_generator(s, images)
    if images is not None and s.server_url:
        raise SpeculatorsError(
            "regenerating image conversations runs vLLM's offline engine (a server's token-id API takes no images); "
            "drop --server-url (--data-parallel-size N runs N offline engines)"
        )

    _, location = load_verifier_config(str(s.verifier))  # a GGUF file becomes its cached directory
    tokenizer = load_tokenizer(location)
    require_chat_template(tokenizer, str(s.verifier))
    ends = turn_end_ids(tokenizer)
    max_model_len = s.max_length + s.max_new_tokens
    if offline_vllm_engine(s):
        engine = VllmGenerate(
            location,
            s.max_new_tokens,
            s.temperature,
            s.seed,
            s.dtype,
            ends,
            max_model_len,
            s.tensor_parallel_size,
            quantization=s.quantization,
            nodes=node_group_of(s),
        )
        return tokenizer, engine, closing(engine)  # the engine stops while vLLM's log is still the file

    def on_server(url: str, model: str | None) -> Generate:
        return server_generate_fn(
            url,
            s.max_new_tokens,
            s.temperature,
            s.seed,
            ends,
            model=model,
            concurrency=requests_in_flight(s),
            api_key=os.environ.get("VLLM_API_KEY"),
        )

    if s.server_url:
        return tokenizer, on_server(s.server_url, s.server_model), nullcontext()

    # Data-parallel replicas: vLLM's server runs one engine per replica behind one API (the offline
    # engine cannot for dense models); requests go to it concurrently.

    server = VllmServer(
        ServerSettings(
            verifier=str(s.verifier),
            port=0,
            dtype=s.dtype,
            quantization=s.quantization,
            seed=s.seed,
            enforce_eager=decoding_enforce_eager(),  # no hooks here: CUDA graphs on GPUs
            max_model_len=max_model_len,
            tensor_parallel_size=s.tensor_parallel_size,
            log_path=output / "regeneration-vllm.log",
            extra_args=["--data-parallel-size", str(s.data_parallel_size)],
            nodes=node_group_of(s),
        )
    )

    def generate_on_server(prompts: list[list[int]]) -> list[list[int]]:  # the URL is known once it runs
        return on_server(server.url, server.model_name)(prompts)

    return tokenizer, generate_on_server, server


def transformers_answer_generator(
    settings: PrepareSettings, images: ImageInputs | None = None
) -> tuple[PreTrainedTokenizerBase, Generate | ImageGenerateFn, AbstractContextManager[Any]]:
    """answer_generator for the transformers backend: the verifier loaded here, generating in this process."""
    s = settings
    if s.tensor_parallel_size > 1 or s.data_parallel_size > 1 or s.server_url:
        raise SpeculatorsError("--tensor-parallel-size and --server-url need --backend vllm")

    verifier = load_verifier(str(s.verifier), dtype=s.dtype, device=s.device, quantization=s.quantization)
    require_chat_template(verifier.tokenizer, str(s.verifier))
    if images is not None:
        return (
            verifier.tokenizer,
            transformers_image_generate_fn(
                verifier.model, verifier.tokenizer, images, s.max_new_tokens, s.temperature, s.seed
            ),
            nullcontext(),
        )
    generate = transformers_generate_fn(verifier.model, verifier.tokenizer, s.max_new_tokens, s.temperature, s.seed)
    return verifier.tokenizer, generate, nullcontext()
