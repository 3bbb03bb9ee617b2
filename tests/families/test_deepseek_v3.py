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

import re

import pytest
import torch

from speculators.settings import DrafterShape
from speculators.verifier.loading import draft_config_for_verifier, load_verifier

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
    full = draft_config_for_verifier(
        DeepseekV3Config(), "deepseek-ai/DeepSeek-V3", DrafterShape(draft_vocab_size=32000)
    )
    layer = full.transformer_layer_config
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]) == (128, 128, 64)
    assert layer["intermediate_size"] == 18432 and layer["hidden_size"] == 7168
    assert 128 % 8 == 0 and 128 % 16 == 0  # vLLM shards the draft heads over the verifier's TP (8 or 16)
    assert full.eagle_aux_hidden_state_layer_ids == [2, 30, 58]


def test_vllm_cpu_rotary_kernel_misrotates_the_3d_multi_head_query_mla_passes(tiny_verifier_dir):
    """Why VllmCapture switches vLLM's CPU rotary kernel off for MLA verifiers (cpu_rotary_workaround):
    MLA rotates `q[..., qk_nope_head_dim:]`, a [tokens, heads, 64] view, and the CPU build's kernel
    (RotaryEmbedding.forward_cpu) gets a query of that shape wrong when it has more than one head, while
    the same query flattened to [tokens, heads * 64] (how llama-style models pass it), the single-head key
    and vLLM's PyTorch rotary (forward_native) are right. With the kernel the tiny DeepSeek-V3's states
    differ from transformers' by ~1% at every id after the first layer; without it they agree to 3e-7
    (tests/unit/data/test_vllm_capture.py runs this family). If this test fails, vLLM fixed the kernel and the
    workaround can go."""
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the CPU build's kernel")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from speculators.serving.engine import cpu_rotary_workaround

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            64,
            max_position=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            is_neox_style=False,  # DeepSeek's MLA rope
            dtype=torch.float32,
        )
    generator = torch.Generator().manual_seed(0)
    tokens, heads = 10, 2
    positions = torch.arange(tokens)
    query = torch.randn(tokens, heads, 64, generator=generator)
    key = torch.randn(tokens, 1, 64, generator=generator)
    native_query, native_key = rope.forward_native(positions, query.clone(), key.clone())
    flat_query, _ = rope.forward_cpu(positions, query.clone().view(tokens, heads * 64), key.clone().view(tokens, 64))
    torch.testing.assert_close(flat_query.view(tokens, heads, 64), native_query, atol=1e-5, rtol=1e-5)
    kernel_query, kernel_key = rope.forward_cpu(positions, query.clone(), key.clone())
    torch.testing.assert_close(kernel_key, native_key, atol=1e-5, rtol=1e-5)
    assert (kernel_query - native_query).abs().max() > 1.0  # not rounding: wrong rotations

    assert cpu_rotary_workaround(str(tiny_verifier_dir(FAMILY))) == {"custom_ops": ["-rotary_embedding"]}
    assert cpu_rotary_workaround(str(tiny_verifier_dir("llama"))) == {}


class FakeDeepseekModel(torch.nn.Module):
    """vLLM's DeepseekV2Model's EAGLE-3 contract: `aux_hidden_state_layers`, and a forward that returns
    (hidden, [hidden + residual entering each requested layer, ..., after the last layer])."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(4))
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids.float()[:, None].repeat(1, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        hidden = self.embed_input_ids(input_ids)
        aux = []
        for index in range(len(self.layers)):
            if index in self.aux_hidden_state_layers:
                if index == 0:
                    raise TypeError("unsupported operand type(s) for +: 'Tensor' and 'NoneType'")  # vLLM's
                aux.append(hidden + index)
            hidden = hidden * 10
        if len(self.layers) in self.aux_hidden_state_layers:
            aux.append(hidden + 100)
        return (hidden, aux) if aux else hidden


def test_capture_hooks_take_deepseeks_returned_aux_states_and_restore_the_model(monkeypatch):
    """vLLM's DeepSeek model has no `_maybe_add_hidden_state`: the hooks ask it for the ids through
    `aux_hidden_state_layers`, record what it returns (id 0, the embeddings, where they are made: vLLM's
    forward fails on id 0) and hand the model's caller its output alone; removing them restores it."""
    from speculators.data import capture_vllm as vllm_capture

    monkeypatch.setattr(vllm_capture, "_tensor_parallel_rank", lambda: 0)
    wrapper = torch.nn.Module()
    wrapper.model = FakeDeepseekModel()
    base = wrapper.model
    assert vllm_capture.install_capture_hooks([0, 2, 4], wrapper) == 4
    assert base.aux_hidden_state_layers == (2, 4)
    input_ids = torch.tensor([1, 2])
    output = base(input_ids)  # nn.Module.__call__ -> the instance's forward
    assert torch.equal(output, input_ids.float()[:, None].repeat(1, 3) * 10**4)
    (record,) = vllm_capture.fetch_records(wrapper)
    embeddings = input_ids.float()[:, None].repeat(1, 3)
    assert torch.equal(record["input_ids"], input_ids) and record["recorded"] == [0, 2, 4]
    states = record["states"]  # [ids, rows, H], in the ids' order
    assert torch.equal(states[0], embeddings)
    assert torch.equal(states[1], embeddings * 100 + 2) and torch.equal(states[2], embeddings * 10**4 + 100)

    vllm_capture.remove_capture_hooks(wrapper)
    assert base.aux_hidden_state_layers == () and "forward" not in base.__dict__
    assert "embed_input_ids" not in base.__dict__ and torch.equal(base(input_ids), embeddings * 10**4)


@pytest.fixture(scope="module")
def peaked_deepseek(tmp_path_factory):
    """The tiny DeepSeek-V3 with peaked next-token distributions (a drafter has something to learn)."""
    from speculators.verifier.tiny import make_tiny_verifier

    return make_tiny_verifier(FAMILY, tmp_path_factory.mktemp("peaked-deepseek"), seed=1, initializer_range=0.3)


@pytest.fixture(scope="module")
def deepseek_drafter(peaked_deepseek, tmp_path_factory):
    """Our EAGLE-3 drafter trained on the peaked DeepSeek-V3's own answers (as `trained_drafter` is on
    the tiny Llama's): the aux states come from the transformers capture."""
    from tests.conftest import build_peaked_store, train_peaked_drafter

    store = build_peaked_store(peaked_deepseek, tmp_path_factory.mktemp("deepseek-store"))
    return train_peaked_drafter(store, peaked_deepseek, tmp_path_factory.mktemp("deepseek-drafter"), epochs=40)


@pytest.mark.slow
def test_vllm_cpu_serves_the_verifier_but_not_our_drafter_beside_it_so_the_evaluator_checks_lossless(
    peaked_deepseek, deepseek_drafter, tmp_path
):
    """vLLM's CPU build serves the tiny DeepSeek-V3 alone (CPU MLA backend; rotary kernel off, see
    cpu_rotary_workaround), and its fp32 greedy tokens are transformers' plain greedy decoding. It
    cannot serve our EAGLE-3 drafter beside it: every KV cache must share one kernel block size, and
    the verifier's CPU_MLA backend takes only 16 (its decode kernel, csrc/cpu/mla_decode.cpp) while the
    drafter's llama layer gets the CPU_ATTN backend, which takes multiples of 32
    (vllm/v1/worker/utils.py, select_common_block_size). The speculators format gives vLLM only llama
    or qwen3 draft layers, never an MLA one (configs/speculators/algos.py). So the drafter is checked
    by our evaluator: speculative decoding in PyTorch gives every prompt exactly the verifier's greedy
    output (fp32), with drafts accepted. On CUDA the block sizes agree (FlashMLA takes 64, FlashAttention
    multiples of 16: read in vLLM's backends, not run here)."""
    import json

    from speculators.data.prompt_set import load_prompts
    from speculators.errors import SpeculatorsError
    from speculators.eval.evaluate import DrafterProposer, evaluate, greedy_generate, load_proposer, tokenize_prompts
    from speculators.serving.engine import cpu_rotary_workaround
    from speculators.serving.serve import ServerSettings, VllmServer
    from tests.conftest import write_peaked_prompts
    from tests.unit.serving.test_serve_bench import NEW_TOKENS, SERVER, K, completions

    verifier = load_verifier(peaked_deepseek, dtype="float32")
    prompts = tokenize_prompts(verifier.tokenizer, load_prompts(str(write_peaked_prompts(tmp_path / "p.jsonl"))))
    token_prompts = [ids for _, ids in prompts]
    workaround = cpu_rotary_workaround(str(peaked_deepseek))
    extra = ["--compilation-config", json.dumps(workaround)] if workaround else []
    common = dict(verifier=str(peaked_deepseek), **SERVER, extra_args=extra)
    with VllmServer(ServerSettings(**common, log_path=tmp_path / "baseline.log")) as server:
        baseline = completions(server.url, server.model_name, token_prompts)
    greedy = [greedy_generate(verifier, ids, NEW_TOKENS, stop_ids=set()).tokens for ids in token_prompts]
    assert baseline == greedy  # vLLM's CPU MLA, token for token transformers' greedy decoding

    settings = ServerSettings(
        **common, speculator=str(deepseek_drafter), num_speculative_tokens=K, log_path=tmp_path / "speculator.log"
    )
    refused = VllmServer(settings)
    try:
        with pytest.raises(SpeculatorsError, match="before it was ready"):
            refused.start()
    finally:
        refused.stop()  # the engine processes of its group, if any are left
    # The KV manager's size before the kernels' are matched differs by CPU (16 on the AVX2-only EPYC,
    # 128 on an AMX Xeon); no size suits both kernels on either.
    assert re.search(
        r"No common block size for (16|128) \(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)",
        (tmp_path / "speculator.log").read_text(),
    )

    proposer = load_proposer("eagle3", verifier, str(deepseek_drafter), "float32")
    assert isinstance(proposer, DrafterProposer)
    report = evaluate(verifier, prompts, proposer, K, NEW_TOKENS, stop_at_eos=False, progress=False)
    totals = report.totals()
    assert totals["lossless"]["identical"] == len(prompts) == 8, report.render()  # fp32: exactly greedy
    assert totals["acceptance_length"] > 1.8, report.render()
