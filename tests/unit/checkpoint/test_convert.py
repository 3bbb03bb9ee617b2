"""Converter and validator: research layout, reference-library checkpoints, CLI exit codes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators.checkpoint.convert import convert_checkpoint
from speculators.checkpoint.validation import validate_checkpoint
from speculators.cli import main
from speculators.errors import SpeculatorsError
from speculators.models.eagle3 import Eagle3Drafter
from speculators.settings import ConvertSettings
from tests.reference_eagle3 import reference_draft_logits

H, V, D, HEADS, KV, HD, INNER = 64, 512, 96, 2, 1, 32, 160


def research_tensors(seed=0, dtype=torch.float16):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    def norm(size):
        return (1 + 0.3 * torch.rand(size, generator=generator)).to(dtype)

    selected = torch.tensor(sorted(torch.randperm(V, generator=generator)[:D].tolist()))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    return {
        "fc.weight": randn(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": randn(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": randn(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": randn(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": randn(H, HEADS * HD),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": randn(INNER, H),
        "midlayer.mlp.up_proj.weight": randn(INNER, H),
        "midlayer.mlp.down_proj.weight": randn(H, INNER),
        "norm.weight": norm(H),
        "lm_head.weight": randn(D, H),
        "embed_tokens.weight": randn(V, H, scale=1.0),
        "d2t": selected - torch.arange(D),
        "t2d": t2d,
    }


def write_research_checkpoint(directory, tensors, as_bin=True):
    directory.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INNER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": V,
        "draft_vocab_size": D,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    }
    (directory / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save(tensors, directory / "pytorch_model.bin")
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    return directory


def assert_matches_reference(drafter, weights, aux, ids, **flags):
    """The drafter's logits and fed-forward state equal the independent forward on `weights`."""
    with torch.no_grad():
        ours = drafter(ids[None], drafter.project_aux(aux[None]), position_ids=torch.arange(ids.numel())[None])
    logits, hidden = reference_draft_logits(
        weights,
        aux,
        weights["embed_tokens.weight"][ids],
        heads=HEADS,
        kv_heads=KV,
        head_dim=HD,
        eps=1e-5,
        theta=10000.0,
        **flags,
    )
    torch.testing.assert_close(ours.logits[0], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.hidden_states[0], hidden, atol=1e-5, rtol=1e-5)
    return ours.logits[0], logits


def test_research_checkpoint_converts_validates_and_keeps_logits(tmp_path, tiny_verifier_dir):
    verifier = tiny_verifier_dir("llama")
    tensors = research_tensors()
    source = write_research_checkpoint(tmp_path / "research", tensors)
    result = convert_checkpoint(
        ConvertSettings(
            source=source,
            verifier=str(verifier),
            output=tmp_path / "converted",
            aux_layer_ids=[1, 4, 8],
            dtype="float32",
        )
    )
    assert result.source_layout == "research-eagle3"
    assert any("embed_tokens.weight dropped" in note for note in result.notes)
    report = validate_checkpoint(tmp_path / "converted", verifier=str(verifier))
    assert report.ok, report.render()

    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert (config["norm_before_residual"], config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (
        False,
        False,
        False,
        False,
    )
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    saved = load_file(str(tmp_path / "converted" / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in saved and not any(k.startswith("midlayer") for k in saved)

    # Logits of the converted drafter equal an independent computation on the source weights.
    w = {k.replace("midlayer.", "layers.0."): v.float() for k, v in tensors.items()}
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "converted", verifier_embeddings=w["embed_tokens.weight"])
    generator = torch.Generator().manual_seed(5)
    aux = torch.randn(7, 3 * H, generator=generator)
    ids = torch.randint(0, V, (7,), generator=generator)
    ours, expected_logits = assert_matches_reference(drafter, w, aux, ids, norm_before_residual=False)
    targets = drafter.draft_to_target(ours.argmax(-1))
    expected_targets = expected_logits.argmax(-1) + tensors["d2t"][expected_logits.argmax(-1)]
    assert torch.equal(targets, expected_targets)


def test_norm_flags_reach_the_forward(tmp_path, tiny_verifier_dir):
    """norm_before_residual / norm_output / norm_before_fc flags given to convert change the math as the spec says."""
    tensors = research_tensors(seed=1, dtype=torch.float32)
    tensors["input_norm.weight"] = 1 + 0.3 * torch.rand(3 * H)
    source = write_research_checkpoint(tmp_path / "research", tensors, as_bin=False)
    convert_checkpoint(
        ConvertSettings(
            source=source,
            verifier=str(tiny_verifier_dir("llama")),
            output=tmp_path / "out",
            aux_layer_ids=[1, 4, 8],
            norm_before_residual=True,
            norm_output=True,
        )
    )
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["dtype"] == "float32"
    w = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "out", verifier_embeddings=w["embed_tokens.weight"])
    aux, ids = torch.randn(5, 3 * H), torch.randint(0, V, (5,))
    assert_matches_reference(drafter, w, aux, ids, norm_before_residual=True, norm_before_fc=True, norm_output=True)


def write_reference_library_checkpoint(directory, tensors):
    """What the reference library writes: our tensor names plus embeddings, config.py and auto_map."""
    directory.mkdir(parents=True)
    names = {
        k.replace("midlayer.", "layers.0."): v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in tensors.items()
    }
    save_file(names, str(directory / "model.safetensors"))
    config = {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": D,
        "embed_requires_grad": False,
        "has_no_defaults_at_init": False,
        "model_type": "speculators",
        "norm_before_residual": True,
        "eagle_aux_hidden_state_layer_ids": [1, 4, 8],
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1}
            ],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "acme/tiny-llama"},
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0",
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": H,
            "intermediate_size": INNER,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV,
            "head_dim": HD,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
            "vocab_size": V,
            "torch_dtype": "bfloat16",
        },
    }
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "config.py").write_text("raise RuntimeError('never executed')\n")
    return directory


def test_reference_library_checkpoint_loads_and_converts(tmp_path, tiny_verifier_dir):
    source = write_reference_library_checkpoint(tmp_path / "reference", research_tensors(seed=2))
    report = validate_checkpoint(source)
    assert report.ok, report.render()
    assert any("auto_map" in note for note in report.notes) and any("config.py" in note for note in report.notes)
    drafter = Eagle3Drafter.from_pretrained(source)
    assert drafter.embed_tokens is not None and drafter.config.speculative_tokens == 5
    assert drafter.config.norm_before_fc is False  # missing flag read as vLLM reads it
    result = convert_checkpoint(
        ConvertSettings(source=source, verifier=str(tiny_verifier_dir("llama")), output=tmp_path / "ours")
    )
    assert result.source_layout == "speculators"
    out = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "auto_map" not in out and out["norm_before_fc"] is False and out["norm_output"] is False
    assert out["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert not (tmp_path / "ours" / "config.py").exists()
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "ours" / "model.safetensors"))
    reloaded = Eagle3Drafter.from_pretrained(tmp_path / "ours", verifier_embeddings=drafter.embed_tokens.weight)
    aux, ids = torch.randn(1, 4, 3 * H), torch.randint(0, V, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(ids, reloaded.project_aux(aux.bfloat16())).logits,
            drafter(ids, drafter.project_aux(aux.bfloat16())).logits,
        )


def test_conversion_refuses_a_mismatched_verifier(tmp_path, tiny_verifier_dir):
    from speculators.verifier.tiny import make_tiny_verifier

    wide = make_tiny_verifier("llama", tmp_path / "wide", hidden_size=96, num_layers=8)
    source = write_research_checkpoint(tmp_path / "research", research_tensors())
    with pytest.raises(SpeculatorsError, match="verifier hidden size 64"):
        convert_checkpoint(
            ConvertSettings(source=source, verifier=str(wide), output=tmp_path / "out", aux_layer_ids=[1, 4, 8])
        )
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_eagle1_checkpoint_is_named(tmp_path, tiny_verifier_dir):
    directory = tmp_path / "eagle1"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"fusion_fc.weight": torch.zeros(4, 8)}, str(directory / "model.safetensors"))
    with pytest.raises(SpeculatorsError, match="EAGLE-1/HASS"):
        convert_checkpoint(
            ConvertSettings(source=directory, verifier=str(tiny_verifier_dir("llama")), output=tmp_path / "out")
        )


def corrupt(directory, **changes):
    tensors = load_file(str(directory / "model.safetensors"))
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, str(directory / "model.safetensors"))


def fresh_checkpoint(tmp_path, tiny_verifier_dir, name):
    source = write_research_checkpoint(tmp_path / f"research-{name}", research_tensors())
    out = tmp_path / name
    convert_checkpoint(
        ConvertSettings(source=source, verifier=str(tiny_verifier_dir("llama")), output=out, aux_layer_ids=[1, 4, 8])
    )
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"d2t": torch.zeros(D - 1, dtype=torch.long)}, "d2t has shape [95], expected [96]"),
        ({"t2d": torch.zeros(V + 1, dtype=torch.bool)}, "t2d has shape [513], expected [512]"),
        (
            {"fc.weight": torch.zeros(H, 2 * H, dtype=torch.float16)},
            "fc.weight has shape [64, 128], expected [64, 192]",
        ),
        ({"d2t": torch.full((D,), V, dtype=torch.long)}, "outside the verifier vocab of 512"),
        ({"d2t": torch.zeros(D, dtype=torch.int32)}, "d2t has dtype I32"),
        ({"norm.weight": None}, "missing tensors: norm.weight"),
        ({"lm_head.weight": torch.zeros(D, H, dtype=torch.float32)}, "weights mix dtypes"),
        ({"extra.weight": torch.zeros(2)}, "unexpected tensors"),
    ],
)
def test_validate_names_each_problem(tmp_path, tiny_verifier_dir, change, message):
    checkpoint = fresh_checkpoint(tmp_path, tiny_verifier_dir, "ckpt")
    corrupt(checkpoint, **change)
    report = validate_checkpoint(checkpoint)
    assert not report.ok
    assert any(message in problem for problem in report.problems), report.problems


def test_validate_against_a_verifier_catches_size_mismatches(tmp_path, tiny_verifier_dir):
    from speculators.verifier.tiny import make_tiny_verifier

    checkpoint = fresh_checkpoint(tmp_path, tiny_verifier_dir, "ckpt")
    shallow = make_tiny_verifier("llama", tmp_path / "shallow", num_layers=6)
    report = validate_checkpoint(checkpoint, verifier=str(shallow))
    assert any("aux layer ids [8] exceed the verifier's 6 layers" in p for p in report.problems)
    wide = make_tiny_verifier("llama", tmp_path / "wide", hidden_size=96)
    report = validate_checkpoint(checkpoint, verifier=str(wide))
    assert any("verifier hidden size 64" in p and "is 96" in p for p in report.problems)


def test_cli_validate_and_convert_exit_codes(tmp_path, tiny_verifier_dir, capsys):
    verifier = str(tiny_verifier_dir("llama"))
    source = write_research_checkpoint(tmp_path / "research", research_tensors())
    assert (
        main(
            [
                "convert",
                str(source),
                "--verifier",
                verifier,
                "--output",
                str(tmp_path / "out"),
                "--aux-layer-ids",
                "1,4,8",
                "--no-norm-before-residual",
            ]
        )
        == 0
    )
    assert main(["validate", str(tmp_path / "out"), "--verifier", verifier]) == 0
    assert "result: valid" in capsys.readouterr().out
    corrupt(tmp_path / "out", **{"norm.weight": None})
    assert main(["validate", str(tmp_path / "out")]) == 1
    assert "PROBLEM: missing tensors: norm.weight" in capsys.readouterr().out
    assert main(["validate", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_training_only_verifier_head_copies_are_dropped_on_load_flagged_by_validate(tmp_path, tiny_verifier_dir):
    source = write_reference_library_checkpoint(tmp_path / "reference", research_tensors(seed=3))
    tensors = load_file(str(source / "model.safetensors"))
    tensors["verifier_lm_head.weight"] = torch.zeros(V, H, dtype=torch.bfloat16)
    tensors["verifier_norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    save_file(tensors, str(source / "model.safetensors"))
    drafter = Eagle3Drafter.from_pretrained(source)
    assert "verifier_lm_head.weight" not in drafter.checkpoint_tensors()
    report = validate_checkpoint(source)
    assert any("unexpected tensors" in p and "verifier_lm_head.weight" in p for p in report.problems)
    result = convert_checkpoint(
        ConvertSettings(source=source, verifier=str(tiny_verifier_dir("llama")), output=tmp_path / "clean")
    )
    assert any("training-only tensors dropped" in note for note in result.notes)
    assert validate_checkpoint(tmp_path / "clean").ok
