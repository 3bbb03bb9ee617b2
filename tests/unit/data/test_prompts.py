"""Prompt sources: every shape, every rejection reason, dedup, data version, demo prompts, HF presets."""

from __future__ import annotations

import json

import pytest

from speculators.data.demo_prompts import TASKS, all_demo_prompts, demo_prompts
from speculators.data.prompt_set import prepare_conversations
from speculators.data.sources import HF_PRESETS
from speculators.errors import SpeculatorsError

SHAREGPT = {"conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]}
OPENAI = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
}
PARTS = {
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hi"},
    ]
}
SINGLE = {"prompt": "Name a colour.", "response": "Blue."}


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def test_every_shape_normalises_to_messages(tmp_path):
    conversations, report = prepare_conversations(
        [write_jsonl(tmp_path / "a.jsonl", [SHAREGPT, OPENAI, PARTS, SINGLE])]
    )
    assert report.kept == 4 and not report.rejected
    assert conversations[0].messages == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert conversations[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert conversations[2].messages[0]["content"] == "Say hi"
    assert conversations[3].messages == [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]


def test_json_list_json_object_parquet_and_folder(tmp_path):
    import datasets

    (tmp_path / "list.json").write_text(json.dumps([SHAREGPT]))
    (tmp_path / "object.json").write_text(json.dumps({"data": [OPENAI]}))
    datasets.Dataset.from_list([{"prompt": "Name a fruit.", "response": "Apple."}]).to_parquet(
        str(tmp_path / "t.parquet")
    )
    conversations, report = prepare_conversations([str(tmp_path)])
    assert report.rows_read == 3 and report.kept == 3
    assert {c.messages[-1]["content"] for c in conversations} == {"Hello!", "4", "Apple."}


def test_every_rejection_reason_is_counted_with_its_location(tmp_path):
    rows = [
        SHAREGPT,
        '{"messages": [ broken',
        {"messages": []},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        {"prompt": "No answer here"},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"text": "plain text"},
        {"messages": [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "ok"}]},
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
        "[1, 2]",
    ]
    _conversations, report = prepare_conversations([write_jsonl(tmp_path / "bad.jsonl", rows)])
    assert report.rows_read == 10 and report.kept == 1
    assert report.rejected == {
        "malformed JSON (Expecting value)": 1,
        "empty conversation": 1,
        "no user turn": 1,
        "no assistant turn": 1,
        "unknown role 'tool'": 1,
        "unrecognised shape (no conversations, messages or prompt)": 1,
        "assistant turn before the first user turn": 1,
        "unsupported message content part 'input_audio'": 1,
        "row is not an object": 1,
    }
    assert report.examples["malformed JSON (Expecting value)"] == ["bad.jsonl:2"]
    assert report.examples["no assistant turn"] == ["bad.jsonl:5"]
    assert report.rows_read == report.kept + report.duplicates + sum(report.rejected.values())


def test_unreadable_sources_are_one_error_naming_the_file(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00binary")
    for name, message in (("broken.parquet", "is not a readable Parquet file"), ("binary.jsonl", "is not UTF-8 text")):
        with pytest.raises(SpeculatorsError, match=message) as error:
            prepare_conversations([str(tmp_path / name)])
        assert str(tmp_path / name) in str(error.value) and "\n" not in str(error.value)


def test_prompt_only_rows_without_regeneration_point_to_it(tmp_path):
    _, report = prepare_conversations([write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi"}])])
    assert report.rejected == {"no assistant turn": 1}
    assert "--verifier V --regenerate" in report.summary()


def test_prompts_without_answers_are_kept_for_regeneration(tmp_path):
    conversations, report = prepare_conversations(
        [write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Hi"}])], require_assistant=False
    )
    assert report.kept == 1 and conversations[0].messages == [{"role": "user", "content": "Hi"}]


def test_trailing_unanswered_user_turn_is_cut_when_answers_are_required(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    }
    conversations, _ = prepare_conversations([write_jsonl(tmp_path / "p.jsonl", [row])])
    assert [m["content"] for m in conversations[0].messages] == ["a", "b"]


def test_deduplication_and_data_version(tmp_path):
    same_as_sharegpt = {
        "messages": [{"role": "user", "content": " Hi there "}, {"role": "assistant", "content": "Hello!"}]
    }
    _first, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", [SHAREGPT, same_as_sharegpt, OPENAI])])
    assert report.kept == 2 and report.duplicates == 1
    _reordered, report2 = prepare_conversations([write_jsonl(tmp_path / "b.jsonl", [OPENAI, SHAREGPT])])
    assert report2.data_version == report.data_version  # same set, other order and file
    _changed, report3 = prepare_conversations([write_jsonl(tmp_path / "c.jsonl", [OPENAI, SINGLE])])
    assert report3.data_version != report.data_version


def test_missing_source_and_unknown_extension_are_clear(tmp_path):
    with pytest.raises(SpeculatorsError, match="does not exist"):
        prepare_conversations([str(tmp_path / "missing.jsonl")])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(SpeculatorsError, match=r"not \.jsonl, \.json or \.parquet"):
        prepare_conversations([str(tmp_path / "data.csv")])


def test_demo_prompts_are_many_varied_deterministic_and_split():
    train, held_out = demo_prompts("train", seed=0), demo_prompts("eval", seed=0)
    assert len(set(train)) == len(train) >= 2000
    assert len(held_out) >= 200 and not set(train) & set(held_out)
    assert sorted(train) == sorted(demo_prompts("train", seed=1)) and train != demo_prompts("train", seed=1)
    assert train == demo_prompts("train", seed=0)
    assert len(train) + len(held_out) == len(all_demo_prompts())
    verbs = {task.split()[0] for task in TASKS}
    assert {"Explain", "Summarise", "Write", "List", "Compare", "Rewrite"} <= verbs
    for verb in ("Explain", "Summarise", "Write", "Compare", "Rewrite"):
        assert any(p.startswith(verb) for p in held_out), verb


def test_demo_source_through_prepare():
    conversations, report = prepare_conversations(["demo:eval"], require_assistant=False, max_samples=50)
    assert report.kept == 50 and all(c.messages[0]["role"] == "user" for c in conversations)
    with pytest.raises(SpeculatorsError, match="demo split 'test'"):
        prepare_conversations(["demo:test"], require_assistant=False)


def test_hf_presets_reach_datasets_with_their_arguments(monkeypatch):
    """The hub cannot be reached here: the call to `datasets` is checked, the rows parsed for real."""
    import datasets

    calls = []

    def fake_load_dataset(name, subset, split, streaming):
        calls.append((name, subset, split, streaming))
        return [
            {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]},
            {"conversations": []},
        ]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    _conversations, report = prepare_conversations(["hf:ultrachat"])
    assert calls == [(HF_PRESETS["ultrachat"][0], None, "train_sft", True)]
    assert report.kept == 1 and report.rejected == {"empty conversation": 1}
    prepare_conversations(["hf:sharegpt"], hf_split="train[:10]")
    assert calls[-1] == (HF_PRESETS["sharegpt"][0], None, "train[:10]", True)


def test_hf_failure_is_one_clear_error(monkeypatch):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach the hub\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(SpeculatorsError, match="could not load dataset 'acme/chats' \\(Couldn't reach the hub\\)"):
        prepare_conversations(["hf:acme/chats"])


def test_the_natural_evaluation_set_is_a_builtin_source_unlike_the_demo_generator():
    """`natural:eval`: hand-written prompts of many kinds, none of them a demo-generator prompt."""
    from speculators.data.demo_prompts import all_demo_prompts
    from speculators.data.prompt_set import load_prompts
    from speculators.data.sources import source_fingerprint

    conversations = load_prompts("natural:eval")
    prompts = [c.messages[-1]["content"] for c in conversations]
    assert len(prompts) >= 60 and len(set(prompts)) == len(prompts)
    generated = {" ".join(p.lower().split()) for p in all_demo_prompts()}
    for source in ("natural:eval", "natural:validation"):  # neither hand-written set shares a prompt with it
        written = {" ".join(c.messages[-1]["content"].lower().split()) for c in load_prompts(source)}
        assert not written & generated, source
    assert len({len(p.split()) for p in prompts}) > 20  # short questions to multi-sentence requests
    assert source_fingerprint("natural:eval") == source_fingerprint("natural:eval") != source_fingerprint("demo:eval")


def test_validation_sources_are_tagged_come_first_and_win_over_equal_training_rows(tmp_path):
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.train.data import is_validation

    training = tmp_path / "train.jsonl"
    shared = "Why does ice float on water?"  # also in natural:validation
    training.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [shared, "one", "two", "three"]))
    conversations, report = prepare_conversations(
        [str(training)], require_assistant=False, max_samples=2, validation_sources=["natural:validation"]
    )
    validation = [c for c in conversations if c.id.startswith(VALIDATION_PREFIX)]
    assert len(validation) == report.validation == 42 and conversations[:42] == validation
    # The shared prompt stays a validation sample only; max_samples counts the training rows.
    assert [c.messages[-1]["content"] for c in conversations[42:]] == ["one", "two"]
    assert report.duplicates == 1 and report.kept == 44 and "(42 for validation only)" in report.summary()
    assert all(is_validation(c.id, 0.0) for c in validation)
    assert not any(is_validation(c.id, 0.0) for c in conversations[42:])
    # The hidden-state step re-reads conversations.jsonl: the tags survive the round trip.
    written = tmp_path / "conversations.jsonl"
    written.write_text("".join(c.to_json() + "\n" for c in conversations))
    again, report = prepare_conversations([str(written)], require_assistant=False)
    assert [c.id for c in again] == [c.id for c in conversations] and report.validation == 42


# ----- image prompts (vision-language verifiers) -------------------------------------------------------


def png(path, colour=(255, 0, 0), size=(64, 64)):
    """A small PNG at `path`; returns its normalised image part's digest."""
    import hashlib

    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format="PNG")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def image(path, digest):
    return {"type": "image", "image": str(path.resolve()), "sha256": digest}


def text(value):
    return {"type": "text", "text": value}


def test_openai_image_parts_in_every_form_normalise_in_order(tmp_path, monkeypatch):
    red, blue, green = (
        png(tmp_path / "img" / f"{c}.png", colour)
        for c, colour in (("red", (255, 0, 0)), ("blue", (0, 0, 255)), ("green", (0, 255, 0)))
    )
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image_url", "image_url": {"url": "img/red.png"}},
                    {"type": "text", "text": " and "},
                    {"type": "image_url", "image_url": "img/blue.png"},
                    {"type": "image", "image": str(tmp_path / "img" / "green.png")},
                    {"type": "text", "text": "?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Red, blue, green."}]},
        ]
    }
    monkeypatch.chdir(tmp_path.parent)  # relative paths follow the file, not the working directory
    conversations, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", [row])])
    assert report.kept == 1 and not report.rejected
    assert conversations[0].messages == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                text("Look:"),
                image(tmp_path / "img" / "red.png", red),
                text("and"),
                image(tmp_path / "img" / "blue.png", blue),
                image(tmp_path / "img" / "green.png", green),
                text("?"),
            ],
        },
        {"role": "assistant", "content": "Red, blue, green."},  # text-only: still a plain string
    ]
    from speculators.data.messages import text_of

    assert text_of(conversations[0].messages[1]["content"]) == "Look:and?"


def test_llava_rows_put_each_image_at_its_placeholder_in_json_jsonl_and_parquet(tmp_path, monkeypatch):
    import datasets

    data = tmp_path / "data"
    cat, dog = png(data / "pics" / "cat.png", (10, 10, 10)), png(data / "pics" / "dog.png", (200, 200, 200))
    one = {
        "id": "llava-1",
        "image": "pics/cat.png",
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is this?"},
            {"from": "gpt", "value": "A cat."},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "Yes."},
        ],
    }
    two = {
        "image": ["pics/cat.png", "pics/dog.png"],
        "conversations": [
            {"from": "human", "value": "Compare <image> with <image>."},
            {"from": "gpt", "value": "Dark and light."},
        ],
    }
    none = {
        "image": "pics/dog.png",
        "conversations": [{"from": "human", "value": "Describe it."}, {"from": "gpt", "value": "Grey."}],
    }
    (data / "llava.json").write_text(json.dumps([one]))
    write_jsonl(data / "llava.jsonl", [two])
    datasets.Dataset.from_list([none]).to_parquet(str(data / "llava.parquet"))
    monkeypatch.chdir(tmp_path)
    conversations, report = prepare_conversations([str(data)])
    assert report.kept == 3 and not report.rejected
    by_text = {c.messages[-1]["content"]: c.messages for c in conversations}
    assert by_text["Yes."] == [
        {"role": "user", "content": [image(data / "pics" / "cat.png", cat), text("What is this?")]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    assert by_text["Dark and light."][0]["content"] == [
        text("Compare"),
        image(data / "pics" / "cat.png", cat),
        text("with"),
        image(data / "pics" / "dog.png", dog),
        text("."),
    ]
    # No placeholder at all: the LLaVA convention puts the image first in the first human turn.
    assert by_text["Grey."][0]["content"] == [image(data / "pics" / "dog.png", dog), text("Describe it.")]


def test_data_urls_and_file_urls(tmp_path):
    import base64

    digest = png(tmp_path / "x.png", (1, 2, 3))
    url = "data:image/png;base64," + base64.b64encode((tmp_path / "x.png").read_bytes()).decode()
    rows = [
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text("Colour?")]}
            ]
        },
        {"prompt": [{"type": "image", "image": (tmp_path / "x.png").as_uri()}, text("Which colour?")]},
    ]
    conversations, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", rows)], require_assistant=False)
    assert report.kept == 2 and not report.rejected
    assert conversations[0].messages[0]["content"] == [
        {"type": "image", "image": url, "sha256": digest},
        text("Colour?"),
    ]
    assert conversations[1].messages[0]["content"] == [image(tmp_path / "x.png", digest), text("Which colour?")]


def test_every_image_rejection_is_counted_with_its_reason_and_location(tmp_path):
    png(tmp_path / "ok.png")
    (tmp_path / "junk.png").write_bytes(b"this is not an image")
    answer = {"role": "assistant", "content": "fine"}

    def asking(*parts):
        return {"messages": [{"role": "user", "content": [*parts, text("What is it?")]}, answer]}

    rows = [
        asking({"type": "image_url", "image_url": {"url": "missing.png"}}),
        asking({"type": "image", "image": "junk.png"}),
        asking({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
        asking({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}),
        {
            "image": "ok.png",
            "conversations": [{"from": "human", "value": "<image> and <image>?"}, {"from": "gpt", "value": "x"}],
        },
        {
            "image": ["ok.png", "ok.png"],
            "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}],
        },
        {
            "messages": [
                {"role": "user", "content": "Draw"},
                {"role": "assistant", "content": [{"type": "image", "image": "ok.png"}]},
            ]
        },
        {"image": "ok.png", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<image>"}]},
        {
            "messages": [
                {"role": "system", "content": [{"type": "image", "image": "ok.png"}]},
                {"role": "user", "content": "?"},
                answer,
            ]
        },
        {
            "image": {"bytes": "...", "path": None},
            "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}],
        },
        asking({"type": "image"}),
        asking({"type": "image_url", "image_url": {}}),
        asking({"type": "image_url", "image_url": {"url": "ok.png"}}),  # the one good row
    ]
    _conversations, report = prepare_conversations([write_jsonl(tmp_path / "bad.jsonl", rows)])
    junk = next(
        reason
        for reason in report.rejected
        if reason.startswith(f"image {tmp_path / 'junk.png'} is not a readable image (")
    )
    assert report.kept == 1 and report.rows_read == 13
    assert report.rejected == {
        f"image {tmp_path / 'missing.png'} does not exist": 1,
        junk: 1,
        "image https://example.com/cat.png is a remote URL; download it and give the local path": 1,
        "image data URL has invalid base64": 1,
        "2 <image> placeholders for 1 images": 1,
        "1 <image> placeholders for 2 images": 1,
        "image in an assistant turn": 2,
        "image in a system turn": 1,
        "images in dataset rows must be paths or data URLs": 1,
        "an image part has no image (give 'image' a path or data URL)": 1,
        "an image_url part has no url": 1,
    }
    assert report.examples[f"image {tmp_path / 'missing.png'} does not exist"] == ["bad.jsonl:1"]
    assert report.examples[junk] == ["bad.jsonl:2"]
    assert report.examples["2 <image> placeholders for 1 images"] == ["bad.jsonl:5"]
    assert report.examples["image in an assistant turn"] == ["bad.jsonl:7", "bad.jsonl:8"]
    assert f"image {tmp_path / 'missing.png'} does not exist (e.g. bad.jsonl:1)" in report.summary()


def test_dataset_rows_with_decoded_images_are_rejected_with_the_reason(monkeypatch):
    import datasets
    from PIL import Image

    picture = Image.new("RGB", (32, 32))
    rows = [
        {"image": picture, "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "x"}]},
        {"images": [picture], "messages": [{"role": "user", "content": [{"type": "image"}, text("?")]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": picture}, text("?")]}]},
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows)
    _conversations, report = prepare_conversations(["hf:acme/vl"], require_assistant=False)
    assert report.rejected == {"images in dataset rows must be paths or data URLs": 3}
    assert report.examples["images in dataset rows must be paths or data URLs"] == [
        "acme/vl[0]",
        "acme/vl[1]",
        "acme/vl[2]",
    ]


def test_conversation_ids_follow_image_bytes_not_paths(tmp_path):
    import base64

    from speculators.data.conversation import conversation_id

    png(tmp_path / "a.png", (9, 9, 9))
    png(tmp_path / "copy" / "same.png", (9, 9, 9))
    png(tmp_path / "other.png", (9, 9, 10))
    url = "data:image/png;base64," + base64.b64encode((tmp_path / "a.png").read_bytes()).decode()

    def row(reference):
        return {"messages": [{"role": "user", "content": [{"type": "image", "image": reference}, text("Colour?")]}]}

    rows = [row("a.png"), row("copy/same.png"), row(url), row("other.png")]
    conversations, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", rows)], require_assistant=False)
    assert report.kept == 2 and report.duplicates == 2  # same bytes at another path, or inline: same conversation
    assert conversations[0].messages[0]["content"][0]["image"] == str(tmp_path / "a.png")  # the first one seen
    assert conversations[0].id != conversations[1].id  # other bytes, other id
    assert conversation_id([{"role": "user", "content": "Colour?"}]) not in {c.id for c in conversations}


def test_text_only_conversation_ids_are_what_they_were():
    """Ids and data versions computed by the code before image prompts existed (commit dd54071)."""
    from speculators.data.conversation import conversation_id
    from speculators.data.messages import parse_row

    assert conversation_id(parse_row(OPENAI, True)) == "69dac6c5253cb8d5b45d"
    assert conversation_id(parse_row(SHAREGPT, True)) == "efb17071a837fc830a06"
    assert conversation_id(parse_row(PARTS, True)) == "e21788efbf50871ece6a"
    _conversations, report = prepare_conversations(["natural:eval"], require_assistant=False)
    assert report.data_version == "64b41c0c3101507c"
    # A literal <image> in a row without images of its own is text.
    assert parse_row({"prompt": "What does <image> do in LLaVA data?"}, False)[0]["content"] == (
        "What does <image> do in LLaVA data?"
    )


def test_prepared_image_conversations_read_back_unchanged(tmp_path):
    """The hidden-state step re-reads conversations.jsonl: normalised image parts parse to themselves."""
    png(tmp_path / "a.png")
    row = {
        "image": "a.png",
        "conversations": [{"from": "human", "value": "<image>Hm?"}, {"from": "gpt", "value": "Red."}],
    }
    conversations, _ = prepare_conversations([write_jsonl(tmp_path / "src.jsonl", [row])])
    written = tmp_path / "out" / "conversations.jsonl"
    written.parent.mkdir()
    written.write_text("".join(c.to_json() + "\n" for c in conversations))
    again, report = prepare_conversations([str(written)], image_roots=[tmp_path])  # (the images' folder)
    assert report.kept == 1 and [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in conversations]


def test_prompt_messages_and_openai_messages_with_image_parts(tmp_path):
    import base64

    from speculators.data.conversation import prompt_messages
    from speculators.verifier.vision import openai_messages

    digest = png(tmp_path / "a.png")
    url = "data:image/png;base64,AAAA"
    messages = [
        {"role": "user", "content": [image(tmp_path / "a.png", digest), text("What?")]},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": [{"type": "image", "image": url, "sha256": "0" * 16}, text("And this?")]},
        {"role": "assistant", "content": "Blue."},
    ]
    assert prompt_messages(messages) == messages[:3]
    # local files go as data URLs: the server needs no access to the path
    encoded = base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    assert openai_messages(messages) == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encoded}},
                text("What?"),
            ],
        },
        messages[1],
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text("And this?")]},
        messages[3],
    ]
    assert openai_messages(OPENAI["messages"]) == OPENAI["messages"]


def test_demo_vl_rows_are_deterministic_split_and_small_images():
    import time

    from speculators.data.demo_images import ROWS, demo_image_rows, split_rows
    from speculators.verifier.vision import load_image

    split_rows.cache_clear()
    started = time.perf_counter()
    held_out = demo_image_rows("eval")
    assert time.perf_counter() - started < 5  # measured ~0.2 s
    train = demo_image_rows("train")
    assert len(held_out) == ROWS["eval"] == 40 and len(train) == ROWS["train"] >= 200
    split_rows.cache_clear()
    assert demo_image_rows("eval") == held_out  # drawn again, the same bytes
    reordered = demo_image_rows("eval", seed=1)
    assert reordered != held_out and sorted(map(json.dumps, reordered)) == sorted(map(json.dumps, held_out))
    assert {row["kind"] for row in held_out} == {"bar_chart", "shapes", "text", "two_images"}

    conversations, report = prepare_conversations(["demo-vl:train", "demo-vl:eval"], require_assistant=False)
    assert report.kept == len(train) + len(held_out) and report.duplicates == 0 and not report.rejected
    by_split = {"train": conversations[: len(train)], "eval": conversations[len(train) :]}
    assert not {c.id for c in by_split["train"]} & {c.id for c in by_split["eval"]}
    digests = {
        split: {p["sha256"] for c in rows for p in c.messages[0]["content"] if p["type"] == "image"}
        for split, rows in by_split.items()
    }
    assert not digests["train"] & digests["eval"]  # no eval image is a training image
    sides = {64, 96, 128, 160, 192, 224}
    for c in conversations:
        (message,) = c.messages
        assert message["role"] == "user" and message["content"][-1]["type"] == "text"
        images = message["content"][:-1]
        assert 1 <= len(images) <= 2 and all(p["image"].startswith("data:image/png;base64,") for p in images)
        for part in images:
            width, height = load_image(part).size
            assert width in sides and height in sides, (width, height)
    assert sum(len(c.messages[0]["content"]) == 3 for c in by_split["eval"]) >= 3  # a few with two images


def test_demo_vl_source_names_and_fingerprints():
    from speculators.data.prompt_set import load_prompts
    from speculators.data.sources import source_fingerprint

    prompts = load_prompts("demo-vl:eval", max_prompts=5)
    assert len(prompts) == 5 and all(isinstance(p.messages[0]["content"], list) for p in prompts)
    for bad in ("demo-vl:test", "demo-vl"):
        with pytest.raises(SpeculatorsError, match="is not demo-vl:train or demo-vl:eval"):
            prepare_conversations([bad], require_assistant=False)
    assert isinstance(load_prompts("demo:eval", max_prompts=1)[0].messages[0]["content"], str)  # demo: is text
    fingerprints = {s: source_fingerprint(s) for s in ("demo-vl:eval", "demo-vl:train", "demo:eval")}
    assert len(set(fingerprints.values())) == 3 and source_fingerprint("demo-vl:eval") == fingerprints["demo-vl:eval"]


def test_max_samples_is_shared_among_sources_by_weight_and_a_short_source_leaves_its_rest(tmp_path):
    from speculators.data.prompt_set import source_quotas

    assert source_quotas(10, [1, 1, 1]) == [4, 3, 3] and source_quotas(7, [3, 1]) == [5, 2]
    assert sum(source_quotas(1_000_003, [0.7, 0.2, 0.1])) == 1_000_003
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": f"big {i}"} for i in range(50)])
    small = write_jsonl(tmp_path / "small.jsonl", [{"prompt": f"small {i}"} for i in range(3)] + ["{not json"])
    on_disk = write_jsonl(tmp_path / "disk.jsonl", [{"prompt": f"disk {i}"} for i in range(40)])

    def texts(conversations):
        return [c.messages[0]["content"] for c in conversations]

    # Equal shares by default: both sources are represented (not the first source alone).
    conversations, report = prepare_conversations([big, on_disk], require_assistant=False, max_samples=10)
    assert texts(conversations) == [f"big {i}" for i in range(5)] + [f"disk {i}" for i in range(5)]
    assert report.per_source == [
        {"source": big, "kept": 5, "wanted": 5, "exhausted": False},
        {"source": on_disk, "kept": 5, "wanted": 5, "exhausted": False},
    ]
    # Weights 3:1 of 8 -> 6 and 2.
    conversations, _ = prepare_conversations(
        [big, on_disk], require_assistant=False, max_samples=8, source_weights=[3, 1]
    )
    assert texts(conversations) == [f"big {i}" for i in range(6)] + ["disk 0", "disk 1"]
    # A source with fewer usable rows than its share (3 of 6 wanted; its bad row counted) leaves the
    # rest to the others by their weights: 18 in all.
    conversations, report = prepare_conversations(
        [big, small, on_disk], require_assistant=False, max_samples=18, source_weights=[1, 1, 1]
    )
    assert report.kept == 18 and texts(conversations).count("small 0") == 1
    assert [entry["kept"] for entry in report.per_source] == [8, 3, 7]
    assert report.per_source[1] == {"source": small, "kept": 3, "wanted": 6, "exhausted": True}
    assert sum(report.rejected.values()) == 1
    assert f"{small}: kept 3 of 6 wanted (ran out of rows)" in report.summary()
    # Not enough rows anywhere: everything is kept, each short source says so.
    conversations, report = prepare_conversations([small, on_disk], require_assistant=False, max_samples=100)
    assert report.kept == 43 and all(entry["exhausted"] for entry in report.per_source)
    # Without max_samples every row of every source is kept, in source order.
    conversations, report = prepare_conversations([small, on_disk], require_assistant=False)
    assert texts(conversations)[:4] == ["small 0", "small 1", "small 2", "disk 0"] and report.kept == 43


def test_bad_source_weights_are_one_clear_error(tmp_path, capsys):
    from speculators.cli import main

    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a"}])
    two = write_jsonl(tmp_path / "two.jsonl", [{"prompt": "b"}])
    with pytest.raises(SpeculatorsError, match="3 source weights for 2 sources: give one weight per source"):
        prepare_conversations([one, two], max_samples=2, source_weights=[1, 1, 1])
    with pytest.raises(SpeculatorsError, match=r"source weights share max_samples among the sources: set max_samples"):
        prepare_conversations([one, two], source_weights=[1, 1])
    with pytest.raises(SpeculatorsError, match=r"source weights must all be positive, not \[1, 0\]"):
        prepare_conversations([one, two], max_samples=2, source_weights=[1, 0])
    base = ["prepare", "--source", one, "--source", two, "--output", str(tmp_path / "out")]
    for extra, message in (
        (["--max-samples", "2", "--source-weights", "1,2,3"], "3 source weights for 2 sources"),
        (["--source-weights", "1,1"], "set max_samples (--max-samples) too"),
        (["--max-samples", "2", "--source-weights", "1,0"], "greater than 0"),
        (["--max-samples", "2", "--source-weights", "1,x"], "'1,x' is not a comma-separated list of float"),
    ):
        try:
            code = main([*base, *extra])
        except SystemExit as exit_info:  # argparse's own type errors
            code = exit_info.code
        error = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in error[-1], (extra, error)
    assert not (tmp_path / "out" / "conversations.jsonl").exists()


def test_a_token_budget_keeps_the_shortest_training_samples_and_every_validation_one(
    tmp_path, tiny_verifier_dir, capsys
):
    """prepare --max-train-tokens N --prefer shortest (the demo's data): the shortest training samples, ties in
    the sources' order, until their tokens reach N (the one that crosses N is the last), kept in the sources'
    order; validation samples are all kept; what was left out is counted in the report."""
    from speculators.cli import main
    from speculators.data.conversation import VALIDATION_PREFIX
    from speculators.data.tokenization import TokenizedSample

    answers = ["one two three four five six seven eight", "one", "one two three", "one two", "one", "one two three"]
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": a}]}
        for i, a in enumerate(answers)
    ]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    held_out = [{"role": "user", "content": "held out"}, {"role": "assistant", "content": "yes"}]
    validation = write_jsonl(tmp_path / "validation.jsonl", [{"messages": held_out}])
    verifier = str(tiny_verifier_dir("llama"))
    common = ["prepare", "--source", source, "--validation-source", validation, "--verifier", verifier]

    def samples(out):
        lines = (out / "samples.jsonl").read_text().splitlines()
        return [TokenizedSample.from_row(json.loads(line)) for line in lines]

    assert main([*common, "--output", str(tmp_path / "all")]) == 0
    every = samples(tmp_path / "all")
    training = [s for s in every if not s.id.startswith(VALIDATION_PREFIX)]
    length = {s.id: len(s.input_ids) for s in training}
    assert len(training) == 6 and len(every) == 7
    # Rows 1 and 4 are the same length (ties keep the order); a budget one token past the three shortest.
    by_length = sorted(training, key=lambda s: len(s.input_ids))
    assert [s.id for s in by_length[:2]] == [training[1].id, training[4].id]
    budget = sum(length[s.id] for s in by_length[:3]) + 1

    shortest = ["--max-train-tokens", str(budget), "--prefer", "shortest"]
    assert main([*common, "--output", str(tmp_path / "short"), *shortest]) == 0
    kept = samples(tmp_path / "short")
    wanted = {s.id for s in by_length[:4]}  # the fourth crosses the budget: the last one kept
    assert [s.id for s in kept] == [s.id for s in every if s.id in wanted or s.id.startswith(VALIDATION_PREFIX)]
    assert [s.input_ids for s in kept if s.id in wanted] == [s.input_ids for s in training if s.id in wanted]
    report = json.loads((tmp_path / "short" / "prepare_report.json").read_text())["tokenization"]
    tokens = sum(length[i] for i in wanted)
    assert report["token_budget"] == {
        "max_train_tokens": budget,
        "prefer": "shortest",
        "training_samples": 6,
        "kept": 4,
        "kept_tokens": tokens,
        "left_out": 2,
        "left_out_tokens": sum(length.values()) - tokens,
    }
    assert f"kept the shortest 4 of 6 training samples: {tokens} tokens" in capsys.readouterr().out
    # The Dagster step shows the count as the store's metadata.
    from speculators.data.records import PreparedDataReport
    from speculators_assets.workload import token_budget_metadata

    def tokenization(out):
        return PreparedDataReport.model_validate_json((out / "prepare_report.json").read_bytes()).tokenization

    budget_read = tokenization(tmp_path / "short").token_budget
    assert token_budget_metadata(budget_read) == {
        "token_budget": f"{budget} tokens, shortest first",
        "kept_by_token_budget": 4,
        "left_out_by_token_budget": 2,
        "left_out_tokens": sum(length.values()) - tokens,
    }
    assert tokenization(tmp_path / "all").token_budget is None

    # In the sources' order: the first samples until the budget (one token past the first sample: two of them).
    budget = length[training[0].id] + 1
    assert main([*common, "--output", str(tmp_path / "first"), "--max-train-tokens", str(budget)]) == 0
    first = [s.id for s in samples(tmp_path / "first")]
    two = (training[0].id, training[1].id)
    assert first == [s.id for s in every if s.id in two or s.id.startswith(VALIDATION_PREFIX)]

    # Settings that would do nothing are one line each, and write nothing.
    for extra, message in (
        (["--prefer", "shortest"], "prefer shortest keeps every sample without a token budget: set max_train_tokens"),
        (["--max-train-tokens", "0"], "greater than 0"),
    ):
        assert main([*common, "--output", str(tmp_path / "bad"), *extra]) == 2
        assert message in capsys.readouterr().err.strip().splitlines()[-1]
    no_verifier = ["prepare", "--source", source, "--output", str(tmp_path / "bad"), "--max-train-tokens", "9"]
    assert main(no_verifier) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--max-train-tokens works on tokenized samples, which only a verifier's tokenizer makes: pass" in error
    assert not (tmp_path / "bad").exists()
