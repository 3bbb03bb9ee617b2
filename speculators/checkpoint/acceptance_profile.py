"""`acceptance_profile.json`: the served acceptance a speculator checkpoint was measured at, shipped beside
its `config.json`.

vLLM ignores the file (it reads config.json and the weights), so `vllm serve <checkpoint>` works as
before. It is built from a `speculators bench` report (report.json): the headline acceptance per draft
position, the per-category acceptance where the prompts had categories (MT-Bench beside the eval prompts
first), and, where bench ran its load sweep, the step costs and measured speed-ups at each concurrency and
the K to serve at each (`load.recommended_k`). `speculators validate` checks it (profile_problems) and
`speculators serve --serving-concurrency N` serves the K it recommends at N (recommended_k).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from speculators.atomic_io import write_text_atomic
from speculators.errors import SpeculatorsError
from speculators.settings import MAX_DRAFT_TOKENS

PROFILE_FILE = "acceptance_profile.json"
PROFILE_FORMAT = "speculators-acceptance-profile"
PROFILE_VERSION = 1
ALGORITHMS = ("eagle3", "peagle", "dflash")
TOLERANCE = 1e-6  # acceptance length against 1 + the per-position rates (floats summed in another order)
# A Hugging Face cache snapshot: .../models--org--name/snapshots/<commit sha>/
SNAPSHOT = re.compile(r"/snapshots/(?P<sha>[0-9a-f]{40})/?$")
HOW_TO_MEASURE = "speculators bench ... --attach-profile"


# ----- building ----------------------------------------------------------------------------------


def verifier_identity(verifier: str | Path) -> tuple[str | None, str | None]:
    """(weights fingerprint, hub commit sha) of a verifier as far as this machine knows them without the
    network: a local directory's fingerprint, a GGUF file's through its converted copy, a hub id's from its
    cached snapshot; the commit sha where the directory is a Hugging Face cache snapshot. Unknown: None."""
    from speculators.verifier.loading import convert_gguf_to_hf, resolve_verifier_source, weights_fingerprint

    try:
        kind, location = resolve_verifier_source(verifier)
        if kind == "gguf":
            directory = convert_gguf_to_hf(location)  # (bench converted it already: cached)
        elif kind == "hub":
            from huggingface_hub import snapshot_download

            directory = Path(snapshot_download(location, local_files_only=True))
        else:
            directory = Path(location)
    except Exception:  # offline and not cached, a damaged file: the profile says "unknown", never fails
        return None, None
    snapshot = SNAPSHOT.search(str(directory))
    try:
        fingerprint: str | None = weights_fingerprint(directory)
    except Exception:  # a Mistral-format folder, no weight files: unknown
        fingerprint = None
    return fingerprint, snapshot["sha"] if snapshot else None


def category_columns(report: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The per-category acceptance columns and which prompts they came from: MT-Bench's where it was
    measured beside the eval prompts, else the eval prompts' own categories, else none."""
    mt_bench = report.get("mt_bench") or {}
    for part in (mt_bench, report):
        columns = (part.get("per_category") or {}).get("columns")
        if columns:
            source = (part.get("prompts") or {}).get("source")
            return columns, "mt-bench" if part is mt_bench else (str(source) if source else None)
    return {}, None


def load_section(sweep: dict[str, Any] | None) -> dict[str, Any] | None:
    """The profile's `load`: the sweep's step costs and speed-ups, and the K it chose at each concurrency."""
    if not sweep:
        return None
    return {
        "concurrency": sweep["concurrency"],
        "step_cost_ratio": sweep["step_cost_ratio"],
        "predicted_speedup": sweep["predicted_speedup"],
        "speedup": sweep["speedup"],
        "recommended_k": {c: best["chosen"] for c, best in sweep["best_k"].items()},
        "break_even_concurrency": sweep["break_even_concurrency"],
    }


def profile_from_report(report: dict[str, Any], checkpoint_dir: str | Path, verifier: str | Path) -> dict[str, Any]:
    """The acceptance profile of the checkpoint in `checkpoint_dir` from a bench report of it (report.json's
    content) served with `verifier` (what bench served: a hub id, directory or GGUF file)."""
    from speculators.models.algorithms import read_speculator_checkpoint

    config = read_speculator_checkpoint(checkpoint_dir).config
    fingerprint, revision = verifier_identity(verifier)
    acceptance = report["acceptance"]
    columns, category_source = category_columns(report)
    settings = report.get("settings") or {}
    prompts = report.get("prompts") or {}
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "algorithm": config.speculators_model_type,
        "num_speculative_tokens": config.speculative_tokens,
        "verifier": {
            "name": config.speculators_config.verifier.name_or_path,
            "fingerprint": fingerprint,
            "revision": revision,
        },
        "measured": {
            # (report.json holds no date of its own: the profile is built right after the report is written)
            "date": report.get("date") or datetime.now(UTC).date().isoformat(),
            "versions": report.get("versions") or {},
            "hardware": report.get("hardware") or {},
            "dtype": settings.get("dtype"),
            "length": acceptance.get("length", "fixed"),
            "temperature": 0,
            "served_k": settings.get("num_speculative_tokens") or config.speculative_tokens,
        },
        "prompts": {key: prompts.get(key) for key in ("source", "count", "data_version")},
        "acceptance_length": acceptance["acceptance_length"],
        "acceptance_per_position": acceptance["acceptance_per_position"],
        "drafts": acceptance.get("drafts"),
        "per_category": {
            name: {
                "acceptance_length": column["acceptance_length"],
                "acceptance_per_position": column["acceptance_per_position"],
                "prompts": column["prompts"],
            }
            for name, column in columns.items()
            if name != "overall"
        },
        "per_category_prompts": category_source,
        "load": load_section(report.get("load_sweep")),
    }


# ----- reading and writing ------------------------------------------------------------------------


def write_profile(folder: str | Path, profile: dict[str, Any]) -> Path:
    """`folder`/acceptance_profile.json, written atomically (nothing else in the folder is touched)."""
    return write_text_atomic(Path(folder) / PROFILE_FILE, json.dumps(profile, indent=2) + "\n")


def read_profile(folder: str | Path) -> dict[str, Any] | None:
    """The profile in `folder`; None where there is none; one-line SpeculatorsError where the file is not a
    JSON object."""
    path = Path(folder) / PROFILE_FILE
    if not path.is_file():
        return None
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        first = (str(error).splitlines() or [""])[0]
        raise SpeculatorsError(f"{path} is not readable JSON ({first}); rebuild it with {HOW_TO_MEASURE}") from None
    if not isinstance(profile, dict):
        raise SpeculatorsError(f"{path} holds a JSON {type(profile).__name__}, not an object; rebuild it")
    return profile


def write_bench_profile(
    report: dict[str, Any], report_folder: str | Path, speculator: str | Path, verifier: str | Path, attach: bool
) -> dict[str, Any]:
    """bench's last step: the profile of its report into the report folder and, with `attach`
    (--attach-profile), into the speculator checkpoint too; a profile with problems is not attached (a
    one-line error once the report folder holds it)."""
    from speculators.models.algorithms import read_speculator_checkpoint

    profile = profile_from_report(report, speculator, verifier)
    path = write_profile(report_folder, profile)
    print(f"[bench] acceptance profile: {path}", flush=True)
    if attach:
        config = read_speculator_checkpoint(speculator).config
        problems = profile_problems(profile, config, profile["verifier"]["fingerprint"])
        if problems:
            raise SpeculatorsError(
                f"the acceptance profile in {path} was not attached to {speculator}: {problems[0]}"
                + (f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else "")
            )
        print(f"[bench] attached it to the checkpoint: {write_profile(speculator, profile)}", flush=True)
    return profile


# ----- checking -----------------------------------------------------------------------------------


def rates_problems(what: str, length: Any, rates: Any, served_k: int | None) -> list[str]:
    """An acceptance (overall or one category's): K rates in [0, 1], non-increasing (accepted drafts are a
    prefix: position i is accepted only with every position before it), length = 1 + their sum."""
    if not isinstance(rates, list) or not all(isinstance(r, int | float) for r in rates):
        return [f"{what}: acceptance_per_position {rates!r} is not a list of numbers"]
    problems = []
    if served_k is not None and len(rates) != served_k:
        problems.append(f"{what}: {len(rates)} acceptance rates for served K {served_k}; give one per draft position")
    outside = [r for r in rates if not 0 <= r <= 1]
    if outside:
        problems.append(f"{what}: acceptance rates {outside} lie outside [0, 1]")
    rises = [i + 2 for i in range(len(rates) - 1) if rates[i + 1] > rates[i] + TOLERANCE]
    if rises:
        problems.append(f"{what}: the acceptance rate rises at positions {rises}; rates must not increase")
    if not isinstance(length, int | float) or abs(length - (1 + sum(rates))) > TOLERANCE:
        problems.append(f"{what}: acceptance_length {length!r} is not 1 + the sum of its rates ({1 + sum(rates):.6f})")
    return problems


def load_problems(load: Any, served_k: int | None) -> list[str]:
    """The load section: positive integer concurrencies, each recommended K in 0..served K."""
    if load is None:
        return []
    if not isinstance(load, dict) or not isinstance(load.get("recommended_k"), dict):
        return ["load: has no recommended_k object (concurrency -> K)"]
    problems = []
    bad = [c for c in [*load.get("concurrency", []), *load["recommended_k"]] if not positive_int(c)]
    if bad:
        problems.append(f"load: concurrencies {bad} are not positive integers")
    # (a served K that is itself wrong is its own problem: the Ks are then checked for being Ks at all)
    top = served_k if served_k is not None else MAX_DRAFT_TOKENS
    wrong = {c: k for c, k in load["recommended_k"].items() if not (isinstance(k, int) and 0 <= k <= top)}
    if wrong:
        problems.append(f"load: recommended K {wrong} outside 0..{top} (served K)")
    return problems


def positive_int(value: Any) -> bool:
    text = str(value)
    return text.isdigit() and int(text) > 0


def identity_problems(profile: dict[str, Any], config: Any, verifier_fingerprint: str | None) -> list[str]:
    """The profile against the checkpoint it sits in (algorithm, verifier name) and the given verifier."""
    problems = []
    if profile.get("algorithm") != config.speculators_model_type:
        problems.append(
            f"algorithm {profile.get('algorithm')!r} is not the checkpoint's {config.speculators_model_type!r}; "
            f"the profile was measured on another drafter"
        )
    recorded = profile.get("verifier")
    verifier: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    name = config.speculators_config.verifier.name_or_path
    if verifier.get("name") != name:
        problems.append(f"verifier {verifier.get('name')!r} is not the checkpoint's verifier {name!r}")
    measured = verifier.get("fingerprint")
    if measured and verifier_fingerprint and measured != verifier_fingerprint:
        problems.append(
            f"measured on verifier weights {measured}, but the given verifier's are {verifier_fingerprint}; "
            f"measure again with {HOW_TO_MEASURE}"
        )
    return problems


def profile_problems(profile: dict[str, Any], config: Any, verifier_fingerprint: str | None = None) -> list[str]:
    """What is wrong with an acceptance profile, one line each, against the checkpoint's config (an
    algorithm config: speculators_model_type, speculators_config.verifier.name_or_path) and, where known,
    the verifier's weights fingerprint."""
    if profile.get("format") != PROFILE_FORMAT or profile.get("version") != PROFILE_VERSION:
        return [
            f"format {profile.get('format')!r} version {profile.get('version')!r} is not "
            f"{PROFILE_FORMAT!r} version {PROFILE_VERSION}; rebuild it with {HOW_TO_MEASURE}"
        ]
    problems = identity_problems(profile, config, verifier_fingerprint)
    served_k = object_at(profile, "measured").get("served_k")
    if not (isinstance(served_k, int) and served_k >= 1):
        problems.append(f"measured.served_k {served_k!r} is not a K of at least 1")
        served_k = None
    problems += rates_problems(
        "overall", profile.get("acceptance_length"), profile.get("acceptance_per_position"), served_k
    )
    categories = profile.get("per_category") or {}
    if not isinstance(categories, dict):
        return [*problems, "per_category is not an object (category -> acceptance)"]
    for name, column in categories.items():
        column = column if isinstance(column, dict) else {}
        problems += rates_problems(
            f"category {name}", column.get("acceptance_length"), column.get("acceptance_per_position"), served_k
        )
    return problems + load_problems(profile.get("load"), served_k)


def object_at(profile: dict[str, Any], key: str) -> dict[str, Any]:
    """profile[key] where it is a JSON object, else {} (its fields then read as missing)."""
    value = profile.get(key)
    return value if isinstance(value, dict) else {}


# ----- using --------------------------------------------------------------------------------------


def recommended_k(profile: dict[str, Any], concurrency: int) -> int:
    """The K the profile recommends at `concurrency` streams: the recommendation at the largest swept
    concurrency not above it (the speed-up of a drafter only falls as the batch grows)."""
    load = profile.get("load")
    if not load:
        raise SpeculatorsError(
            f"the acceptance profile has no load section (bench ran no concurrency sweep); make one with "
            f"{HOW_TO_MEASURE} and --concurrency, or pass -k"
        )
    if concurrency < 1:
        raise SpeculatorsError(f"serving concurrency {concurrency} must be at least 1")
    return int(load["recommended_k"][str(swept_concurrency(profile, concurrency))])


def swept_concurrency(profile: dict[str, Any], concurrency: int) -> int:
    """The swept concurrency recommended_k reads at `concurrency`: the largest one not above it."""
    swept = sorted(int(c) for c in profile["load"]["recommended_k"])
    if not swept or swept[0] > concurrency:
        raise SpeculatorsError(f"the acceptance profile's sweep starts at concurrency {swept[:1]}; measure c = 1 too")
    return max(c for c in swept if c <= concurrency)


def predicted_speedup(profile: dict[str, Any], k: int, concurrency: int) -> float | None:
    """The profile's predicted speed-up of K = `k` at the swept concurrency recommended_k reads (1 at K = 0)."""
    if k == 0:
        return 1.0
    at = str(swept_concurrency(profile, concurrency))
    value = profile["load"]["predicted_speedup"].get(str(k), {}).get(at)
    return float(value) if value is not None else None


def profile_summary(profile: dict[str, Any]) -> str:
    """validate's line: "AL 2.31 on mt-bench (16 prompts), K by concurrency: 1->3, 4->2, 16->0"."""
    prompts = object_at(profile, "prompts")
    length = profile.get("acceptance_length")
    shown = f"{length:.2f}" if isinstance(length, int | float) else repr(length)
    line = f"AL {shown} on {prompts.get('source')} ({prompts.get('count')} prompts)"
    load = profile.get("load")
    if isinstance(load, dict) and isinstance(load.get("recommended_k"), dict):
        by_c = sorted(load["recommended_k"].items(), key=lambda item: concurrency_order(item[0]))
        line += ", K by concurrency: " + ", ".join(f"{c}->{k}" for c, k in by_c)
    return line


def k_at_serving_concurrency(
    speculator: str | Path | None, num_speculative_tokens: int | None, concurrency: int
) -> tuple[int, str]:
    """`speculators serve --serving-concurrency N`: the K the checkpoint's acceptance profile recommends at
    N concurrent streams, and the line that says why (its predicted speed-up). A profile that is missing or
    invalid, a K of 0 (the drafter does not pay at that load), or -k given as well: one-line errors."""
    from speculators.models.algorithms import read_speculator_checkpoint

    flag = f"--serving-concurrency {concurrency}"
    if speculator is None:
        raise SpeculatorsError(f"{flag} picks a speculator's K from its acceptance profile; pass --speculator")
    if num_speculative_tokens is not None:
        raise SpeculatorsError(
            f"pass -k {num_speculative_tokens} or {flag}, not both: the flag chooses K from the acceptance profile"
        )
    profile = read_profile(speculator)
    if profile is None:
        raise SpeculatorsError(
            f"{speculator} has no {PROFILE_FILE}; make one with `speculators bench ... --attach-profile` or pass -k"
        )
    problems = profile_problems(profile, read_speculator_checkpoint(speculator).config)
    if problems:
        raise SpeculatorsError(
            f"{speculator}/{PROFILE_FILE} is not usable ({problems[0]}); run `speculators validate {speculator}`"
        )
    k = recommended_k(profile, concurrency)
    at = swept_concurrency(profile, concurrency)
    served_k = profile["measured"]["served_k"]
    main = predicted_speedup(profile, served_k, concurrency)
    main_text = f"{main:.2f}x" if main is not None else "not measured"
    if k == 0:
        raise SpeculatorsError(
            f"at {concurrency} concurrent streams the drafter does not pay: the acceptance profile recommends K = 0 "
            f"(measured up to c = {at}; K = {served_k} predicts {main_text}); serve the verifier alone (omit "
            f"--speculator) or pass -k to serve the drafter anyway"
        )
    chosen = predicted_speedup(profile, k, concurrency)
    chosen_text = f"{chosen:.2f}x" if chosen is not None else "not measured"
    return k, (
        f"serving K = {k} for {concurrency} concurrent streams: the acceptance profile's choice at c = {at}, "
        f"predicted speed-up {chosen_text} over the verifier alone (K = {served_k}: {main_text})"
    )


def concurrency_order(key: Any) -> tuple[bool, int, str]:
    """Concurrency keys in numeric order, anything else (a problem validate names) after them."""
    text = str(key)
    return (not positive_int(text), int(text) if positive_int(text) else 0, text)
