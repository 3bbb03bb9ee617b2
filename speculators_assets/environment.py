"""The code location's environment, read in one place: each variable, its default and its meaning.

`Settings.from_env()` reads them; definitions.py (runner, storage, schedule) and variants.py (more
variant files) use it. Import-light: no Dagster, no torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

RUNNERS = ("local", "k8s")
LOCAL_STORAGE_ROOT = ".speculators-storage"  # relative to the working directory, resolved to absolute
K8S_STORAGE_ROOT = "/data"  # where the claim is mounted in every pod


def variable(name: str, default: Any, meaning: str) -> Any:
    return field(default=default, metadata={"variable": name, "meaning": meaning})


@dataclass(frozen=True)
class Settings:
    """One field per environment variable (its name, default and meaning in the field's metadata)."""

    runner: str = variable(
        "SPECULATORS_RUNNER",
        "local",
        "how steps run: `local` (subprocesses on this machine) or `k8s` (one pod per step, through Dagster Pipes)",
    )
    storage_root: str = variable(
        "SPECULATORS_STORAGE_ROOT",
        "",  # the runner's: LOCAL_STORAGE_ROOT or K8S_STORAGE_ROOT
        "the root of the artifacts as the workload sees it (`<root>/<variant>/<asset>/...`). Local runner: a "
        f"directory (default `{LOCAL_STORAGE_ROOT}`, made absolute); k8s runner: the absolute path where the "
        f"storage claim is mounted in every step pod (default `{K8S_STORAGE_ROOT}`)",
    )
    variants_dir: str | None = variable(
        "SPECULATORS_VARIANTS_DIR", None, "a folder of more variant YAML files (a deployment's own, or tiny ones)"
    )
    automated_variants: tuple[str, ...] = variable(
        "SPECULATORS_AUTOMATED_VARIANTS",
        (),
        "comma-separated variants the retraining schedule considers (default: all)",
    )
    k8s_namespace: str = variable("SPECULATORS_K8S_NAMESPACE", "speculators", "k8s: the namespace of the step pods")
    workload_image: str = variable(
        "SPECULATORS_WORKLOAD_IMAGE",
        "speculators-pipeline-gpu:latest",
        "k8s: the step pods' image (a variant's compute profile may name another)",
    )
    storage_claim: str = variable(
        "SPECULATORS_STORAGE_CLAIM",
        "speculators-storage",
        "k8s: the ReadWriteMany claim mounted at the storage root in every step pod",
    )
    plan_secret: str = variable(
        "SPECULATORS_PLAN_SECRET_NAME",
        "speculators-plan-secret",
        "k8s: the Secret (key `secret`) every pod of a multi-node step gets as SPECULATORS_PLAN_SECRET, the node "
        "group's shared key for node rank 0's engine plan (create it with a random value: deploy/README.md)",
    )

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ValueError(f"SPECULATORS_RUNNER={self.runner} is not one of {', '.join(RUNNERS)}")
        if not self.storage_root:
            object.__setattr__(self, "storage_root", K8S_STORAGE_ROOT if self.runner == "k8s" else LOCAL_STORAGE_ROOT)
        if self.runner == "local":
            object.__setattr__(self, "storage_root", str(Path(self.storage_root).expanduser().resolve()))
        elif not self.storage_root.startswith("/"):
            raise ValueError(
                f"SPECULATORS_STORAGE_ROOT={self.storage_root} must be an absolute path with the k8s "
                f"runner: the claim is mounted there in every pod"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings from `environ` (default: os.environ); unset or empty variables take their default."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for item in fields(cls):
            raw = environ.get(item.metadata["variable"], "").strip()
            if not raw:
                continue
            if item.name == "automated_variants":
                values[item.name] = tuple(name.strip() for name in raw.split(",") if name.strip())
            else:
                values[item.name] = raw
        return cls(**values)
