"""Prompt sources: what a source name means and the rows it gives.

A source is a local file or folder (JSONL, JSON, Parquet), `hf:<preset or dataset id>` (a Hugging Face
dataset, streamed), `demo:train` / `demo:eval` (generated prompts), `demo-vl:train` / `demo-vl:eval`
(generated image prompts), a built-in file (`natural:eval`, `natural:validation`) or a packaged data set
(`sharegpt`, `mt-bench`'s first turns). source_kind decides which, once for every reader of sources;
source_fingerprint hashes a source's content cheaply enough to poll.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from speculators.data.demo_images import demo_image_rows
from speculators.data.demo_prompts import BUILTIN_SOURCES, demo_prompts
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import MT_BENCH, PACKAGED_SOURCES, packaged_file
from speculators.data.rows import iter_file_rows, open_source_file
from speculators.errors import SpeculatorsError

# Hugging Face dataset presets for users with network: name -> (dataset id, subset, split).
HF_PRESETS = {
    "sharegpt": ("anon8231489123/ShareGPT_Vicuna_unfiltered", None, "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", None, "train_sft"),
}


def iter_hf_rows(name: str, subset: str | None, split: str | None) -> Iterator[tuple[str, Any]]:
    import datasets

    dataset_id, preset_subset, preset_split = HF_PRESETS.get(name, (name, None, "train"))
    try:
        data = datasets.load_dataset(dataset_id, subset or preset_subset, split=split or preset_split, streaming=True)
    except Exception as error:  # network, auth, missing dataset: one clear line
        raise SpeculatorsError(
            f"could not load dataset '{dataset_id}' ({str(error).splitlines()[0]}); check the name and network, "
            f"or pass a local file"
        ) from None
    for index, row in enumerate(data):
        yield f"{dataset_id}[{index}]", row


SourceKind = Literal["builtin", "mt-bench", "packaged", "demo-vl", "demo", "hf", "local"]


def source_kind(source: str) -> SourceKind:
    """What a prompt source names, decided here once for every reader of sources: a built-in file
    (`natural:eval`), MT-Bench's questions, another packaged data set (`sharegpt`), generated rows
    (`demo-vl:*`, `demo:*`), a dataset (`hf:*`), or a local file or folder."""
    if source in BUILTIN_SOURCES:
        return "builtin"
    if source == MT_BENCH:
        return "mt-bench"
    if source in PACKAGED_SOURCES:
        return "packaged"
    if source.startswith("demo-vl"):
        return "demo-vl"
    if source.startswith("demo"):
        return "demo"
    if source.startswith("hf:"):
        return "hf"
    return "local"


def local_source_path(source: str) -> Path:
    """A local source's file or folder, or one error when it does not exist."""
    path = Path(source).expanduser()
    if not path.exists():
        raise SpeculatorsError(f"prompt source {source} does not exist; pass a file, hf:<dataset> or demo:train")
    return path


def iter_source_rows(
    source: str, hf_subset: str | None = None, hf_split: str | None = None, seed: int = 0
) -> Iterator[tuple[str, Any, Path | None]]:
    """(location, row, base_dir) for each row of a source: a local file or folder, `hf:<preset or
    dataset id>`, `demo:train` / `demo:eval`, `demo-vl:train` / `demo-vl:eval`, a built-in file
    (`natural:eval`) or a packaged data set (`sharegpt`, `mt-bench`'s first turns). `base_dir` is the
    folder relative image paths resolve against: the row's file's folder, None for datasets, packaged
    data sets and generated rows."""
    kind = source_kind(source)
    if kind == "builtin":
        for _, row in iter_file_rows(BUILTIN_SOURCES[source]):
            yield row["id"], row, BUILTIN_SOURCES[source].parent
    elif kind == "mt-bench":
        for question in mt_bench_questions():
            turn = question.first_turn()
            yield turn.id, {"id": turn.id, "category": turn.category, "messages": turn.messages}, None
    elif kind == "packaged":
        for location, row in iter_file_rows(packaged_file(source)):
            yield location, row, None
    elif kind == "demo-vl":
        split = demo_vl_split(source)
        for index, row in enumerate(demo_image_rows(split, seed=seed)):
            yield f"demo-vl-{split}[{index}]", row, None
    elif kind == "demo":
        split = source.partition(":")[2] or "train"
        if split not in ("train", "eval"):
            raise SpeculatorsError(f"demo split '{split}' is not train or eval; use demo:train or demo:eval")
        for index, prompt in enumerate(demo_prompts(split, seed=seed)):
            yield f"demo-{split}[{index}]", {"prompt": prompt}, None
    elif kind == "hf":
        for location, row in iter_hf_rows(source.removeprefix("hf:"), hf_subset, hf_split):
            yield location, row, None
    else:
        path = local_source_path(source)
        suffixes = (".jsonl", ".json", ".parquet")
        files = sorted(p for p in path.iterdir() if p.suffix in suffixes) if path.is_dir() else [path]
        for file in files:
            base_dir = file.parent.resolve()
            for location, row in iter_file_rows(file):
                yield location, row, base_dir


def is_local_source(source: str) -> bool:
    """Whether a source names a local file or folder (not hf:, demo, demo-vl, a built-in file or a
    packaged data set)."""
    return source_kind(source) == "local"


def source_image_root(source: str) -> Path:
    """The folder a source's rows may name local images in without --image-root: a file source's
    folder, a folder source itself, the working directory for hf: and generated rows."""
    if source_kind(source) == "builtin":
        return BUILTIN_SOURCES[source].parent
    if not is_local_source(source):
        return Path.cwd().resolve()
    path = Path(source).expanduser().resolve()
    return path if path.is_dir() else path.parent


def demo_vl_split(source: str) -> str:
    prefix, _, split = source.partition(":")
    if prefix != "demo-vl" or split not in ("train", "eval"):
        raise SpeculatorsError(f"demo-vl source '{source}' is not demo-vl:train or demo-vl:eval; use one of those")
    return split


def source_fingerprint(source: str) -> str:
    """Content hash of a prompt source, cheap enough to poll: file bytes, the demo prompt set, or
    for `hf:` the dataset spec itself (pin a revision in the name to make that meaningful)."""
    digest = hashlib.sha256(source.encode())
    kind = source_kind(source)
    if kind == "builtin":
        digest.update(BUILTIN_SOURCES[source].read_bytes())
    elif kind in ("mt-bench", "packaged"):  # (ShareGPT's 125 MB hash in about a third of a second)
        with open_source_file(packaged_file(source)) as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    elif kind == "demo-vl":
        rows = demo_image_rows(demo_vl_split(source))
        digest.update("\n".join(json.dumps(row, sort_keys=True) for row in rows).encode())
    elif kind == "demo":
        split = source.partition(":")[2] or "train"
        digest.update("\n".join(demo_prompts(split)).encode())
    elif kind == "local":
        path = local_source_path(source)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode())
            with open_source_file(file) as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]
