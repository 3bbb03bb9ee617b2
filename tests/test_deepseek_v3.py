"""DeepSeek-V3 as a verifier family (Mistral Large 3's architecture: vLLM serves it as
`MistralLarge3ForCausalLM`, a subclass of its DeepSeek-V3 model): MLA attention, two dense first layers
then MoE layers with a shared expert.

What vLLM records for EAGLE-3 (vllm/model_executor/models/deepseek_v2.py, DeepseekV2Model.forward): the
decoder layers defer the residual add (each returns its MLP output and the residual apart), and for every
id k in `aux_hidden_state_layers` the model keeps `hidden_states + residual` entering layer k (id 0: the
embeddings), and for id N the same sum after the last layer, before the final norm. The sum is the
residual stream, whatever the layer's MLP is: dense and MoE layers are recorded alike. So the aux ids
mean what they mean for every other family, and the transformers capture (hooks on the decoder layers)
equals the model's own `output_hidden_states`.
"""

from __future__ import annotations

import pytest
import torch

from speculators.verifier import draft_config_for_verifier, load_verifier

FAMILY = "deepseek_v3"
CONVERSATION = [
    {"role": "user", "content": "The model explains the next token."},
    {"role": "assistant", "content": "A drafter predicts two numbers quickly."},
]


@pytest.fixture(scope="module")
def verifier(tiny_verifier_dir):
    return load_verifier(tiny_verifier_dir(FAMILY), dtype="float32")


def test_the_tiny_verifier_has_mla_two_dense_layers_then_moe(verifier):
    config = verifier.config
    assert verifier.model_type == FAMILY and verifier.architectures == ["DeepseekV3ForCausalLM"]
    assert (verifier.num_layers, verifier.hidden_size, verifier.vocab_size) == (8, 64, 512)
    # MLA: a 512-wide latent plus a 64-wide shared rope key (576, the width vLLM's CPU MLA kernel takes)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim) == (
        512,
        64,
        32,
        32,
    )
    assert config.q_lora_rank == 32
    layers = verifier.adapter.decoder_layers(verifier.model)
    kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in layers]
    assert kinds == ["dense"] * 2 + ["moe"] * 6 and config.first_k_dense_replace == 2
    moe = layers[2].mlp
    assert moe.experts.num_experts == 4 and moe.gate.top_k == 2 and moe.shared_experts is not None
    # vLLM reads the routing from these keys (defaults: softmax, no correction bias); transformers
    # routes this way always and has no field for it.
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")


def test_capture_of_every_id_equals_the_models_hidden_states_and_the_logits(verifier):
    """Ids 0-2 enter the embeddings' and the two dense layers' successors, 3-7 follow MoE layers, 8 is the
    last layer's pre-norm output: each equals HF's hidden state exactly, and id 8 gives the logits."""
    ids = verifier.tokenizer.apply_chat_template(CONVERSATION, return_tensors="pt", return_dict=True)["input_ids"]
    n = verifier.num_layers
    layer_ids = list(range(n + 1))
    states = verifier.capture(ids, layer_ids)
    assert states.shape == (1, ids.shape[1], n + 1, verifier.hidden_size)
    with torch.inference_mode():
        reference = verifier.model(ids, output_hidden_states=True)
    for layer_id in range(n):
        assert torch.equal(states[:, :, layer_id], reference.hidden_states[layer_id]), layer_id
    last = states[:, :, n]
    torch.testing.assert_close(verifier.final_norm(last), reference.hidden_states[n], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(last, reference.hidden_states[n], atol=1e-3)  # pre-norm, not HF's last state
    torch.testing.assert_close(verifier.logits_from_final_states(last), reference.logits, atol=1e-4, rtol=1e-4)


def test_the_draft_config_is_a_llama_layer_with_the_verifiers_heads_and_dense_mlp_width(verifier):
    """The speculators format gives vLLM a llama (or qwen3) draft layer, never MLA (vLLM's
    configs/speculators/algos.py maps only those two to Eagle3LlamaForCausalLM / Eagle3Qwen3ForCausalLM).
    Its heads, KV heads and head_dim are the verifier config's, as the reference library copies them:
    transformers' DeepseekV3Config.head_dim is qk_rope_head_dim (64), and an MLA config has as many KV
    heads as heads. The MLP is the dense layers' width, as vLLM's own DeepSeek EAGLE-3 drafter has it."""
    from transformers import DeepseekV3Config

    tiny = draft_config_for_verifier(verifier.config, "tiny").transformer_layer_config
    assert (tiny["model_type"], tiny["num_attention_heads"], tiny["num_key_value_heads"], tiny["head_dim"]) == (
        "llama",
        2,
        2,
        64,
    )
    assert (tiny["hidden_size"], tiny["intermediate_size"]) == (64, 128)

    # The published DeepSeek-V3 shape (transformers' defaults are its config): 61 layers, hidden 7168.
    full = draft_config_for_verifier(DeepseekV3Config(), "deepseek-ai/DeepSeek-V3", draft_vocab_size=32000)
    layer = full.transformer_layer_config
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (128, 128, 64)
    assert layer["intermediate_size"] == 18432 and layer["hidden_size"] == 7168
    assert 128 % 8 == 0 and 128 % 16 == 0  # vLLM shards the draft heads over the verifier's TP (8 or 16)
    assert full.eagle_aux_hidden_state_layer_ids == [2, 30, 58]
