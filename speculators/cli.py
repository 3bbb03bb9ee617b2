"""`speculators` command line: the library's capabilities, one subcommand each."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from speculators.checkpoint.acceptance_profile import k_at_serving_concurrency
from speculators.checkpoint.convert import convert_checkpoint
from speculators.checkpoint.validation import validate_checkpoint
from speculators.data.capture import run_capture
from speculators.data.prepare import run_prepare
from speculators.data.store import HiddenStateStore
from speculators.errors import SpeculatorsError, argv_problem, user_error_line
from speculators.eval.bench import run_bench
from speculators.eval.evaluate import run_evaluation
from speculators.flags import add_flags, from_args
from speculators.models.algorithms import algorithm_named
from speculators.precision import compute_dtype
from speculators.serving.multinode import follow
from speculators.serving.serve import ServerSettings, serve_forever
from speculators.settings import (
    BenchSettings,
    CaptureSettings,
    CompareSettings,
    ConvertSettings,
    EvaluateSettings,
    FollowSettings,
    InitSettings,
    PrepareSettings,
    Server,
    ServeSettings,
    TinyVerifierSettings,
    TrainConfig,
    ValidateSettings,
    VerifierSettings,
    VerifyStoreSettings,
    VocabSettings,
    node_group_of,
)
from speculators.train.trainer import train
from speculators.train.vocab import build_store_vocab
from speculators.verifier.loading import (
    cache_as_hub_model,
    checkpoint_verifier_name,
    load_verifier,
    load_verifier_config,
    local_model_dir,
    require_chat_template,
)
from speculators.verifier.mask_token import default_mask_token_id
from speculators.verifier.tiny import make_tiny_mistral_verifier, make_tiny_verifier

# Commands whose --dtype is the compute dtype (auto: bf16 where the hardware computes it, else fp32).
COMPUTE_COMMANDS = ("verifier", "prepare", "datagen", "evaluate", "compare", "serve", "bench")


def passthrough(args: argparse.Namespace) -> list[str]:
    """serve's and bench's vLLM flags after `--`."""
    return args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args


def cmd_validate(args: argparse.Namespace) -> int:
    s: ValidateSettings = from_args(ValidateSettings, args)
    report = validate_checkpoint(s.checkpoint, verifier=s.verifier)
    if s.as_json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "problems": report.problems,
                    "notes": report.notes,
                    "summary": {k: str(v) for k, v in report.summary.items()},
                },
                indent=2,
            )
        )
    else:
        print(report.render())
    return 0 if report.ok else 1


def cmd_convert(args: argparse.Namespace) -> int:
    s: ConvertSettings = from_args(ConvertSettings, args)
    result = convert_checkpoint(s)
    for note in result.notes:
        print(f"note: {note}")
    print(f"converted {result.source_layout} checkpoint {s.source} -> {result.output} ({result.checked})")
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:
    s: VerifierSettings = from_args(VerifierSettings, args)
    if s.cache_as:
        _, location = load_verifier_config(s.source)
        snapshot = cache_as_hub_model(location, s.cache_as)
        print(f"{s.cache_as} now loads offline (HF_HUB_OFFLINE=1) from {snapshot} -> {location}")
        return 0

    verifier = load_verifier(s.source, dtype=s.dtype)
    info = verifier.describe()
    if s.prompt:
        require_chat_template(verifier.tokenizer, s.source)
        import torch
        from transformers import BatchEncoding

        messages = [{"role": "user", "content": s.prompt}]
        ids = verifier.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        assert isinstance(ids, BatchEncoding)  # (return_dict=True)
        with torch.inference_mode():
            out = verifier.model.generate(**ids, max_new_tokens=s.max_new_tokens, do_sample=False)
        info["generated"] = verifier.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(json.dumps(info, indent=2))
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    import torch

    s: InitSettings = from_args(InitSettings, args)
    algorithm = algorithm_named(s.algorithm)
    verifier = load_verifier(s.verifier, dtype="float32")
    name = checkpoint_verifier_name(s.verifier, verifier.name_or_path, s.verifier_name)
    shape = s.drafter_shape()
    if algorithm.parallel and shape.mask_token_id is None:
        shape = replace(shape, mask_token_id=default_mask_token_id(local_model_dir(verifier.name_or_path)))
    config = algorithm.part("config_for_verifier")(verifier.config, name, shape)
    drafter = algorithm.part("drafter")(config)
    drafter.reset_parameters(seed=s.seed)
    # Without token statistics the draft vocab is the lowest ids; `speculators vocab` picks better ones.
    drafter.init_draft_vocab(torch.arange(config.draft_vocab_size), verifier.lm_head_weight)
    drafter.save_pretrained(s.output, overwrite=s.overwrite)
    print(f"wrote an untrained {algorithm.name} drafter for {verifier.name_or_path} to {s.output}")
    return 0


def cmd_tiny_verifier(args: argparse.Namespace) -> int:
    s: TinyVerifierSettings = from_args(TinyVerifierSettings, args)
    if s.mistral_format:
        if s.family != "deepseek_v3":
            raise SpeculatorsError(
                f"--mistral-format writes Mistral Large 3 (a deepseek_v3 model), not {s.family}; pass "
                f"--family deepseek_v3 or leave --mistral-format out"
            )
        path = make_tiny_mistral_verifier(s.output, seed=s.seed, num_layers=s.num_layers, overwrite=s.overwrite)
        print(f"wrote a tiny random Mistral Large 3 in Mistral's checkpoint format to {path}")
        return 0
    path = make_tiny_verifier(s.family, s.output, seed=s.seed, num_layers=s.num_layers, overwrite=s.overwrite)
    print(f"wrote a tiny random {s.family} verifier to {path}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    run_prepare(from_args(PrepareSettings, args))
    return 0


def cmd_datagen(args: argparse.Namespace) -> int:
    report = run_capture(from_args(CaptureSettings, args), replica=args.replica)
    if args.replica:
        print(f"replica {args.replica[0]}/{args.replica[1]}: computed {report.computed} samples")
    else:
        print(json.dumps(report.to_dict(), indent=2))
    return 0


def parse_replica(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"replica '{text}' is not INDEX/COUNT, e.g. 0/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"replica '{text}' needs 0 <= INDEX < COUNT")
    return index, count


def cmd_vocab(args: argparse.Namespace) -> int:
    s: VocabSettings = from_args(VocabSettings, args)
    vocab = build_store_vocab(s.store, s.draft_vocab_size)
    print(
        f"draft vocab of {s.draft_vocab_size} over {vocab.distinct_tokens} distinct supervised tokens: "
        f"coverage {vocab.coverage:.4f} of {vocab.supervised_tokens} supervised tokens"
    )
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:
    s: VerifyStoreSettings = from_args(VerifyStoreSettings, args)
    store = HiddenStateStore(s.store)
    problems = store.verify()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    manifest = store.manifest()
    uncomputed = len(manifest.uncomputed)
    index = (
        f" (an index: {len(manifest.samples) - uncomputed} samples' states checked, {uncomputed} samples without "
        f"states, their tokens checked)"
        if uncomputed
        else ""
    )
    print(f"store: valid{index}" if not problems else f"store: INVALID ({len(problems)} problem(s)){index}")
    return 0 if not problems else 1


def cmd_stream(args: argparse.Namespace) -> int:
    from speculators.train.stream import run_producer

    run_producer(args.spool, *args.replica)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    summary = train(from_args(TrainConfig, args))
    if summary is not None:
        final = summary.final_train
        print(
            f"trained {summary.steps} steps ({summary.epochs:.2f} epochs) at {summary.tokens_per_second} "
            f"tokens/s; train full_acc {[round(a, 3) for a in final['full_acc']]}, "
            f"acceptance length estimate {final['acceptance_length']:.2f}"
        )
        if summary.best_validation:
            best = summary.best_validation
            print(
                f"best validation: full_acc {[round(a, 3) for a in best['full_acc']]}, acceptance length "
                f"{best['replayed_acceptance_length']:.2f} replayed as decoding (estimate "
                f"{best['acceptance_length']:.2f})"
            )
        print(f"drafter: {summary.drafter}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    s: EvaluateSettings = from_args(EvaluateSettings, args)
    report = run_evaluation(s)
    print(report.render())
    if s.output:
        print(f"report: {s.output}")
    report.raise_for_divergence()
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from speculators.eval.compare import run_comparison

    s: CompareSettings = from_args(CompareSettings, args)
    report = run_comparison(s)
    print(report.render())
    if s.output:
        print(f"report: {s.output}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    s: ServeSettings = from_args(ServeSettings, args)
    if s.serving_concurrency is not None:
        k, why = k_at_serving_concurrency(s.speculator, s.num_speculative_tokens, s.serving_concurrency)
        print(why, flush=True)
        s = s.model_copy(update={"num_speculative_tokens": k})
    settings = ServerSettings(
        **s.model_dump(include=set(Server.model_fields)), extra_args=passthrough(args), nodes=node_group_of(s)
    )
    return serve_forever(settings, follow_log=not s.quiet)


def cmd_follow(args: argparse.Namespace) -> int:
    s: FollowSettings = from_args(FollowSettings, args)
    return follow(node_group_of(s), idle_timeout=s.idle_timeout, trust_remote_code=s.trust_remote_code)


def cmd_bench(args: argparse.Namespace) -> int:
    settings = from_args(BenchSettings, args, vllm_args=passthrough(args))
    run_bench(settings)
    print((Path(settings.output) / "report.md").read_text())
    print(f"report folder: {settings.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculators", description="EAGLE-3 speculators for vLLM")
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, model: type[BaseModel], run: Any, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text)
        add_flags(sub, model, exclude=("vllm_args",))
        sub.set_defaults(func=run)
        return sub

    command("validate", ValidateSettings, cmd_validate, "check a speculator checkpoint (and its fit to a verifier)")
    command("convert", ConvertSettings, cmd_convert, "research / reference checkpoints -> the speculators format")
    command("verifier", VerifierSettings, cmd_verifier, "load a verifier and print its facts (optionally generate)")
    command("init", InitSettings, cmd_init, "write an untrained EAGLE-3 drafter sized for a verifier")
    command(
        "tiny-verifier", TinyVerifierSettings, cmd_tiny_verifier, "write a tiny random-weight verifier (tests, demos)"
    )
    command("prepare", PrepareSettings, cmd_prepare, "prompt sources -> conversations (+ tokenized samples)")
    datagen = command("datagen", CaptureSettings, cmd_datagen, "tokenized samples -> hidden-state store")
    # INDEX/COUNT: set by run_capture_replicas for its replica processes
    datagen.add_argument("--replica", type=parse_replica, help=argparse.SUPPRESS)
    command("vocab", VocabSettings, cmd_vocab, "draft vocabulary (d2t, t2d) from a hidden-state store")
    command("train", TrainConfig, cmd_train, "train an EAGLE-3 drafter (training-time test) from a store")
    # internal: a streamed run's producer, started by its supervisor (speculators/train/stream.py)
    stream = commands.add_parser("stream")
    stream.add_argument("--spool", required=True)
    stream.add_argument("--replica", type=parse_replica, required=True)
    stream.set_defaults(func=cmd_stream)
    command(
        "evaluate",
        EvaluateSettings,
        cmd_evaluate,
        "offline speculative decoding with transformers: acceptance, speed, lossless check",
    )
    command(
        "compare",
        CompareSettings,
        cmd_compare,
        "several drafters' acceptance on the same prompts, replayed on the verifier's greedy answers, with "
        "paired bootstrap intervals",
    )
    serve = command(
        "serve", ServeSettings, cmd_serve, "run vLLM's OpenAI server for a verifier, alone or with a speculator"
    )
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more vLLM server flags")
    command(
        "follow",
        FollowSettings,
        cmd_follow,
        "on node ranks 1..N-1 of a multi-node engine: vLLM's headless workers of every engine node rank 0 "
        "starts (prepare, datagen, bench or serve with --nnodes), with its engine arguments",
    )
    bench = command("bench", BenchSettings, cmd_bench, "GuideLLM: vLLM with and without the speculator, report folder")
    bench.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more flags for both vLLM servers")
    command(
        "verify-store",
        VerifyStoreSettings,
        cmd_verify_store,
        "re-read every shard of a store: checksums, shapes, values",
    )
    return parser


def runs_vllm(args: argparse.Namespace) -> bool:
    return args.command in ("serve", "bench") or getattr(args, "backend", None) == "vllm"


def compute_device(args: argparse.Namespace) -> str:
    """Where a command computes, for what `--dtype auto` means: vLLM's commands where the installed vLLM
    computes (asked without touching CUDA, whose engines then fork cleanly: vllm_engine)."""
    if runs_vllm(args):
        return "vllm"
    return getattr(args, "device", None) or "auto"


def check_output_folder(args: argparse.Namespace) -> None:
    """A command whose --output is a folder refuses a file there, before any work."""
    output = getattr(args, "output", None)
    if output and args.command not in ("evaluate", "compare") and Path(output).exists() and not Path(output).is_dir():
        raise SpeculatorsError(f"--output {output} is a file, not a folder; name a new or empty folder")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if (problem := argv_problem(argv)) is not None:  # (before argparse, which would echo it)
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        check_output_folder(args)
        if args.command in COMPUTE_COMMANDS:  # (convert and init: --dtype is the checkpoint's file format)
            args.dtype = compute_dtype(args.dtype, compute_device(args), getattr(args, "quantization", None))
        return args.func(args)
    except Exception as error:  # a user's mistake, or what only a user's input raises: one line; a bug: its traceback
        line = user_error_line(error, vars(args))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
