"""acceptance_profile.json: built from a bench report, checked against its checkpoint and verifier, read
back by validate and serve's choice of K."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from speculators.checkpoint.acceptance_profile import (
    PROFILE_FILE,
    profile_from_report,
    profile_problems,
    profile_summary,
    read_profile,
    recommended_k,
    verifier_identity,
    write_bench_profile,
    write_profile,
)
from speculators.cli import main
from speculators.errors import SpeculatorsError
from speculators.models.algorithms import read_speculator_checkpoint
from speculators.verifier.loading import weights_fingerprint
from tests.unit.checkpoint.bench_reports import RATES, THROUGHPUT, bench_report, load_sweep, untrained_drafter


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir) -> Path:
    return Path(tiny_verifier_dir("llama"))


@pytest.fixture(scope="module")
def checkpoint(verifier, tmp_path_factory) -> Path:
    """An untrained K = 3 drafter for the tiny verifier, as `speculators init` writes it."""
    return untrained_drafter(verifier, tmp_path_factory.mktemp("profile") / "drafter")


@pytest.fixture
def drafter(checkpoint, tmp_path) -> Path:
    """A copy of the checkpoint a test may write its profile into."""
    return Path(shutil.copytree(checkpoint, tmp_path / "drafter"))


@pytest.fixture(scope="module")
def profile(checkpoint, verifier) -> dict:
    return profile_from_report(bench_report(sweep=load_sweep(RATES, THROUGHPUT)), checkpoint, verifier)


def config_of(folder: Path):
    return read_speculator_checkpoint(folder).config


def test_the_profile_carries_the_headline_acceptance_the_categories_and_the_checkpoints_identity(
    profile, checkpoint, verifier
):
    report = bench_report(sweep=load_sweep(RATES, THROUGHPUT))
    config = config_of(checkpoint)
    assert profile["format"] == "speculators-acceptance-profile" and profile["version"] == 1
    assert profile["algorithm"] == "eagle3" and profile["num_speculative_tokens"] == config.speculative_tokens == 3
    assert profile["verifier"] == {
        "name": config.speculators_config.verifier.name_or_path,
        "fingerprint": weights_fingerprint(verifier),
        "revision": None,  # (a local folder, not a hub snapshot)
    }
    assert profile["measured"]["served_k"] == 3 and profile["measured"]["length"] == "natural"
    assert profile["measured"]["dtype"] == "float32" and profile["measured"]["temperature"] == 0
    assert profile["measured"]["versions"] == report["versions"] and profile["measured"]["hardware"]["cpus"] == 2
    assert profile["prompts"] == {"source": "demo:eval", "count": 8, "data_version": "0123abcd"}
    assert profile["acceptance_per_position"] == report["acceptance"]["acceptance_per_position"]
    assert profile["acceptance_length"] == pytest.approx(1 + sum(RATES))
    assert profile["drafts"] == 400
    # MT-Bench's categories (measured beside the eval prompts), its `overall` column left out
    assert profile["per_category_prompts"] == "mt-bench"
    assert sorted(profile["per_category"]) == ["math", "writing"]
    assert profile["per_category"]["math"]["acceptance_per_position"] == [0.6, 0.3, 0.1]
    assert profile["per_category"]["math"]["acceptance_length"] == pytest.approx(2.0)
    assert profile_problems(profile, config, weights_fingerprint(verifier)) == []


def test_the_recommended_k_is_the_sweeps_choice_at_each_concurrency(profile):
    sweep = load_sweep(RATES, THROUGHPUT)
    load = profile["load"]
    assert load["recommended_k"] == {c: best["chosen"] for c, best in sweep["best_k"].items()}
    # the points were chosen so the drafter pays less as the load grows: K = 3, then 2, then the verifier alone
    assert load["recommended_k"] == {"1": 3, "4": 2, "16": 0}
    assert load["speedup"] == sweep["speedup"] and load["step_cost_ratio"] == sweep["step_cost_ratio"]
    assert load["break_even_concurrency"]["value"] == pytest.approx(sweep["break_even_concurrency"]["value"])
    assert 4 < load["break_even_concurrency"]["value"] < 16
    # between swept concurrencies: the recommendation at the largest one not above
    assert [recommended_k(profile, c) for c in (1, 2, 3, 4, 15, 16, 1000)] == [3, 3, 3, 2, 2, 0, 0]


def test_without_a_sweep_the_profile_has_no_load_and_recommends_nothing(checkpoint, verifier):
    profile = profile_from_report(bench_report(mt_bench=False), checkpoint, verifier)
    assert profile["load"] is None and profile["per_category"] == {} and profile["per_category_prompts"] is None
    with pytest.raises(SpeculatorsError, match=r"no load section .*speculators bench \.\.\. --attach-profile") as error:
        recommended_k(profile, 4)
    assert "\n" not in str(error.value)


def test_the_eval_prompts_own_categories_stand_in_where_mt_bench_did_not_run(checkpoint, verifier):
    report = bench_report(mt_bench=False)
    report["per_category"] = copy.deepcopy(bench_report()["mt_bench"]["per_category"])
    profile = profile_from_report(report, checkpoint, verifier)
    assert profile["per_category_prompts"] == "demo:eval" and sorted(profile["per_category"]) == ["math", "writing"]


def test_a_hub_snapshot_gives_the_revision_and_an_unreachable_hub_id_gives_nothing(verifier, tmp_path, monkeypatch):
    sha = "0123456789abcdef0123456789abcdef01234567"
    snapshot = shutil.copytree(verifier, tmp_path / "models--org--tiny" / "snapshots" / sha)
    assert verifier_identity(snapshot) == (weights_fingerprint(verifier), sha)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert verifier_identity("nobody-here/no-such-model") == (None, None)


def with_rates(path: list[str], rates: list[float]):
    """Rates set with a length that agrees with them (1 + their sum): only the rates are wrong."""

    def change(profile: dict) -> None:
        set_in([*path, "acceptance_per_position"], rates)(profile)
        set_in([*path, "acceptance_length"], 1 + sum(rates))(profile)

    return change


def profile_with(profile: dict, change) -> dict:
    changed = copy.deepcopy(profile)
    change(changed)
    return changed


def set_in(path: list[str], value):
    def change(profile: dict) -> None:
        target = profile
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (set_in(["format"], "something-else"), r"format 'something-else' version 1 is not 'speculators-acceptance"),
        (set_in(["version"], 2), r"version 2 is not .* version 1; rebuild it"),
        (set_in(["algorithm"], "dflash"), r"algorithm 'dflash' is not the checkpoint's 'eagle3'"),
        (set_in(["verifier", "name"], "org/other"), r"verifier 'org/other' is not the checkpoint's verifier"),
        (set_in(["measured", "served_k"], 0), r"measured.served_k 0 is not a K of at least 1"),
        (with_rates([], [0.8, 0.6]), r"overall: 2 acceptance rates for served K 3"),
        (with_rates([], [1.2, 0.6, 0.4]), r"overall: acceptance rates \[1.2\] lie outside"),
        (
            set_in(["acceptance_per_position"], [0.6, 0.8, 0.4]),
            r"overall: the acceptance rate rises at positions \[2\]",
        ),
        (set_in(["acceptance_length"], 2.5), r"overall: acceptance_length 2.5 is not 1 \+ the sum of its rates"),
        (set_in(["per_category", "math", "acceptance_length"], 3.0), r"category math: acceptance_length 3.0 is not"),
        (
            with_rates(["per_category", "writing"], [0.5, 0.7, 0.1]),
            r"category writing: the acceptance rate rises at positions \[2\]",
        ),
        (set_in(["load", "recommended_k", "4"], 5), r"load: recommended K \{'4': 5\} outside 0..3"),
        (set_in(["load", "recommended_k", "0"], 1), r"load: concurrencies \['0'\] are not positive integers"),
        (set_in(["load", "concurrency"], [1, -4]), r"load: concurrencies \[-4\] are not positive integers"),
    ],
)
def test_each_problem_of_a_profile_is_one_line_naming_it(profile, checkpoint, change, problem):
    problems = profile_problems(profile_with(profile, change), config_of(checkpoint))
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    assert re.search(problem, problems[0]), problems[0]


def test_a_profile_of_the_wrong_shapes_is_problems_never_an_exception(checkpoint):
    garbage = {
        "format": "speculators-acceptance-profile",
        "version": 1,
        "algorithm": "eagle3",
        "verifier": "someone",
        "measured": "yesterday",
        "prompts": [],
        "acceptance_per_position": "high",
        "per_category": [1],
        "load": {"recommended_k": {"x": "y"}},
    }
    problems = profile_problems(garbage, config_of(checkpoint))
    assert "verifier None is not the checkpoint's verifier" in problems[0]
    assert "measured.served_k None is not a K of at least 1" in problems
    assert "overall: acceptance_per_position 'high' is not a list of numbers" in problems
    assert "per_category is not an object (category -> acceptance)" in problems
    assert profile_summary(garbage) == "AL None on None (None prompts), K by concurrency: x->y"


def test_a_profile_measured_on_other_weights_is_a_problem_only_where_both_are_known(profile, checkpoint):
    config = config_of(checkpoint)
    (problem,) = profile_problems(profile, config, "f" * 24)
    assert f"but the given verifier's are {'f' * 24}" in problem
    assert profile_problems(profile_with(profile, set_in(["verifier", "fingerprint"], None)), config, "f" * 24) == []


def test_a_profile_reads_back_as_written_and_an_unreadable_one_is_one_line(profile, tmp_path):
    assert read_profile(tmp_path) is None
    write_profile(tmp_path, profile)
    assert read_profile(tmp_path) == profile
    assert [p.name for p in tmp_path.iterdir()] == [PROFILE_FILE]  # (no temporary file left behind)
    (tmp_path / PROFILE_FILE).write_text("{not json")
    with pytest.raises(SpeculatorsError, match=rf"{PROFILE_FILE} is not readable JSON") as error:
        read_profile(tmp_path)
    assert "\n" not in str(error.value)
    (tmp_path / PROFILE_FILE).write_text("[1, 2]")
    with pytest.raises(SpeculatorsError, match="holds a JSON list, not an object"):
        read_profile(tmp_path)


def test_bench_writes_the_profile_beside_its_report_and_attaches_it_only_when_asked(drafter, verifier, tmp_path):
    report = bench_report(sweep=load_sweep(RATES, THROUGHPUT))
    written = write_bench_profile(report, tmp_path / "report", drafter, verifier, attach=False)
    assert read_profile(tmp_path / "report") == written and read_profile(drafter) is None
    files = sorted(p.name for p in drafter.iterdir())
    write_bench_profile(report, tmp_path / "report", drafter, verifier, attach=True)
    assert read_profile(drafter) == written
    assert sorted(p.name for p in drafter.iterdir()) == sorted([*files, PROFILE_FILE])  # nothing else written


def test_bench_does_not_attach_a_profile_with_problems(drafter, verifier, tmp_path):
    report = bench_report()
    report["acceptance"]["acceptance_per_position"] = [0.1, 0.5, 0.2]  # rises: not a prefix acceptance
    with pytest.raises(SpeculatorsError, match=r"was not attached to .*: overall: the acceptance rate rises") as error:
        write_bench_profile(report, tmp_path / "report", drafter, verifier, attach=True)
    assert "\n" not in str(error.value)
    assert read_profile(tmp_path / "report") is not None and read_profile(drafter) is None


# ----- speculators validate ---------------------------------------------------------------------


def validate_output(folder: Path, capsys, *more: str) -> tuple[int, str]:
    code = main(["validate", str(folder), *more])
    return code, capsys.readouterr().out


def test_validate_says_when_a_checkpoint_has_no_profile(drafter, capsys):
    code, out = validate_output(drafter, capsys)
    assert code == 0 and "  acceptance profile: none" in out.splitlines()


def test_validate_summarizes_a_good_profile(drafter, profile, verifier, capsys):
    write_profile(drafter, profile)
    code, out = validate_output(drafter, capsys, "--verifier", str(verifier))
    assert code == 0, out
    line = "  acceptance profile: AL 2.80 on demo:eval (8 prompts), K by concurrency: 1->3, 4->2, 16->0"
    assert line in out.splitlines() and "PROBLEM" not in out


def test_validate_names_each_problem_of_a_profile(drafter, profile, capsys):
    write_profile(drafter, profile_with(profile, set_in(["acceptance_per_position"], [0.6, 0.8, 0.4])))
    code, out = validate_output(drafter, capsys)
    assert code == 1
    problems = [line for line in out.splitlines() if "PROBLEM" in line]
    assert problems == [
        f"  PROBLEM: {PROFILE_FILE}: overall: the acceptance rate rises at positions [2]; rates must not increase"
    ]


def test_validate_reports_a_profile_that_is_not_json_as_one_problem(drafter, capsys):
    (drafter / PROFILE_FILE).write_text("AL 2.3")
    code, out = validate_output(drafter, capsys, "--json")
    printed = json.loads(out)
    assert code == 1 and len(printed["problems"]) == 1
    assert printed["problems"][0].startswith(f"{PROFILE_FILE}: ") and "is not readable JSON" in printed["problems"][0]
    assert printed["summary"]["acceptance profile"] == "unreadable"
