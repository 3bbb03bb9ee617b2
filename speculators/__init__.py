"""speculators pipeline: EAGLE-3 draft models for vLLM (library part; never imports Dagster)."""

__version__ = "0.1.0"

# The format version written into config.json (`speculators_version`); the reference
# `speculators` library reads checkpoints that carry its own version string here.
SPECULATORS_FORMAT_VERSION = "0.9.0"
