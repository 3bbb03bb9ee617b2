"""`speculators serve --serving-concurrency N`: K from the checkpoint's acceptance profile, resolved before
any vLLM starts."""

from __future__ import annotations

import json
import shutil
import urllib.request
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
from tests.unit.checkpoint.bench_reports import RATES, THROUGHPUT, bench_report, load_sweep, untrained_drafter


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir) -> Path:
    return Path(tiny_verifier_dir("llama"))


@pytest.fixture(scope="module")
def profiled(verifier, tmp_path_factory) -> Path:
    """A K = 3 drafter with the profile of a sweep where K = 3 pays at c = 1, K = 2 at c = 4, none at 16."""
    output = untrained_drafter(verifier, tmp_path_factory.mktemp("serve-profile") / "drafter")
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


def completion_ids(url: str, model: str, prompts: list[list[int]], max_tokens: int = 32) -> list[list[int]]:
    """Greedy completions of token-id prompts, one request each, their output token ids."""
    outputs = []
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps({**body, "return_token_ids": True}).encode(), JSON
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            outputs.append(json.loads(response.read())["choices"][0]["token_ids"])
    return outputs


JSON = {"Content-Type": "application/json"}


@pytest.mark.slow
def test_vllm_serves_a_checkpoint_with_its_profile_at_the_k_the_profile_chose(
    trained_drafter, peaked_verifier, tmp_path, monkeypatch
):
    """`vllm serve <checkpoint>` (the one-command deployment: the checkpoint names its verifier) with an
    acceptance_profile.json beside config.json: vLLM ignores the file, serves, and drafts at the K that
    `speculators serve --serving-concurrency 4` picked from it."""
    from speculators.checkpoint.validation import validate_checkpoint
    from speculators.data.prompt_set import load_prompts
    from speculators.eval.evaluate import tokenize_prompts
    from speculators.serving.serve import ServerSettings, VllmServer, acceptance_from_counters
    from speculators.verifier.loading import load_verifier
    from tests.conftest import write_peaked_prompts

    drafter = Path(shutil.copytree(trained_drafter, tmp_path / "drafter"))
    report = bench_report(sweep=load_sweep(RATES, THROUGHPUT))
    write_profile(drafter, profile_from_report(report, drafter, peaked_verifier))
    assert validate_checkpoint(drafter, verifier=str(peaked_verifier)).ok
    k, _ = k_at_serving_concurrency(drafter, None, 4)
    assert k == 2  # (the sweep's choice at c = 4; the checkpoint's own K is 3)

    tokenizer = load_verifier(peaked_verifier, dtype="float32").tokenizer
    conversations = load_prompts(str(write_peaked_prompts(tmp_path / "p.jsonl")))
    prompts = [ids for _, ids in tokenize_prompts(tokenizer, conversations)]
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)  # (an offline engine in this process sets it)
    server_settings = dict(port=0, dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_gib=1)
    # what cmd_serve builds for `speculators serve --speculator <checkpoint> --serving-concurrency 4`
    settings = ServerSettings(
        verifier=None, speculator=str(drafter), num_speculative_tokens=k, **server_settings, log_path=tmp_path / "log"
    )
    with VllmServer(settings) as server:
        command = server.command()
        assert command[command.index("--model") + 1] == str(drafter.resolve())
        before = server.metrics()
        outputs = completion_ids(server.url, server.model_name, prompts[:4])
        served = acceptance_from_counters(before, server.metrics())
    assert [len(ids) for ids in outputs] == [32] * 4
    assert served["drafts"] > 0 and served["draft_tokens"] == k * served["drafts"]  # K = 2, the profile's
    assert served["accepted_tokens"] > 0 and len(served["accepted_per_position"]) == k
