"""config.json of the speculators format: round trip, golden key set, reference-library files, errors."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.config import DraftLayerConfig, Eagle3Config, load_eagle3_config, parse_eagle3_config
from speculators.settings import DrafterShape
from speculators.verifier.loading import draft_config_for_verifier
from tests.paths import GOLDEN_DIR, TEST_DATA_DIR

GOLDEN = GOLDEN_DIR


def smollm2_verifier_config():
    """SmolLM2-135M-Instruct's published config (no weights needed)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )


def smollm2_drafter_config() -> Eagle3Config:
    return draft_config_for_verifier(
        smollm2_verifier_config(), "HuggingFaceTB/SmolLM2-135M-Instruct", DrafterShape(draft_vocab_size=8192)
    )


def test_config_for_a_known_drafter_matches_the_golden_file():
    written = json.loads(json.dumps(smollm2_drafter_config().to_json_dict()))
    golden = json.loads((GOLDEN / "smollm2_eagle3_config.json").read_text())
    assert sorted(written) == sorted(golden)
    assert sorted(written["transformer_layer_config"]) == sorted(golden["transformer_layer_config"])
    assert written == golden


def test_every_norm_flag_and_required_layer_key_is_explicit():
    data = smollm2_drafter_config().to_json_dict()
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        assert isinstance(data[flag], bool)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "rope_theta",
    ):
        assert key in data["transformer_layer_config"], key


def test_config_json_round_trip(tmp_path):
    config = smollm2_drafter_config()
    config.save(tmp_path)
    loaded, notes = load_eagle3_config(tmp_path)
    assert notes == []
    assert loaded.to_json_dict() == config.to_json_dict()
    loaded.save(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_bytes() == (tmp_path / "config.json").read_bytes()


def test_derived_sizes():
    config = smollm2_drafter_config()
    assert (config.hidden_size, config.verifier_hidden_size, config.verifier_vocab_size) == (576, 576, 49152)
    assert config.speculative_tokens == 3
    assert config.eagle_aux_hidden_state_layer_ids == [2, 15, 27]


def test_a_config_written_by_the_reference_library_loads():
    raw = json.loads((GOLDEN / "reference_library_eagle3_config.json").read_text())
    config, notes = parse_eagle3_config(raw)
    assert config.norm_before_residual is False  # written explicitly by the reference library
    assert (config.norm_before_fc, config.fc_norm, config.norm_output) == (False, False, False)
    assert config.dtype == "bfloat16"  # from torch_dtype
    assert config.hidden_size == 4096 and config.verifier_vocab_size == 128256 and config.draft_vocab_size == 32000
    assert config.eagle_aux_hidden_state_layer_ids is None
    layer = config.transformer_layer_config
    assert layer["rope_parameters"]["rope_type"] == "llama3" and layer["rope_theta"] == 500000.0
    assert layer["rope_scaling"]["factor"] == 8.0
    assert any("auto_map" in note for note in notes)
    assert any("norm_before_fc missing" in note for note in notes)
    written = config.to_json_dict()
    assert "auto_map" not in written and "model_type" not in written and "torch_dtype" not in written
    assert written["norm_before_fc"] is False


def _bad(mutate) -> str:
    raw = smollm2_drafter_config().to_json_dict()
    mutate(raw)
    with pytest.raises(CheckpointFormatError) as error:
        parse_eagle3_config(copy.deepcopy(raw))
    return str(error.value)


def test_unknown_algorithm_is_named():
    message = _bad(lambda raw: raw.update(speculators_model_type="medusa2"))
    assert "unknown algorithm 'medusa2'" in message


def test_known_but_unsupported_algorithm_says_so():
    message = _bad(lambda raw: raw.update(speculators_model_type="mtp"))
    assert "algorithm 'mtp'" in message and "does not load" in message


def test_draft_layer_type_must_be_one_vllm_loads():
    message = _bad(lambda raw: raw["transformer_layer_config"].update(model_type="mistral"))
    assert "'mistral'" in message and "llama, qwen3" in message


def test_draft_vocab_larger_than_verifier_vocab():
    message = _bad(lambda raw: raw.update(draft_vocab_size=60000))
    assert "draft_vocab_size 60000 exceeds the verifier vocab 49152" in message


def test_exclusive_fc_norms():
    message = _bad(lambda raw: raw.update(fc_norm=True, norm_before_fc=True))
    assert "exclusive" in message


def test_aux_layer_ids_must_be_three_distinct():
    assert "3 distinct" in _bad(lambda raw: raw.update(eagle_aux_hidden_state_layer_ids=[2, 15]))
    assert "3 distinct" in _bad(lambda raw: raw.update(eagle_aux_hidden_state_layer_ids=[2, 2, 27]))


def test_missing_speculators_model_type_points_at_convert():
    message = _bad(lambda raw: raw.pop("speculators_model_type"))
    assert "speculators convert" in message


def test_missing_proposal_methods():
    message = _bad(lambda raw: raw["speculators_config"].update(proposal_methods=[]))
    assert "proposal_methods" in message


def reference_config_with_layer(**layer: object) -> dict:
    raw = json.loads((GOLDEN / "reference_library_eagle3_config.json").read_text())
    raw["transformer_layer_config"].update(layer)
    return raw


@pytest.mark.parametrize(
    "layer",
    [
        {"layer_types": ["sliding_attention"], "sliding_window": 512},  # llama: vLLM honours layer_types
        {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 0},
    ],
)
def test_a_sliding_window_draft_layer_is_refused_by_validate_and_convert(layer, tmp_path):
    """vLLM would run these draft layers with a 512-token window; our drafter attends to everything."""
    from speculators.cli import main
    from speculators.models.config import parse_eagle3_config

    raw = reference_config_with_layer(**layer)
    with pytest.raises(CheckpointFormatError) as error:
        parse_eagle3_config(raw)
    assert "draft layer(s) [0] sliding-window attention (sliding_window 512)" in str(error.value)
    assert "retrain the drafter with full attention" in str(error.value)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert main(["validate", str(tmp_path)]) == 1


def test_a_sliding_window_that_no_draft_layer_uses_is_a_note():
    """Qwen3's use_sliding_window only applies from max_window_layers on (28 by default): layer 0 is full."""
    from speculators.models.config import parse_eagle3_config

    raw = reference_config_with_layer(model_type="qwen3", use_sliding_window=True, sliding_window=4096)
    config, notes = parse_eagle3_config(raw)
    assert config.draft_layer_type == "qwen3"
    assert any("use_sliding_window=True" in n and "full attention" in n for n in notes)


MODEL_CONFIGS = TEST_DATA_DIR / "model_configs"


def drafter_config_for_published_verifier(name: str) -> Eagle3Config:
    """A draft config, with draft layers of the verifier's own type, for a published verifier config.json."""
    from transformers import LlamaConfig, Qwen3Config

    raw = json.loads((MODEL_CONFIGS / f"{name}.json").read_text())
    verifier = {"llama": LlamaConfig, "qwen3": Qwen3Config}[raw["model_type"]](**raw)
    return draft_config_for_verifier(
        verifier, name, DrafterShape(draft_vocab_size=32000, draft_layer_type=raw["model_type"])
    )


@pytest.mark.parametrize(
    ("name", "layer_type", "rope_type"),
    [("llama3_1_8b", "llama", "llama3"), ("qwen3_8b", "qwen3", "default"), ("reference_library", "llama", "llama3")],
)
def test_the_typed_layer_config_is_a_view_of_the_dict(name, layer_type, rope_type):
    if name == "reference_library":
        config, _ = parse_eagle3_config(json.loads((GOLDEN / "reference_library_eagle3_config.json").read_text()))
    else:
        config = drafter_config_for_published_verifier(name)
    layer, typed = config.transformer_layer_config, config.layer
    assert isinstance(typed, DraftLayerConfig)
    for field in dataclasses.fields(DraftLayerConfig):
        assert getattr(typed, field.name) == layer.get(field.name, field.default), field.name
    assert (typed.model_type, typed.rope_type, typed.rope_theta) == (layer_type, rope_type, layer["rope_theta"])
    assert typed.attention_bias is False and typed.mlp_bias is False
    assert (config.hidden_size, config.num_draft_layers, config.draft_layer_type) == (
        layer["hidden_size"],
        layer["num_hidden_layers"],
        layer_type,
    )
    assert config.to_json_dict()["transformer_layer_config"] == layer  # config.json still holds the dict


def test_a_layer_config_missing_a_field_is_one_clear_error():
    layer = dict(drafter_config_for_published_verifier("llama3_1_8b").transformer_layer_config)
    del layer["num_key_value_heads"]
    with pytest.raises(SpeculatorsError) as error:
        DraftLayerConfig.from_dict(layer)
    assert str(error.value) == (
        "transformer_layer_config lacks num_key_value_heads (an integer); add it to the speculator's config.json "
        "(the draft layers' Hugging Face decoder config)"
    )


def test_a_layer_field_of_the_wrong_type_is_one_clear_error():
    layer = dict(drafter_config_for_published_verifier("qwen3_8b").transformer_layer_config, hidden_size="4096")
    expected = (
        "transformer_layer_config.hidden_size is '4096' (str), not an integer; "
        "write it as an integer in the speculator's config.json"
    )
    with pytest.raises(SpeculatorsError) as error:
        DraftLayerConfig.from_dict(layer)
    assert str(error.value) == expected
    # A checkpoint's config.json says the same (before, transformers' own type check escaped unformatted).
    in_checkpoint = _bad(lambda raw: raw["transformer_layer_config"].update(hidden_size="576"))
    assert expected.replace("4096", "576") in in_checkpoint
    assert "not true or false" in _bad(lambda raw: raw["transformer_layer_config"].update(attention_bias=1))
    assert "not a float" in _bad(lambda raw: raw["transformer_layer_config"].update(rms_norm_eps=1))


def test_a_mistyped_key_only_transformers_checks_is_a_checkpoint_error():
    message = _bad(lambda raw: raw["transformer_layer_config"].update(initializer_range="small"))
    assert "transformer_layer_config is not a valid LlamaConfig" in message and "initializer_range" in message
