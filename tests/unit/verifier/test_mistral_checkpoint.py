"""A verifier in Mistral's own checkpoint format (Mistral Large 3's: params.json, consolidated.safetensors
under Mistral's tensor names, tekken.json; no config.json), read as it is by every step.

The tiny one (speculators.verifier.tiny.make_tiny_mistral_verifier) is Mistral Large 3 at tiny size: MLA,
routed experts with a shared one after dense layers, softmax routing, YaRN without magnitude scaling and
llama-4 query scaling with 32-position periods, so a short prompt crosses them. Our reading (transformers'
Mistral 4 model, speculators.verifier.mistral_format) and vLLM's (`--config-format mistral --load-format mistral`,
MistralLarge3ForCausalLM) give the same greedy tokens and the same aux states; the drafter trained on it is
lossless under our evaluator, and vLLM's CPU build refuses to serve it beside the verifier for the reason
it refuses DeepSeek-V3's (tests/families/test_deepseek_v3.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from speculators.errors import SpeculatorsError
from speculators.settings import DrafterShape
from speculators.verifier.loading import (
    VerifierHead,
    draft_config_for_verifier,
    load_verifier,
    load_verifier_config,
    resolve_verifier_source,
)
from speculators.verifier.mistral_format import (
    HEAD_TENSORS,
    hf_config_from_params,
    is_mistral_checkpoint,
    mistral_tensor_name,
    transformers_config_dict,
    vllm_format_kwargs,
)
from speculators.verifier.tiny import TINY_MISTRAL_LARGE_3_PARAMS, make_tiny_mistral_verifier

CONVERSATION = [
    {"role": "user", "content": "The model explains the next token to a student."},
    {"role": "assistant", "content": "A drafter predicts two numbers quickly."},
    {"role": "user", "content": "And the verifier checks them?"},
    {"role": "assistant", "content": "Yes: every draft is checked."},
]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_tiny_mistral_verifier(tmp_path_factory.mktemp("mistral-large-3"))


@pytest.fixture(scope="module")
def verifier(mistral_dir):
    return load_verifier(mistral_dir, dtype="float32")


def test_the_tiny_checkpoint_is_in_mistrals_format_only(mistral_dir):
    names = sorted(path.name for path in mistral_dir.iterdir())
    assert names == ["consolidated.safetensors", "params.json", "tekken.json", "tiny_verifier.json"]
    assert is_mistral_checkpoint(mistral_dir) and resolve_verifier_source(mistral_dir) == ("mistral", str(mistral_dir))
    from safetensors import safe_open

    with safe_open(str(mistral_dir / "consolidated.safetensors"), "pt") as handle:
        keys = set(handle.keys())
        assert handle.get_tensor("layers.3.experts.2.w1.weight").shape == (64, 64)  # [expert width, dim]
        assert handle.get_tensor("layers.0.attention.wkv_a_with_mqa.weight").shape == (512 + 64, 64)
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.2.gate.weight"} <= keys
    assert "layers.1.gate.weight" not in keys and "layers.2.shared_experts.w2.weight" in keys  # 2 dense first
    assert not any(key.startswith("model.") for key in keys)


def test_the_config_is_vllms_view_and_the_model_transformers_mistral4(verifier):
    """The facts (what the store, the draft config and the matrix read) are the DeepSeek-V3 config vLLM
    derives; the module computing them is transformers' Mistral 4 (softmax routing, llama-4 scaling)."""
    assert verifier.model_type == "deepseek_v3" and verifier.architectures == ["MistralLarge3ForCausalLM"]
    assert type(verifier.model).__name__ == "Mistral4ForCausalLM"
    assert (verifier.num_layers, verifier.hidden_size, verifier.vocab_size) == (8, 64, 512)
    config = verifier.config
    assert (config.scoring_func, config.topk_method, config.norm_topk_prob) == ("softmax", None, True)
    assert config.llama_4_scaling == {"original_max_position_embeddings": 32, "beta": 0.1}
    model_config = verifier.model.config
    assert model_config.rope_parameters["mscale_all_dim"] == 0 and model_config.rope_parameters["factor"] == 32.0
    assert model_config.rope_parameters["llama_4_scaling_beta"] == 0.1
    layers = verifier.adapter.decoder_layers(verifier.model)
    assert ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in layers] == ["dense"] * 2 + ["moe"] * 6
    assert verifier.default_aux_layer_ids == [2, 4, 5]


def test_every_tensor_is_read_under_its_mistral_name(mistral_dir, verifier):
    """Each of the model's tensors equals the consolidated file's tensor of its Mistral name (experts
    fused: gate_up_proj = w1 then w3 per expert, down_proj = w2)."""
    from safetensors.torch import load_file

    stored = load_file(str(mistral_dir / "consolidated.safetensors"))
    state = verifier.model.state_dict()
    for name, tensor in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            for expert in range(4):
                w1 = stored[mistral_tensor_name(f"{prefix}.{expert}.gate_proj.weight")]
                w3 = stored[mistral_tensor_name(f"{prefix}.{expert}.up_proj.weight")]
                assert torch.equal(tensor[expert], torch.cat([w1, w3])), name
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for expert in range(4):
                assert torch.equal(tensor[expert], stored[mistral_tensor_name(f"{prefix}.{expert}.down_proj.weight")])
        else:
            assert torch.equal(tensor, stored[mistral_tensor_name(name)]), name
    head = VerifierHead.from_source(mistral_dir, dtype="float32")  # training's reading: three tensors by name
    assert torch.equal(head.embedding_weight, stored[HEAD_TENSORS["embedding"]])
    assert torch.equal(head.lm_head_weight, stored[HEAD_TENSORS["lm_head"]])
    assert torch.equal(head.final_norm.weight, stored[HEAD_TENSORS["norm"]])
    assert not torch.equal(head.lm_head_weight, head.embedding_weight)


def test_tekken_tokenizer_renders_mistrals_instruct_format_and_masks_the_answers(verifier):
    """mistral-common renders `<s>[INST]user[/INST]answer</s>` (what vLLM's mistral tokenizer mode does),
    and the training mask covers each answer and its `</s>`."""
    from speculators.data.tokenization import tokenize_conversation, turn_end_ids

    tokenizer = verifier.tokenizer
    vocab = tokenizer.get_vocab()
    bos, eos, inst, end_inst = (vocab[t] for t in ("<s>", "</s>", "[INST]", "[/INST]"))
    assert (bos, eos, inst, end_inst) == (1, 2, 3, 4) and turn_end_ids(tokenizer) == {eos}
    sample = tokenize_conversation(tokenizer, "c", CONVERSATION, 512)
    ids, mask = sample.input_ids, sample.loss_mask
    assert ids[:2] == [bos, inst] and ids[-1] == eos and max(ids) < 512
    answers = [i for i, m in enumerate(mask) if m]
    spans = [ids[i] for i in answers]
    assert spans.count(eos) == 2 and inst not in spans and end_inst not in spans
    first_answer = tokenizer.decode([ids[i] for i in answers if i < ids.index(eos)])
    assert first_answer == CONVERSATION[1]["content"]
    assert all(ids[i - 1] == end_inst for i in answers if mask[i - 1] == 0)  # each answer follows [/INST]


def test_the_draft_config_and_vllm_engine_arguments(mistral_dir, verifier, tmp_path):
    draft = draft_config_for_verifier(verifier.config, str(mistral_dir), DrafterShape(draft_vocab_size=128))
    layer = draft.transformer_layer_config
    assert draft.speculators_config.verifier.architectures == ["MistralLarge3ForCausalLM"]
    assert (layer["model_type"], layer["num_attention_heads"], layer["head_dim"], layer["intermediate_size"]) == (
        "llama",
        2,
        64,
        128,
    )
    assert vllm_format_kwargs(mistral_dir) == {
        "tokenizer_mode": "mistral",
        "config_format": "mistral",
        "load_format": "mistral",
    }
    # beside a drafter, vLLM's auto detection reads each model's folder (the drafter's is config.json)
    assert vllm_format_kwargs(mistral_dir, with_drafter=True) == {"tokenizer_mode": "mistral"}
    assert vllm_format_kwargs(tmp_path) == {}


def test_unreadable_variants_fail_in_one_sentence(tmp_path):
    params = json.loads(json.dumps(TINY_MISTRAL_LARGE_3_PARAMS))
    del params["yarn"]
    with pytest.raises(SpeculatorsError, match=r"no `yarn` section.*--backend vllm"):
        transformers_config_dict(hf_config_from_params(params))
    params = json.loads(json.dumps(TINY_MISTRAL_LARGE_3_PARAMS))
    params["llama_4_scaling"]["original_max_position_embeddings"] = 64
    with pytest.raises(SpeculatorsError, match="differs from yarn's"):
        transformers_config_dict(hf_config_from_params(params))
    (tmp_path / "params.json").write_text(json.dumps(TINY_MISTRAL_LARGE_3_PARAMS))
    with pytest.raises(SpeculatorsError, match=r"no config\.json \(nor Mistral's params\.json beside consolidated"):
        resolve_verifier_source(tmp_path)  # params.json without weights is no checkpoint


def test_a_hub_id_in_mistrals_format_reads_params_json_alone(mistral_dir, tmp_path, monkeypatch):
    """A hub model that ships only Mistral's format (Mistral Large 3's): its config comes from params.json
    (no weights fetched); loading it reads the snapshot's files like a local folder."""
    from speculators.verifier.loading import cache_as_hub_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    cache_as_hub_model(mistral_dir, "mistralai/Tiny-Large-3", tmp_path / "hub")
    config, location = load_verifier_config("mistralai/Tiny-Large-3")
    assert location == "mistralai/Tiny-Large-3" and config.architectures == ["MistralLarge3ForCausalLM"]
    loaded = load_verifier("mistralai/Tiny-Large-3", dtype="float32")
    assert type(loaded.model).__name__ == "Mistral4ForCausalLM"


# ----- vLLM's reading, and the drafter ----------------------------------------------------------------


def greedy_prompts(verifier) -> list[list[int]]:
    from speculators.data.conversation import Conversation
    from speculators.eval.evaluate import tokenize_prompts

    texts = [
        "The model explains the next token to a student.",
        "A drafter predicts two numbers quickly, and the verifier checks them one by one.",
        "Write a short list of three colours.",
    ]
    conversations = [Conversation(f"p{i}", [{"role": "user", "content": t}]) for i, t in enumerate(texts)]
    return [ids for _, ids in tokenize_prompts(verifier.tokenizer, conversations)]


@pytest.mark.slow
def test_vllm_reads_the_mistral_checkpoint_as_we_do_greedy_tokens_and_aux_states(mistral_dir, verifier, tmp_path):
    """vLLM's CPU build with `--config-format mistral --load-format mistral --tokenizer-mode mistral`:
    its fp32 greedy tokens are our plain greedy decoding, and `speculators datagen --backend vllm` (which
    names the formats itself) stores the aux states our transformers capture stores, at ids after the
    dense layers, the MoE layers and the last layer (the prompts pass the 32-position llama-4 period)."""
    from speculators.atomic_io import write_jsonl_atomic
    from speculators.data.capture import capture_samples
    from speculators.data.tokenization import tokenize_conversation
    from speculators.eval.evaluate import greedy_generate
    from speculators.serving.serve import ServerSettings, VllmServer
    from tests.unit.data.test_vllm_capture import assert_same_store, vllm_datagen
    from tests.unit.serving.test_serve_bench import NEW_TOKENS, SERVER, completions

    prompts = greedy_prompts(verifier)
    flags = ["--config-format", "mistral", "--load-format", "mistral", "--tokenizer-mode", "mistral"]
    settings = ServerSettings(str(mistral_dir), **SERVER, extra_args=flags, log_path=tmp_path / "server.log")
    server = VllmServer(settings)
    assert server.command().count("--load-format") == 1  # the user's flags, not ours twice
    with server:
        served = completions(server.url, server.model_name, prompts)
    greedy = [greedy_generate(verifier, ids, NEW_TOKENS, stop_ids=set()).tokens for ids in prompts]
    assert served == greedy
    assert all(len(ids) + NEW_TOKENS > 40 for ids in prompts)  # past the 32-position llama-4 period
    log = (tmp_path / "server.log").read_text()
    assert "MistralLarge3ForCausalLM" in log

    aux = [2, 5, 8]
    samples = [
        tokenize_conversation(verifier.tokenizer, f"s{i}", CONVERSATION[: 2 + 2 * (i % 2)], 512) for i in range(5)
    ]
    write_jsonl_atomic(tmp_path / "samples.jsonl", samples)
    capture_samples(samples, verifier, tmp_path / "hf", aux_layer_ids=aux, storage="float32", progress=False)
    vllm_datagen(mistral_dir, tmp_path / "samples.jsonl", tmp_path / "vllm", aux=aux)
    assert_same_store(tmp_path / "hf", tmp_path / "vllm", atol=1e-4)


@pytest.fixture(scope="module")
def peaked_mistral(tmp_path_factory):
    """The tiny Mistral Large 3 with peaked next-token distributions (a drafter has something to learn)."""
    return make_tiny_mistral_verifier(tmp_path_factory.mktemp("peaked-mistral"), seed=1, initializer_range=0.3)


@pytest.mark.slow
def test_a_drafter_trained_on_the_mistral_checkpoint_is_lossless_vllm_cpu_refuses_it_beside_mla(
    peaked_mistral, tmp_path
):
    """Our EAGLE-3 drafter trained on the Mistral-format verifier's own answers (regenerated, captured,
    the head read under Mistral's names), converted and checked against the verifier, is lossless under
    `speculators evaluate` (fp32: every output exactly the verifier's greedy one, drafts accepted). vLLM's
    CPU build loads both (the drafter's folder through vLLM's auto detection) and refuses the pair at its
    KV-cache set-up, as for DeepSeek-V3: MLA's CPU backend takes block size 16 only, the drafter's llama
    layer's multiples of 32 (tests/families/test_deepseek_v3.py)."""
    import subprocess
    import sys

    from speculators.serving.serve import ServerSettings, VllmServer
    from tests.conftest import build_peaked_store, train_peaked_drafter, write_peaked_prompts
    from tests.unit.serving.test_serve_bench import SERVER, K

    store = build_peaked_store(peaked_mistral, tmp_path / "store")
    drafter = train_peaked_drafter(store, peaked_mistral, tmp_path / "train", epochs=40)
    config = json.loads((drafter / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["architectures"] == ["MistralLarge3ForCausalLM"]

    prompts = write_peaked_prompts(tmp_path / "prompts.jsonl")
    report = tmp_path / "eval.json"
    command = [sys.executable, "-m", "speculators.cli", "evaluate", "--verifier", str(peaked_mistral)]
    command += ["--speculator", str(drafter), "--prompts", str(prompts), "--dtype", "float32"]
    command += ["--max-new-tokens", "40", "--no-stop-at-eos", "--output", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    totals = json.loads(report.read_text())
    assert totals["lossless"]["identical"] == totals["prompts"] == 8, done.stdout[-2000:]
    assert totals["acceptance_length"] > 1.8, done.stdout[-2000:]

    settings = ServerSettings(
        str(peaked_mistral),
        **SERVER,
        speculator=str(drafter),
        num_speculative_tokens=K,
        log_path=tmp_path / "speculator.log",
    )
    refused = VllmServer(settings)
    command = refused.command()
    assert "--tokenizer-mode" in command and "--config-format" not in command and "--load-format" not in command
    try:
        with pytest.raises(SpeculatorsError, match="before it was ready"):
            refused.start()
    finally:
        refused.stop()
    log = (tmp_path / "speculator.log").read_text()
    assert re.search(r"No common block size for (16|128) \(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)", log)


def test_the_tiny_verifier_command_writes_mistrals_format(tmp_path, capsys):
    from speculators.cli import main

    output = tmp_path / "tiny"
    args = ["tiny-verifier", "--family", "deepseek_v3", "--mistral-format", "--num-layers", "4"]
    assert main([*args, "--output", str(output)]) == 0
    assert resolve_verifier_source(output)[0] == "mistral"
    config, _ = load_verifier_config(output)
    assert (config.num_hidden_layers, config.first_k_dense_replace) == (4, 2)
    assert main(["tiny-verifier", "--family", "llama", "--mistral-format", "--output", str(tmp_path / "other")]) == 2
    assert "--mistral-format writes Mistral Large 3 (a deepseek_v3 model), not llama" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
