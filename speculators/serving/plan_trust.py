"""What makes the multi-node engine plan something a follower can trust (speculators/serving/multinode.py).

Node rank 0 serves each engine's arguments over plain HTTP, and `speculators follow` on every other node
starts vLLM with them: whoever could answer on that port, or change the answer, would choose the
command line and the environment of every follower (`--trust-remote-code` and `PYTHONPATH` are enough
to run a `sitecustomize.py`). So:

- the nodes of a group share a secret (SPECULATORS_PLAN_SECRET, or a file named by --plan-secret-file;
  never a command-line value, which `ps` and the step's log would show), at least 16 bytes;
- a follower's request carries a fresh nonce and its HMAC-SHA256 under the secret: node rank 0 answers
  anything else with 403 and no plan;
- node rank 0's reply carries HMAC-SHA256(secret, nonce || body): the follower checks it with
  `hmac.compare_digest` before it parses a byte of the body, so a forged plan, or a signed one replayed
  from an earlier request, is refused;
- a plan that passes both still has to fit an allow-list (PLAN_FLAGS, ENGINE_ENV_VALUES): the engine
  arguments this library emits and the serving knobs a user passes through after `serve --` or
  `bench --`, each value checked, and the environment variables this library sets with their values.
  Node rank 0 checks its own plan against it before it serves it (it never serves a plan its followers
  refuse), and a follower checks it again before it starts anything;
- the OpenAI API server's own flags (FRONTEND_FLAGS: --api-key, --chat-template, ...) never enter a plan:
  only node rank 0's server reads them, so split_frontend_args keeps them on its command line.

Standard library only (hmac, hashlib, secrets, json).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from speculators.errors import SpeculatorsError

if TYPE_CHECKING:
    from speculators.settings import MultiNode

PLAN_SECRET_ENV = "SPECULATORS_PLAN_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 4096
# A plan is a few kilobytes of flags; a reply larger than this is not read (a hostile server could
# otherwise make a follower hold gigabytes before the signature is even checked).
MAX_PLAN_BYTES = 1 << 20
NONCE_HEADER = "X-Speculators-Nonce"
RANK_HEADER = "X-Speculators-Rank"
REQUEST_MAC_HEADER = "X-Speculators-Request-Mac"
SIGNATURE_HEADER = "X-Speculators-Signature"
SECRET_HELP = (
    f"set {PLAN_SECRET_ENV} to the same random value on every node (e.g. $(openssl rand -hex 32); in "
    f"Kubernetes from a Secret) or pass --plan-secret-file with a file that holds it"
)


# ----- the shared secret ---------------------------------------------------------------------------


def plan_secret(nodes: MultiNode) -> bytes:
    """The node group's shared secret: the file --plan-secret-file names (trailing whitespace dropped:
    `echo` and editors end it with a newline), else SPECULATORS_PLAN_SECRET. Missing, unreadable or
    shorter than MIN_SECRET_BYTES: one sentence saying how to set it."""
    if nodes.plan_secret_file:
        path = Path(nodes.plan_secret_file)
        try:
            with open(path, "rb") as file:
                raw = file.read(MAX_SECRET_FILE_BYTES + 1)
        except OSError as error:
            raise SpeculatorsError(
                f"cannot read the plan secret file {path} ({error.strerror or error}); {SECRET_HELP}"
            ) from None
        if len(raw) > MAX_SECRET_FILE_BYTES:
            raise SpeculatorsError(
                f"the plan secret file {path} is larger than {MAX_SECRET_FILE_BYTES} bytes; it should hold one "
                f"random value, e.g. from openssl rand -hex 32"
            )
        secret, source = raw.rstrip(), f"the plan secret file {path}"
    else:
        secret, source = os.environ.get(PLAN_SECRET_ENV, "").encode(), PLAN_SECRET_ENV
        if not secret:
            raise SpeculatorsError(
                f"an engine over several nodes needs the node group's shared plan secret, and none is set; "
                f"{SECRET_HELP}"
            )
    if len(secret) < MIN_SECRET_BYTES:
        raise SpeculatorsError(
            f"{source} holds {len(secret)} bytes, fewer than the {MIN_SECRET_BYTES} a plan secret needs; use a "
            f"longer random value, e.g. $(openssl rand -hex 32), the same on every node"
        )
    return secret


def new_nonce() -> str:
    return secrets.token_hex(16)


def mac(secret: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 of `parts` under `secret`, each part length-prefixed (no two part lists collide)."""
    message = b"".join(len(part).to_bytes(8, "big") + part for part in parts)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def request_headers(secret: bytes, nonce: str, rank: int) -> dict[str, str]:
    """A follower's request: its nonce and rank and their MAC ("request" keeps it from passing as a reply's)."""
    return {
        NONCE_HEADER: nonce,
        RANK_HEADER: str(rank),
        REQUEST_MAC_HEADER: mac(secret, b"request", nonce.encode(), str(rank).encode()),
    }


def authentic_request(secret: bytes, headers: Message | Mapping[str, str]) -> tuple[str, int] | None:
    """(nonce, rank) of a request whose MAC is right, else None (header names in any case, as HTTP has them)."""
    nonce, rank, given = (headers.get(name, "") for name in (NONCE_HEADER, RANK_HEADER, REQUEST_MAC_HEADER))
    if not re.fullmatch(r"[0-9a-f]{32}", nonce) or not re.fullmatch(r"[0-9]{1,6}", rank):
        return None
    if not hmac.compare_digest(given.encode(), mac(secret, b"request", nonce.encode(), rank.encode()).encode()):
        return None
    return nonce, int(rank)


def reply_signature(secret: bytes, nonce: str, body: bytes) -> str:
    return mac(secret, b"reply", nonce.encode(), body)


def authentic_reply(secret: bytes, nonce: str, body: bytes, signature: str | None) -> bool:
    """Whether `body` is what node rank 0 signed for this very request (`nonce`)."""
    expected = reply_signature(secret, nonce, body)
    return signature is not None and hmac.compare_digest(signature.encode(), expected.encode())


# ----- the allow-list ------------------------------------------------------------------------------

ValueCheck = Callable[[str], str | None]  # a value's problem ("is not ..."), or None


def one_of(*choices: str) -> ValueCheck:
    return lambda value: None if value in choices else f"is not one of {', '.join(choices)}"


def pattern(regex: str, what: str) -> ValueCheck:
    return lambda value: None if re.fullmatch(regex, value) else f"is not {what}"


COUNT = pattern(r"[0-9]{1,12}", "a non-negative whole number")
FRACTION = pattern(r"(0?\.[0-9]{1,6}|1(\.0*)?)", "a fraction in (0, 1]")
GIB = pattern(r"[0-9]{1,6}(\.[0-9]{1,6})?", "a non-negative number of GiB")
LENGTH = pattern(r"[0-9]{1,12}[kKmM]?", "a length such as 8192 or 8k")
NAME = pattern(r"[A-Za-z0-9_]{1,64}", "a plain name (letters, digits, _)")
# A model or served name: a path or hub id, no control characters, never read as a flag.
MODEL_NAME = pattern(r"[^-\x00-\x1f\x7f][^\x00-\x1f\x7f]{0,1023}", "a model path, hub id or name")
CUSTOM_OP = pattern(r"[+-]?[A-Za-z0-9_]{1,64}|all|none", "an op name such as -rotary_embedding")


def json_object(check_items: Callable[[dict[str, Any]], str | None]) -> ValueCheck:
    def check(value: str) -> str | None:
        try:
            parsed = json.loads(value)
        except ValueError:
            return "is not a JSON object"
        return check_items(parsed) if isinstance(parsed, dict) else "is not a JSON object"

    return check


def keys_within(allowed: set[str]) -> Callable[[dict[str, Any]], str | None]:
    def check(items: dict[str, Any]) -> str | None:
        unknown = sorted(set(items) - allowed)
        return f"has the key {unknown[0]!r}, not one of {', '.join(sorted(allowed))}" if unknown else None

    return check


def compilation_items(items: dict[str, Any]) -> str | None:
    """compilation_config: the mode, custom ops and CUDA-graph sizes, no `backend` (an importable name:
    vllm/config/compilation.py) nor anything that writes files."""
    problem = keys_within(
        {"mode", "custom_ops", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
    )(items)
    if problem:
        return problem
    ops = items.get("custom_ops", [])
    if not isinstance(ops, list) or any(not isinstance(op, str) or CUSTOM_OP(op) for op in ops):
        return "has custom_ops that are not a list of op names"
    sizes = items.get("cudagraph_capture_sizes", [])
    numbers = [items.get("mode", 0), items.get("max_cudagraph_capture_size", 0), *sizes]
    if not isinstance(sizes, list) or any(type(n) is not int or n < 0 for n in numbers):
        return "has a mode or CUDA-graph size that is not a non-negative whole number"
    mode = items.get("cudagraph_mode", "NONE")
    return None if isinstance(mode, str) and not NAME(mode) else "has a cudagraph_mode that is not a plain name"


def image_limit_items(items: dict[str, Any]) -> str | None:
    problem = keys_within({"image", "video", "audio"})(items)
    if problem:
        return problem
    return None if all(type(n) is int and n >= 0 for n in items.values()) else "has a limit that is not a count"


# The drafters this library trains and vLLM serves by name. Without a method vLLM takes a `model`
# that looks like a module path for a custom proposer class (vllm/config/speculative.py: custom_class).
SPECULATIVE_METHODS = ("eagle", "eagle3", "dflash")


def speculative_items(items: dict[str, Any]) -> str | None:
    problem = keys_within(
        {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size", "parallel_drafting"}
    )(items)
    if problem:
        return problem
    method, model = items.get("method"), items.get("model")
    if (model is not None or method is not None) and method not in SPECULATIVE_METHODS:
        return f"has the method {method!r}, not one of {', '.join(SPECULATIVE_METHODS)}"
    if model is not None and (not isinstance(model, str) or MODEL_NAME(model)):
        return f"has the model {model!r}, which is not a model path or hub id"
    counts = [items.get("num_speculative_tokens", 1), items.get("draft_tensor_parallel_size", 1)]
    if any(type(n) is not int or n < 1 for n in counts) or not isinstance(items.get("parallel_drafting", False), bool):
        return "has a token count or parallel size that is not a positive whole number"
    return None


@dataclass(frozen=True)
class FlagRule:
    """How a vLLM flag of a plan is written: a switch (with its `--no-` form), one value, or one or more
    values (argparse nargs '+'), each value checked."""

    takes: Literal["switch", "value", "values"]
    check: ValueCheck | None = None


SWITCH = FlagRule("switch")

# The `vllm serve` arguments a plan may carry (vLLM 0.32, vllm/engine/arg_utils.py), exactly as
# spelled here: vLLM's parser also takes abbreviations, `_` for `-` and `--flag.key` forms, none of
# which is accepted. First the ones this library emits (engine.verifier_engine_kwargs through
# engine_flags; serve.VllmServer.engine_args), then the serving knobs a user passes through after
# `serve --` / `bench --` over several nodes. Left out on purpose, among others: --trust-remote-code
# (only with `follow --trust-remote-code`), --worker-cls, --worker-extension-cls, --logits-processors,
# --io-processor-plugin, --scheduler-cls, --model-impl, --hf-overrides, --model-class-overrides,
# --model-loader-extra-config, --config (a file of more flags), --tokenizer (another tokenizer), the
# plugin flags of the API server (--middleware, --tool-parser-plugin, --reasoning-parser-plugin),
# the node flags (each follower adds its own) and every flag that names a file to write.
PLAN_FLAGS: dict[str, FlagRule] = {
    # emitted by this library
    "--dtype": FlagRule("value", one_of("auto", "bfloat16", "float16", "float32", "half", "float")),
    "--quantization": FlagRule("value", NAME),
    "--seed": FlagRule("value", COUNT),
    "--enforce-eager": SWITCH,
    "--max-model-len": FlagRule("value", LENGTH),
    "--tensor-parallel-size": FlagRule("value", COUNT),
    "--data-parallel-size": FlagRule("value", COUNT),
    "--compilation-config": FlagRule("value", json_object(compilation_items)),
    "--enable-prefix-caching": SWITCH,
    "--max-num-batched-tokens": FlagRule("value", COUNT),
    "--max-num-seqs": FlagRule("value", COUNT),
    "--mm-device-do-normalize": SWITCH,
    "--attention-backend": FlagRule("value", NAME),
    "--limit-mm-per-prompt": FlagRule("value", json_object(image_limit_items)),
    "--tokenizer-mode": FlagRule("value", one_of("auto", "hf", "slow", "mistral")),  # (not custom: a plugin's)
    "--config-format": FlagRule("value", one_of("auto", "hf", "mistral")),
    "--load-format": FlagRule("value", one_of("auto", "safetensors", "mistral")),  # (not pt: pickles)
    "--served-model-name": FlagRule("values", MODEL_NAME),
    "--logprobs-mode": FlagRule(
        "value", one_of("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
    ),
    "--speculative-config": FlagRule("value", json_object(speculative_items)),
    "--per-request-spec-decode-metrics": FlagRule("value", one_of("none", "summary", "detailed")),
    # serving knobs passed through after `serve --` / `bench --`
    "--gpu-memory-utilization": FlagRule("value", FRACTION),
    "--kv-cache-dtype": FlagRule("value", NAME),
    "--kv-cache-memory-bytes": FlagRule("value", LENGTH),
    "--block-size": FlagRule("value", COUNT),
    "--num-gpu-blocks-override": FlagRule("value", COUNT),
    "--cpu-offload-gb": FlagRule("value", GIB),
    "--pipeline-parallel-size": FlagRule("value", COUNT),
    "--enable-expert-parallel": SWITCH,
    "--disable-custom-all-reduce": SWITCH,
    "--enable-chunked-prefill": SWITCH,
    "--long-prefill-token-threshold": FlagRule("value", COUNT),
    "--async-scheduling": SWITCH,
    "--scheduling-policy": FlagRule("value", one_of("fcfs", "priority")),
    "--max-logprobs": FlagRule("value", COUNT),
    "--disable-cascade-attn": SWITCH,
    "--disable-sliding-window": SWITCH,
    "--cudagraph-capture-sizes": FlagRule("values", COUNT),
    "--max-cudagraph-capture-size": FlagRule("value", COUNT),
    "--optimization-level": FlagRule("value", one_of("0", "1", "2", "3")),
    "--performance-mode": FlagRule("value", one_of("balanced", "interactivity", "throughput")),
    "--moe-backend": FlagRule("value", NAME),
    "--linear-backend": FlagRule("value", NAME),
    "--distributed-timeout-seconds": FlagRule("value", COUNT),
    "--revision": FlagRule("value", pattern(r"[A-Za-z0-9_.]{1,64}", "a revision name or commit")),
    "--enable-log-requests": SWITCH,
}
TRUST_REMOTE_CODE = "--trust-remote-code"
# What this library sets in its own environment for an engine (engine.prepare_engine_environment,
# capture_vllm's hooks), which the plan carries to the other nodes' workers, and the values it sets.
ENGINE_ENV_VALUES: dict[str, tuple[str, ...]] = {
    "VLLM_WORKER_MULTIPROC_METHOD": ("spawn", "fork"),
    "VLLM_ALLOW_INSECURE_SERIALIZATION": ("1",),
}


def flag_rule(flag: str, trust_remote_code: bool) -> FlagRule | None:
    if flag in (TRUST_REMOTE_CODE, "--no-trust-remote-code"):
        return SWITCH if trust_remote_code or flag.startswith("--no-") else None
    if flag in PLAN_FLAGS:
        return PLAN_FLAGS[flag]
    positive = "--" + flag.removeprefix("--no-")
    return SWITCH if flag.startswith("--no-") and PLAN_FLAGS.get(positive) == SWITCH else None


def shown(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def engine_args_problem(args: list[Any], trust_remote_code: bool = False) -> str | None:
    """What in engine arguments falls outside the allow-list (PLAN_FLAGS), named, or None: a flag not
    listed (`--trust-remote-code` only with `trust_remote_code`), a switch given a value, a value
    missing, starting a new flag or failing its check, a word that belongs to no flag."""
    index = 0
    while index < len(args):
        token = args[index]
        if not isinstance(token, str):
            return f"the argument {token!r}, which is not text"
        flag, has_inline, inline = token.partition("=")
        if not flag.startswith("--"):
            return f"the argument {shown(token)}, which is no flag's value"
        rule = flag_rule(flag, trust_remote_code)
        if rule is None:
            if flag == TRUST_REMOTE_CODE:
                return f"{TRUST_REMOTE_CODE}, which runs the model's own code"
            return f"{shown(flag)}, which is not among the vLLM arguments a multi-node plan may carry"
        index += 1
        if rule.takes == "switch":
            if has_inline:
                return f"{flag} given the value {shown(inline)}, but it takes none"
            continue
        values = [inline] if has_inline else []
        while not has_inline and index < len(args) and (not values or rule.takes == "values"):
            if not isinstance(args[index], str) or args[index].startswith("-"):
                break
            values.append(args[index])
            index += 1
        if not values:
            following = f", not {shown(str(args[index]))}" if index < len(args) else ""
            return f"{flag} without its value{following}"
        for value in values:
            problem = rule.check(value) if rule.check else None
            if problem or value.startswith("-"):
                return f"{flag} {shown(value)}, which {problem or 'starts like a flag'}"
    return None


def plan_problem(document: Any, trust_remote_code: bool = False) -> str | None:
    """What in an engine plan (multinode.plan_document's shape) a follower must not run, named, or None:
    its fields' types, the model (never read as a flag), the engine arguments (engine_args_problem) and
    the environment (only ENGINE_ENV_VALUES' names, with their values)."""
    if not isinstance(document, dict):
        return "a plan that is not a JSON object"
    if document.get("done") is True:
        return None if isinstance(document.get("group"), dict) else "a 'done' without its node group"
    engine, model, args, env = (document.get(key) for key in ("engine", "model", "args", "env"))
    if not isinstance(engine, str) or not re.fullmatch(r"[0-9a-f]{32}", engine):
        return f"the engine id {engine!r}, which is not 32 hex digits"
    if not isinstance(document.get("group"), dict):
        return "no node group"
    if not isinstance(model, str) or MODEL_NAME(model):
        return f"the model {model!r}, which is not a model path or hub id (it must not start with '-')"
    if not isinstance(args, list):
        return "engine arguments that are not a list"
    problem = engine_args_problem(args, trust_remote_code)
    if problem:
        return problem
    if not isinstance(env, dict):
        return "an environment that is not a JSON object"
    for name, value in env.items():
        allowed = ENGINE_ENV_VALUES.get(name)
        if allowed is None:
            return (
                f"the environment variable {shown(name)}, which is not one this library sets for an engine "
                f"({', '.join(ENGINE_ENV_VALUES)})"
            )
        if value not in allowed:
            return f"the environment variable {name}={shown(str(value))}, which is not {' or '.join(allowed)}"
    return None


# ----- the API server's own flags: node rank 0's, never in a plan ----------------------------------

# How many values a flag takes as vLLM's parser reads it: 0 a switch, 1 one value, "+" one or more.
Arity = Literal[0, 1, "+"]

# The OpenAI API server's own `vllm serve` flags (vLLM 0.32, vllm/entrypoints/launchers/cli_args.py:
# the fields of BaseFrontendArgs and FrontendArgs), which only node rank 0's API server reads: the headless
# workers of the other nodes never do, so they go on rank 0's command line and never into the plan. The
# arity is what vLLM's argparse makes of each field (vllm/engine/arg_utils.py, _compute_kwargs): a bool is
# an argparse.BooleanOptionalAction (`--x` and `--no-x`, no value), a list keeps nargs="+" (--lora-modules,
# --api-key) unless FrontendArgs._customize_cli_kwargs drops it (--allowed-origins/-methods/-headers take
# one JSON value, --middleware one value per repeat), anything else one value.
# tests/unit/serving/test_multinode.py holds this table to the installed vLLM's parser.
FRONTEND_FLAGS: dict[str, Arity] = {
    # BaseFrontendArgs
    "--lora-modules": "+",
    "--chat-template": 1,
    "--chat-template-content-format": 1,
    "--trust-request-chat-template": 0,
    "--trust-request-mm-kwargs": 0,
    "--default-chat-template-kwargs": 1,
    "--response-role": 1,
    "--return-tokens-as-token-ids": 0,
    "--enable-auto-tool-choice": 0,
    "--exclude-tools-when-tool-choice-none": 0,
    "--tool-call-parser": 1,
    "--tool-parser-plugin": 1,
    "--tool-strict-level": 1,
    "--tool-server": 1,
    "--max-log-len": 1,
    "--enable-prompt-tokens-details": 0,
    "--enable-per-request-metrics": 0,
    "--enable-server-load-tracking": 0,
    "--enable-force-include-usage": 0,
    "--sse-keep-alive-interval": 1,
    "--enable-tokenizer-info-endpoint": 0,
    "--enable-log-outputs": 0,
    "--enable-log-deltas": 0,
    "--cohere-is-reasoning-model": 0,
    "--cohere-format": 1,
    "--anthropic-disabled-thinking-effort": 1,
    "--log-error-stack": 0,
    "--tokens-only": 0,
    "--enable-scale-out": 0,
    "--fingerprint-mode": 1,
    "--fingerprint-value": 1,
    # FrontendArgs
    "--grpc-port": 1,
    "--data-parallel-supervisor-port": 1,
    "--dp-supervisor-probe-interval-s": 1,
    "--dp-supervisor-probe-timeout-s": 1,
    "--dp-supervisor-probe-failure-threshold": 1,
    "--uvicorn-log-level": 1,
    "--disable-uvicorn-access-log": 0,
    "--disable-access-log-for-endpoints": 1,
    "--allow-credentials": 0,
    "--allowed-origins": 1,
    "--allowed-methods": 1,
    "--allowed-headers": 1,
    "--api-key": "+",
    "--ssl-keyfile": 1,
    "--ssl-certfile": 1,
    "--ssl-ca-certs": 1,
    "--enable-ssl-refresh": 0,
    "--ssl-cert-reqs": 1,
    "--ssl-ciphers": 1,
    "--root-path": 1,
    "--middleware": 1,
    "--enable-request-id-headers": 0,
    "--disable-fastapi-docs": 0,
    "--h11-max-incomplete-event-size": 1,
    "--h11-max-header-count": 1,
    "--enable-offline-docs": 0,
}
# FrontendArgs fields left out of FRONTEND_FLAGS on purpose: after `--` they stay engine arguments, passed
# through on one node as always and refused by the plan's allow-list over several.
FRONTEND_FLAGS_LEFT_OUT = {
    # where the server listens: the command sets --host and --port itself (a user's own after `--` comes
    # later and wins, as it always did), and the library reaches the server there
    "--host": "set by the command",
    "--port": "set by the command",
    "--uds": "the server must listen on --host and --port, where the library reaches it",
    # also copied into the engine's PoolerConfig (its docstring): not the API server's alone
    "--enable-flash-late-interaction": "reaches the engine",
}
# argparse reads a word that starts with `-` as a value when it is a negative number (vLLM has no flag
# that looks like one) or holds a space (argparse.ArgumentParser._parse_optional).
NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")


def starts_a_flag(word: str) -> bool:
    """Whether vLLM's parser reads `word` as a flag rather than as the value of the flag before it."""
    if not word.startswith("-") or word == "-" or NEGATIVE_NUMBER.fullmatch(word):
        return False
    return " " not in word or frontend_flag(word) is not None


def frontend_flag(word: str) -> tuple[str, Arity] | None:
    """The API server's flag `word` names (`--flag` or `--flag=value`, with `_` for `-` as vLLM's
    FlexibleArgumentParser allows, and `--no-flag` for a switch), spelled with dashes, and its arity; or None."""
    if not word.startswith("--"):
        return None
    name = "--" + word.partition("=")[0][2:].replace("_", "-")
    if name in FRONTEND_FLAGS:
        return name, FRONTEND_FLAGS[name]
    switched_off = name.startswith("--no-") and FRONTEND_FLAGS.get("--" + name.removeprefix("--no-")) == 0
    return (name, 0) if switched_off else None


def split_frontend_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Passthrough `vllm serve` flags (after `serve --` / `bench --`) split as vLLM's parser reads them into
    the API server's own (FRONTEND_FLAGS, with their values) and the engine's (everything else, in order).
    A frontend flag vLLM would refuse (a switch given a value, a flag without its value) is refused here in
    one sentence, before any node starts anything."""
    frontend: list[str] = []
    engine: list[str] = []
    index = 0
    while index < len(args):
        word = args[index]
        index += 1
        known = frontend_flag(word) if starts_a_flag(word) else None
        if known is None:
            engine.append(word)
            continue
        _, arity = known
        flag, has_value, value = word.partition("=")
        if arity == 0 and has_value:
            raise SpeculatorsError(f"{flag} is a switch and takes no value, not {shown(value)}; write {flag} alone")
        taken = [word]
        while arity != 0 and not has_value and index < len(args) and not starts_a_flag(args[index]):
            taken.append(args[index])
            index += 1
            if arity == 1:
                break
        if arity != 0 and not has_value and len(taken) == 1:
            following = f", not the flag {shown(args[index])}" if index < len(args) else ""
            raise SpeculatorsError(
                f"{flag} after -- needs its value{following}; give it one (as {flag}=VALUE where the value "
                f"starts with -)"
            )
        frontend += taken
    return frontend, engine
