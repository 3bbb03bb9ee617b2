"""Dagster code location of the speculators pipeline.

`defs` is built on first access, so `python -m speculators_assets.workload` (the Pipes workload in a
GPU pod) does not import Dagster. Nothing here imports torch: the code location loads in seconds.
"""

from typing import Any

__all__ = ["defs"]


def __getattr__(name: str) -> Any:
    if name == "defs":
        from speculators_assets.definitions import defs

        return defs
    raise AttributeError(f"module 'speculators_assets' has no attribute {name!r}")
