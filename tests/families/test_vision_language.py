"""Vision-language verifiers (Qwen3-VL): images through tokenization, regeneration, capture,
training and speculative decoding, on tiny random Qwen3-VL verifiers (text model + vision tower).

vLLM's CPU build cannot load Qwen3-VL here: its model module imports transformers' torchvision
image processor, and torchvision has no build for the CPU torch 2.13.0 wheel (the vLLM tests below
say so and check it). The transformers path covers the lineage; the drafter positions it trains
and decodes with are vLLM's (the M-RoPE temporal row), checked against transformers' own M-RoPE.
"""

from __future__ import annotations

import base64
import io
import random

import pytest
import torch

from speculators.data.conversation import Conversation
from speculators.verifier.vision import image_part, image_parts, load_image

PEAKED_AUX = [1, 4, 6]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "cyan"]


def drawn_image(seed: int, width: int = 96, height: int = 64) -> str:
    """A data URL of a small PNG: a coloured shape on white (different for each seed)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    box = [rng.randint(0, width // 3), rng.randint(0, height // 3), rng.randint(width // 2, width), height - 4]
    (draw.ellipse if seed % 2 else draw.rectangle)(box, fill=rng.choice(COLOURS))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_conversation(index: int, images: int = 1, size: tuple[int, int] = (96, 64)) -> Conversation:
    parts = [image_part(drawn_image(index * 7 + k, *size)) for k in range(images)]
    text = {"type": "text", "text": f"Describe the shape number {index} in one short sentence."}
    messages = [{"role": "user", "content": [*parts, text]}]
    return Conversation(f"vl{index}", messages)


@pytest.fixture(scope="module")
def vl_verifier(tmp_path_factory):
    """A tiny Qwen3-VL with peaked next-token distributions (a drafter has something to learn)."""
    from speculators.verifier.tiny import make_tiny_verifier

    return make_tiny_verifier("qwen3_vl", tmp_path_factory.mktemp("qwen3-vl"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def loaded(vl_verifier):
    from speculators.verifier.loading import load_verifier

    return load_verifier(vl_verifier, dtype="float32")


def test_drafter_positions_are_the_temporal_row_of_transformers_mrope(loaded):
    """vLLM gives a 1-D drafter `positions[0]` of an M-RoPE target; ours equal transformers' row 0
    for one image, two images of other shapes, and text after them."""
    inputs = loaded.image_inputs
    for conversation in (image_conversation(0), image_conversation(1, images=2, size=(128, 64))):
        ids = loaded.tokenizer.apply_chat_template(
            conversation.messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        pictures = [load_image(part) for part in image_parts(conversation.messages)]
        grids = [inputs.grid(picture) for picture in pictures]
        expanded, _ = inputs.expand(list(ids), [0] * len(ids), grids)
        assert expanded.count(inputs.tokens.image_token_id) == sum(t * h * w // 4 for t, h, w in grids)
        tensor = torch.tensor([expanded])
        pixel = inputs.pixel_inputs(pictures)
        rope, _ = loaded.model.model.get_rope_index(tensor, inputs.token_types(tensor), pixel["image_grid_thw"])
        positions = inputs.drafter_positions(expanded, grids)
        assert positions == rope[0, 0].tolist()
        assert positions != list(range(len(expanded)))  # the image compresses the positions


def test_image_grids_are_the_processors(loaded):
    """The grid (and so the token count) computed from an image's size alone equals the one the image
    processor returns with the pixels, for images it keeps, enlarges and shrinks."""
    from PIL import Image

    inputs = loaded.image_inputs
    for width, height in ((96, 64), (20, 20), (33, 95), (400, 300), (1000, 64)):
        image = Image.new("RGB", (width, height), "white")
        assert inputs.grid(image) == inputs.pixel_inputs([image])["image_grid_thw"][0].tolist(), (width, height)


def test_capture_with_pixels_equals_the_models_hidden_states(loaded):
    """Aux ids k < N are the residual stream entering layer k (after the deepstack additions of the
    layers before), id N the pre-norm output of the last layer, all with the vision tower's features
    at the image positions: the same tensors as transformers' output_hidden_states, and different
    from a text-only pass and from another image."""
    inputs = loaded.image_inputs
    conversation = image_conversation(2)
    ids = loaded.tokenizer.apply_chat_template(
        conversation.messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    pictures = [load_image(part) for part in image_parts(conversation.messages)]
    expanded, _ = inputs.expand(list(ids), [0] * len(ids), [inputs.grid(p) for p in pictures])
    tensor = torch.tensor([expanded])
    vision = inputs.pixel_inputs(pictures)
    vision["mm_token_type_ids"] = inputs.token_types(tensor)
    layer_ids = [1, 4, 6, loaded.num_layers]
    states = loaded.capture(tensor, layer_ids, **vision)
    assert states.shape == (1, len(expanded), 4, loaded.hidden_size)
    with torch.inference_mode():
        out = loaded.model(input_ids=tensor, output_hidden_states=True, **vision)
    hidden = out.hidden_states  # [embeddings, output of layer 0, ..., after the final norm]
    # vLLM records id k after layer k-1's deepstack addition (the vision features of the tower's
    # deepstack layers, added at the image positions); transformers' hidden_states are before it.
    with torch.inference_mode():
        features = loaded.model.model.get_image_features(vision["pixel_values"], vision["image_grid_thw"])
    deepstack = [torch.cat(f) for f in features.deepstack_features]
    assert len(deepstack) == 2
    image_rows = tensor[0] == inputs.tokens.image_token_id
    for column, layer in enumerate(layer_ids[:3]):
        expected = hidden[layer][0].clone()
        if layer - 1 < len(deepstack):
            expected[image_rows] += deepstack[layer - 1]
        torch.testing.assert_close(states[0, :, column], expected)
    # transformers' last entry is normed; the logits of our pre-norm state through the final norm agree
    torch.testing.assert_close(loaded.logits_from_final_states(states[0, :, 3]), out.logits[0])
    text_only = loaded.capture(tensor, layer_ids)
    other = inputs.pixel_inputs([load_image(image_part(drawn_image(99)))])
    other["mm_token_type_ids"] = vision["mm_token_type_ids"]
    other_image = loaded.capture(tensor, layer_ids, **other)
    for changed in (text_only, other_image):
        assert not torch.allclose(changed[0, image_rows], states[0, image_rows])
        assert not torch.allclose(changed[0, -1, 1:], states[0, -1, 1:])  # later text sees the image


def test_tokenization_expands_each_image_and_never_supervises_it(loaded):
    from speculators.data.tokenization import tokenize_conversation
    from speculators.verifier.vision import collapse_placeholders

    conversation = image_conversation(3, images=2, size=(64, 128))
    conversation.messages.append({"role": "assistant", "content": "A shape."})
    inputs = loaded.image_inputs
    sample = tokenize_conversation(loaded.tokenizer, conversation.id, conversation.messages, 512, inputs)
    pad = inputs.tokens.image_token_id
    grids = [inputs.grid(load_image(part)) for part in sample.images]
    assert sample.images == image_parts(conversation.messages)
    assert sample.input_ids.count(pad) == sum(inputs.token_count(g) for g in grids) == 2 * (2 * 4)
    assert all(m == 0 for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if t == pad)
    answer = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    assert loaded.tokenizer.decode(answer) == "A shape.<|im_end|>"
    rendered = loaded.tokenizer.apply_chat_template(conversation.messages, tokenize=True, return_dict=False)
    assert collapse_placeholders(sample.input_ids, pad) == list(rendered)
    # A limit inside the second image drops it whole (and the answer after it: nothing supervised).
    first_end = sample.input_ids.index(pad) + inputs.token_count(grids[0])
    from speculators.data.rows import RowRejected

    with pytest.raises(RowRejected, match="over-length"):
        tokenize_conversation(loaded.tokenizer, conversation.id, conversation.messages, first_end + 4, inputs)
    with pytest.raises(RowRejected, match="text-only verifier"):
        tokenize_conversation(loaded.tokenizer, conversation.id, conversation.messages, 512)


@pytest.fixture(scope="module")
def vl_store(vl_verifier, loaded, tmp_path_factory):
    """On-policy image conversations regenerated by the tiny Qwen3-VL, captured, with a draft vocab."""
    from speculators.data.capture import capture_samples
    from speculators.data.regenerate import regenerate, transformers_image_generate_fn
    from speculators.train.vocab import build_store_vocab

    directory = tmp_path_factory.mktemp("vl-store")
    conversations = [image_conversation(i, images=1 + i % 2) for i in range(8)]
    generate = transformers_image_generate_fn(
        loaded.model, loaded.tokenizer, loaded.image_inputs, 40, temperature=0.0, seed=0
    )
    samples, report = regenerate(
        conversations,
        loaded.tokenizer,
        generate,
        directory / "partial.jsonl",
        512,
        progress=False,
        image_inputs=loaded.image_inputs,
    )
    assert report.regenerated == 8 and not report.rejected
    capture_samples(samples, loaded, directory, aux_layer_ids=PEAKED_AUX, storage="float32", progress=False)
    build_store_vocab(directory, 128)
    return {"dir": directory, "samples": samples, "conversations": conversations}


def test_regenerated_answers_are_the_verifiers_greedy_answers_with_the_images(loaded, vl_store):
    """Regeneration (transformers generate with the pixels) and the evaluator's own cached greedy loop
    agree token for token; without the images the answers differ."""
    from speculators.data.tokenization import turn_end_ids
    from speculators.eval.evaluate import greedy_generate

    stops = turn_end_ids(loaded.tokenizer)
    differs = 0
    for sample in vl_store["samples"]:
        first = sample.loss_mask.index(1)
        answer = sample.input_ids[first:]
        pictures = [load_image(part) for part in sample.images]
        greedy = greedy_generate(loaded, sample.input_ids[:first], len(answer), stops, images=pictures).tokens
        assert greedy == answer
        blind = greedy_generate(loaded, sample.input_ids[:first], len(answer), stops).tokens
        differs += blind != answer
    assert differs >= 6


def test_store_keys_follow_the_images_and_hold_the_drafter_positions(loaded, vl_store):
    from speculators.data.store import HiddenStateStore, sample_key
    from speculators.verifier.vision import images_digest

    store = HiddenStateStore(vl_store["dir"])
    manifest = store.manifest()
    assert store.verify() == []
    sample, entry = vl_store["samples"][0], manifest.samples[0]
    capture_ids = [*PEAKED_AUX, loaded.num_layers]
    assert entry.key == sample_key(
        loaded.fingerprint, capture_ids, "float32", sample.input_ids, images_digest(sample.images)
    )
    assert entry.key != sample_key(loaded.fingerprint, capture_ids, "float32", sample.input_ids)
    stored = store.read_sample(entry)
    inputs = loaded.image_inputs
    grids = [inputs.grid(load_image(part)) for part in sample.images]
    assert stored.position_ids.tolist() == inputs.drafter_positions(sample.input_ids, grids)


@pytest.fixture(scope="module")
def vl_drafter(vl_store, vl_verifier, tmp_path_factory):
    from tests.conftest import train_peaked_drafter

    return train_peaked_drafter(vl_store["dir"], vl_verifier, tmp_path_factory.mktemp("vl-drafter"))


def test_training_replay_equals_speculative_decoding_with_images(loaded, vl_store, vl_drafter, vl_verifier, tmp_path):
    """The drafter trains at vLLM's positions and decodes at the same ones: validation's replayed
    acceptance equals `evaluate`'s on the same prompts and images (fp32), and decoding is lossless."""
    from speculators.eval.evaluate import DrafterProposer, evaluate
    from speculators.models.eagle3 import Eagle3Drafter
    from speculators.settings import TrainConfig
    from speculators.train.data import PackedStore
    from speculators.train.distributed import wrap_model
    from speculators.train.objectives import objective_for
    from speculators.train.validation import greedy_in_draft_vocab, run_validation
    from speculators.train.vocab import load_draft_vocab
    from speculators.verifier.loading import VerifierHead

    drafter = Eagle3Drafter.from_pretrained(
        vl_drafter, verifier_embeddings=loaded.embedding_weight, dtype="float32"
    ).eval()
    assert "mrope_section" not in str(drafter.config.transformer_layer_config)  # a 1-D drafter for vLLM
    k = drafter.config.speculative_tokens
    packs = PackedStore(vl_store["dir"], 4096, "validation", validation_share=1.0, seed=-1)
    head_source = VerifierHead.from_source(str(vl_verifier), dtype="float32")
    selected = load_draft_vocab(vl_store["dir"])["selected_ids"]
    head = (head_source.final_norm, head_source.lm_head_weight[selected].float())
    cpu = torch.device("cpu")
    in_vocab = greedy_in_draft_vocab(packs, head_source, selected, cpu, 0, 1)
    config = TrainConfig(
        store=str(vl_store["dir"]), verifier=str(vl_verifier), output=str(tmp_path), precision="fp32", ttt_steps=k
    )
    objective = objective_for(config, drafter, head)
    model = wrap_model(objective.forward_module(drafter), drafter, 1, cpu, False)
    metrics = run_validation(model, objective, packs, config, cpu, 0, 1, in_vocab)
    by_id = {s.id: s for s in vl_store["samples"]}
    prompts, budget = [], 0
    for entry in packs.entries:
        sample = by_id[entry.id]
        first = sample.loss_mask.index(1)
        prompts.append((sample.id, sample.input_ids[:first], sample.images))
        budget = max(budget, len(sample.input_ids) - first)
    report = evaluate(loaded, prompts, DrafterProposer(drafter), k, max_new_tokens=budget, progress=False)
    totals = report.totals()
    assert all(r.comparison.status == "identical" for r in report.results)
    assert metrics["replayed_rounds"] == totals["drafts"] > 0
    assert metrics["replayed_acceptance_length"] == pytest.approx(totals["acceptance_length"])
    assert totals["acceptance_length"] > 2.0


def write_image_prompts(path, rows):
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_the_lineage_materializes_for_a_tiny_qwen3_vl_through_dagster(vl_verifier, tmp_path, monkeypatch):
    """raw_prompts -> hidden states -> drafter -> checkpoint for image prompts, through Dagster with
    Pipes subprocesses; the benchmark step says why this vLLM cannot serve Qwen3-VL, and the
    transformers evaluator measures the published drafter on held-out image prompts instead."""
    import dagster as dg

    from speculators.data.demo_images import demo_image_rows
    from speculators.eval.evaluate import run_evaluation
    from speculators.settings import EvaluateSettings
    from speculators.verifier.vision import vllm_vision_support

    prompts = write_image_prompts(tmp_path / "train.jsonl", demo_image_rows("train")[:8])
    held_out = write_image_prompts(tmp_path / "eval.jsonl", demo_image_rows("eval")[:4])
    variants = tmp_path / "variants"
    variants.mkdir()
    (variants / "tiny_qwen3_vl.yaml").write_text(f"""
description: tiny random Qwen3-VL (tests)
verifier: {vl_verifier}
family: qwen3_vl
prompts: {{sources: ["{prompts}"], eval_source: "{held_out}"}}
datagen: {{regenerate: true, backend: transformers, max_length: 384, max_new_tokens: 32, batch_size: 4,
          storage: float32, dtype: float32}}
drafter: {{draft_vocab_size: 128, aux_layer_ids: [1, 4, 6], speculative_tokens: 3, draft_layer_type: qwen3}}
training: {{epochs: 60, lr: 0.01, token_budget: 512, validation_share: 0.0, precision: fp32}}
benchmark: {{requests: 4, output_tokens: 16, concurrency: [2], dtype: float32, max_model_len: 512,
            enforce_eager: true, kv_cache_gib: 1}}
gates: {{min_acceptance_length: 1.2, min_vocab_coverage: 0.5}}
""")
    monkeypatch.setenv("SPECULATORS_VARIANTS_DIR", str(variants))
    monkeypatch.setenv("SPECULATORS_STORAGE_ROOT", str(tmp_path / "storage"))
    from speculators_assets.definitions import build_defs

    defs = build_defs()
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        list(defs.assets),
        partition_key="tiny_qwen3_vl",
        resources=defs.resources,
        instance=instance,
        raise_on_error=False,
    )
    meta = {
        e.materialization.asset_key.to_user_string(): {k: v.value for k, v in e.materialization.metadata.items()}
        for e in result.get_asset_materialization_events()
    }
    assert meta["raw_prompts"]["kept"] == 8 and meta["raw_prompts"]["rejected"] == 0
    hidden = meta["verifier_hidden_states"]
    assert hidden["samples"] == 8 and hidden["regenerated"] == 8
    assert meta["trained_drafter"]["acceptance_length"] > 1.2
    checkpoint = meta["speculator_checkpoint"]
    assert checkpoint["published"] is True
    reason = vllm_vision_support()
    if reason is None:  # a machine whose vLLM loads Qwen3-VL: the benchmark runs like any other
        assert result.success and meta["benchmark_report"]["outputs_lossless"]
        return
    assert "benchmark_report" not in meta
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert len(failures) == 1 and failures[0].step_key == "benchmark_report"
    # The CLI's one-line reason reaches the run's events (the workload's failure, reported over Pipes).
    events = [entry.dagster_event for entry in instance.all_logs(result.run_id) if entry.dagster_event]
    closed = [e for e in events if "closed with exception" in (e.message or "")]
    error = closed[0].event_specific_data.error.message
    assert "`speculators bench` failed with exit code 2: cannot serve" in error and "torchvision" in error
    held_out_settings = EvaluateSettings(
        verifier=str(vl_verifier), prompts=str(held_out), speculator=checkpoint["latest"], max_new_tokens=24
    )
    report = run_evaluation(held_out_settings)
    totals = report.totals()
    assert totals["lossless"]["identical"] == totals["prompts"] == 4
    assert totals["acceptance_length"] > 1.0


@pytest.mark.slow
def test_vllm_loads_qwen3_vl_only_with_torchvision(vl_verifier, loaded, vl_store, capfd):
    """Where torchvision cannot be imported (this CPU build), vLLM itself refuses the model for that
    reason, which is what `speculators bench` reports up front. Where it can, vLLM's capture with the
    images equals the transformers capture (fp32 here; bf16 rounding on GPUs)."""
    from speculators.data.capture_vllm import VllmCapture
    from speculators.verifier.vision import vllm_vision_support

    capture_ids = [*PEAKED_AUX, loaded.num_layers]
    samples = vl_store["samples"][:2]
    if vllm_vision_support() is not None:
        with pytest.raises(Exception, match=r"\['Qwen3VLForConditionalGeneration'\] failed to be inspected"):
            VllmCapture(
                str(vl_verifier), capture_ids, "float32", max_model_len=512, image_token_id=loaded.config.image_token_id
            )
        captured = capfd.readouterr()
        assert "No module named 'torchvision'" in captured.out + captured.err  # vLLM's log of the inspection
        return
    engine = VllmCapture(
        str(vl_verifier), capture_ids, "float32", max_model_len=512, image_token_id=loaded.config.image_token_id
    )
    try:
        served = engine([s.input_ids for s in samples], [s.images for s in samples])
    finally:
        engine.close()
    from speculators.data.capture import transformers_capture_fn

    reference = transformers_capture_fn(loaded, capture_ids)(
        [s.input_ids for s in samples], [s.images for s in samples]
    )
    for got, want in zip(served, reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_data_parallel_regeneration_equals_one_process_and_resumes(vl_verifier, tmp_path):
    """Image conversations regenerate on replica processes (vLLM's server takes no images; here the
    transformers backend): the same samples, in the same order, as one process; a rerun reuses them."""
    import json

    from speculators.data.demo_images import demo_image_rows
    from speculators.data.prepare import run_prepare
    from speculators.settings import PrepareSettings

    source = write_image_prompts(tmp_path / "prompts.jsonl", demo_image_rows("eval")[:5])

    def prepare(folder: str, replicas: int) -> dict:
        settings = PrepareSettings(
            sources=[str(source)],
            output=str(tmp_path / folder),
            verifier=str(vl_verifier),
            regenerate=True,
            max_new_tokens=12,
            max_length=384,
            dtype="float32",
            data_parallel_size=replicas,
        )
        return run_prepare(settings)

    prepare("one", 1)
    report = prepare("two", 2)
    one, two = ((tmp_path / name / "samples.jsonl").read_text() for name in ("one", "two"))
    assert one == two and one.count("\n") == 5 and '"images"' in one
    assert report["tokenization"]["regeneration"] == {**report["tokenization"]["regeneration"], "replicas": 2}
    assert report["tokenization"]["regeneration"]["regenerated"] == 5
    replica_reports = [
        json.loads((tmp_path / "two" / "replicas" / str(i) / "prepare_report.json").read_text()) for i in (0, 1)
    ]
    assert [r["tokenization"]["regeneration"]["regenerated"] for r in replica_reports] == [3, 2]
    again = prepare("two", 2)
    assert again["tokenization"]["regeneration"]["regenerated"] == 0
    assert again["tokenization"]["regeneration"]["resumed"] == 5
    assert (tmp_path / "two" / "samples.jsonl").read_text() == one
