"""`speculators serve --serving-concurrency N`: K from the checkpoint's acceptance profile, resolved before
any vLLM starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import speculators.cli as cli
from speculators.checkpoint.acceptance_profile import (
    PROFILE_FILE,
    k_at_serving_concurrency,
    profile_from_report,
    write_profile,
)
from speculators.cli import main
from speculators.errors import SpeculatorsError
from tests.unit.checkpoint.bench_reports import RATES, THROUGHPUT, bench_report, load_sweep


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir) -> Path:
    return Path(tiny_verifier_dir("llama"))


@pytest.fixture(scope="module")
def profiled(verifier, tmp_path_factory) -> Path:
    """A K = 3 drafter with the profile of a sweep where K = 3 pays at c = 1, K = 2 at c = 4, none at 16."""
    output = tmp_path_factory.mktemp("serve-profile") / "drafter"
    assert main(["init", "--verifier", str(verifier), "--output", str(output), "--dtype", "float32"]) == 0
    write_profile(output, profile_from_report(bench_report(sweep=load_sweep(RATES, THROUGHPUT)), output, verifier))
    return output


def test_the_k_at_a_serving_concurrency_is_the_profiles_choice_with_its_predicted_speedup(profiled):
    sweep = load_sweep(RATES, THROUGHPUT)
    k, why = k_at_serving_concurrency(profiled, None, 1)
    assert k == sweep["best_k"]["1"]["chosen"] == 3
    assert f"predicted speed-up {sweep['predicted_speedup']['3']['1']:.2f}x over the verifier alone" in why
    k, why = k_at_serving_concurrency(profiled, None, 6)  # between swept 4 and 16: the choice at 4
    assert k == sweep["best_k"]["4"]["chosen"] == 2
    assert "choice at c = 4" in why
    assert (
        f"{sweep['predicted_speedup']['2']['4']:.2f}x" in why
        and f"(K = 3: {sweep['predicted_speedup']['3']['4']:.2f}x)" in why
    )


def test_where_the_drafter_does_not_pay_serve_says_so_and_how_to_serve_anyway(profiled):
    with pytest.raises(SpeculatorsError, match=r"does not pay.*K = 0.*serve the verifier alone.*pass -k") as error:
        k_at_serving_concurrency(profiled, None, 32)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("speculator", "k", "message"),
    [
        ("profiled", 3, r"pass -k 3 or --serving-concurrency 4, not both"),
        (None, None, r"--serving-concurrency 4 picks a speculator's K .*; pass --speculator"),
        ("bare", None, rf"has no {PROFILE_FILE}; make one with `speculators bench \.\.\. --attach-profile` or pass -k"),
        ("broken", None, rf"{PROFILE_FILE} is not usable \(overall: .*\); run `speculators validate"),
    ],
)
def test_serving_concurrency_refuses_what_it_cannot_resolve_in_one_line(profiled, tmp_path, speculator, k, message):
    folders = {"profiled": profiled, None: None, "bare": tmp_path / "bare", "broken": tmp_path / "broken"}
    for name in ("bare", "broken"):
        shutil.copytree(profiled, folders[name])
    (folders["bare"] / PROFILE_FILE).unlink()
    broken = (
        (folders["broken"] / PROFILE_FILE).read_text().replace('"acceptance_length": 2.8', '"acceptance_length": 9')
    )
    (folders["broken"] / PROFILE_FILE).write_text(broken)
    with pytest.raises(SpeculatorsError, match=message) as error:
        k_at_serving_concurrency(folders[speculator], k, 4)
    assert "\n" not in str(error.value)


def test_the_serve_command_serves_the_chosen_k_and_says_why(profiled, monkeypatch, capsys):
    served = []
    monkeypatch.setattr(cli, "serve_forever", lambda settings, follow_log: served.append(settings) or 0)
    assert main(["serve", "--speculator", str(profiled), "--serving-concurrency", "4", "--port", "0"]) == 0
    assert served[0].num_speculative_tokens == 2 and served[0].verifier is None
    assert "serving K = 2 for 4 concurrent streams" in capsys.readouterr().out
    # K = 0: one error line, no server
    assert main(["serve", "--speculator", str(profiled), "--serving-concurrency", "16"]) != 0
    assert len(served) == 1
    assert "does not pay" in capsys.readouterr().err
