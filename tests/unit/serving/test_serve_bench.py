"""vLLM (CPU build) serves our checkpoints; `speculators serve` lifecycle; `speculators bench` with GuideLLM.

The served test is the guarantee that vLLM reads our format: it runs in CI (slow tests run there).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from speculators.errors import SpeculatorsError
from speculators.serving.serve import (
    ServerSettings,
    VllmServer,
    acceptance_from_counters,
    added_spec_decode,
    parse_spec_decode_counters,
    request_spec_decode,
)
from tests.conftest import write_peaked_prompts

K = 3
NEW_TOKENS = 40

EXPOSITION = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 8.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_spec_decode_counters_parse_and_difference():
    after = parse_spec_decode_counters(EXPOSITION)
    assert after == {
        "drafts": 20.0,
        "draft_tokens": 60.0,
        "accepted_tokens": 25.0,
        "accepted_per_position": [14.0, 8.0, 3.0],
        "prefix_cache_queries": 900.0,
        "prefix_cache_hits": 256.0,
    }
    before = {"drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 5.0, "accepted_per_position": [4.0, 1.0]}
    delta = acceptance_from_counters(before, after)
    assert delta["drafts"] == 10 and delta["accepted_per_position"] == [10, 7, 3]
    assert delta["acceptance_length"] == pytest.approx(1 + 20 / 10)
    assert delta["acceptance_per_position"] == pytest.approx([1.0, 0.7, 0.3])
    assert acceptance_from_counters(before, before)["acceptance_length"] is None


def test_a_replys_own_spec_decode_statistics_read_as_counter_differences():
    """vLLM's per-request statistics (--per-request-spec-decode-metrics summary): histogram[j] verify steps
    accepted exactly j drafted tokens, so position p was accepted in the steps with j > p."""
    stats = {"acceptance_histogram": [5, 3, 2, 1], "num_draft_tokens": 33, "num_spec_steps": 11,
             "num_accepted_draft_tokens": 10, "mean_acceptance_length": 1 + 10 / 11}  # fmt: skip
    own = request_spec_decode({"choices": [], "metrics": {"speculative_decoding": stats}})
    assert own is not None
    assert (own["drafts"], own["draft_tokens"], own["accepted_tokens"]) == (11, 33, 10)
    assert own["accepted_per_position"] == [6, 3, 1]  # 3 + 2 + 1, 2 + 1, 1
    assert own["acceptance_length"] == pytest.approx(stats["mean_acceptance_length"])
    assert request_spec_decode({"choices": [], "usage": {}}) is None  # a baseline server's reply
    # Added with a counter difference of the same shape, as the per-category pass adds a group's requests.
    before = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_position": []}
    after = {"drafts": 4.0, "draft_tokens": 12.0, "accepted_tokens": 3.0, "accepted_per_position": [2.0, 1.0, 0.0]}
    total = added_spec_decode([own, acceptance_from_counters(before, after)])
    assert (total["drafts"], total["accepted_tokens"], total["accepted_per_position"]) == (15, 13, [8, 4, 1])
    assert total["acceptance_per_position"] == pytest.approx([8 / 15, 4 / 15, 1 / 15])
    assert added_spec_decode([])["acceptance_length"] is None


def test_serve_errors_are_one_clear_sentence(tiny_verifier_dir, monkeypatch):
    verifier = str(tiny_verifier_dir("llama"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(SpeculatorsError, match=f"port {port} on 127.0.0.1 is already in use"):
            VllmServer(ServerSettings(verifier=verifier, port=port)).start()
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name))
    with pytest.raises(SpeculatorsError, match="vLLM is not installed; install the project with"):
        VllmServer(ServerSettings(verifier=verifier))


def completions(url: str, model: str, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            outputs.append(json.loads(response.read())["choices"][0]["token_ids"])
    return outputs


SERVER = dict(port=0, dtype="float32", max_model_len=512, enforce_eager=True, kv_cache_gib=1)


@pytest.fixture(scope="module")
def served_baseline(peaked_verifier, tmp_path_factory):
    """The peaked verifier's prompts (token ids) and its fp32 greedy outputs from a baseline vLLM server."""
    from speculators.data.prompt_set import load_prompts
    from speculators.eval.evaluate import tokenize_prompts
    from speculators.verifier.loading import load_verifier

    directory = tmp_path_factory.mktemp("baseline")
    verifier = load_verifier(peaked_verifier, dtype="float32")
    prompts = tokenize_prompts(verifier.tokenizer, load_prompts(str(write_peaked_prompts(directory / "p.jsonl"))))
    token_prompts = [ids for _, ids in prompts]
    settings = ServerSettings(verifier=str(peaked_verifier), **SERVER, dev_endpoints=True, log_path=directory / "log")
    with VllmServer(settings) as server:
        baseline = completions(server.url, server.model_name, token_prompts)
        assert server.metrics()["drafts"] == 0
        cache_hits = prefix_cache_hits_around_a_reset(server, token_prompts[0])
    assert all(len(ids) == NEW_TOKENS for ids in baseline)
    return prompts, baseline, cache_hits


def prefix_cache_hits_around_a_reset(server: VllmServer, prompt: list[int]) -> dict[str, float]:
    """Prefix-cache hits (tokens) of one 300-token prompt sent again as it is, then again after
    reset_prefix_cache (vLLM's CPU blocks hold 128 tokens: a repeat can hit 256)."""

    long_prompt = (prompt * (300 // len(prompt) + 1))[:300]
    hits = []
    for reset in (False, False, True):
        if reset:
            server.reset_prefix_cache()
        before = server.metrics()["prefix_cache_hits"]
        completions(server.url, server.model_name, [long_prompt], max_tokens=1)
        hits.append(server.metrics()["prefix_cache_hits"] - before)
    return {"first": hits[0], "repeated": hits[1], "after_reset": hits[2]}


@pytest.mark.slow
def test_reset_prefix_cache_leaves_a_repeated_prompt_nothing_to_hit(served_baseline):
    """bench empties the prefix cache before each measurement: a prompt the server has seen is a hit
    (two whole 128-token blocks of 300 tokens), and after the reset it is prefilled again."""
    _, _, hits = served_baseline
    assert hits == {"first": 0, "repeated": 256, "after_reset": 0}


def test_a_server_without_dev_endpoints_refuses_to_reset_its_prefix_cache(tiny_verifier_dir):
    server = VllmServer(ServerSettings(verifier=str(tiny_verifier_dir("llama")), port=0))
    with pytest.raises(SpeculatorsError, match="started without dev_endpoints; it cannot reset its prefix cache"):
        server.reset_prefix_cache()


def offline_totals(verifier_dir: Path, prompts: list, checkpoint: Path) -> dict:
    """Our evaluator's totals for the checkpoint on the served prompts (fp32, the servers' fixed length):
    what vLLM's spec-decode counters must match when it reads our files as we do."""
    from speculators.eval.evaluate import DrafterProposer, evaluate, load_proposer
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(verifier_dir, dtype="float32")
    proposer = load_proposer("eagle3", verifier, str(checkpoint), "float32")
    assert isinstance(proposer, DrafterProposer)
    return evaluate(verifier, prompts, proposer, K, NEW_TOKENS, stop_at_eos=False, progress=False).totals()


@pytest.mark.slow
def test_vllm_serves_our_trained_checkpoint_losslessly_with_the_offline_acceptance(
    peaked_verifier, trained_drafter, served_baseline, tmp_path
):
    """fp32 greedy outputs equal the baseline server's token for token; acceptance matches our evaluator's."""
    prompts, baseline, _ = served_baseline
    token_prompts = [ids for _, ids in prompts]
    common = dict(verifier=str(peaked_verifier), **SERVER)
    speculative_settings = ServerSettings(
        **common, speculator=str(trained_drafter), num_speculative_tokens=K, log_path=tmp_path / "speculator.log"
    )
    with VllmServer(speculative_settings) as server:
        assert server.speculative == {
            "method": "eagle3",
            "model": str(trained_drafter.resolve()),
            "num_speculative_tokens": K,
        }
        before = server.metrics()
        speculative = completions(server.url, server.model_name, token_prompts)
        served = acceptance_from_counters(before, server.metrics())
    assert speculative == baseline  # fp32: not one token changed
    assert served["drafts"] > 0 and served["draft_tokens"] == K * served["drafts"]

    offline = offline_totals(peaked_verifier, prompts, trained_drafter)
    # The same drafter read by vLLM from our files accepts what our own decoder accepts.
    assert served["acceptance_length"] > 1.8
    assert served["acceptance_length"] == pytest.approx(offline["acceptance_length"], abs=0.15)
    assert served["acceptance_per_position"] == pytest.approx(offline["acceptance_per_position"], abs=0.1)


@pytest.mark.slow
def test_vllm_serve_of_the_checkpoint_directory_alone_serves_a_two_layer_drafter_losslessly(
    peaked_verifier, store, served_baseline, tmp_path, monkeypatch, capsys
):
    """`vllm serve <checkpoint>` (no --speculative-config): vLLM loads the verifier the checkpoint names
    (a hub id, found offline in the hub cache where `speculators verifier --cache-as` put the local copy)
    and the drafter's own K; the drafter has 2 layers and one norm per aux state (`fc_norm`), its fp32 greedy
    outputs equal the baseline's, and vLLM accepts what our evaluator accepts (it reads both the same way)."""
    from safetensors import safe_open

    from speculators.cli import main
    from speculators.models.weights import read_checkpoint
    from speculators.train.trainer import TrainConfig, train

    train(
        TrainConfig(
            store=str(store),
            verifier=str(peaked_verifier),
            output=str(tmp_path / "run"),
            epochs=20,
            lr=1e-2,
            validation_share=0.0,
            token_budget=512,
            precision="fp32",
            num_draft_layers=2,
            fc_norm=True,
            log_every=50,
            eval_every=1000,
            checkpoint_every=1000,
            progress=False,
        )
    )
    assert "names its verifier by the local path" in capsys.readouterr().out  # the tiny verifier has no hub id
    drafter = tmp_path / "run" / "drafter"
    with safe_open(str(drafter / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    # vLLM builds a hidden_norm in every layer but uses only layer 0's: the checkpoint holds just that one.
    assert "layers.0.hidden_norm.weight" in names and "layers.1.input_layernorm.weight" in names
    assert not any(name.startswith("layers.1.hidden_norm") for name in names)
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= names and "input_norm.weight" not in names

    hub_id = "speculators-tests/peaked-llama"
    named = tmp_path / "named"
    assert (
        main(
            [
                "convert",
                str(drafter),
                "--verifier",
                str(peaked_verifier),
                "--verifier-name",
                hub_id,
                "--output",
                str(named),
            ]
        )
        == 0
    )
    assert read_checkpoint(named).config.speculators_config.verifier.name_or_path == hub_id
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["verifier", str(peaked_verifier), "--cache-as", hub_id]) == 0

    prompts, baseline, _ = served_baseline
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)  # (an offline engine in this process sets it)
    settings = ServerSettings(verifier=None, speculator=str(named), **SERVER, log_path=tmp_path / "one-command.log")
    with VllmServer(settings) as server:
        command = server.command()
        assert command[command.index("--model") + 1] == str(named.resolve()) and "--speculative-config" not in command
        assert server.verifier_name == hub_id and server.model_name == str(named.resolve())
        before = server.metrics()
        outputs = completions(server.url, server.model_name, [ids for _, ids in prompts])
        served = acceptance_from_counters(before, server.metrics())
    assert outputs == baseline  # fp32: not one token changed
    assert served["drafts"] > 0 and served["draft_tokens"] == K * served["drafts"]  # K from the checkpoint
    assert "reserve_cpu_num=0" in (tmp_path / "one-command.log").read_text()  # the server's CPU default: every core

    offline = offline_totals(peaked_verifier, prompts, named)
    assert served["acceptance_length"] > 1.5
    assert served["acceptance_length"] == pytest.approx(offline["acceptance_length"], abs=0.15)


def processes_mentioning(text: str) -> list[str]:
    result = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if "pgrep" not in line]


def start_cli_server(model_dir: Path, log_path: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "speculators.cli",
        "serve",
        "--verifier",
        str(model_dir),
        "--port",
        "0",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--enforce-eager",
        "--kv-cache-gib",
        "1",
        "--log-file",
        str(log_path),
        "--quiet",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 420
    for line in process.stdout:
        if line.startswith("ready: http://127.0.0.1:"):
            return process
        assert time.monotonic() < deadline, "vLLM did not become ready"
    raise AssertionError(f"speculators serve exited with {process.wait()}: {log_path.read_text()[-2000:]}")


def wait_until_gone(text: str, seconds: float = 60) -> list[str]:
    deadline = time.monotonic() + seconds
    while processes_mentioning(text) and time.monotonic() < deadline:
        time.sleep(0.5)
    return processes_mentioning(text)


@pytest.mark.slow
def test_serve_cli_leaves_no_process_on_ctrl_c_or_when_killed(tiny_verifier_dir, tmp_path):
    model_dir = tmp_path / "verifier-served-by-the-cli"
    shutil.copytree(tiny_verifier_dir("llama"), model_dir)
    try:
        process = start_cli_server(model_dir, tmp_path / "first.log")
        assert len(processes_mentioning(str(model_dir))) >= 2  # our CLI and vLLM's API server
        process.send_signal(signal.SIGINT)  # Ctrl-C
        assert process.wait(timeout=120) == 0
        assert wait_until_gone(str(model_dir)) == []

        process = start_cli_server(model_dir, tmp_path / "second.log")
        os.kill(process.pid, signal.SIGKILL)  # the caller dies without any chance to clean up
        process.wait()
        assert wait_until_gone(str(model_dir)) == []
    finally:
        subprocess.run(["pkill", "-9", "-f", str(model_dir)], check=False)


@pytest.mark.slow
def test_a_model_that_does_not_load_is_reported_with_the_log_tail(tiny_verifier_dir, tmp_path):
    broken = tmp_path / "broken-verifier"
    shutil.copytree(tiny_verifier_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    settings = ServerSettings(
        verifier=str(broken),
        port=0,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_gib=1,
        log_path=tmp_path / "broken.log",
    )
    server = VllmServer(settings)
    with pytest.raises(
        SpeculatorsError, match=r"exited with code \d+ before it was ready; the end of its log"
    ) as error:
        server.start()
    assert "Error" in str(error.value).split("the end of its log", 1)[1]
    assert wait_until_gone(str(broken), 30) == []


def test_differing_served_outputs_are_judged_near_tie_or_diverged(peaked_verifier):
    """At the first differing token, both tokens within the tolerance of the verifier's top logit make a
    near-tie; a token further below the top (another token, or a tighter tolerance) is a divergence."""
    import torch

    from speculators.data.tokenization import render_ids
    from speculators.eval.lossless import top_two
    from speculators.eval.output_judge import OutputJudge, compare_served_outputs
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(peaked_verifier, dtype="float32")
    tokenizer = verifier.tokenizer
    messages = [{"role": "user", "content": "Describe a tide pool."}]
    prompt = render_ids(tokenizer, messages, add_generation_prompt=True)
    answer = tokenizer.encode("Tide pools hold small crabs, snails and bright anemones.", add_special_tokens=False)
    position = 3
    with torch.inference_mode():
        logits = verifier.model(input_ids=torch.tensor([prompt + answer[:position]])).logits[0, -1:]
    top, top_logit, second, second_logit = top_two(logits)[0]
    margin = top_logit - second_logit
    first, runner_up = [*answer[:position], top, 7], [*answer[:position], second, 9]
    wrong = int(logits[0].argmin())
    below = top_logit - logits[0, wrong].item()  # > margin: `wrong` is below the runner-up
    other = [*answer[:position], wrong]

    verdict = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=margin + 1e-3)(prompt, first, runner_up)
    assert verdict["status"] == "near_tie" and verdict["position"] == position
    assert verdict["verifier_top_two"] == [top, second] and abs(verdict["margin"] - margin) < 1e-4
    assert verdict["below_top"][0] == 0.0 and abs(verdict["below_top"][1] - margin) < 1e-4
    tight = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=margin / 2)
    assert tight(prompt, first, runner_up)["status"] == "diverged"
    judge = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=margin + 1e-3)
    assert judge(prompt, first, other)["status"] == "diverged"
    reaching = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=below + 1e-3)
    assert reaching(prompt, first, other)["status"] == "near_tie"  # a three-way near-tie within tolerance
    assert judge(prompt, first, first[:4])["status"] == "diverged"  # a prefix: cut short, not a tie

    # compare_served_outputs counts them prompt by prompt; a prompt tokenized differently is a divergence.
    hello = [{"role": "user", "content": "Hi."}]

    def served(messages, prompt_ids, ids):
        return {"messages": messages, "prompt_token_ids": prompt_ids, "token_ids": ids}

    baseline = [served(messages, prompt, first), served(hello, [1, 2], [5, 6]), served(hello, [1, 2], [5])]
    speculator = [served(messages, prompt, runner_up), served(hello, [1, 2], [5, 6]), served(hello, [1, 3], [6])]
    counted = compare_served_outputs(baseline, speculator, judge)
    assert (counted["compared"], counted["identical"], counted["near_tie"], counted["diverged"]) == (3, 1, 1, 1)
    assert [d["prompt"] for d in counted["differences"]] == ["Describe a tide pool.", "Hi."]
    assert counted["differences"][1]["reason"] == "the servers tokenized the prompt differently"
    with pytest.raises(SpeculatorsError, match="different prompts"):
        compare_served_outputs(baseline, speculator[::-1], judge)


def test_the_judge_reads_the_baseline_servers_logits_and_agrees_with_a_re_score(peaked_verifier, monkeypatch):
    """Given the baseline server's largest logits at the split (here: the verifier's own, as vLLM's
    --logprobs-mode raw_logits reports them), the judge decides without loading the verifier, and its
    verdicts equal the transformers re-score's; where they cannot decide (the other token below every
    reported logit, the last of them within the tolerance) it re-scores."""
    import torch

    from speculators.data.tokenization import render_ids
    from speculators.eval import output_judge
    from speculators.eval.output_judge import OutputJudge
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(peaked_verifier, dtype="float32")
    prompt = render_ids(verifier.tokenizer, [{"role": "user", "content": "Describe a tide pool."}], True)
    answer = verifier.tokenizer.encode("Tide pools hold small crabs.", add_special_tokens=False)
    position = 3
    with torch.inference_mode():
        logits = verifier.model(input_ids=torch.tensor([prompt + answer[:position]])).logits[0, -1].float()
    values, ids = logits.topk(output_judge.JUDGE_TOP_LOGITS)
    top = [[int(i), float(v)] for i, v in zip(ids, values, strict=True)]
    served_top = [[[t, 0.0]] for t in answer[:position]] + [top]  # earlier positions: their greedy tokens
    first = [*answer[:position], top[0][0]]
    runner_up, fifth = [*answer[:position], top[1][0]], [*answer[:position], top[4][0]]
    outside = [*answer[:position], int(logits.argmin())]
    margin, fifth_below = top[0][1] - top[1][1], top[0][1] - top[4][1]
    loads = []  # the judge's loads of the verifier (when it re-scores)
    monkeypatch.setattr(output_judge, "load_verifier", lambda *a, **k: loads.append(a) or load_verifier(*a, **k))
    for tolerance, other in ((margin + 1e-3, runner_up), (margin / 2, runner_up), (fifth_below + 1e-3, fifth)):
        judge = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=tolerance)
        served = judge(prompt, first, other, served_top=served_top)
        assert served["judged_from"] == "served logits" and loads == []
        rescored = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=tolerance)(prompt, first, other)
        assert rescored["judged_from"] == "transformers re-score" and len(loads) == 1
        loads.clear()
        assert served["status"] == rescored["status"] and served["position"] == rescored["position"] == position
        assert served["below_top"] == pytest.approx(rescored["below_top"], abs=1e-4)
    below_last = top[0][1] - top[-1][1]
    decided = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=below_last / 2)(
        prompt, first, outside, served_top=served_top
    )
    assert decided["status"] == "diverged" and decided["judged_from"] == "served logits" and loads == []
    undecided = OutputJudge(str(peaked_verifier), "float32", tie_tolerance=below_last + 1e-3)(
        prompt, first, outside, served_top=served_top
    )
    assert undecided["judged_from"] == "transformers re-score" and len(loads) == 1


def test_bench_profiles_and_guidellm_requests_for_fixed_and_natural_lengths(tmp_path):
    """Fixed-length profiles send an exact budget per row (GuideLLM adds ignore_eos); the natural-length
    profile's rows carry none and its requests are capped by max_tokens, so answers end at end of turn."""
    from speculators.eval.guidellm import guidellm_command, guidellm_profile, profile_name
    from speculators.settings import BenchSettings

    settings = BenchSettings(verifier="v", speculator="s", output=tmp_path, concurrency=[2], natural_max_tokens=300)
    profiles = settings.profiles()  # one stream at a time (the concurrencies are the load sweep's)
    assert [profile_name(p) for p in profiles] == ["synchronous", "synchronous-natural"]
    assert guidellm_profile(profiles[0]) == {"kind": "synchronous"}
    assert profile_name({"kind": "concurrent", "streams": 2}) == "concurrent-2"
    command = guidellm_command(
        "http://h",
        "m",
        "tok",
        tmp_path / "d.jsonl",
        guidellm_profile(profiles[1]),
        4,
        tmp_path / "a.json",
        tmp_path / "a.html",
        max_tokens=300,
    )
    backend = json.loads(command[command.index("--backend") + 1])
    assert backend["extras"]["body"] == {"temperature": 0, "max_tokens": 300}
    fixed = guidellm_command(
        "http://h",
        "m",
        "tok",
        tmp_path / "d.jsonl",
        guidellm_profile(profiles[0]),
        4,
        tmp_path / "a.json",
        tmp_path / "a.html",
    )
    assert json.loads(fixed[fixed.index("--backend") + 1])["extras"]["body"] == {"temperature": 0}
    assert json.loads(fixed[fixed.index("--profile") + 1]) == {"kind": "synchronous"}
    off = BenchSettings(verifier="v", speculator="s", output=tmp_path, concurrency=[], natural_max_tokens=0)
    assert [profile_name(p) for p in off.profiles()] == ["synchronous"]


@pytest.mark.slow
def test_bench_load_sweep_serves_every_k_at_every_concurrency_and_its_analysis_is_the_points(
    peaked_verifier, trained_drafter, tmp_path
):
    """The real `speculators bench` at K = 2 with --sweep-k 1 and --concurrency 2: three servers (the
    verifier alone, K = 2, K = 1) each measured at 1 and 2 streams on the same prompts; the K = 1 server
    runs the sweep alone; report.json's analysis is load_sweep.py's over the points it holds."""
    from speculators.cli import main
    from speculators.eval.load_sweep import analyse_load, expected_tokens

    out = tmp_path / "bench"
    prompts = write_peaked_prompts(tmp_path / "prompts.jsonl")  # the drafter's own: acceptance well above 1
    arguments = [
        "bench", "--verifier", str(peaked_verifier), "--speculator", str(trained_drafter), "--output", str(out),
        "--prompts", str(prompts), "-k", "2", "--concurrency", "2", "--sweep-k", "1", "--load-requests", "2",
        "--serving-concurrency", "2",
        "--requests", "4", "--output-tokens", "16", "--natural-max-tokens", "32", "--no-fixed-length",
        "--lossless-prompts", "2", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--kv-cache-gib", "1",
    ]  # fmt: skip
    assert main(arguments) == 0
    report = json.loads((out / "report.json").read_text())
    assert list(report["profiles"]) == ["synchronous-natural"]  # single-stream: the headline's
    sweep = report["load_sweep"]
    assert (sweep["length"], sweep["k"], sweep["ks"], sweep["concurrency"]) == ("natural", 2, [0, 1, 2], [1, 2])
    assert sweep["requests"] == {"1": 2, "2": 4}  # n(c) = min(max(2, 2c), 4 prompts)
    for k, role in ((0, "baseline"), (1, "speculator-k1"), (2, "speculator")):
        for c in (1, 2):
            for kind in ("json", "html", "log"):
                assert (out / role / f"guidellm-load-c{c}.{kind}").stat().st_size > 0, (role, c, kind)
            point = sweep["points"][str(k)][str(c)]
            assert point["requests"]["successful"] == sweep["requests"][str(c)] and point["output_tokens_per_s"] > 0
            if k:  # each server drafted at its own K
                assert point["spec_decode"]["drafts"] > 0
                assert point["spec_decode"]["draft_tokens"] == k * point["spec_decode"]["drafts"]
            else:
                assert "spec_decode" not in point
    # the K = 1 server ran the sweep alone: no main profile, no greedy outputs
    assert sorted(p.name for p in (out / "speculator-k1").glob("guidellm-*.json")) == [
        "guidellm-load-c1.json", "guidellm-load-c2.json"
    ]  # fmt: skip
    assert not (out / "speculator-k1" / "outputs.jsonl").exists() and "speculator-k1" in report["servers"]

    # The profile is the headline acceptance, and the analysis is load_sweep.py's over the points as written.
    rates = sweep["profile"]["acceptance_per_position"]
    assert rates == (report["acceptance"]["acceptance_per_position"] + [0.0, 0.0])[:2] and rates[0] > 0.3
    points = {int(k): {int(c): p for c, p in by_c.items()} for k, by_c in sweep["points"].items()}
    recomputed = analyse_load(points, rates, 2, 2)
    for key, value in recomputed.items():
        assert sweep[key] == value, key  # (floats survive JSON exactly)
    for k in (1, 2):
        for c in ("1", "2"):
            measured_al = sweep["points"][str(k)][c]["spec_decode"]["acceptance_length"]
            ratio = sweep["predicted_speedup"][str(k)][c] / sweep["speedup"][str(k)][c]
            assert ratio == pytest.approx(expected_tokens(rates, k) / measured_al)
    assert sweep["speedup_at_serving_concurrency"] == pytest.approx(sweep["speedup"]["2"]["2"])
    markdown = (out / "report.md").read_text()
    assert "## Under load" in markdown and "| concurrency | requests | baseline tokens/s | K=1 | K=2 |" in markdown
    assert f"**Break-even concurrency** of K=2: {sweep['break_even_concurrency']['note']}." in markdown
    assert (out / "concurrency.png").read_bytes()[:4] == b"\x89PNG"
    assert report["machine_load"]["runs"] == 2 + 6  # the profile on two servers, six sweep points
