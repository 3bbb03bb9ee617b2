"""The P-EAGLE drafter: training forward = vLLM's one forward, checkpoint names and shapes, vLLM's config reader."""

from __future__ import annotations

import json

import pytest
import torch

from speculators.errors import CheckpointFormatError, SpeculatorsError
from speculators.models.algorithms import algorithm_of_checkpoint
from speculators.models.peagle import PEagleConfig, PEagleDrafter, cod_attention_mask, cod_sample, peagle_config_from
from tests.unit.models.test_drafter import SPEC_TABLE, V, saved_layout, tiny_config

MASK_ID = 7


def make_peagle(seed=0, **overrides) -> PEagleDrafter:
    torch.manual_seed(seed)
    drafter = PEagleDrafter(peagle_config_from(tiny_config(**overrides), MASK_ID))
    drafter.reset_parameters(seed=seed)
    for name, param in drafter.named_parameters():  # norms away from 1 so a mixed-up norm shows
        if name.endswith("norm.weight"):
            param.data.uniform_(0.5, 1.5)
    drafter.set_vocab_mapping(torch.arange(0, 256, 2))
    drafter.attach_verifier_embeddings(torch.randn(V, 64))
    return drafter.eval()


def test_saved_checkpoint_is_the_eagle3_table_plus_mask_hidden(tmp_path):
    drafter = make_peagle()
    drafter.save_pretrained(tmp_path / "d")
    layout = saved_layout(tmp_path / "d")
    assert {name: shape for name, (shape, _) in layout.items()} == {**SPEC_TABLE, "mask_hidden": [1, 1, 192]}
    assert layout["mask_hidden"][1] == "F32"
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["algorithm"] == "peagle"
    assert config["mask_token_id"] == MASK_ID
    assert config["norm_before_residual"] is True  # written: vLLM's P-EAGLE default (false) would differ
    assert config["fc_norm"] is False
    assert algorithm_of_checkpoint(tmp_path / "d").name == "peagle"
    loaded = PEagleDrafter.from_pretrained(tmp_path / "d", verifier_embeddings=drafter.embed_tokens.weight)
    assert isinstance(loaded.config, PEagleConfig)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_a_checkpoint_without_mask_hidden_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    make_peagle().save_pretrained(tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    del tensors["mask_hidden"]
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointFormatError, match="missing tensors: mask_hidden"):
        PEagleDrafter.from_pretrained(tmp_path / "d")


def test_bad_mask_token_and_fc_norm_are_one_line_errors():
    with pytest.raises(SpeculatorsError, match=f"mask_token_id {V} is outside the verifier vocab of {V}"):
        peagle_config_from(tiny_config(), V)
    with pytest.raises(SpeculatorsError, match="drops it"):
        peagle_config_from(tiny_config(fc_norm=True, norm_before_fc=False), 0)


def test_vllm_reads_our_config_as_parallel_eagle3(tmp_path):
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    drafter = make_peagle(speculative_tokens=5)
    drafter.save_pretrained(tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    speculative = SpeculatorsConfig.build_vllm_speculative_config(raw)
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 5, "parallel_drafting": True}
    hf = SpeculatorsConfig.extract_transformers_pre_trained_config(raw)
    assert hf["pard_token"] == MASK_ID
    assert hf["architectures"] == ["PeagleLlamaForCausalLM"]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 4, 8]
    assert hf["norm_before_residual"] is True and hf["norm_before_fc"] is True
    assert hf["draft_vocab_size"] == 128
    # The trap: update_peagle copies neither, so vLLM reads both as false; we never train fc_norm and
    # norm_output only feeds a second draft forward, which parallel drafting never runs.
    assert hf.get("fc_norm", False) is False and hf.get("norm_output", False) is False


def dense_parallel_reference(drafter: PEagleDrafter, ids, aux, anchor: int, depths: int) -> torch.Tensor:
    """Logits of vLLM's one forward over positions 0..anchor then depths-1 mask slots, built by hand."""
    embeds, hidden = drafter.mask_inputs(depths - 1, ids.device)
    inputs = torch.cat([drafter.embed(ids[:, : anchor + 1]), embeds], dim=1)
    states = torch.cat([drafter.project_aux(aux[:, : anchor + 1]), hidden], dim=1)
    out = drafter(None, states, torch.arange(anchor + depths)[None] + 1, inputs_embeds=inputs)
    return out.logits[0, anchor:]


def test_training_forward_equals_the_inference_forward_per_chain():
    drafter = make_peagle()
    torch.manual_seed(1)
    length, depths = 12, 4
    ids, aux = torch.randint(0, V, (1, length)), torch.randn(1, length, 192)
    documents = torch.tensor([[0] * 7 + [1] * 5])
    positions = torch.cat([torch.arange(1, 8), torch.arange(1, 6)])[None]
    # Every chain continues to the end of its document (ratio 1).
    chains = cod_sample(torch.ones(1, length), documents, depths, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert [c.tolist() for c in chains] == [
        [0, 1, 2, 3, 4, 5, 7, 8, 9, 10],
        [0, 1, 2, 3, 4, 7, 8, 9],
        [0, 1, 2, 3, 7, 8],
    ]
    with torch.no_grad():
        outputs = drafter.cod_forward(ids, aux, chains, positions, documents)
        for anchor in (2, 8):  # one chain in each document
            start = 0 if anchor < 7 else 7
            expected = dense_parallel_reference(drafter, ids[:, start:], aux[:, start:], anchor - start, depths)
            got = [drafter.lm_head(outputs[0][0, anchor])]
            for depth in range(1, depths):
                row = chains[depth - 1].tolist().index(anchor)
                got.append(drafter.lm_head(outputs[depth][0, row]))
            torch.testing.assert_close(torch.stack(got), expected, rtol=1e-5, atol=1e-5)


def test_parallel_draft_with_a_cache_equals_one_forward_over_the_whole_prefix():
    drafter = make_peagle()
    torch.manual_seed(2)
    ids, aux = torch.randint(0, V, (1, 9)), torch.randn(1, 9, 192)
    full, _ = drafter.parallel_draft(aux, ids, 4)
    _, past = drafter.parallel_draft(aux[:, :6], ids[:, :6], 4)
    cached, _ = drafter.parallel_draft(aux[:, 6:], ids[:, 6:], 4, past_key_values=past)
    expected = drafter.draft_to_target(dense_parallel_reference(drafter, ids, aux, 8, 4).argmax(-1))
    assert full.tolist() == cached.tolist() == [expected.tolist()]


def test_cod_sampling_keeps_its_share_inside_documents_and_is_seeded():
    loss_mask = torch.zeros(1, 200, dtype=torch.bool)
    loss_mask[:, 20:100] = loss_mask[:, 120:200] = True
    documents = torch.tensor([[0] * 100 + [1] * 100])

    def draw(seed):
        return cod_sample(loss_mask, documents, 5, 0.7, 0.2, torch.Generator().manual_seed(seed))

    chains = draw(3)
    assert [c.numel() for c in chains] == [round(160 * r) for r in (0.7, 0.49, 0.343, 0.2401)]
    for depth, anchors in enumerate(chains, start=1):
        targets = anchors + depth
        assert loss_mask[0, targets].all() and (documents[0, targets] == documents[0, anchors]).all()
        if depth > 1:
            assert set(anchors.tolist()) <= set(chains[depth - 2].tolist())
    assert [c.tolist() for c in draw(3)] == [c.tolist() for c in chains]
    assert [c.tolist() for c in draw(4)] != [c.tolist() for c in chains]


def test_cod_mask_sees_its_document_up_to_the_anchor_and_its_own_chain():
    anchors, depths = torch.tensor([1, 4, 1]), torch.tensor([1, 1, 2])
    mask = cod_attention_mask(anchors, depths, torch.tensor([0, 0, 0, 1, 1, 1]), 6)[0, 0]
    assert mask.int().tolist() == [
        [1, 1, 0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 1],
    ]


def test_a_pack_without_chains_still_gives_mask_hidden_a_gradient():
    drafter = make_peagle().train()
    ids, aux = torch.randint(0, V, (1, 4)), torch.randn(1, 4, 192)
    outputs = drafter.cod_forward(
        ids, aux, [torch.zeros(0, dtype=torch.long)] * 2, torch.arange(1, 5)[None], torch.zeros(1, 4)
    )
    assert [tuple(o.shape) for o in outputs] == [(1, 4, 64), (1, 0, 64), (1, 0, 64)]
    sum(o.sum() for o in outputs).backward()
    assert drafter.mask_hidden.grad is not None and not drafter.mask_hidden.grad.any()
