"""On-policy regeneration: generated ids kept exactly, masks on them only, multi-turn, truncation, resume."""

from __future__ import annotations

import pytest
import torch

from speculators.data.conversation import Conversation
from speculators.data.regenerate import regenerate, transformers_generate_fn
from speculators.data.tokenization import render_ids, turn_end_ids
from speculators.verifier.loading import load_verifier

PROMPTS = [
    "Explain black holes.",
    "Write a haiku about tea.",
    "List three rivers.",
    "Compare cats and dogs.",
    "What is recursion?",
]


def conversations(n=5):
    return [
        Conversation(f"c{i}", [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " " * (i // 5)}])
        for i in range(n)
    ]


def greedy_reference(model, prompt, max_new_tokens, ends):
    """Plain greedy decoding without a cache or padding: the ids the verifier itself produces."""
    ids = list(prompt)
    generated = []
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        generated.append(token)
        ids.append(token)
        if token in ends:
            break
    return generated


@pytest.fixture(scope="module")
def llama(tiny_verifier_dir):
    return load_verifier(tiny_verifier_dir("llama"), dtype="float32")


def test_generated_ids_are_kept_exactly_and_masked(llama, tmp_path):
    tokenizer = llama.tokenizer
    generate = transformers_generate_fn(llama.model, tokenizer, max_new_tokens=12, temperature=0.0, seed=0)
    samples, report = regenerate(
        conversations(), tokenizer, generate, tmp_path / "partial.jsonl", max_length=512, batch_size=3, progress=False
    )
    assert report.regenerated == 5 and [s.id for s in samples] == [f"c{i}" for i in range(5)]
    ends = turn_end_ids(tokenizer)
    for sample, conversation in zip(samples, conversations(), strict=True):
        prompt = render_ids(tokenizer, conversation.messages, add_generation_prompt=True)
        assert sample.input_ids[: len(prompt)] == prompt
        generated = sample.input_ids[len(prompt) :]
        assert generated == greedy_reference(llama.model, prompt, 12, ends)
        assert sample.loss_mask == [0] * len(prompt) + [1] * len(generated)
    assert report.generated_tokens == sum(s.supervised_tokens for s in samples)


class ScriptedModel:
    """A verifier stand-in with fixed replies, to exercise turn bookkeeping precisely."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.calls = tokenizer, list(replies), []

    def __call__(self, prompts):
        self.calls.append([list(p) for p in prompts])
        return [self.replies.pop(0) for _ in prompts]


def test_multi_turn_keeps_generated_ids_and_templates_the_next_user_turn(llama, tmp_path):
    tokenizer = llama.tokenizer
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    first = tokenizer("Short answer.", add_special_tokens=False)["input_ids"] + [eot]
    second = tokenizer("Second answer.", add_special_tokens=False)["input_ids"] + [eot]
    conversation = Conversation(
        "m",
        [
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "old answer one"},
            {"role": "user", "content": "Second question?"},
            {"role": "assistant", "content": "old answer two"},
        ],
    )
    scripted = ScriptedModel(tokenizer, [first, second])
    samples, report = regenerate([conversation], tokenizer, scripted, tmp_path / "p.jsonl", 512, progress=False)
    sample = samples[0]
    # The second prompt is the first prompt + generated ids + the templated next user turn.
    expected_second_prompt = render_ids(
        tokenizer,
        [
            {"role": "user", "content": "First question?"},
            {"role": "assistant", "content": "Short answer."},
            {"role": "user", "content": "Second question?"},
        ],
        add_generation_prompt=True,
    )
    assert scripted.calls[1][0] == expected_second_prompt
    assert sample.input_ids == expected_second_prompt + second
    masked = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert masked == first + second
    assert report.truncated_turns == 0 and not report.dropped_turns


def test_truncated_turn_gets_no_end_token_and_ends_the_conversation(llama, tmp_path):
    tokenizer = llama.tokenizer
    cut = tokenizer("An answer that goes on", add_special_tokens=False)["input_ids"]  # no end-of-turn token
    conversation = Conversation(
        "t",
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}],
    )
    samples, report = regenerate(
        [conversation], tokenizer, ScriptedModel(tokenizer, [cut]), tmp_path / "p.jsonl", 512, progress=False
    )
    prompt = render_ids(tokenizer, conversation.messages[:1], add_generation_prompt=True)
    assert samples[0].input_ids == prompt + cut
    assert report.truncated_turns == 1 and report.dropped_turns == {"turn cut by the token limit": 1}


def test_prompt_over_max_length_is_rejected_and_counted(llama, tmp_path):
    tokenizer = llama.tokenizer
    long = Conversation("long", [{"role": "user", "content": "word " * 200}])
    samples, report = regenerate(
        [long, *conversations(1)],
        tokenizer,
        transformers_generate_fn(llama.model, tokenizer, 4, 0.0, 0),
        tmp_path / "p.jsonl",
        max_length=64,
        progress=False,
    )
    assert [s.id for s in samples] == ["c0"]
    assert report.rejected == {"over-length (the prompt alone exceeds max length 64)": 1}


class ShuffledSteps:
    """A step-by-step engine (regenerate.StepGenerate) around a batch function that finishes queued
    requests in a seeded random order, a few per step: the continuous scheduler must give the samples
    the batch scheduler gives, whatever order answers end in."""

    def __init__(self, generate, seed: int):
        import random

        self.generate, self.random, self.queued, self.added = generate, random.Random(seed), {}, 0

    def add(self, prompt_ids, images=None):
        self.added += 1
        self.queued[f"r{self.added}"] = prompt_ids
        return f"r{self.added}"

    def step(self):
        chosen = self.random.sample(sorted(self.queued), k=min(len(self.queued), self.random.randint(0, 2)))
        return [(key, self.generate([self.queued.pop(key)])[0]) for key in chosen]


def test_step_by_step_scheduling_equals_batches_on_multi_turn_conversations(llama, tmp_path):
    tokenizer = llama.tokenizer
    generate = transformers_generate_fn(llama.model, tokenizer, max_new_tokens=10, temperature=0.0, seed=0)
    turns = [
        Conversation(
            f"m{i}",
            [
                {"role": "user", "content": PROMPTS[i]},
                {"role": "assistant", "content": "-"},
                {"role": "user", "content": PROMPTS[(i + 1) % 5]},
                *([{"role": "assistant", "content": "-"}, {"role": "user", "content": "Why?"}] if i % 2 else []),
            ],
        )
        for i in range(5)
    ]
    work = [*turns, *conversations(4)]
    batched, by_batch = regenerate(work, tokenizer, generate, tmp_path / "a.jsonl", 512, batch_size=3, progress=False)
    stepped, by_step = regenerate(
        work, tokenizer, ShuffledSteps(generate, seed=3), tmp_path / "b.jsonl", 512, batch_size=3, progress=False
    )
    assert [s.to_json() for s in stepped] == [s.to_json() for s in batched] and len(batched) == 9
    assert by_step.to_dict() | {"tokens_per_second": None} == by_batch.to_dict() | {"tokens_per_second": None}
    assert sum(s.loss_mask.count(1) > 0 for s in batched) == 9
    # Answers ended out of order, so the resume file holds them in finishing order; the result is in input order.
    written = [line for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert sorted(written) == sorted(s.to_json() for s in stepped)


def test_resume_after_an_interrupted_run_equals_an_uninterrupted_one(llama, tmp_path):
    tokenizer = llama.tokenizer
    generate = transformers_generate_fn(llama.model, tokenizer, max_new_tokens=8, temperature=0.0, seed=0)
    full, _ = regenerate(
        conversations(7), tokenizer, generate, tmp_path / "full.jsonl", 512, batch_size=2, progress=False
    )
    # An interrupted run: two finished samples on disk, then a line torn by the kill.
    partial = tmp_path / "resumed.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    partial.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    counting = ScriptedCounter(generate)
    resumed, report = regenerate(conversations(7), tokenizer, counting, partial, 512, batch_size=2, progress=False)
    assert report.resumed == 2 and report.regenerated == 5 and counting.prompts == 5
    assert [(s.id, s.input_ids, s.loss_mask) for s in resumed] == [(s.id, s.input_ids, s.loss_mask) for s in full]


class ScriptedCounter:
    def __init__(self, generate):
        self.generate, self.prompts = generate, 0

    def __call__(self, prompts):
        self.prompts += len(prompts)
        return self.generate(prompts)


def test_the_vllm_log_file_is_set_for_engine_processes_and_restored(tmp_path, monkeypatch):
    """The logging config reaches engine processes through the environment, only while inside; a user's own
    vLLM logging settings win."""
    import json
    import os
    from pathlib import Path

    from speculators.serving.engine import vllm_log_file

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    with vllm_log_file(tmp_path / "logs" / "vllm.log") as path:
        config = json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text())
        assert config["handlers"]["file"]["filename"] == str(path) == str(tmp_path / "logs" / "vllm.log")
        assert config["loggers"]["vllm"]["propagate"] is False
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ  # later servers log to their own files again
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    with vllm_log_file(tmp_path / "other.log") as path:
        assert path is None and "VLLM_LOGGING_CONFIG_PATH" not in os.environ


def regeneration_command(tmp_path, verifier: str) -> list[str]:
    """`speculators prepare` regenerating PROMPTS (written as prompt-only rows) in fp32, without the
    backend and output flags each test adds."""
    import json

    rows = [{"prompt": p} for p in PROMPTS]
    # Two conversations of three user turns: each later turn is asked after the verifier's own answer,
    # which vLLM's step-by-step scheduling sends the moment the earlier one ends.
    rows += [
        {"messages": [{"role": role, "content": text} for role, text in turns]}
        for turns in (
            [("user", "Name a colour."), ("assistant", "-"), ("user", "And another?"), ("assistant", "-"),
             ("user", "Which do you prefer?")],
            [("user", "Count to three."), ("assistant", "-"), ("user", "Now backwards."), ("assistant", "-"),
             ("user", "Thanks.")],
        )
    ]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [
        "prepare",
        "--source",
        str(tmp_path / "rows.jsonl"),
        "--verifier",
        verifier,
        "--regenerate",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "16",
        "--max-length",
        "256",
    ]


def test_engine_processes_stderr_goes_to_the_log_and_this_process_keeps_the_terminal(tmp_path, capfd, monkeypatch):
    """What a child process writes to stderr (vLLM's engine: Python and C++ warnings) lands in the log
    file; this process's progress output and messages stay on the terminal, and fd 2 is restored."""
    import subprocess
    import sys
    import warnings

    from speculators.serving.engine import vllm_log_file

    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    child = "import sys, warnings; sys.stderr.write('engine noise\\n'); warnings.warn('engine warning')"
    with vllm_log_file(tmp_path / "vllm.log") as path:
        subprocess.run([sys.executable, "-c", child], check=True)
        print("progress 50%", file=sys.stderr, flush=True)
        warnings.warn("deprecated inside vLLM", UserWarning, stacklevel=1)
    print("after", file=sys.stderr, flush=True)
    log = path.read_text()
    assert "engine noise" in log and "engine warning" in log and "deprecated inside vLLM" in log
    err = capfd.readouterr().err
    assert "progress 50%" in err and "after" in err
    assert "engine noise" not in err and "deprecated inside vLLM" not in err


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_vllm_backend_matches_transformers_greedy(replicas, tiny_verifier_dir, tmp_path):
    """vLLM's CPU build regenerates the same ids as transformers (fp32, greedy) through the CLI: the
    offline engine, and with 2 data-parallel replicas a vLLM server with one engine per replica."""
    import json
    import subprocess
    import sys

    from speculators.cli import main

    verifier = str(tiny_verifier_dir("llama"))
    common = regeneration_command(tmp_path, verifier)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "speculators.cli",
            *common,
            "--backend",
            "vllm",
            "--output",
            str(tmp_path / "vllm"),
            "--data-parallel-size",
            str(replicas),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert main([*common, "--backend", "transformers", "--output", str(tmp_path / "hf")]) == 0
    read = lambda name: [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]  # noqa: E731
    assert read("vllm") == read("hf")
    assert all(sum(row["loss_mask"]) > 0 for row in read("vllm"))
    # vLLM's own lines go to the log file (the server's, or the offline engine's processes'), not the terminal.
    engine_start = "Initializing a V1 LLM engine"
    assert engine_start in (tmp_path / "vllm" / "regeneration-vllm.log").read_text()
    assert engine_start not in result.stdout + result.stderr
    assert ("vLLM's log:" in result.stdout) == (replicas == 1)
    if replicas == 1:  # the offline engine: its import-time lines and its shutdown stay out of the terminal too
        terminal = result.stdout + result.stderr
        assert "Triton" not in terminal and "force killing" not in terminal and "FutureWarning" not in terminal
        assert "regenerating: 100%" in result.stderr  # the progress bar is still shown


@pytest.mark.slow
def test_vllm_server_backend_matches_transformers_greedy(tiny_verifier_dir, tmp_path):
    """Regeneration through a running OpenAI-compatible vLLM server gives transformers' greedy ids."""
    import json

    from speculators.cli import main
    from speculators.serving.serve import ServerSettings, VllmServer

    verifier = str(tiny_verifier_dir("llama"))
    common = regeneration_command(tmp_path, verifier)
    settings = ServerSettings(
        verifier=verifier,
        port=0,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_gib=1,
        log_path=tmp_path / "server.log",
    )
    with VllmServer(settings) as server:
        url = server.url
        assert main([*common, "--backend", "vllm", "--server-url", url, "--output", str(tmp_path / "server")]) == 0
    assert main([*common, "--backend", "transformers", "--output", str(tmp_path / "hf")]) == 0

    def read(name):
        return [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]

    assert read("server") == read("hf")


def test_a_rerun_regenerates_only_new_conversations_and_equals_a_fresh_run(tiny_verifier_dir, tmp_path):
    import json

    from speculators.cli import main

    verifier = str(tiny_verifier_dir("llama"))
    rows = tmp_path / "rows.jsonl"
    common = [
        "prepare",
        "--source",
        str(rows),
        "--verifier",
        verifier,
        "--regenerate",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "12",
        "--max-length",
        "256",
    ]

    def run(output: str, prompts: list[str]) -> dict:
        rows.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        assert main([*common, "--output", str(tmp_path / output)]) == 0
        return json.loads((tmp_path / output / "prepare_report.json").read_text())["tokenization"]["regeneration"]

    first = run("incremental", PROMPTS[:4])
    assert first["regenerated"] == 4 and first["resumed"] == 0
    again = run("incremental", PROMPTS[:5])  # one new prompt
    assert again["resumed"] == 4 and again["regenerated"] == 1
    run("fresh", PROMPTS[:5])
    read = lambda name: (tmp_path / name / "samples.jsonl").read_text()  # noqa: E731
    assert read("incremental") == read("fresh")
    # Other settings (a longer budget) make earlier answers unusable: everything is regenerated.
    common[common.index("--max-new-tokens") + 1] = "16"
    assert run("incremental", PROMPTS[:5])["regenerated"] == 5


def test_a_data_parallel_regeneration_server_gets_a_batch_per_replica_and_cuda_graphs_on_gpus(
    tiny_verifier_dir, tmp_path, monkeypatch
):
    """With N data-parallel replicas behind one vLLM server, `--batch-size` requests per replica are in
    flight (before: one batch shared by all replicas); the server decodes in eager mode on the CPU
    build (as always here) and with CUDA graphs on the CUDA build (read through its metadata, faked)."""
    from speculators import precision
    from speculators.data.prepare import answer_generator, requests_in_flight
    from speculators.settings import PrepareSettings

    settings = PrepareSettings(
        sources=["demo:train"],
        output=str(tmp_path),
        verifier=str(tiny_verifier_dir("llama")),
        regenerate=True,
        backend="vllm",
        batch_size=8,
        data_parallel_size=4,
    )
    assert requests_in_flight(settings) == 32
    assert requests_in_flight(settings.model_copy(update={"backend": "transformers"})) == 8
    _, _, server = answer_generator(settings, tmp_path)  # the server is built, not started
    assert server.settings.enforce_eager and server.settings.extra_args == ["--data-parallel-size", "4"]
    cuda = {"distribution": "vllm", "version": "0.32.0", "device": "cuda"}
    monkeypatch.setattr(precision, "installed_vllm", lambda: cuda)
    _, _, server = answer_generator(settings, tmp_path)
    assert not server.settings.enforce_eager


def test_own_answers_for_training_and_the_verifiers_for_validation(tiny_verifier_dir, tmp_path, capsys):
    """--no-regenerate --regenerate-validation: training rows keep their own answers (tokenized as a
    plain prepare would), validation prompts get the verifier's greedy answers; a training row without
    an answer is rejected, a validation prompt is not; a rerun resumes the validation answers, and a
    full regeneration into the same folder takes none of this run's samples for the verifier's."""
    import json

    from speculators.cli import main
    from speculators.data.tokenization import tokenize_conversation

    verifier = str(tiny_verifier_dir("llama"))
    rows = tmp_path / "rows.jsonl"
    answered = [{"prompt": p, "response": f"Answer {i}: " + "word " * (i + 2)} for i, p in enumerate(PROMPTS[:3])]
    rows.write_text("".join(json.dumps(r) + "\n" for r in [*answered, {"prompt": "No answer here."}]))
    validation = tmp_path / "validation.jsonl"
    validation.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[3:]))
    out = tmp_path / "out"
    command = ["prepare", "--source", str(rows), "--validation-source", str(validation), "--verifier", verifier]
    command += ["--dtype", "float32", "--max-new-tokens", "12", "--max-length", "256", "--output", str(out)]

    def run(*flags: str) -> tuple[dict, list[dict]]:
        assert main([*command, *flags]) == 0
        report = json.loads((out / "prepare_report.json").read_text())
        return report, [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]

    report, samples = run("--regenerate-validation")
    assert report["prompts"]["rejected_total"] == 1 and report["prompts"]["validation"] == 2
    tokenization = report["tokenization"]
    assert tokenization["regeneration"]["regenerated"] == 2 and "own answers" in tokenization["answers"]
    assert [s["id"].startswith("validation-") for s in samples] == [True, True, False, False, False]
    llama = load_verifier(verifier, dtype="float32")
    ends = turn_end_ids(llama.tokenizer)
    for sample, prompt_text in zip(samples[:2], PROMPTS[3:], strict=True):
        prompt = render_ids(llama.tokenizer, [{"role": "user", "content": prompt_text}], add_generation_prompt=True)
        assert sample["input_ids"][: len(prompt)] == prompt
        assert sample["input_ids"][len(prompt) :] == greedy_reference(llama.model, prompt, 12, ends)
    for sample, row in zip(samples[2:], answered, strict=True):
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        own = tokenize_conversation(llama.tokenizer, sample["id"], messages, 256)
        assert (sample["input_ids"], sample["loss_mask"]) == (own.input_ids, own.loss_mask)

    again, same = run("--regenerate-validation")
    assert (
        again["tokenization"]["regeneration"]["resumed"] == 2
        and again["tokenization"]["regeneration"]["regenerated"] == 0
    )
    assert same == samples
    # The verifier answering everything: nothing of the mixed run is reused (its training answers are not its).
    full, regenerated = run("--regenerate")
    assert (
        full["tokenization"]["regeneration"]["regenerated"] == 6
        and full["tokenization"]["regeneration"]["resumed"] == 0
    )
    assert regenerated[:2] == samples[:2] and regenerated[2]["input_ids"] != samples[2]["input_ids"]
    # Own answers clipped as regeneration clips its own: the first 3 tokens of each, nothing after.
    report, short = run("--regenerate-validation", "--max-answer-tokens", "3")
    assert report["tokenization"]["clipped_answers"] == 3 and short[:2] == samples[:2]
    for clipped, whole in zip(short[2:], samples[2:], strict=True):
        end = whole["loss_mask"].index(1) + 3
        assert (clipped["input_ids"], clipped["loss_mask"]) == (whole["input_ids"][:end], whole["loss_mask"][:end])
    assert main([*command, "--regenerate", "--no-regenerate-validation"]) == 2
    assert "--no-regenerate-validation with --regenerate" in capsys.readouterr().err
    # Without the verifier answering validation, prompt-only validation rows are rejected as before.
    plain, _ = run("--no-regenerate")
    assert plain["prompts"]["rejected_total"] == 3 and plain["prompts"]["validation"] == 0


def test_clip_answers_ends_the_conversation_at_the_first_answer_over_the_budget():
    from speculators.data.tokenization import TokenizedSample, clip_answers

    sample = TokenizedSample("a", list(range(12)), [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1])
    assert clip_answers(sample, 4) is None
    clipped = clip_answers(sample, 3)
    assert clipped is not None and (clipped.input_ids, clipped.loss_mask) == (list(range(9)), sample.loss_mask[:9])
    assert clip_answers(sample, 1).loss_mask == [0, 0, 1]


def test_prepare_batch_size_defaults_to_what_each_backend_should_run():
    """`prepare --batch-size` unset: 256 conversations in flight with vLLM (every variant's setting, 1.66x the
    tokens/s of 64 on the CPU build in the same KV cache), 8 with transformers, whose padded batch keeps a KV
    cache for every prompt (256 would need ~12 GB for SmolLM2 in fp32); a value given is kept with either."""
    from speculators.data.prepare import requests_in_flight
    from speculators.settings import PrepareSettings

    vllm = PrepareSettings(sources=["demo:train"], output="out", verifier="v", regenerate=True, backend="vllm")
    assert vllm.batch_size is None and requests_in_flight(vllm) == 256
    assert requests_in_flight(vllm.model_copy(update={"data_parallel_size": 2})) == 512
    assert requests_in_flight(vllm.model_copy(update={"backend": "transformers"})) == 8
    assert requests_in_flight(vllm.model_copy(update={"batch_size": 16, "backend": "transformers"})) == 16
