"""The EAGLE-3 drafter module: tensor names/shapes, save/load, forward, cache, TTT, vocab mapping."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.config import VerifierShape, build_eagle3_config
from speculators.models.eagle3 import DraftKVCache, Eagle3Drafter, ttt_attention_mask
from speculators.settings import DrafterShape

H, V, D = 64, 512, 128


VERIFIER = VerifierShape(
    name_or_path="tiny/llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=H,
    vocab_size=V,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)
VERIFIER_FIELDS = {f.name for f in dataclasses.fields(VerifierShape)}


def tiny_config(**overrides):
    """The tiny drafter's config; `overrides` set fields of its shape or of what it copies from the verifier."""
    verifier = dataclasses.replace(VERIFIER, **{k: v for k, v in overrides.items() if k in VERIFIER_FIELDS})
    shape = {"aux_layer_ids": [1, 4, 8], "draft_vocab_size": D, "dtype": "float32"}
    shape.update({k: v for k, v in overrides.items() if k not in VERIFIER_FIELDS})
    return build_eagle3_config(verifier, DrafterShape(**shape))


def make_drafter(seed=0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(tiny_config(**overrides))
    drafter.reset_parameters(seed=seed)
    for name, param in drafter.named_parameters():  # norms away from 1 so a mixed-up norm shows
        if name.endswith("norm.weight") or ".fc_norm." in name or "input_norm" in name:
            param.data.uniform_(0.5, 1.5)
    drafter.set_vocab_mapping(torch.arange(0, 2 * D, 2))
    drafter.attach_verifier_embeddings(torch.randn(V, H))
    return drafter.eval()


# The spec's tensor table, written out by hand for H=64, 3 aux states of 64, 2 heads x 32, 1 kv head.
SPEC_TABLE = {
    "fc.weight": [64, 192],
    "input_norm.weight": [192],
    "layers.0.self_attn.q_proj.weight": [64, 128],
    "layers.0.self_attn.k_proj.weight": [32, 128],
    "layers.0.self_attn.v_proj.weight": [32, 128],
    "layers.0.self_attn.o_proj.weight": [64, 64],
    "layers.0.input_layernorm.weight": [64],
    "layers.0.hidden_norm.weight": [64],
    "layers.0.post_attention_layernorm.weight": [64],
    "layers.0.mlp.gate_proj.weight": [128, 64],
    "layers.0.mlp.up_proj.weight": [128, 64],
    "layers.0.mlp.down_proj.weight": [64, 128],
    "norm.weight": [64],
    "lm_head.weight": [128, 64],
    "d2t": [128],
    "t2d": [512],
}


def saved_layout(directory):
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        names = list(handle.keys())
        return {name: (list(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype()) for name in names}


def test_saved_tensor_names_and_shapes_equal_the_spec_table(tmp_path):
    make_drafter().save_pretrained(tmp_path, dtype="bfloat16")
    layout = saved_layout(tmp_path)
    assert {name: shape for name, (shape, _) in layout.items()} == SPEC_TABLE
    assert layout["d2t"][1] == "I64" and layout["t2d"][1] == "BOOL"
    assert {dtype for name, (_, dtype) in layout.items() if name not in ("d2t", "t2d")} == {"BF16"}


def test_fc_norm_qwen3_and_second_layer_tensors(tmp_path):
    drafter = make_drafter(norm_before_fc=False, fc_norm=True, draft_layer_type="qwen3", num_draft_layers=2)
    drafter.save_pretrained(tmp_path)
    names = set(saved_layout(tmp_path))
    expected = set(SPEC_TABLE) - {"input_norm.weight"}
    expected |= {
        "fc_norm.0.weight",
        "fc_norm.1.weight",
        "fc_norm.2.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.k_norm.weight",
    }
    expected |= {name.replace("layers.0.", "layers.1.") for name in SPEC_TABLE if name.startswith("layers.0.")}
    expected -= {"layers.1.hidden_norm.weight"}
    expected |= {"layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"}
    assert names == expected
    layout = saved_layout(tmp_path)
    assert layout["layers.1.self_attn.q_proj.weight"][0] == [64, 64]  # later layers take H, not 2H


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_save_load_is_exact(tmp_path, dtype):
    make_drafter().save_pretrained(tmp_path / "a", dtype=dtype)
    first = Eagle3Drafter.from_pretrained(tmp_path / "a")
    first.save_pretrained(tmp_path / "b")
    second = Eagle3Drafter.from_pretrained(tmp_path / "b")
    assert first.config.dtype == second.config.dtype == dtype
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE, YARN_ROPE, {"rope_type": "linear", "factor": 2.0}])
@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
def test_rotary_tables_equal_transformers_own_from_the_whole_layer_dict(rope, layer_type):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    drafter = make_drafter(rope_parameters=rope, draft_layer_type=layer_type, max_position_embeddings=4096)
    layer = {k: v for k, v in drafter.config.transformer_layer_config.items() if k != "model_type"}
    theirs = LlamaRotaryEmbedding(LlamaConfig(**copy.deepcopy(layer)))
    positions = torch.arange(5000)[None]
    cos, sin = drafter.rotary(positions, torch.float32)
    their_cos, their_sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    assert torch.equal(cos[:, 0], their_cos) and torch.equal(sin[:, 0], their_sin)


def test_saved_config_json_keeps_its_form_for_a_scaled_rope(tmp_path):
    """save_pretrained writes rope_theta into the legacy rope_scaling too, as it always has."""
    drafter = make_drafter(rope_parameters=LLAMA3_ROPE)
    layer = copy.deepcopy(drafter.config.transformer_layer_config)
    assert "rope_theta" not in layer["rope_scaling"]
    drafter.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["transformer_layer_config"]
    assert saved == {**layer, "rope_scaling": {**layer["rope_scaling"], "rope_theta": 500000.0}}
    assert drafter.config.transformer_layer_config == layer  # building and saving leave the config as it was
    Eagle3Drafter.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_bytes() == (tmp_path / "config.json").read_bytes()


def test_embeddings_saved_only_when_asked(tmp_path):
    drafter = make_drafter()
    drafter.save_pretrained(tmp_path / "without")
    assert "embed_tokens.weight" not in saved_layout(tmp_path / "without")
    drafter.attach_verifier_embeddings(drafter.embed_tokens.weight, save=True)
    drafter.save_pretrained(tmp_path / "with")
    assert saved_layout(tmp_path / "with")["embed_tokens.weight"][0] == [V, H]
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "with")
    assert torch.equal(loaded.embed_tokens.weight, drafter.embed_tokens.weight)


def test_forward_shapes_and_determinism():
    drafter = make_drafter()
    aux = torch.randn(2, 7, 3 * H)
    ids = torch.randint(0, V, (2, 7))
    first = drafter(ids, drafter.project_aux(aux))
    second = drafter(ids, drafter.project_aux(aux.view(2, 7, 3, H)))
    assert first.logits.shape == (2, 7, D) and first.hidden_states.shape == (2, 7, H)
    assert torch.equal(first.logits, second.logits)
    assert len(first.new_key_values) == 1 and first.new_key_values[0][0].shape == (2, 1, 7, 32)


def test_d2t_maps_draft_ids_to_the_selected_target_ids():
    drafter = make_drafter()
    selected = torch.tensor(sorted(torch.randperm(V)[:D].tolist()))
    drafter.set_vocab_mapping(selected)
    assert torch.equal(drafter.draft_to_target(torch.arange(D)), selected)
    assert torch.equal(drafter.d2t, selected - torch.arange(D))
    assert drafter.t2d.sum() == D and drafter.t2d[selected].all()
    with pytest.raises(SpeculatorsError, match="ascending"):
        drafter.set_vocab_mapping(selected.flip(0))


def test_norm_output_decides_what_is_fed_forward():
    aux, ids = torch.randn(1, 5, 3 * H), torch.randint(0, V, (1, 5))
    normed = make_drafter(norm_output=True)
    out = normed(ids, normed.project_aux(aux))
    raw = make_drafter(norm_output=False)
    raw_out = raw(ids, raw.project_aux(aux))
    # Same weights, same logits; only the fed-forward state differs (normed vs pre-norm).
    assert torch.allclose(out.logits, raw_out.logits, atol=1e-6)
    assert torch.allclose(raw.norm(raw_out.hidden_states), out.hidden_states, atol=1e-6)
    assert not torch.allclose(raw_out.hidden_states, out.hidden_states, atol=1e-3)


def test_cached_step_by_step_logits_equal_a_full_forward():
    drafter = make_drafter()
    aux, ids = torch.randn(1, 9, 3 * H), torch.randint(0, V, (1, 9))
    hidden = drafter.project_aux(aux)
    full = drafter(ids, hidden).logits
    cache = DraftKVCache(1)
    pieces = []
    for start, end in ((0, 4), (4, 5), (5, 9)):
        out = drafter(ids[:, start:end], hidden[:, start:end], past_key_values=[cache.get(0)])
        cache.append(0, out.new_key_values[0])
        pieces.append(out.logits)
    assert cache.length == 9
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


def test_propose_equals_a_greedy_chain_of_full_forwards():
    drafter = make_drafter()
    aux, ids = torch.randn(1, 6, 3 * H), torch.randint(0, V, (1, 6))
    cache = DraftKVCache(1)
    drafted = drafter.propose(aux, ids, cache, num_tokens=3)
    assert drafted.shape == (1, 3) and cache.length == 6 + 2
    # Recompute without a cache: each step re-runs the whole prefix, feeding back the drafter's
    # own hidden state and drafted token.
    tokens, hidden = ids, drafter.project_aux(aux)
    expected = []
    for _ in range(3):
        out = drafter(tokens, hidden)
        next_id = drafter.draft_to_target(out.logits[:, -1].argmax(-1))
        expected.append(next_id)
        tokens = torch.cat([tokens, next_id[:, None]], 1)
        hidden = torch.cat([hidden, out.hidden_states[:, -1:]], 1)
    assert torch.equal(drafted, torch.stack(expected, 1))
    assert bool(drafter.t2d[drafted].all())
    cache.crop(6)
    assert cache.length == 6


def test_ttt_mask_for_two_documents_and_three_steps():
    document_ids = torch.tensor([[0, 0, 0, 1, 1]])
    mask = ttt_attention_mask(document_ids, step=2)[0, 0].int()
    causal_docs = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    eye = torch.eye(5, dtype=torch.int)
    assert torch.equal(mask, torch.cat([causal_docs, eye, eye], 1))


def test_ttt_steps_equal_inference_chains_with_forced_tokens():
    """Step s at position i of the training forward equals drafting s steps from position i."""
    drafter = make_drafter(seed=3)
    T, steps = 8, 3
    aux, ids = torch.randn(1, T, 3 * H), torch.randint(0, V, (1, T))
    ttt_logits = drafter.ttt_forward(ids, aux, num_steps=steps)
    assert len(ttt_logits) == steps and ttt_logits[0].shape == (1, T, D)
    hidden = drafter.project_aux(aux)
    positions = torch.arange(1, T + 1)[None]
    step0 = drafter(ids, hidden, position_ids=positions)
    torch.testing.assert_close(ttt_logits[0], step0.logits, atol=1e-5, rtol=1e-5)
    for i in range(T - steps + 1):
        # Prefix up to i from the verifier's states, then forced tokens ids[i+s] with own hidden.
        out = drafter(ids[:, : i + 1], hidden[:, : i + 1], position_ids=positions[:, : i + 1])
        past = out.new_key_values
        state = out.hidden_states[:, -1:]
        for s in range(1, steps):
            step = drafter(
                ids[:, i + s : i + s + 1], state, position_ids=positions[:, i : i + 1] + s, past_key_values=past
            )
            torch.testing.assert_close(step.logits[0, 0], ttt_logits[s][0, i], atol=1e-5, rtol=1e-5)
            past = [
                (torch.cat([p[0], n[0]], 2), torch.cat([p[1], n[1]], 2))
                for p, n in zip(past, step.new_key_values, strict=True)
            ]
            state = step.hidden_states


def test_missing_embeddings_is_a_clear_error():
    drafter = Eagle3Drafter(tiny_config())
    with pytest.raises(SpeculatorsError, match="attach_verifier_embeddings"):
        drafter(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, H))
    with pytest.raises(SpeculatorsError, match=r"\(512, 64\)"):
        drafter.attach_verifier_embeddings(torch.zeros(100, H))


def test_loading_rejects_a_checkpoint_with_a_wrong_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    make_drafter().save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["fc.weight"] = torch.zeros(64, 190)
    del tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointFormatError) as error:
        Eagle3Drafter.from_pretrained(tmp_path)
    assert "missing tensors: norm.weight" in str(error.value)
    assert "fc.weight has shape [64, 190], expected [64, 192]" in str(error.value)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(norm_before_fc=False, fc_norm=True, draft_layer_type="qwen3"),
        dict(norm_before_residual=False, norm_output=False, num_draft_layers=2),
        dict(draft_layer_type="qwen3", num_draft_layers=3, norm_before_fc=False),
    ],
)
def test_forward_matches_an_independent_implementation(options):
    from tests.reference_eagle3 import reference_draft_logits

    drafter = make_drafter(seed=7, **options)
    for name, param in drafter.named_parameters():  # q/k norms away from 1 as well
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.data.uniform_(0.5, 1.5)
    config = drafter.config
    weights = {name: tensor.detach() for name, tensor in drafter.checkpoint_tensors().items()}
    aux, ids = torch.randn(6, 3 * H), torch.randint(0, V, (6,))
    with torch.no_grad():
        ours = drafter(ids[None], drafter.project_aux(aux[None]))
    logits, hidden = reference_draft_logits(
        weights,
        aux,
        drafter.embed_tokens.weight[ids],
        heads=2,
        kv_heads=1,
        head_dim=32,
        eps=1e-6,
        theta=10000.0,
        norm_before_residual=config.norm_before_residual,
        norm_before_fc=config.norm_before_fc,
        fc_norm=config.fc_norm,
        norm_output=config.norm_output,
        qk_norm=config.draft_layer_type == "qwen3",
        num_layers=config.num_draft_layers,
    )
    torch.testing.assert_close(ours.logits[0], logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.hidden_states[0], hidden, atol=1e-5, rtol=1e-5)


def test_structured_ttt_attention_equals_the_dense_mask():
    """Packed batch of one: per-document attention + diagonals equals the dense [T, (s+1)T] mask."""
    drafter = make_drafter(seed=11, num_draft_layers=2)
    T = 12
    aux, ids = torch.randn(1, T, 3 * H), torch.randint(0, V, (1, T))
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]])
    positions = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 1, 2, 3, 4, 5]])
    structured = drafter.ttt_forward(ids, aux, 3, positions, documents)
    # A batch of two identical rows takes the dense-mask path.
    dense = drafter.ttt_forward(
        ids.repeat(2, 1), aux.repeat(2, 1, 1), 3, positions.repeat(2, 1), documents.repeat(2, 1)
    )
    for a, b in zip(structured, dense, strict=True):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[0], b[1], atol=1e-5, rtol=1e-5)
    loss = sum(x.float().pow(2).mean() for x in structured)
    loss.backward()  # gradients flow through the structured path
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_later_ttt_steps_run_only_where_a_later_step_scores():
    """With the loss mask, steps after the first skip the positions no later step scores: the scored
    outputs, the TTT loss and every gradient equal the full computation's; the skipped rows are zeros."""
    from speculators.models.ttt import later_steps_needed, ttt_loss

    T, steps = 16, 3
    aux, ids = torch.randn(1, T, 3 * H), torch.randint(0, V, (1, T))
    documents = torch.tensor([[0] * 7 + [1] * 5 + [2] * 4])
    positions = torch.tensor([[*range(1, 8), *range(1, 6), *range(1, 5)]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    targets = torch.randn(int(loss_mask.sum()), D)
    needed = later_steps_needed(loss_mask, documents, steps)[0]
    # Hand-derived: chain starts t with t + s (s = 1, 2) in the mask and in t's document.
    assert needed.nonzero().flatten().tolist() == [1, 2, 3, 4, 5, 8, 9, 10]
    results = []
    for mask in (None, loss_mask):
        drafter = make_drafter(seed=5, num_draft_layers=2).train()
        outputs = drafter.ttt_forward(ids, aux, steps, positions, documents, return_normed=True, loss_mask=mask)
        loss, sums = ttt_loss(outputs, targets, loss_mask, documents, decay=0.8, lm_head=drafter.lm_head)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        results.append((outputs, loss, sums, grads))
    (full, full_loss, full_sums, full_grads), (pruned, pruned_loss, pruned_sums, pruned_grads) = results
    torch.testing.assert_close(full[0], pruned[0])
    for step in (1, 2):
        torch.testing.assert_close(pruned[step][0, needed], full[step][0, needed], atol=1e-5, rtol=1e-5)
        assert pruned[step][0, ~needed].abs().sum() == 0
    torch.testing.assert_close(pruned_loss, full_loss, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(full_sums[k], pruned_sums[k]) for k in full_sums if k != "kl")
    assert full_grads.keys() == pruned_grads.keys() and "layers.1.mlp.up_proj.weight" in full_grads
    for name, grad in full_grads.items():
        torch.testing.assert_close(pruned_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    # Only a document's first position in the mask: no later step scores anything, the layers still run.
    first_only = torch.zeros_like(loss_mask)
    first_only[0, 7] = True
    assert not later_steps_needed(first_only, documents, steps).any()
    outputs = drafter.ttt_forward(ids, aux, steps, positions, documents, return_normed=True, loss_mask=first_only)
    assert [tuple(o.shape) for o in outputs] == [(1, T, H)] * 3 and not outputs[1].any() and not outputs[2].any()
    loss, _ = ttt_loss(outputs, targets[:1], first_only, documents, lm_head=drafter.lm_head)
    loss.backward()
