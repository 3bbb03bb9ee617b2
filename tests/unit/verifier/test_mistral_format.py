"""Mistral's own format read in Hugging Face terms: params.json -> config dict, tensor names (fast, no weights)."""

from __future__ import annotations

import copy
import json

import pytest

from speculators.errors import SpeculatorsError
from speculators.verifier.mistral_format import (
    MISTRAL_TO_HF_TENSORS,
    hf_config_from_file,
    hf_config_from_params,
    hf_tensor_name,
    is_vision_tensor,
    needs_rotary_permutation,
    read_params,
    to_hf_rotary_layout,
)
from tests.paths import TEST_DATA_DIR

LARGE_3 = TEST_DATA_DIR / "model_configs" / "mistral_large_3.params.json"

# The spec's table (spec/mistral-large-3.md): Mistral Large 3 in Hugging Face (deepseek_v3) keys
LARGE_3_FACTS = {
    "model_type": "deepseek_v3",
    "architectures": ["MistralLarge3ForCausalLM"],
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "intermediate_size": 16384,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "vocab_size": 131072,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 128,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "moe_intermediate_size": 4096,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "softmax",
    "norm_topk_prob": True,
    "topk_method": None,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 294912,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "llama_4_scaling": {"original_max_position_embeddings": 8192, "beta": 0.1},
    "rope_parameters": {
        "rope_type": "yarn",
        "mscale_all_dim": 1,
        "rope_theta": 10000.0,
        "factor": 36.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.0,  # yarn.apply_scale false
    },
}

DENSE = {  # a dense Mistral params.json (Mistral-7B-like shape, smaller)
    "dim": 512,
    "n_layers": 4,
    "head_dim": 64,
    "hidden_dim": 1024,
    "n_heads": 8,
    "n_kv_heads": 2,
    "norm_eps": 1e-5,
    "vocab_size": 32768,
    "rope_theta": 1000000.0,
}


def large_3() -> dict:
    return json.loads(LARGE_3.read_text())


def test_the_transcribed_params_json_gives_the_published_facts():
    config = hf_config_from_file(LARGE_3)
    assert {key: config.get(key) for key in LARGE_3_FACTS} == LARGE_3_FACTS
    assert "head_dim" not in config  # 192 = 128 + 64: transformers derives its own (the rotary width)
    assert not {"moe", "yarn", "dim", "n_layers", "norm_eps"} & set(config)  # mapped, not carried
    assert hf_config_from_file(LARGE_3.parent / LARGE_3.name) == hf_config_from_params(large_3())


def test_transformers_builds_the_configs_it_is_given():
    from transformers import DeepseekV3Config, MistralConfig

    large = DeepseekV3Config(**hf_config_from_params(large_3()))
    assert (large.num_hidden_layers, large.n_routed_experts, large.qk_head_dim, large.head_dim) == (61, 128, 192, 64)
    assert (large.n_group, large.topk_group, large.routed_scaling_factor) == (1, 1, 1.0)  # not DeepSeek's defaults
    assert large.rope_parameters["rope_type"] == "yarn" and large.rope_parameters["factor"] == 36.0
    dense = MistralConfig(**hf_config_from_params(DENSE))
    assert (dense.head_dim, dense.num_key_value_heads, dense.intermediate_size) == (64, 2, 1024)
    assert dense.rope_parameters["rope_theta"] == 1e6


def test_a_dense_mistral_maps_to_mistral_for_causal_lm():
    config = hf_config_from_params(DENSE)
    assert config == {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1024,
        "vocab_size": 32768,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "max_position_embeddings": 128_000,  # vLLM's default
        "max_seq_len": 128_000,
        "head_dim": 64,
        "rope_theta": 1e6,
    }
    windowed = hf_config_from_params({**DENSE, "sliding_window": [None, 4096]})
    assert windowed["sliding_window"] == 4096
    assert windowed["layer_types"] == ["full_attention", "sliding_attention"] * 2


def test_the_other_mistral_forms_vllm_reads():
    mla_dense = {key: value for key, value in large_3().items() if key != "moe"}  # MLA, no MoE section
    config = hf_config_from_params(mla_dense)
    assert config["architectures"] == ["MistralLarge3ForCausalLM"] and config["first_k_dense_replace"] == 61
    assert (config["n_routed_experts"], config["n_shared_experts"], config["moe_intermediate_size"]) == (1, 1, 16384)

    vision = {"hidden_size": 1664, "num_hidden_layers": 48, "num_attention_heads": 16, "patch_size": 14}
    wrapped = hf_config_from_params({**large_3(), "vision_encoder": vision})
    assert (wrapped["model_type"], wrapped["architectures"]) == ("pixtral", ["PixtralForConditionalGeneration"])
    assert wrapped["vision_config"] == vision and wrapped["text_config"] == hf_config_from_params(large_3())

    fp8 = hf_config_from_params({**DENSE, "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "NO_SCALES"}})
    assert fp8["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic"}
    passed = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    assert hf_config_from_params({**large_3(), "quantization_config": passed})["quantization_config"] == passed


def edit(params: dict, path: str, value: object = None, remove: bool = False) -> dict:
    params = copy.deepcopy(params)
    *sections, key = path.split(".")
    target = params
    for section in sections:
        target = target[section]
    if remove:
        del target[key]
    else:
        target[key] = value
    return params


@pytest.mark.parametrize(
    ("path", "value", "remove", "named"),
    [
        ("n_layers", None, True, "`n_layers` is missing"),
        ("vocab_size", None, True, "`vocab_size` is missing"),
        ("moe.num_experts", None, True, "`moe.num_experts` is missing"),
        ("moe.expert_hidden_dim", None, True, "`moe.expert_hidden_dim` is missing"),
        ("llama_4_scaling", None, True, "`llama_4_scaling` is missing"),
        ("llama_4_scaling.beta", None, True, "`llama_4_scaling.beta` is missing"),
        ("kv_lora_rank", None, True, "`kv_lora_rank` is missing"),
        ("dim", "7168", False, "`dim` is '7168'"),
        ("n_layers", True, False, "`n_layers` is True"),
        ("norm_eps", 0, False, "`norm_eps` is 0"),
        ("n_kv_heads", 3, False, "`n_kv_heads` is 3"),
        ("head_dim", 128, False, "`head_dim` is not qk_nope_head_dim + qk_rope_head_dim"),
        ("moe.num_experts_per_tok", 256, False, "`moe.num_experts_per_tok` is over num_experts"),
        ("moe.first_k_dense_replace", 62, False, "`moe.first_k_dense_replace` is 62"),
        ("yarn.temperature", 1, False, "`yarn.temperature` is no YaRN setting"),
        ("moe.num_shared_experts", 0, False, "`moe.num_shared_experts` says 0"),
        ("model_type", "mamba", False, "`model_type` says 'mamba'"),
    ],
)
def test_a_bad_or_missing_key_is_one_sentence_naming_it_and_the_file(path, value, remove, named):
    with pytest.raises(SpeculatorsError) as error:
        hf_config_from_params(edit(large_3(), path, value, remove), "/ckpt/params.json")
    message = str(error.value)
    assert named in message and message.startswith("/ckpt/params.json: ") and "\n" not in message


def test_a_dense_params_json_without_its_mlp_width_is_refused():
    with pytest.raises(SpeculatorsError, match=r"^params\.json: `hidden_dim` is missing"):
        hf_config_from_params(edit(DENSE, "hidden_dim", remove=True))


def test_reading_a_params_file(tmp_path):
    (tmp_path / "params.json").write_text(json.dumps(DENSE))
    assert read_params(tmp_path) == DENSE and hf_config_from_file(tmp_path)["model_type"] == "mistral"
    with pytest.raises(SpeculatorsError, match="does not exist"):
        read_params(tmp_path / "missing")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SpeculatorsError, match="not readable JSON"):
        read_params(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(SpeculatorsError, match="not a JSON object"):
        read_params(tmp_path / "list.json")


@pytest.mark.parametrize(
    ("mistral", "hf"),
    [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("layers.0.attention_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("layers.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
        # dense attention
        ("layers.1.attention.wq.weight", "model.layers.1.self_attn.q_proj.weight"),
        ("layers.1.attention.wk.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("layers.1.attention.wv.weight", "model.layers.1.self_attn.v_proj.weight"),
        ("layers.1.attention.wo.weight", "model.layers.1.self_attn.o_proj.weight"),
        # MLA attention
        ("layers.60.attention.wq_a.weight", "model.layers.60.self_attn.q_a_proj.weight"),
        ("layers.60.attention.q_a_norm.weight", "model.layers.60.self_attn.q_a_layernorm.weight"),
        ("layers.60.attention.wq_b.weight", "model.layers.60.self_attn.q_b_proj.weight"),
        ("layers.60.attention.wkv_a_with_mqa.weight", "model.layers.60.self_attn.kv_a_proj_with_mqa.weight"),
        ("layers.60.attention.kv_a_norm.weight", "model.layers.60.self_attn.kv_a_layernorm.weight"),
        ("layers.60.attention.wkv_b.weight", "model.layers.60.self_attn.kv_b_proj.weight"),
        # dense MLP
        ("layers.2.feed_forward.w1.weight", "model.layers.2.mlp.gate_proj.weight"),
        ("layers.2.feed_forward.w2.weight", "model.layers.2.mlp.down_proj.weight"),
        ("layers.2.feed_forward.w3.weight", "model.layers.2.mlp.up_proj.weight"),
        # MoE: router, shared experts, routed experts
        ("layers.3.gate.weight", "model.layers.3.mlp.gate.weight"),
        ("layers.3.shared_experts.w1.weight", "model.layers.3.mlp.shared_experts.gate_proj.weight"),
        ("layers.3.shared_experts.w2.weight", "model.layers.3.mlp.shared_experts.down_proj.weight"),
        ("layers.3.shared_experts.w3.weight", "model.layers.3.mlp.shared_experts.up_proj.weight"),
        ("layers.3.experts.127.w1.weight", "model.layers.3.mlp.experts.127.gate_proj.weight"),
        ("layers.3.experts.127.w2.weight", "model.layers.3.mlp.experts.127.down_proj.weight"),
        ("layers.3.experts.0.w3.weight", "model.layers.3.mlp.experts.0.up_proj.weight"),
        # a linear's quantization scales
        ("layers.3.experts.5.w2.weight_scale", "model.layers.3.mlp.experts.5.down_proj.weight_scale"),
        ("layers.0.attention.wkv_b.qscale_weight", "model.layers.0.self_attn.kv_b_proj.weight_scale"),
        ("layers.0.attention.wq.qscale_act", "model.layers.0.self_attn.q_proj.input_scale"),
    ],
)
def test_every_tensor_class_maps_to_its_hugging_face_name(mistral, hf):
    assert hf_tensor_name(mistral) == hf


def large_3_layer_names(layer: int, experts: int, moe: bool) -> list[str]:
    attention = ["wq_a", "q_a_norm", "wq_b", "wkv_a_with_mqa", "kv_a_norm", "wkv_b", "wo"]
    names = [f"layers.{layer}.{n}.weight" for n in ["attention_norm", "ffn_norm"]]
    names += [f"layers.{layer}.attention.{n}.weight" for n in attention]
    if not moe:
        return names + [f"layers.{layer}.feed_forward.w{i}.weight" for i in (1, 2, 3)]
    names += [f"layers.{layer}.gate.weight"] + [f"layers.{layer}.shared_experts.w{i}.weight" for i in (1, 2, 3)]
    return names + [f"layers.{layer}.experts.{e}.w{i}.weight" for e in range(experts) for i in (1, 2, 3)]


def test_a_deepseek_style_checkpoint_maps_one_to_one_onto_its_hugging_face_names():
    """Every tensor of a 2-layer Mistral Large 3 shape (one dense layer, one MoE layer of 4 experts) maps, no two
    onto the same name, and onto DeepSeek-V3's own per-expert checkpoint names."""
    names = ["tok_embeddings.weight", "norm.weight", "output.weight"]
    names += large_3_layer_names(0, 4, moe=False) + large_3_layer_names(1, 4, moe=True)
    mapped = [hf_tensor_name(name) for name in names]
    assert len(set(mapped)) == len(names) == 3 + (9 + 3) + (9 + 1 + 3 + 4 * 3)
    attention = ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for layer in (0, 1):
        expected |= {f"model.layers.{layer}.{n}.weight" for n in ["input_layernorm", "post_attention_layernorm"]}
        expected |= {f"model.layers.{layer}.self_attn.{n}.weight" for n in attention}
    expected |= {f"model.layers.0.mlp.{n}.weight" for n in ["gate_proj", "down_proj", "up_proj"]}
    expected |= {"model.layers.1.mlp.gate.weight"}
    expected |= {f"model.layers.1.mlp.shared_experts.{n}.weight" for n in ["gate_proj", "down_proj", "up_proj"]}
    expected |= {
        f"model.layers.1.mlp.experts.{e}.{n}.weight" for e in range(4) for n in ["gate_proj", "down_proj", "up_proj"]
    }
    assert set(mapped) == expected


def test_the_table_covers_every_template():
    for mistral, hf in MISTRAL_TO_HF_TENSORS.items():
        assert hf_tensor_name(mistral.format(layer=7, expert=3)) == hf.format(layer=7, expert=3)


@pytest.mark.parametrize(
    "name",
    [
        "layers.0.attention.wqkv.weight",
        "layers.0.experts.w1.weight",  # no expert index
        "layers.x.ffn_norm.weight",
        "model.layers.0.input_layernorm.weight",  # already a Hugging Face name
        "layers.0.gate.weight_scale",  # the router is not quantized
        "layers.0.attention_norm.qscale_act",  # nor are the norms
        "tok_embeddings.bias",
        "vision_encoder.transformer.layers.0.attention.wq.weight",
        "patch_merger.merging_layer.weight",
        "",
    ],
)
def test_an_unknown_tensor_name_raises(name):
    with pytest.raises(SpeculatorsError, match="no Hugging Face name maps to it"):
        hf_tensor_name(name)


def test_vision_tensors_are_told_apart():
    assert is_vision_tensor("vision_encoder.transformer.layers.0.attention.wq.weight")
    assert is_vision_tensor("vision_language_adapter.w_in.weight") and is_vision_tensor("pre_mm_projector_norm.weight")
    assert not is_vision_tensor("layers.0.attention.wq.weight")
    with pytest.raises(SpeculatorsError, match="vision encoder's tensor"):
        hf_tensor_name("patch_merger.merging_layer.weight")


def test_dense_query_and_key_rows_move_to_hugging_faces_rotary_layout():
    torch = pytest.importorskip("torch")

    assert needs_rotary_permutation("layers.3.attention.wq.weight")
    assert needs_rotary_permutation("layers.3.attention.wk.weight")
    assert not needs_rotary_permutation("layers.3.attention.wv.weight")
    assert not needs_rotary_permutation("layers.3.attention.wq_a.weight")  # MLA: interleaved on both sides
    # two heads of 4 rows: each head's interleaved pairs (0, 1), (2, 3) -> halves 0, 2 | 1, 3
    weight = torch.arange(8, dtype=torch.float32).repeat(3, 1).T.contiguous()  # row i holds i
    moved = to_hf_rotary_layout(weight, heads=2)
    assert moved[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7] and moved.shape == weight.shape
    with pytest.raises(SpeculatorsError, match="whole pairs"):
        to_hf_rotary_layout(weight, heads=3)
