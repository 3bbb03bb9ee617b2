"""The code location's Definitions. Empty until the asset lineage is built (issue: Dagster code location)."""

import dagster as dg

defs = dg.Definitions()
