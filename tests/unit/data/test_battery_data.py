"""Hostile and careless input to the prompt-reading stage: oversized rows, truncated or broken JSON, text
longer than any sample can hold, FIFOs, devices, decompression bombs and images outside the data folder
must end as counted rejections or one clear error, never a hang, a memory blow-up or a traceback.

The byte limits are monkeypatched down to a few KiB, so no test writes more than a megabyte.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from speculators.data import prompt_set, sources, tokenization
from speculators.data import rows as source_rows
from speculators.data.conversation import Conversation
from speculators.data.prompt_set import prepare_conversations
from speculators.errors import SpeculatorsError
from speculators.verifier import vision
from tests.unit.shared.test_battery import one_error, run

ANSWER = {"role": "assistant", "content": "fine"}


def write_jsonl(path: Path, rows: list) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def single(prompt: str, response: str = "ok") -> dict:
    return {"prompt": prompt, "response": response}


def png(path: Path, size: tuple[int, int] = (16, 16), colour: tuple[int, int, int] = (200, 0, 0)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, format="PNG")
    return path


def image_row(reference: str) -> dict:
    """A row whose user turn shows one image (by path, file:// URL or data URL)."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": reference}, {"type": "text", "text": "What?"}]},
            ANSWER,
        ]
    }


@pytest.fixture
def small_rows(monkeypatch):
    """Rows over 2 KiB are oversized; files are read 512 bytes at a time."""
    monkeypatch.setattr(source_rows, "MAX_ROW_BYTES", 2048)
    monkeypatch.setattr(source_rows, "READ_CHUNK_BYTES", 512)
    return "row larger than 2 KiB"


def peak_bytes(function) -> int:
    """The most memory Python allocated while `function` ran."""
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ----- bounded rows: JSONL --------------------------------------------------------------------------------


def test_an_oversized_jsonl_line_is_a_counted_row_and_the_rows_around_it_are_kept(tmp_path, small_rows):
    rows = [single("first"), single("big", "a" * 5000), single("third"), single("tail", "b" * 3000)]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))  # the oversized last line has no newline
    conversations, report = prepare_conversations([str(path)])
    assert [c.messages[0]["content"] for c in conversations] == ["first", "third"]
    assert report.rows_read == 4 and report.rejected == {small_rows: 2}
    assert report.examples[small_rows] == ["rows.jsonl:2", "rows.jsonl:4"]
    # a line of exactly the limit is a row like any other
    exact = json.dumps(single("x", ""))
    exact = json.dumps(single("x", "y" * (2048 - len(exact))))
    assert len(exact) == 2048
    _, report = prepare_conversations([write_jsonl(tmp_path / "exact.jsonl", [exact])])
    assert report.kept == 1 and not report.rejected


def test_an_oversized_jsonl_line_is_never_held_in_memory(tmp_path, small_rows):
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as handle:
        for index in range(3):
            handle.write(json.dumps(single(f"p{index}", "z" * 400_000)) + "\n")
        handle.write(json.dumps(single("small")) + "\n")
    rows: list = []
    peak = peak_bytes(lambda: rows.extend(source_rows.iter_file_rows(path)))
    assert [type(row).__name__ for _, row in rows] == ["RowRejected"] * 3 + ["dict"]
    assert peak < 100_000, peak  # one line is 400 KB: read and skipped in 512-byte pieces


# ----- bounded rows: .json ---------------------------------------------------------------------------------


def test_json_elements_are_read_one_by_one_an_oversized_one_counted_and_the_rest_kept(tmp_path, small_rows):
    rows = [single("one"), single("big", "x" * 5000), single("three"), [1, 2], "text"]
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=1))
    conversations, report = prepare_conversations([str(tmp_path / "rows.json")])
    assert [c.messages[0]["content"] for c in conversations] == ["one", "three"]
    assert report.rejected == {small_rows: 1, "row is not an object": 2}
    assert report.examples[small_rows] == ["rows.json[1]"]
    big = tmp_path / "big.json"
    big.write_text(json.dumps([single("a", "q" * 600_000), single("b")]))
    rows_read: list = []
    peak = peak_bytes(lambda: rows_read.extend(source_rows.iter_file_rows(big)))
    assert [type(row).__name__ for _, row in rows_read] == ["RowRejected", "dict"] and peak < 100_000, peak


def test_a_truncated_json_file_gives_its_complete_rows_then_one_counted_row(tmp_path, small_rows):
    whole = json.dumps([single(f"prompt {i}", 'answer with "quotes" and \\ slashes') for i in range(6)])
    for cut in (whole.index('{"prompt": "prompt 4"') + 30, whole.index('{"prompt": "prompt 4"') - 2, len(whole) - 1):
        (tmp_path / "cut.json").write_text(whole[:cut])
        _, report = prepare_conversations([str(tmp_path / "cut.json")])
        assert report.kept == (4 if cut < len(whole) - 1 else 6), cut
        assert report.rejected == {source_rows.TRUNCATED_JSON: 1}
        assert report.examples[source_rows.TRUNCATED_JSON] == [f"cut.json[{report.kept}]"]
    (tmp_path / "object.json").write_text(json.dumps({"data": [single("a"), single("b")]})[:-30])
    _, report = prepare_conversations([str(tmp_path / "object.json")])
    assert report.kept == 1 and report.rejected == {source_rows.TRUNCATED_JSON: 1}


def test_a_json_object_holding_one_list_is_read_and_other_shapes_are_one_error(tmp_path, small_rows):
    holder = {"meta": {"rows": "not these", "nested": [1, 2]}, "data": [single("a"), single("b")], "n": "x" * 5000}
    (tmp_path / "object.json").write_text(json.dumps(holder))
    conversations, report = prepare_conversations([str(tmp_path / "object.json")])
    assert [c.messages[0]["content"] for c in conversations] == ["a", "b"] and not report.rejected
    problems = {
        "two.json": ('{"a": [], "b": []}', "is a JSON object without exactly one list of rows; pass a list"),
        "none.json": ('{"a": 1}', "is a JSON object without exactly one list of rows; pass a list"),
        "scalar.json": ("42", "is not a JSON list of rows or an object holding one"),
        "empty.json": ("  \n", r"is empty; pass a JSON list of rows"),
        "glued.json": ('[{"prompt": "a"}\n {"prompt": "b"}]', r"line 2: expected ',' or '\]' after row 0"),
        "stray.json": ('[{"prompt": "a"}, ]', r"line 1: a comma before '\]'"),
        "more.json": ('[{"prompt": "a"}] []', r"line 1: more data after the rows"),
    }
    for name, (text, message) in problems.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SpeculatorsError, match=message) as error:
            prepare_conversations([str(tmp_path / name)])
        assert str(tmp_path / name) in str(error.value) and "\n" not in str(error.value)


def test_a_malformed_json_element_whose_brackets_close_is_a_counted_row(tmp_path, monkeypatch):
    deep = "[" * 3000 + "]" * 3000  # valid JSON nested deeper than Python decodes
    text = '[{"prompt": "a", "response": "b"}, {"prompt": "bad",}, ' + deep + ', {"prompt": "c", "response": "d"}]'
    (tmp_path / "rows.json").write_text(text)
    monkeypatch.setattr(source_rows, "READ_CHUNK_BYTES", 512)
    conversations, report = prepare_conversations([str(tmp_path / "rows.json")])
    assert [c.messages[0]["content"] for c in conversations] == ["a", "c"]
    assert report.rejected == {
        "malformed JSON (Expecting property name enclosed in double quotes)": 1,
        "malformed JSON (nested too deeply)": 1,
    }
    assert report.examples["malformed JSON (nested too deeply)"] == ["rows.json[2]"]


def test_json_strings_with_escapes_and_brackets_split_across_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(source_rows, "READ_CHUNK_BYTES", 3)
    rows = [single('a \\" ] } [ { \\\\', 'b "]}"'), single("\\", '\\\\"'), single("é 漢字 \u2028", "ok")]
    for name, data in (("list.json", rows), ("object.json", {"rows": rows})):
        (tmp_path / name).write_text("\ufeff" + json.dumps(data, ensure_ascii=False))
        got = [row for _, row in source_rows.iter_file_rows(tmp_path / name)]
        assert got == rows


# ----- bounded text before the tokenizer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_verifier_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier_dir("llama"))


def spy_templates(monkeypatch, tokenizer, uncounted: tuple[str, ...] = ()) -> list[int]:
    """The message text (characters; messages of the `uncounted` roles left out) of every chat-template
    call on `tokenizer`, recorded: all the text the tokenizer is given comes through there."""
    seen: list[int] = []
    original = tokenizer.apply_chat_template

    def spy(messages, *args, **kwargs):
        seen.append(sum(tokenization.text_length(m["content"]) for m in messages if m["role"] not in uncounted))
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    return seen


def unclipped(monkeypatch):
    """Tokenization without the bound (as before it existed): no token is shorter than a billion chars."""
    monkeypatch.setattr(tokenization, "longest_token_chars", lambda tokenizer: 10**9)


PROSE = (
    "The verifier checks every drafted token in one forward pass, and the drafter proposes the next few. "
    "When they agree the output moves ahead by several tokens at once; when they differ, nothing is lost. "
    "Numbers like 1234567 and symbols such as {[(<>)]} appear too, with\nnew lines and\ttabs between words. "
)


def test_the_longest_token_bounds_the_text_and_is_measured_once(tokenizer, monkeypatch):
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert tokenization.longest_token_chars(tokenizer) == longest >= len("<|start_header_id|>")
    assert tokenization.text_limit(tokenizer, 100) == 100 * longest + tokenization.TEXT_MARGIN_CHARS
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: pytest.fail("the vocabulary was read again"))
    assert tokenization.longest_token_chars(tokenizer) == longest


def test_a_long_conversation_reaches_the_tokenizer_clipped_with_the_same_first_tokens(tokenizer, monkeypatch):
    max_length = 96
    limit = tokenization.text_limit(tokenizer, max_length)
    messages = [
        {"role": "user", "content": "Summarise this: " + PROSE[:60]},
        {"role": "assistant", "content": PROSE * 40},  # ~12k characters, far past the limit
        {"role": "user", "content": "And again?"},
        {"role": "assistant", "content": "Yes."},
    ]
    seen = spy_templates(monkeypatch, tokenizer)
    clipped = tokenization.tokenize_conversation(tokenizer, "x", messages, max_length)
    assert seen and max(seen) <= limit < sum(tokenization.text_length(m["content"]) for m in messages)
    unclipped(monkeypatch)
    whole = tokenization.tokenize_conversation(tokenizer, "x", messages, max_length)
    assert len(whole.input_ids) == max_length and max(seen) > limit  # (the reference saw everything)
    assert (clipped.input_ids, clipped.loss_mask) == (whole.input_ids, whole.loss_mask)


def test_conversations_within_the_bound_tokenize_exactly_as_before(tokenizer, monkeypatch):
    conversations = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": PROSE},
            {"role": "assistant", "content": PROSE[:150]},
            {"role": "user", "content": "More?"},
            {"role": "assistant", "content": PROSE[150:]},
        ],
        [{"role": "user", "content": PROSE * 3}, {"role": "assistant", "content": PROSE * 3}],
    ]
    for max_length in (16, 64, 512):
        bounded = []
        for index, messages in enumerate(conversations):
            try:
                bounded.append(tokenization.tokenize_conversation(tokenizer, str(index), messages, max_length))
            except source_rows.RowRejected as reason:
                bounded.append(str(reason))
        with monkeypatch.context() as patch:
            unclipped(patch)
            before = []
            for index, messages in enumerate(conversations):
                try:
                    before.append(tokenization.tokenize_conversation(tokenizer, str(index), messages, max_length))
                except source_rows.RowRejected as reason:
                    before.append(str(reason))
        assert bounded == before, max_length


def test_an_answer_clipped_away_is_still_rejected_as_over_length(tokenizer, monkeypatch):
    seen = spy_templates(monkeypatch, tokenizer)
    messages = [{"role": "user", "content": "x" * 200_000}, {"role": "assistant", "content": "late"}]
    with pytest.raises(source_rows.RowRejected, match=r"^over-length \(the prompt alone exceeds max length 32\)$"):
        tokenization.tokenize_conversation(tokenizer, "x", messages, 32)
    assert max(seen, default=0) <= tokenization.text_limit(tokenizer, 32)


def test_regeneration_rejects_a_prompt_past_the_bound_without_tokenizing_it(tokenizer, monkeypatch, tmp_path):
    from speculators.data.regenerate import regenerate

    end = sorted(tokenization.turn_end_ids(tokenizer))[0]
    prompted: list[int] = []

    def generate(batch):
        prompted.extend(len(ids) for ids in batch)
        return [[5, 6, end] for _ in batch]

    seen = spy_templates(monkeypatch, tokenizer, uncounted=("assistant",))  # (generated answers are not clipped)
    max_length = 64
    limit = tokenization.text_limit(tokenizer, max_length)
    huge = Conversation("huge", [{"role": "user", "content": "y" * (limit + 1)}])
    later = Conversation(
        "later",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old answer " * 5000},  # replaced, not counted
            {"role": "user", "content": "z " * 100_000},
        ],
    )
    short = Conversation("short", [{"role": "user", "content": "Hello"}])
    samples, report = regenerate([huge, later, short], tokenizer, generate, tmp_path / "p.jsonl", max_length, 4, False)
    assert report.rejected == {"over-length (the prompt alone exceeds max length 64)": 1}
    assert [s.id for s in samples] == ["later", "short"]
    assert max(seen) <= limit  # the huge prompt never reached the template or the tokenizer
    assert max(prompted) < max_length  # no generation from a prompt already past the sample's end
    assert all(len(s.input_ids) <= max_length for s in samples)


# ----- images: regular files of bounded size ---------------------------------------------------------------


def test_a_decompression_bomb_rejects_its_row_and_the_next_row_is_kept(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    png(tmp_path / "warned.png", (40, 40))  # 1600 pixels: PIL only warns between the limit and twice it
    png(tmp_path / "bomb.png", (64, 64))  # 4096 pixels: PIL raises
    png(tmp_path / "fine.png", (20, 20))
    rows = [image_row("warned.png"), image_row("bomb.png"), image_row("fine.png")]
    conversations, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", rows)])
    assert report.kept == 1 and conversations[0].messages[0]["content"][0]["image"] == str(tmp_path / "fine.png")
    assert report.rejected == {vision.TOO_MANY_PIXELS: 2}
    assert report.examples[vision.TOO_MANY_PIXELS] == ["a.jsonl:1", "a.jsonl:2"]
    digest = hashlib.sha256((tmp_path / "bomb.png").read_bytes()).hexdigest()[:16]
    with pytest.raises(SpeculatorsError) as error:
        vision.load_image({"type": "image", "image": str(tmp_path / "bomb.png"), "sha256": digest})
    assert vision.TOO_MANY_PIXELS in str(error.value) and "\n" not in str(error.value)


def test_images_over_the_size_limit_are_refused_as_files_and_as_data_urls(tmp_path, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(vision, "MAX_IMAGE_BYTES", 1024)
    noise = Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3))
    noise.save(tmp_path / "big.png")
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    png(tmp_path / "small.png", (8, 8))
    rows = [image_row("big.png"), image_row(url), image_row("small.png")]
    _, report = prepare_conversations([write_jsonl(tmp_path / "a.jsonl", rows)])
    assert report.kept == 1 and report.rejected == {"image larger than 1 KiB": 2}
    part = {"image": str(tmp_path / "big.png"), "sha256": hashlib.sha256(b"").hexdigest()[:16]}
    with pytest.raises(
        SpeculatorsError, match=r"big.png cannot be used \(image larger than 1 KiB\); restore it or run prepare again$"
    ):
        vision.load_image(part)


def test_dev_zero_is_refused_as_an_image_and_as_a_source(tmp_path):
    rows = [image_row("/dev/zero"), image_row(str(png(tmp_path / "ok.png")))]
    source = write_jsonl(tmp_path / "a.jsonl", rows)
    _, report = prepare_conversations([source])  # outside the data folder, before anything is read
    assert report.rejected == {vision.OUTSIDE_ROOTS: 1} and report.kept == 1
    _, report = prepare_conversations([source], image_roots=["/dev"])
    assert report.rejected == {vision.NOT_A_REGULAR_FILE: 1} and report.kept == 1
    with pytest.raises(SpeculatorsError, match="is not a regular file") as error:
        vision.load_image({"image": "/dev/zero", "sha256": "0" * 16})
    assert "/dev/zero" in str(error.value)
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    for name in ("zero.jsonl", "zero.json"):
        with pytest.raises(SpeculatorsError, match=r"is a character device, not a regular file; pass a") as error:
            prepare_conversations([str(tmp_path / name)])
        assert str(tmp_path / name) in str(error.value)
    with pytest.raises(SpeculatorsError, match=r"^/dev/zero is not \.jsonl, \.json or \.parquet"):
        prepare_conversations(["/dev/zero"])


def test_a_source_without_read_permission_is_one_error(tmp_path, monkeypatch):
    source = Path(write_jsonl(tmp_path / "locked.jsonl", [single("a")]))
    original = os.open

    def denied(path, *args, **kwargs):  # (root reads anything: the refusal is simulated)
        if Path(path) == source:
            raise PermissionError(13, "Permission denied", str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(SpeculatorsError, match=r"locked.jsonl cannot be read \(Permission denied\); check the path"):
        prepare_conversations([str(source)])


FIFO_SCRIPT = """
import json, os, sys
from pathlib import Path
from speculators.verifier import vision
from speculators.errors import SpeculatorsError
from speculators.data.prompt_set import prepare_conversations
from speculators.data.sources import source_fingerprint

folder = Path(sys.argv[1])
os.mkfifo(folder / "pipe.jsonl")
os.mkfifo(folder / "pipe.png")
question = [{"type": "image", "image": "pipe.png"}, {"type": "text", "text": "?"}]
row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "x"}]}
(folder / "rows.jsonl").write_text(json.dumps(row) + "\\n" + json.dumps({"prompt": "a", "response": "b"}) + "\\n")
results = {}
for name, call in (
    ("source", lambda: prepare_conversations([str(folder / "pipe.jsonl")])),
    ("fingerprint", lambda: source_fingerprint(str(folder / "pipe.jsonl"))),
    ("load_image", lambda: vision.load_image({"image": str(folder / "pipe.png"), "sha256": "0"})),
):
    try:
        call()
        results[name] = "no error"
    except SpeculatorsError as error:
        results[name] = str(error)
_, report = prepare_conversations([str(folder / "rows.jsonl")])
results["report"] = [report.kept, dict(report.rejected), dict(report.examples)]
print(json.dumps(results))
"""


def test_fifos_as_source_or_image_end_at_once_never_hang(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FIFO_SCRIPT), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,  # a FIFO opened for reading blocks forever: the timeout fails the test instead
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    pipe = tmp_path / "pipe.jsonl"
    expected = f"prompt source {pipe} is a FIFO, not a regular file; pass a .jsonl, .json or .parquet file"
    assert results["source"].startswith(expected) and results["fingerprint"].startswith(expected)
    assert results["load_image"].startswith(f"image {tmp_path / 'pipe.png'} cannot be used (image is not a regular")
    assert results["report"] == [1, {vision.NOT_A_REGULAR_FILE: 1}, {vision.NOT_A_REGULAR_FILE: ["rows.jsonl:1"]}]


# ----- images: inside the data folder unless allowed --------------------------------------------------------


def test_images_outside_the_data_folder_are_rejected_unless_their_folder_is_allowed(tmp_path, monkeypatch):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    inside = png(data / "pics" / "in.png", colour=(1, 1, 1))
    outside = png(elsewhere / "out.png", colour=(2, 2, 2))
    (data / "link.png").symlink_to(outside)  # a symlink inside that resolves outside
    (data / "linked").symlink_to(elsewhere)  # a folder inside that is a link out of it
    encoded = base64.b64encode(outside.read_bytes()).decode()
    rows = [
        image_row("../elsewhere/out.png"),
        image_row(str(outside)),
        image_row(outside.as_uri()),
        image_row("link.png"),
        image_row("linked/out.png"),
        image_row("pics/../../elsewhere/out.png"),
        image_row("pics/../pics/in.png"),
        image_row(str(inside)),
        image_row("data:image/png;base64," + encoded),  # data URLs are not files: unaffected
    ]
    source = write_jsonl(data / "rows.jsonl", rows)
    monkeypatch.chdir(tmp_path)  # (the working directory holds both folders: it is no root for a file's rows)
    _, report = prepare_conversations([source], require_assistant=False)
    assert report.kept == 2 and report.duplicates == 1
    assert report.rejected == {vision.OUTSIDE_ROOTS: 6}
    assert report.examples[vision.OUTSIDE_ROOTS] == [f"rows.jsonl:{i}" for i in range(1, 6)]  # (5 examples kept)
    _, report = prepare_conversations([source], require_assistant=False, image_roots=[elsewhere])
    assert report.kept == 2 and report.duplicates == 7 and not report.rejected  # the same two images
    _, report = prepare_conversations([str(data)], require_assistant=False)  # a folder source: the folder
    assert report.rejected == {vision.OUTSIDE_ROOTS: 6}
    with pytest.raises(SpeculatorsError, match=r"image root .*missing is not a folder; pass an existing folder"):
        prepare_conversations([source], image_roots=[tmp_path / "missing"])


def test_dataset_rows_may_name_images_in_the_working_directory_only(tmp_path, monkeypatch):
    import datasets

    png(tmp_path / "work" / "a.png", colour=(3, 3, 3))
    png(tmp_path / "b.png", colour=(4, 4, 4))
    rows = [image_row("a.png"), image_row("../b.png")]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: rows)
    monkeypatch.chdir(tmp_path / "work")
    _, report = prepare_conversations(["hf:acme/vl"])
    assert report.kept == 1 and report.rejected == {vision.OUTSIDE_ROOTS: 1}
    assert report.examples[vision.OUTSIDE_ROOTS] == ["acme/vl[1]"]
    _, report = prepare_conversations(["hf:acme/vl"], image_roots=[tmp_path])
    assert report.kept == 2 and not report.rejected


def test_prepared_conversations_are_read_again_with_their_sources_folders_as_roots(tmp_path):
    """The hidden-state step re-reads raw_prompts' conversations.jsonl from another folder."""
    png(tmp_path / "src" / "a.png")
    source = write_jsonl(tmp_path / "src" / "rows.jsonl", [image_row("a.png")])
    conversations, _ = prepare_conversations([source])
    written = Path(
        write_jsonl(tmp_path / "out" / "conversations.jsonl", [json.loads(c.to_json()) for c in conversations])
    )
    _, report = prepare_conversations([str(written)])
    assert report.rejected == {vision.OUTSIDE_ROOTS: 1}
    root = sources.source_image_root(source)
    again, report = prepare_conversations([str(written)], image_roots=[root])
    assert root == tmp_path / "src" and report.kept == 1
    assert [(c.id, c.messages) for c in again] == [(c.id, c.messages) for c in conversations]
    assert sources.source_image_root(str(tmp_path / "src")) == tmp_path / "src"
    assert sources.source_image_root("hf:ultrachat") == Path.cwd().resolve()


def test_the_hidden_state_prepare_gets_the_variant_roots_and_its_local_sources_folders(tmp_path):
    from speculators_assets.variants import PACKAGE_VARIANTS, load_variant
    from speculators_assets.workload import hidden_state_commands

    plain = load_variant(PACKAGE_VARIANTS / "smollm2_135m.yaml")
    file_source = write_jsonl(tmp_path / "files" / "rows.jsonl", [single("a")])
    (tmp_path / "folder").mkdir()
    (tmp_path / "extra").mkdir()
    prompts_settings = plain.prompts.model_copy(
        update={
            "sources": [file_source, str(tmp_path / "folder"), "demo:train"],
            "validation_sources": ["natural:validation"],
            "image_roots": [str(tmp_path / "extra")],
        }
    )
    variant = plain.model_copy(update={"prompts": prompts_settings})
    prepare = hidden_state_commands(variant, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")[0]
    roots = [prepare[i + 1] for i, flag in enumerate(prepare) if flag == "--image-root"]
    assert roots == [str(tmp_path / "extra"), str(tmp_path / "files"), str(tmp_path / "folder")]
    assert "--image-root" not in hidden_state_commands(plain, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")[0]


def test_a_variant_that_keeps_its_rows_answers_has_the_verifier_answer_only_validation(tmp_path):
    """datagen `regenerate: false` + `regenerate_validation: true`: raw_prompts keeps prompt-only
    validation rows, and the hidden-state prepare keeps the training rows' own answers with the vLLM
    settings for answering the validation prompts (the demo); the regenerating variants (a GPU one and
    smollm2_135m_full) regenerate, and their commands and keys are what they were."""
    from speculators.cli import build_parser
    from speculators_assets.variants import PACKAGE_VARIANTS, load_variant
    from speculators_assets.workload import DATAGEN_ADDED_LATER, dump_for_key, hidden_state_commands, prompts_command

    parser = build_parser()
    for name in ("qwen3_8b", "smollm2_135m_full"):
        regenerating = load_variant(PACKAGE_VARIANTS / f"{name}.yaml")
        assert regenerating.datagen.regenerate and regenerating.datagen.regenerate_validation is None
        assert not set(DATAGEN_ADDED_LATER) & set(dump_for_key(regenerating.datagen, DATAGEN_ADDED_LATER))
        assert "--regenerate-validation" not in prompts_command(regenerating, tmp_path)
        commands = hidden_state_commands(regenerating, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")
        prepare = parser.parse_args(commands[0])
        assert prepare.regenerate is True and prepare.max_answer_tokens is None
        assert prepare.max_train_tokens is None and prepare.prefer == "order"
    own = load_variant(PACKAGE_VARIANTS / "smollm2_135m.yaml")
    raw = parser.parse_args(prompts_command(own, tmp_path))
    assert raw.require_assistant is True and raw.regenerate_validation is True
    commands = hidden_state_commands(own, tmp_path / "c.jsonl", tmp_path / "d", tmp_path / "s")
    prepare = parser.parse_args(commands[0])
    assert prepare.regenerate is False and prepare.regenerate_validation is True
    assert prepare.require_assistant is True
    assert prepare.backend == "vllm" and prepare.batch_size == 256 and prepare.max_new_tokens == 256
    assert prepare.max_answer_tokens == 256
    # The demo's data: the shortest of its 1,800 first turns until 291,392 tokens (BENCHMARKS.md, "Data").
    assert (own.prompts.max_samples, prepare.max_train_tokens, prepare.prefer) == (1800, 291_392, "shortest")


def test_regeneration_replicas_get_the_sources_folders_as_image_roots(tmp_path, monkeypatch):
    import speculators.data.prepare as prepare_module
    from speculators.data.prepare import regenerate_on_replicas
    from speculators.settings import PrepareSettings

    started: list[list[str]] = []

    class Started(Exception):
        pass

    def start_replica(label, index, command, env, log):
        started.append(command)
        assert env == {prepare_module.REPLICA_ENVIRONMENT: "1"}  # (a share left empty is the parent's to judge)
        raise Started

    monkeypatch.setattr(prepare_module, "start_replica", start_replica)
    monkeypatch.setattr(prepare_module, "replica_devices", lambda replicas, tp: [{} for _ in range(replicas)])
    source = write_jsonl(tmp_path / "src" / "rows.jsonl", [single("a")])
    settings = PrepareSettings(
        sources=[source], output=str(tmp_path / "o"), verifier="v", data_parallel_size=2, image_roots=[str(tmp_path)]
    )
    with pytest.raises(Started):
        regenerate_on_replicas(settings, [], tmp_path / "o", "key")
    command = started[0]
    roots = [command[i + 1] for i, flag in enumerate(command) if flag == "--image-root"]
    assert roots == [str(tmp_path), str(tmp_path / "src")]


def test_evaluation_prompts_with_images_load_with_the_default_roots(tmp_path):
    png(tmp_path / "a.png")
    source = write_jsonl(tmp_path / "eval.jsonl", [image_row("a.png"), image_row("../x.png")])
    loaded = prompt_set.load_prompts(source)
    assert len(loaded) == 1 and loaded[0].messages[0]["content"][0]["image"] == str(tmp_path / "a.png")


# ----- empty results: an error naming why, and nothing written ------------------------------------------------


def prompt_tokens(samples_file: Path) -> dict[str, int]:
    """Each prepared sample's prompt length in tokens (the tokens before its first supervised one)."""
    rows = [json.loads(line) for line in samples_file.read_text().splitlines()]
    return {row["id"]: row["loss_mask"].index(1) for row in rows}


def folder_contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"}


def test_prepare_with_every_row_over_max_length_names_the_longest_and_writes_nothing(
    tiny_verifier_dir, tmp_path, capsys
):
    verifier = tiny_verifier_dir("llama")
    source = write_jsonl(tmp_path / "rows.jsonl", [single("word " * n, "fine") for n in (50, 100, 30)])
    reference = tmp_path / "reference"
    prepare = ["prepare", "--source", source, "--verifier", verifier]
    assert run(capsys, *prepare, "--output", reference, "--max-length", "512")[0] == 0
    lengths = prompt_tokens(reference / "samples.jsonl")
    longest = max(lengths, key=lengths.__getitem__)
    refusal = (
        rf"every one of the 3 conversations is over --max-length 16 \(its prompt alone fills it\): the longest, row "
        rf"{longest}, has a {lengths[longest]}-token prompt; raise --max-length to at least {lengths[longest] + 1}, "
        r"or shorten the source's prompts \(nothing was written\)$"
    )
    output = tmp_path / "out"
    one_error(capsys, refusal, *prepare, "--output", output, "--max-length", "16")
    assert not output.exists()  # no empty samples.jsonl, conversations.jsonl or report: no folder at all
    # Into a folder holding an earlier result: that result stays as it was.
    shutil.copytree(reference, output)
    one_error(capsys, refusal, *prepare, "--output", output, "--max-length", "16")
    assert folder_contents(output) == folder_contents(reference)
    # What the message asks for is enough: every row kept.
    assert run(capsys, *prepare, "--output", output, "--max-length", str(lengths[longest] + 1))[0] == 0
    assert sorted(prompt_tokens(output / "samples.jsonl")) == sorted(lengths)


def test_a_prompt_clipped_before_tokenizing_is_named_by_its_characters(
    tiny_verifier_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(tokenization, "longest_token_chars", lambda tokenizer: 1)  # text limit: 16 + 1024 characters
    many = " ".join(["many"] * 600)  # 2,999 characters
    rows = [single("word " * 100, "fine"), single(many, "fine"), single("more " * 300, "fine")]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    conversations, _ = prepare_conversations([source])
    clipped = conversations[1].id  # past the limit, never tokenized (the third, 1,499 characters, is too)
    one_error(
        capsys,
        rf"every one of the 3 conversations is over --max-length 16 \(its prompt alone fills it\): the longest, row "
        rf"{clipped}, has {len(many)} characters of prompt \(clipped before tokenizing\); raise --max-length well "
        r"past 16, or shorten the source's prompts \(nothing was written\)$",
        *["prepare", "--source", source, "--verifier", tiny_verifier_dir("llama"), "--max-length", "16"],
        *["--output", tmp_path / "out"],
    )
    assert not (tmp_path / "out").exists()


def test_regeneration_with_every_prompt_over_max_length_leaves_no_resume_file(tiny_verifier_dir, tmp_path, capsys):
    source = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "word " * n} for n in (40, 20)])
    output = tmp_path / "out"
    one_error(
        capsys,
        r"every one of the 2 conversations is over --max-length 16 \(its prompt alone fills it\): the longest, row "
        r"\w+, has a \d+-token prompt; raise --max-length to at least \d+, or shorten the source's prompts",
        *["prepare", "--source", source, "--verifier", tiny_verifier_dir("llama"), "--regenerate"],
        *["--max-length", "16", "--max-new-tokens", "4", "--output", output],
    )
    assert not output.exists()  # samples.partial.jsonl, opened for answers that never came, removed too


def test_rows_all_rejected_for_any_reason_are_one_line_naming_the_counts_and_reasons(
    tiny_verifier_dir, tmp_path, capsys
):
    verifier = tiny_verifier_dir("llama")
    output = tmp_path / "out"
    prompt_only = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hi"}, {"prompt": "ho"}, "[1]", "{broken"])
    one_error(
        capsys,
        rf"no usable conversation in {prompt_only}: 4 rows read, 4 rejected \(2 no assistant turn, 1 [^,]+, 1 [^)]+\), "
        r"0 duplicates; fix the source, or let the verifier answer prompt-only rows \(--verifier V --regenerate\) "
        r"\(nothing was written\)$",
        *["prepare", "--source", prompt_only, "--output", output],
    )
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    one_error(
        capsys,
        rf"no rows in {empty}; name a source that holds conversations \(nothing was written\)$",
        *["prepare", "--source", empty, "--verifier", verifier, "--output", output],
    )
    # Kept by the prompt stage, then none tokenized: an image for a text-only verifier, a prompt over the limit.
    png(tmp_path / "a.png")
    rows = [image_row("a.png"), single("word " * 40, "fine")]
    mixed = write_jsonl(tmp_path / "mixed.jsonl", rows)
    one_error(
        capsys,
        r"none of the 2 conversations became a sample \(1 images in a conversation for a text-only verifier, 1 "
        r"over-length \(the prompt alone exceeds max length 16\)\); the longest, row \w+, has a \d+-token prompt; "
        r"raise --max-length to at least \d+; fix the source \(nothing was written\)$",
        *["prepare", "--source", mixed, "--verifier", verifier, "--max-length", "16", "--output", output],
    )
    assert not output.exists()
