"""Resources: where artifacts live (storage root) and how heavy steps run (the runner).

The runner executes one workload command with Dagster Pipes: `local` as a subprocess
(`PipesSubprocessClient`), `k8s` as one pod per step (`dagster_k8s.PipesK8sClient`) whose spec comes
from the variant's compute profile. The same command runs in both.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import Any

import dagster as dg
from dagster_pipes import PipesDefaultMessageWriter

from speculators_assets.environment import LOCAL_STORAGE_ROOT, Settings
from speculators_assets.steps import TRAINED_DRAFTER
from speculators_assets.variants import ComputeProfile, Variant, master_address, node_group_name

WORKLOAD_CONTAINER = "workload"


class StorageRoot(dg.ConfigurableResource):
    """Artifacts under `<path>/<variant>/<asset>/...`: the root as the workload sees it (environment.py,
    SPECULATORS_STORAGE_ROOT): a local directory, or with the k8s runner where the claim is mounted in
    every step pod."""

    path: str = LOCAL_STORAGE_ROOT


def local_gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


@contextmanager
def known_preview_quiet() -> Iterator[None]:
    """Dagster's Pipes clients call their own preview API (`expected_writer_count`) and warn about
    it on every step, between the step's progress lines; that one warning is known and not ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*expected_writer_count", category=dg.PreviewWarning)
        yield


class WholeLineMessageReader(dg.PipesMessageReader):
    """Reads the workload's Pipes messages from a temporary file, one whole line at a time.

    Dagster's own file reader (`PipesTempFileMessageReader`, 1.13) hands every `readline()` to
    `json.loads`, and `readline()` at the end of a file that is still being written returns the part
    written so far: a large message (trained_drafter's carries its training curves as a PNG, ~100 KB)
    read while the workload writes it fails to parse, the reader thread stops, and that message and
    every later one are lost; the asset then records an empty materialization. This reader keeps a
    partial line until its newline arrives, and reports one left without a newline when the workload
    ends (it died while writing)."""

    POLL_SECONDS = 0.01

    @contextmanager
    def read_messages(self, handler: Any) -> Iterator[dict[str, Any]]:
        closed = threading.Event()
        with tempfile.TemporaryDirectory(prefix="speculators-pipes-") as folder:
            path = os.path.join(folder, "messages.jsonl")
            open(path, "wb").close()
            thread = threading.Thread(target=self._read, args=(path, handler, closed), daemon=True)
            thread.start()
            try:
                yield {
                    PipesDefaultMessageWriter.FILE_PATH_KEY: path,
                    PipesDefaultMessageWriter.INCLUDE_STDIO_IN_MESSAGES_KEY: False,
                }
            finally:
                closed.set()
                thread.join()

    def _read(self, path: str, handler: Any, closed: threading.Event) -> None:
        try:
            for line in whole_lines(path, closed.is_set, self.POLL_SECONDS):
                handler.handle_message(json.loads(line))
        except Exception:
            handler.report_pipes_framework_exception(f"{type(self).__name__} reader thread", sys.exc_info())

    def no_messages_debug_text(self) -> str:
        return "Attempted to read messages from a temporary file, one whole line at a time."


def whole_lines(path: str, should_stop: Callable[[], bool], poll_seconds: float = 0.01) -> Iterator[str]:
    """The lines appended to `path` until `should_stop()`, each yielded once its newline is written.
    The file is read once more after `should_stop()` turns true, so nothing written before is missed."""
    pending = b""
    with open(path, "rb") as stream:
        while True:
            stopping = should_stop()  # read before the last read: what was written before it is read
            chunk = stream.read()
            if chunk:
                *complete, pending = (pending + chunk).split(b"\n")
                for line in complete:
                    if line.strip():
                        yield line.decode("utf-8")
                continue
            if stopping:
                break
            time.sleep(poll_seconds)
    if pending.strip():
        raise ValueError(
            f"the workload's last Pipes message ends without a newline ({len(pending)} bytes: it stopped "
            f"while writing it); the step's log says why"
        )


def spool_mount(variant: Variant, step: str, root: str) -> str | None:
    """Where a streamed variant's trained_drafter pod mounts its spool volume: hidden_states.spool, unless
    that lies on the storage claim (under `root`, or left out: the run's folder) and needs no volume of its
    own; None for every other step and variant."""
    hidden = variant.hidden_states
    if step != TRAINED_DRAFTER or not hidden.streamed or hidden.spool is None:
        return None
    spool, storage = PurePosixPath(hidden.spool), PurePosixPath(root)
    if spool == storage or storage in spool.parents:
        return None
    return str(spool)


def spool_size(variant: Variant) -> str:
    """The spool volume's size limit as a Kubernetes quantity: hidden_states.spool_gib (in Gi, else in whole Mi). The
    supervisor keeps the spool under that cap; the kubelet evicts a pod whose memory volume outgrows it. A
    memory volume counts against the pod's memory: the profile's `memory` must hold the spool too."""
    gib = variant.hidden_states.spool_gib
    return f"{int(gib)}Gi" if gib == int(gib) else f"{math.ceil(gib * 1024)}Mi"


class PipelineRunner(dg.ConfigurableResource):
    """`local` (subprocess) or `k8s` (one pod per heavy step), both through Dagster Pipes."""

    mode: str = Settings.runner
    python: str = sys.executable  # local: the interpreter that runs workloads
    # k8s (defaults: environment.py)
    namespace: str = Settings.k8s_namespace
    workload_image: str = Settings.workload_image
    image_pull_policy: str = "IfNotPresent"
    storage_claim: str = Settings.storage_claim  # ReadWriteMany claim mounted at the storage root
    plan_secret: str = Settings.plan_secret  # the Secret (key `secret`) of multi-node steps' plan secret
    service_account: str = "speculators-pipes"
    load_incluster_config: bool = True

    def workload_command(self) -> list[str]:
        """The workload reads its step, variant and storage root from the Pipes extras."""
        python = self.python if self.mode == "local" else "python"
        return [python, "-m", "speculators_assets.workload"]

    def run(
        self,
        context: dg.AssetExecutionContext,
        variant: Variant,
        step: str,
        root: str,
        extras: dict[str, Any] | None = None,
    ) -> dg.PipesClientCompletedInvocation:
        """Run `step` of `variant` on artifacts under `root` (k8s: the claim is mounted there)."""
        profile = variant.profile(step)
        command = self.workload_command()
        context.log.info(f"{step} for {variant.name} ({self.mode} runner): {' '.join(command)}")
        if profile.nodes > 1:
            raise dg.Failure(
                f"variant {variant.name} runs {step} on {profile.nodes} nodes; this runner starts one pod per step: "
                f"the step's pods are rendered (PipelineRunner.node_pods) but not launched, so start them with a "
                f"multi-node controller (e.g. a LeaderWorkerSet) or give the step one node"
            )
        if self.mode == "local":
            available = local_gpu_count()
            if profile.gpus > available:
                raise dg.Failure(
                    f"variant {variant.name} needs {profile.gpus} GPU(s) for {step} but this machine has "
                    f"{available}; run it with the k8s runner (SPECULATORS_RUNNER=k8s) or pick a CPU variant"
                )
            with known_preview_quiet():
                client = dg.PipesSubprocessClient(message_reader=WholeLineMessageReader())
                return client.run(context=context, command=command, extras=extras)
        if self.mode == "k8s":
            from dagster_k8s import PipesK8sClient

            client = PipesK8sClient(load_incluster_config=self.load_incluster_config)
            with known_preview_quiet():
                return client.run(
                    context=context,
                    command=command,
                    namespace=self.namespace,
                    extras=extras,
                    base_pod_spec=self.pod_spec(variant, step, root),
                    base_pod_meta={
                        "labels": {
                            "app.kubernetes.io/part-of": "speculators-pipeline",
                            "speculators/variant": variant.name,
                            "speculators/step": step,
                        }
                    },
                )
        raise dg.Failure(f"runner mode '{self.mode}' is not local or k8s; set SPECULATORS_RUNNER to one of them")

    def pod_spec(self, variant: Variant, step: str, root: str) -> dict[str, Any]:
        """The pod spec (Kubernetes API field names) for one step of a variant; the storage claim is
        mounted at `root`, the storage root the workload is given."""
        profile: ComputeProfile = variant.profile(step)
        requests: dict[str, str] = {}
        limits: dict[str, str] = {}
        if profile.cpu:
            requests["cpu"] = profile.cpu
        if profile.memory:
            requests["memory"] = limits["memory"] = profile.memory
        if profile.gpus:
            requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(profile.gpus)
        env = [
            {"name": name, "valueFrom": {"secretKeyRef": {"name": ref.secret, "key": ref.key}}}
            for name, ref in sorted(profile.env_from_secrets.items())
        ]
        env.append({"name": "SPECULATORS_STORAGE_ROOT", "value": root})
        container: dict[str, Any] = {
            "name": WORKLOAD_CONTAINER,
            "image": profile.image or self.workload_image,
            "imagePullPolicy": self.image_pull_policy,
            "env": env,
            "resources": {"requests": requests, "limits": limits},
            "volumeMounts": [
                {"name": "storage", "mountPath": root},
                {"name": "dshm", "mountPath": "/dev/shm"},
            ],
        }
        spec: dict[str, Any] = {
            "serviceAccountName": self.service_account,
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": [
                {"name": "storage", "persistentVolumeClaim": {"claimName": self.storage_claim}},
                # NCCL and torch DataLoader workers need more shared memory than the 64 MiB default.
                {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            ],
        }
        spool = spool_mount(variant, step, root)
        if spool is not None:
            container["volumeMounts"].append({"name": "spool", "mountPath": spool})
            memory = {"medium": "Memory", "sizeLimit": spool_size(variant)}
            spec["volumes"].append({"name": "spool", "emptyDir": memory})
        if profile.node_selector:
            spec["nodeSelector"] = dict(profile.node_selector)
        if profile.tolerations:
            spec["tolerations"] = [dict(t) for t in profile.tolerations]
        return spec

    def node_pods(self, variant: Variant, step: str, root: str) -> list[dict[str, Any]]:
        """A multi-node step's pods (metadata and spec), node rank 0 first, each on its own node with the
        profile's GPUs, resources and placement, named `<group>-<rank>` under the headless Service
        `node_service` (so rank 0 is `<group>-0.<group>` to the others). Rank 0 runs the workload, whose
        commands start each vLLM engine with the node group `ComputeProfile.node_group(0, ...)`; ranks 1..
        run `speculators follow` with their own rank of the same group: it starts vLLM's headless workers
        of every engine rank 0 starts, with the engine arguments rank 0 serves (speculators/serving/multinode.py),
        and ends when rank 0's step ends. Every pod gets the node group's plan secret from the Secret
        `plan_secret` (key `secret`) as SPECULATORS_PLAN_SECRET: rank 0 signs its plan with it and the
        followers take only a plan so signed (speculators/serving/plan_trust.py)."""
        from speculators.flags import to_argv
        from speculators.serving.plan_trust import PLAN_SECRET_ENV
        from speculators.settings import MultiNode

        profile = variant.profile(step)
        group, master = node_group_name(variant.name, step), master_address(variant.name, step)
        pods = []
        for rank in range(profile.nodes):
            spec = self.pod_spec(variant, step, root)
            spec["hostname"], spec["subdomain"] = f"{group}-{rank}", group
            container = spec["containers"][0]
            container["env"] += [
                {"name": "SPECULATORS_NODE_RANK", "value": str(rank)},
                {"name": "SPECULATORS_MASTER_ADDR", "value": master},
                {"name": PLAN_SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": self.plan_secret, "key": "secret"}}},
            ]
            if rank:
                nodes = MultiNode(**profile.node_group(rank, master))
                container["command"] = ["python", "-m", "speculators.cli", "follow", *to_argv(nodes)]
            labels = {"speculators/node-group": group, "speculators/node-rank": str(rank)}
            pods.append({"metadata": {"name": f"{group}-{rank}", "labels": labels}, "spec": spec})
        return pods

    def node_service(self, variant: Variant, step: str) -> dict[str, Any]:
        """The headless Service that gives a multi-node step's pods their DNS names."""
        group = node_group_name(variant.name, step)
        return {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": group},
            # (rank 0's name resolves before its pod is ready: the other nodes reach it while it starts)
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"speculators/node-group": group},
            },
        }
