"""The model matrix: every GPU variant's facts against its verifier's published config.json.

The configs are copies of the hub files (tests/data/model_configs, sources in SOURCES.md; Qwen3-VL-235B's
is transformers' rendering of it, no copy of the file being found). Mistral Large 3 ships Mistral's own
format, so its copy is a params.json, read here as the Hugging Face config vLLM derives from it
(speculators.verifier.mistral_format). Nothing here touches the network, a GPU or model weights. A variant passes
when its family, aux layer ids and verifier id agree with its config, and when its compute profiles hold
the verifier's weights with room to spare.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from speculators.verifier.mistral_format import hf_config_from_params
from speculators_assets.variants import PACKAGE_VARIANTS, Variant, load_variant
from tests.paths import TEST_DATA_DIR

CONFIGS = TEST_DATA_DIR / "model_configs"
GIB = 2**30
MXFP4_BYTES_PER_PARAM = 4.25 / 8  # 4-bit values plus one 8-bit scale per 32
WEIGHT_SHARE = 0.75  # weights may take this much of a TP group's GPU memory; the rest is KV cache and activations
VLLM_STEPS = ("verifier_hidden_states", "benchmark_report")

# Hand-written from the model cards: a wrong or swapped config file fails here.
# (hub id, family, layers, hidden, vocab, experts, published total parameters)
MATRIX = {
    "llama3_1_8b": ("meta-llama/Llama-3.1-8B-Instruct", "llama", 32, 4096, 128256, 0, 8.03e9),
    "llama3_3_70b": ("meta-llama/Llama-3.3-70B-Instruct", "llama", 80, 8192, 128256, 0, 70.6e9),
    "qwen3_8b": ("Qwen/Qwen3-8B", "qwen3", 36, 4096, 151936, 0, 8.2e9),
    "qwen3_14b": ("Qwen/Qwen3-14B", "qwen3", 40, 5120, 151936, 0, 14.8e9),
    "qwen3_32b": ("Qwen/Qwen3-32B", "qwen3", 64, 5120, 151936, 0, 32.8e9),
    "qwen3_30b_a3b": ("Qwen/Qwen3-30B-A3B", "qwen3_moe", 48, 2048, 151936, 128, 30.5e9),
    "qwen3_235b_a22b": ("Qwen/Qwen3-235B-A22B", "qwen3_moe", 94, 4096, 151936, 128, 235e9),
    "gpt_oss_20b": ("openai/gpt-oss-20b", "gpt_oss", 24, 2880, 201088, 32, 21e9),
    "gpt_oss_120b": ("openai/gpt-oss-120b", "gpt_oss", 36, 2880, 201088, 128, 117e9),
    # Qwen3-VL: the text model's facts (text_config); the total includes the vision tower (8.77B: the
    # checkpoint's 8,767,123,696 safetensors parameters in SOURCES.md; haimaker.ai's model page: "8.8B")
    "qwen3_vl_8b": ("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl", 36, 4096, 151936, 0, 8.77e9),
    # 235.67B: the checkpoint's 235,670,022,896 (SOURCES.md); the model card names it 235B-A22B
    "qwen3_vl_235b_a22b": ("Qwen/Qwen3-VL-235B-A22B-Instruct", "qwen3_vl_moe", 94, 4096, 151936, 128, 235.67e9),
    # Mistral Large 3 (DeepSeek-V3 architecture, MLA): the language model's 673B (model card: "a 673B
    # granular-MoE language model" + "a 2.5B vision encoder" = 675B). The params.json copy has no vision
    # encoder, so the estimate counts the language model alone and is compared with 673B; the 675B total
    # is the one test_mistral_large_3_in_bf16_needs_two_h200_nodes_and_its_profiles_give_them checks.
    "mistral_large_3": (
        "mistralai/Mistral-Large-3-675B-Instruct-2512-BF16",
        "deepseek_v3",
        61,
        7168,
        131072,
        128,
        673e9,
    ),
}


def config_path(name: str) -> Path:
    """`<name>.json`, a Hugging Face config.json, or else `<name>.params.json`, Mistral's own format."""
    hf = CONFIGS / f"{name}.json"
    return hf if hf.is_file() else CONFIGS / f"{name}.params.json"


def config(name: str) -> dict:
    """The verifier's Hugging Face config (for a params.json, the one vLLM derives from it)."""
    path = config_path(name)
    raw = json.loads(path.read_text())
    return hf_config_from_params(raw, str(path)) if path.name.endswith(".params.json") else raw


def variant(name: str) -> Variant:
    return load_variant(PACKAGE_VARIANTS / f"{name}.yaml")


def sources() -> dict[str, str]:
    """SOURCES.md's table: config file name (less `.json` or `.params.json`) -> the hub id it is a copy of."""
    table = (CONFIGS / "SOURCES.md").read_text()
    rows = re.findall(r"^\| (\w+)(?:\.params)?\.json \| ([\w./-]+) \|", table, re.MULTILINE)
    return dict(rows)


TOP_LEVEL_FIELDS = ("model_type", "tie_word_embeddings", "quantization_config")


def text_config(cfg: dict) -> dict:
    """The language model's fields. A vision-language config (Qwen3-VL) keeps the layers, hidden size, vocab,
    heads and experts under `text_config`, while its `model_type` (qwen3_vl, qwen3_vl_moe) and whether the
    lm_head is tied to the embeddings are the top level's; any other config is flat and returned as is."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    return {**text, **{key: cfg[key] for key in TOP_LEVEL_FIELDS if key in cfg}}


def num_experts(cfg: dict) -> int:
    text = text_config(cfg)
    return text.get("num_experts") or text.get("num_local_experts") or text.get("n_routed_experts") or 0


def vocab_params(cfg: dict) -> int:
    """Input embeddings plus the lm_head (one matrix when they are tied)."""
    text = text_config(cfg)
    return text["vocab_size"] * text["hidden_size"] * (1 if text.get("tie_word_embeddings") else 2)


def vision_params(cfg: dict) -> int:
    """The vision tower of a Qwen3-VL config, 0 for a text-only one.

    The patch embedding (a Conv3d over in_channels x temporal_patch_size x patch_size**2, with bias), the
    learned position embeddings, `depth` ViT blocks (two LayerNorms, qkv and proj, a two-layer MLP, all with
    biases), the merger (LayerNorm, then spatial_merge_size**2 patches concatenated -> a hidden layer of that
    width -> out_hidden_size, the text model's hidden size) and one such merger per deepstack index, whose
    LayerNorm is over the concatenated width.
    """
    vision = cfg.get("vision_config")
    if not vision:
        return 0
    width, inner, out = vision["hidden_size"], vision["intermediate_size"], vision["out_hidden_size"]
    patch = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    merged = width * vision["spatial_merge_size"] ** 2
    embeddings = patch * width + width + vision["num_position_embeddings"] * width
    block = 2 * 2 * width + (width + 1) * 3 * width + (width + 1) * width + (width + 1) * inner + (inner + 1) * width

    def merger(norm_width: int) -> int:
        return 2 * norm_width + (merged + 1) * merged + (merged + 1) * out

    deepstack = len(vision.get("deepstack_visual_indexes") or [])
    return embeddings + vision["depth"] * block + merger(width) + deepstack * merger(merged)


def estimate_weights(cfg: dict) -> tuple[int, float]:
    """(parameters, bytes) of the verifier's checkpoint, from its config alone.

    Embeddings + lm_head, per layer q/k/v/o (with head_dim and the KV heads), the dense MLP or every expert
    plus the router, and the norms; biases, sinks and q/k norms where the architecture has them; the vision
    tower of a vision-language verifier. Everything is bf16 except MXFP4 expert weights (gpt-oss), at 4.25
    bits each.

    MLA attention (DeepSeek-V3, Mistral Large 3: `kv_lora_rank`): the query's down-projection to
    q_lora_rank, its norm and up-projection to every head's nope + rope width (or one q_proj without
    q_lora_rank); the joint down-projection to the KV latent plus the shared rope key, the latent's norm
    and its up-projection to every head's nope key and value; o_proj from the heads' values. A DeepSeek-
    style MoE (`first_k_dense_replace`): its first layers, and those off `moe_layer_freq`, are dense; the
    others hold the routed experts, the router and `n_shared_experts` shared experts of the same width.
    """
    vision = vision_params(cfg)
    cfg = text_config(cfg)
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    gpt_oss = cfg["model_type"] == "gpt_oss"
    mxfp4 = (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"

    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o and k, v
    if cfg.get("kv_lora_rank"):  # MLA
        nope, rope, value = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        q_rank, kv_rank = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        query = hidden * q_rank + q_rank + q_rank * heads * (nope + rope) if q_rank else hidden * heads * (nope + rope)
        key_value = hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + value)
        attention = query + key_value + heads * value * hidden
    if cfg.get("attention_bias"):
        attention += heads * head_dim + 2 * kv_heads * head_dim + hidden
    if cfg["model_type"].startswith("qwen3"):
        attention += 2 * head_dim  # q_norm, k_norm
    if gpt_oss:
        attention += heads  # attention sinks
    norms = 2 * hidden

    experts = num_experts(cfg)
    dense_layers = set(cfg.get("mlp_only_layers") or []) if experts else set(range(layers))
    if experts and "first_k_dense_replace" in cfg:
        every = cfg.get("moe_layer_freq") or 1
        dense_layers = {layer for layer in range(layers) if layer < cfg["first_k_dense_replace"] or layer % every}
    expert_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared_experts = (cfg.get("n_shared_experts") or 0) * 3 * hidden * expert_size
    dense = 3 * hidden * cfg["intermediate_size"]  # gate, up, down
    expert_weights = experts * 3 * hidden * expert_size
    router = experts * hidden + (experts if gpt_oss else 0)
    expert_biases = experts * (2 * expert_size + hidden) if gpt_oss else 0

    bf16 = vocab_params(cfg) + hidden + layers * (attention + norms) + vision  # + final norm
    packed = 0
    for layer in range(layers):
        if layer in dense_layers:
            bf16 += dense
        else:
            bf16 += router + expert_biases + shared_experts
            if mxfp4:
                packed += expert_weights
            else:
                bf16 += expert_weights
    return bf16 + packed, bf16 * 2 + packed * MXFP4_BYTES_PER_PARAM


def quantity_gib(quantity: str) -> float:
    """A Kubernetes memory quantity (e.g. "256Gi", "8G") in GiB."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", quantity).groups()
    scale = {"Gi": 1, "Ti": 1024, "Mi": 1 / 1024, "G": 1e9 / GIB, "T": 1e12 / GIB, "M": 1e6 / GIB}[unit]
    return float(number) * scale


def test_every_row_has_a_variant_a_config_and_a_source():
    assert sorted(sources()) == sorted(MATRIX)
    for name in MATRIX:
        assert config_path(name).is_file(), name
        assert (PACKAGE_VARIANTS / f"{name}.yaml").is_file(), name


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_the_config_holds_the_published_facts(name):
    hub_id, family, layers, hidden, vocab, experts, _ = MATRIX[name]
    cfg = config(name)
    text = text_config(cfg)
    assert sources()[name] == hub_id
    assert cfg["model_type"] == family
    assert (text["num_hidden_layers"], text["hidden_size"], text["vocab_size"], num_experts(cfg)) == (
        layers,
        hidden,
        vocab,
        experts,
    )
    assert text["num_attention_heads"] % text["num_key_value_heads"] == 0
    if "vision_config" in cfg:  # the vision tower's mergers project into the text model's hidden states
        assert cfg["vision_config"]["out_hidden_size"] == hidden
    if family == "gpt_oss":
        assert cfg["quantization_config"]["quant_method"] == "mxfp4"
        assert len(cfg["layer_types"]) == layers


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_the_variant_matches_its_config(name):
    hub_id, *_ = MATRIX[name]
    cfg, v = config(name), variant(name)
    n = text_config(cfg)["num_hidden_layers"]  # the aux ids index the text model's decoder layers
    assert v.verifier == hub_id == sources()[name]
    assert v.family == cfg["model_type"]
    assert v.drafter.aux_layer_ids == [2, n // 2, n - 3] and max(v.drafter.aux_layer_ids) < n
    assert v.drafter.draft_vocab_size == 32000 and v.drafter.speculative_tokens == 3
    assert v.datagen.backend == "vllm" and v.datagen.device == "cuda"


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_the_weight_estimate_is_within_ten_percent_of_the_published_size(name):
    *_, published = MATRIX[name]
    params, _ = estimate_weights(config(name))
    assert abs(params - published) / published <= 0.10, f"{name}: {params / 1e9:.2f}B vs {published / 1e9}B"


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_vllm_steps_hold_the_verifier_with_room_for_kv_cache(name):
    cfg, v = config(name), variant(name)
    _, weight_bytes = estimate_weights(cfg)
    weights_gib = weight_bytes / GIB
    for step in VLLM_STEPS:
        profile = v.profile(step)
        tp = profile.tensor_parallel_size
        assert profile.gpus >= 1 and profile.total_gpus % tp == 0, (name, step)
        assert text_config(cfg)["num_attention_heads"] % tp == 0, (name, step)  # vLLM shards whole heads
        per_gpu = weights_gib / tp
        assert per_gpu <= WEIGHT_SHARE * profile.gpu_memory_gib, (
            f"{name} {step}: {per_gpu:.1f} GiB of weights per GPU at TP {tp} is over "
            f"{WEIGHT_SHARE:.0%} of {profile.gpu_memory_gib} GiB"
        )
        # host memory: every replica stages its copy of the weights through the pod (one verifier over
        # several nodes: each node's pod its share)
        staged = weights_gib * profile.data_parallel_size / profile.nodes
        assert quantity_gib(profile.memory) >= staged, (name, step)
    capture, benchmark = v.profile("verifier_hidden_states"), v.profile("benchmark_report")
    assert capture.gpus <= 8  # per node
    assert benchmark.total_gpus == benchmark.tensor_parallel_size  # one server


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_training_holds_the_verifier_embeddings_on_every_rank(name):
    cfg, v = config(name), variant(name)
    profile = v.profile("trained_drafter")
    assert 4 <= profile.gpus <= 8 and profile.tensor_parallel_size == 1
    fp32_gib = vocab_params(cfg) * 4 / GIB  # embeddings + lm_head, at worst upcast to fp32 on a rank
    assert fp32_gib <= 0.25 * profile.gpu_memory_gib  # the rest of the GPU is the drafter's
    assert quantity_gib(profile.memory) >= profile.gpus * fp32_gib + 64  # + data loaders and /dev/shm


def flag(arguments: list[str], name: str) -> str:
    return arguments[arguments.index(name) + 1]


@pytest.mark.parametrize("name", sorted(MATRIX))
def test_the_rendered_commands_and_pods_use_the_profiles_gpus(name, tmp_path):
    """What the k8s runner would start for each step: the pod's GPU limit, and the command inside it
    (vLLM regeneration and capture over TP x DP = every GPU of the pod, torchrun on every training
    GPU, one benchmark server per TP group)."""
    from speculators_assets.resources import PipelineRunner
    from speculators_assets.workload import bench_command, command_line, hidden_state_commands, train_command

    v = variant(name)
    runner = PipelineRunner(mode="k8s")
    capture, training, bench = (v.profile(s) for s in ("verifier_hidden_states", "trained_drafter", "benchmark_report"))
    for step, profile in (
        ("verifier_hidden_states", capture),
        ("trained_drafter", training),
        ("benchmark_report", bench),
    ):
        limits = runner.pod_spec(v, step, "/data")["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == str(profile.gpus) and limits["memory"] == profile.memory

    prepare, datagen, vocab = hidden_state_commands(v, tmp_path / "c.jsonl", tmp_path / "data", tmp_path / "store")
    assert prepare[:1] == ["prepare"] and flag(prepare, "--backend") == "vllm" and "--regenerate" in prepare
    assert int(flag(prepare, "--tensor-parallel-size")) == capture.tensor_parallel_size
    assert int(flag(prepare, "--data-parallel-size")) * capture.tensor_parallel_size == capture.total_gpus
    assert flag(datagen, "--backend") == "vllm" and flag(datagen, "--verifier") == MATRIX[name][0]
    tp, dp = int(flag(datagen, "--tensor-parallel-size")), int(flag(datagen, "--data-parallel-size"))
    assert tp == capture.tensor_parallel_size and tp * dp == capture.total_gpus
    assert flag(datagen, "--aux-layer-ids") == ",".join(map(str, v.store_aux_layer_ids))  # (the drafters' union)
    assert vocab == ["vocab", "--store", str(tmp_path / "store"), "--draft-vocab-size", "32000"]

    train = command_line(train_command(v, tmp_path / "store", tmp_path / "out", None), training.gpus, python="python")
    assert train[:4] == ["python", "-m", "torch.distributed.run", f"--nproc_per_node={training.gpus}"]
    assert train[6] == "train" and flag(train, "--speculative-tokens") == "3"

    served = bench_command(v, tmp_path / "latest", tmp_path / "report")
    assert int(flag(served, "--tensor-parallel-size")) == bench.tensor_parallel_size == bench.total_gpus
    assert int(flag(served, "--max-model-len")) == v.benchmark.max_model_len


# Mistral Large 3 is a MATRIX row (its params.json, SOURCES.md) and the one variant over two nodes: its
# profiles are checked here against the model card's published total, the 2.5B vision encoder included.
MISTRAL_LARGE_3 = ("mistralai/Mistral-Large-3-675B-Instruct-2512-BF16", "deepseek_v3", 675e9)  # 673B LM + 2.5B vision
H200_GIB = 141e9 / GIB  # 131.3 GiB


def test_mistral_large_3_in_bf16_needs_two_h200_nodes_and_its_profiles_give_them():
    hub_id, family, published = MISTRAL_LARGE_3
    v = variant("mistral_large_3")
    assert v.verifier == hub_id and v.family == family and sources()["mistral_large_3"] == hub_id
    assert v.drafter.aux_layer_ids == [2, 30, 58]  # [2, N//2, N-3] for its 61 layers (the rule's arithmetic)
    assert v.drafter.draft_layer_type == "llama" and v.datagen.backend == "vllm" and v.datagen.dtype == "bfloat16"
    weights_gib = published * 2 / GIB  # bf16: 1257 GiB
    assert weights_gib > 8 * H200_GIB > 8 * 80  # one node of 8 H200 (or of 8 80 GB GPUs) cannot hold them
    for step in VLLM_STEPS:
        profile = v.profile(step)
        assert (profile.nodes, profile.gpus, profile.tensor_parallel_size) == (2, 8, 16), step
        assert profile.total_gpus == 16 and profile.data_parallel_size == 1  # one verifier over both nodes
        assert profile.gpu_memory_gib == 141 and weights_gib / 16 <= WEIGHT_SHARE * H200_GIB  # 78.6 GiB, 60%
        assert quantity_gib(profile.memory) >= weights_gib / profile.nodes  # each pod stages its node's half
    training = v.profile("trained_drafter")
    assert training.nodes == 1 and 4 <= training.gpus <= 8 and training.tensor_parallel_size == 1


def test_the_fp8_llama_variant_is_llama3_3_70b_on_half_the_gpus():
    """llama3_3_70b_fp8: the same verifier, facts and recipe as llama3_3_70b; vLLM's online FP8 makes
    every decoder projection 1 byte per parameter (embeddings and lm_head stay bf16), so TP 2 holds it."""
    cfg, bf16, fp8 = config("llama3_3_70b"), variant("llama3_3_70b"), variant("llama3_3_70b_fp8")
    assert fp8.verifier_quantization == "fp8_per_channel" and bf16.verifier_quantization is None
    assert (fp8.verifier, fp8.family, fp8.drafter, fp8.training) == (
        bf16.verifier,
        bf16.family,
        bf16.drafter,
        bf16.training,
    )
    params, bf16_bytes = estimate_weights(cfg)
    embeddings = vocab_params(cfg)
    fp8_gib = (embeddings * 2 + (params - embeddings)) / GIB  # (norms counted at 1 byte: 0.01% of the weights)
    assert 0.5 * bf16_bytes / GIB < fp8_gib < 0.55 * bf16_bytes / GIB  # 67.6 of 131.4 GiB
    for step in VLLM_STEPS:
        profile, unquantized = fp8.profile(step), bf16.profile(step)
        assert profile.tensor_parallel_size * 2 == unquantized.tensor_parallel_size
        assert fp8_gib / profile.tensor_parallel_size <= WEIGHT_SHARE * profile.gpu_memory_gib
        assert profile.data_parallel_size == 2 * unquantized.data_parallel_size or step == "benchmark_report"
