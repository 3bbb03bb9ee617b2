"""Dagster code location of the speculators pipeline (the asset graph lands in its own issue).

Kept import-light: nothing here imports torch or the heavy parts of the library, so the code
location loads in seconds.
"""

from speculators_assets.definitions import defs

__all__ = ["defs"]
