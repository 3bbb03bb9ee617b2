"""Tiny random-weight verifiers of each supported family, with an offline tokenizer.

Built from transformers configs (head_dim 32, which vLLM's CPU attention accepts) and a byte-level
BPE tokenizer trained on a fixed built-in corpus, with a chat template in the family's style.
Nothing is downloaded. Used by the tests, the benchmarks and the tiny Dagster variants.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.atomic_io import atomic_directory
from speculators.errors import SpeculatorsError
from speculators.settings import TinyFamily
from speculators.verifier.mistral_format import (
    hf_config_from_params,
    mistral_tensor_name,
    transformers_config_dict,
    transformers_model,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerFast

FAMILIES: tuple[str, ...] = typing.get_args(TinyFamily)
VISION_LANGUAGE_FAMILIES = ("qwen3_vl", "qwen3_vl_moe")

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
HARMONY_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- else %}"
    "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
# Qwen3-VL's: ChatML, with each image part rendered as one placeholder between the vision markers.
CHATML_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- else %}{{- '[INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- endfor %}"
)

# family -> (chat template, special tokens, bos, eos, pad)
TOKENIZER_STYLES: dict[str, tuple[str, list[str], str | None, str, str | None]] = {
    "llama": (
        LLAMA3_TEMPLATE,
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|begin_of_text|>",
        "<|eot_id|>",
        "<|end_of_text|>",
    ),
    "chatml": (
        CHATML_TEMPLATE,
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        None,
        "<|im_end|>",
        "<|endoftext|>",
    ),
    "harmony": (
        HARMONY_TEMPLATE,
        ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"],
        "<|startoftext|>",
        "<|return|>",
        "<|endoftext|>",
    ),
    "mistral": (MISTRAL_TEMPLATE, ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], "<s>", "</s>", "<unk>"),
    "chatml_vl": (
        CHATML_VL_TEMPLATE,
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|image_pad|>",
            "<|video_pad|>",
        ],
        None,
        "<|im_end|>",
        "<|endoftext|>",
    ),
}
FAMILY_TOKENIZER_STYLE = {
    "llama": "llama",
    "qwen3": "chatml",
    "qwen3_moe": "chatml",
    "qwen2": "chatml",
    "gpt_oss": "harmony",
    "mistral": "mistral",
    "qwen3_vl": "chatml_vl",
    "qwen3_vl_moe": "chatml_vl",
    "deepseek_v3": "mistral",  # Mistral Large 3 is a DeepSeek-V3 model with Mistral's chat format
}

_SUBJECTS = [
    "the model",
    "a drafter",
    "the verifier",
    "our team",
    "the scheduler",
    "a student",
    "the cluster",
    "this function",
    "the dataset",
    "a good answer",
    "the kernel",
    "every request",
]
_VERBS = [
    "explains",
    "predicts",
    "compares",
    "summarises",
    "writes",
    "lists",
    "rewrites",
    "answers",
    "checks",
    "measures",
    "accepts",
    "rejects",
    "trains",
    "serves",
    "computes",
    "returns",
]
_OBJECTS = [
    "the next token",
    "three hidden states",
    "a short poem",
    "the latency",
    "a Python function",
    "the main idea",
    "two numbers",
    "a list of steps",
    "the final answer",
    "every word",
    "the speed-up",
    "a summary of the article",
    "the acceptance rate",
    "a recipe for bread",
]
_TAILS = [
    "quickly.",
    "in one pass.",
    "with care.",
    "for the user.",
    "step by step.",
    "on a CPU.",
    "without errors.",
    "as a table.",
    "in plain English.",
    "before lunch.",
    "and then stops.",
]


def training_corpus() -> list[str]:
    """Deterministic English-like sentences (plus digits and code) to train the tiny BPE on."""
    lines = []
    for i, subject in enumerate(_SUBJECTS):
        for j, verb in enumerate(_VERBS):
            obj = _OBJECTS[(i * 7 + j) % len(_OBJECTS)]
            tail = _TAILS[(i + j * 3) % len(_TAILS)]
            lines.append(f"{subject.capitalize()} {verb} {obj} {tail}")
    lines += [f"{a} + {b} = {a + b}" for a in range(12) for b in range(0, 40, 7)]
    lines += [
        "def add(a, b):\n    return a + b",
        "for i in range(10):\n    print(i)",
        "Hello! How can I help you today?",
    ]
    return lines


def build_tokenizer(family: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (fast) with the family's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILY_TOKENIZER_STYLE:
        raise SpeculatorsError(f"unknown tiny verifier family '{family}'; choose one of {', '.join(FAMILIES)}")
    template, specials, bos, eos, pad = TOKENIZER_STYLES[FAMILY_TOKENIZER_STYLE[family]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad)
    fast.chat_template = template
    return fast


def tiny_config(
    family: str, vocab_size: int, num_layers: int = 8, hidden_size: int = 64, initializer_range: float = 0.02
) -> PreTrainedConfig:
    """A transformers config for a tiny verifier of `family` (head_dim 32, 2 heads, 1 kv head)."""
    from transformers import (
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size)
    if family in VISION_LANGUAGE_FAMILIES:
        return tiny_vision_language_config(family, common)
    if family == "deepseek_v3":
        return tiny_deepseek_v3_config(common)
    if family == "gpt_oss":
        # Alternating sliding/full attention and attention sinks, as the real model has.
        common["max_position_embeddings"] = 131072  # what its YaRN rope parameters assume
        return GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)
    raise SpeculatorsError(f"unknown tiny verifier family '{family}'; choose one of {', '.join(FAMILIES)}")


def tiny_deepseek_v3_config(common: dict[str, Any]) -> PreTrainedConfig:
    """DeepSeek-V3 (Mistral Large 3's architecture): MLA attention and MoE layers after two dense ones.

    MLA's latent is kv_lora_rank 512 + qk_rope_head_dim 64 = 576 wide, as in the real model: vLLM's CPU
    MLA decode kernel is built for that width only (v1/attention/backends/mla/cpu_mla.py). The per-head
    dims and the query's low rank are small. 4 routed experts (2 per token, one group) and a shared one;
    routed_scaling_factor 2.5 as DeepSeek-V3 and Mistral Large 3 use. transformers always routes by
    sigmoid scores with a correction bias ("noaux_tc") and keeps no field saying so; vLLM reads
    `topk_method` and `scoring_func` from the config (defaults: no bias, softmax), so they are written
    here as the published DeepSeek-V3 config has them."""
    from transformers import DeepseekV3Config

    text = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    config = DeepseekV3Config(
        **text,
        num_key_value_heads=text["num_attention_heads"],  # MLA: every head has its own key and value
        q_lora_rank=32,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=common["hidden_size"],
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"  # extra config keys, saved as such
    return config


def tiny_vision_language_config(family: str, text: dict[str, Any]) -> PreTrainedConfig:
    """Qwen3-VL: the text model as above with M-RoPE (sections sum to head_dim / 2), and a 2-block
    vision tower (16 px patches merged 2x2, so one token per 32x32 pixels) whose deepstack features
    go into the first two text layers. Placeholder ids are the tokenizer's special tokens, set later."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    text = dict(text, rope_parameters={**TINY_MROPE, "rope_type": "default", "rope_theta": 5_000_000.0})
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=256,
        deepstack_visual_indexes=[0, 1],
        initializer_range=text["initializer_range"],
    )
    if family == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=text["hidden_size"])
        return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


VISION_TOKEN_FIELDS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}
TINY_MROPE = {"mrope_section": [6, 5, 5], "mrope_interleaved": True}
# Qwen3-VL's image processor settings at tiny scale: images between 32x32 and 256x256 pixels.
TINY_IMAGE_PROCESSOR = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def make_tiny_verifier(
    family: str,
    directory: str | Path,
    seed: int = 0,
    num_layers: int = 8,
    hidden_size: int = 64,
    vocab_size: int = 512,
    dtype: str = "float32",
    initializer_range: float = 0.02,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight verifier of `family` (model + tokenizer) to `directory` (an earlier tiny
    verifier there is replaced; any other non-empty folder only with `overwrite`).

    A larger `initializer_range` gives peaked, model-like next-token distributions (random weights at
    the default 0.02 predict almost uniformly, so a drafter has nothing to learn).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    tokenizer = build_tokenizer(family, vocab_size)
    config = tiny_config(family, len(tokenizer), num_layers, hidden_size, initializer_range)
    for part in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        part.bos_token_id = tokenizer.bos_token_id
        part.eos_token_id = tokenizer.eos_token_id
        part.pad_token_id = tokenizer.pad_token_id
    vision_language = family in VISION_LANGUAGE_FAMILIES
    if vision_language:
        for name, token in VISION_TOKEN_FIELDS.items():
            setattr(config, name, tokenizer.convert_tokens_to_ids(token))
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model = auto.from_config(config, dtype=getattr(torch, dtype))
    directory = Path(directory)
    with atomic_directory(directory, lambda old: (old / "tiny_verifier.json").is_file(), overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if vision_language:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            Qwen2VLImageProcessorPil(**TINY_IMAGE_PROCESSOR).save_pretrained(tmp)
        (tmp / "tiny_verifier.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return directory


# ----- a tiny verifier in Mistral's own checkpoint format ------------------------------------------

# Mistral Large 3's params.json (tests/data/model_configs/mistral_large_3.params.json) at tiny size: MLA
# (kv_lora_rank 512 + qk_rope_head_dim 64, the width vLLM's CPU MLA kernel takes), 4 routed experts (2
# per token) and a shared one after 2 dense layers, YaRN without magnitude scaling and llama-4 query
# scaling as the real model has them. Their periods are 32 positions (the real model's: 8192), so the
# llama-4 scaling acts inside a short test prompt and YaRN's factor 32 reshapes its rotary frequencies;
# 32 x 32 = 1024 positions.
TINY_MISTRAL_LARGE_3_PARAMS: dict[str, Any] = {
    "dim": 64,
    "n_layers": 8,
    "head_dim": 96,
    "hidden_dim": 128,
    "n_heads": 2,
    "n_kv_heads": 2,
    "norm_eps": 1e-06,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tied_embeddings": False,
    "q_lora_rank": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "expert_hidden_dim": 64,
        "num_shared_experts": 1,
        "first_k_dense_replace": 2,
        "route_every_n": 1,
        "routed_scale": 1.0,
        "num_expert_groups": 1,
        "num_expert_groups_per_tok": 1,
    },
    "yarn": {"factor": 32.0, "original_max_position_embeddings": 32, "beta": 32.0, "alpha": 1.0, "apply_scale": False},
    "llama_4_scaling": {"beta": 0.1, "original_max_position_embeddings": 32},
}
# tiktoken's pre-split of Mistral's Tekken tokenizers (the `pattern` of their tekken.json)
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_TEKKEN_SPECIAL_TOKENS = 100


def byte_bpe_ranks(texts: list[str], size: int, pattern: str = TEKKEN_PATTERN) -> list[bytes]:
    """A byte-level BPE vocabulary of `size` tokens learnt from `texts` in tiktoken's terms: the 256
    bytes (rank = byte), then each merge's bytes in the order learnt (the most frequent adjacent pair
    first; ties by the pair's bytes), so tiktoken's lowest-rank-first merging replays the training."""
    import itertools
    from collections import Counter

    import regex

    words = Counter(
        tuple(bytes([b]) for b in piece.encode()) for text in texts for piece in regex.findall(pattern, text)
    )
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < size:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            raise SpeculatorsError(f"the corpus holds too few distinct pairs for a vocabulary of {size} tokens")
        (left, right), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        merged = left + right
        if merged not in known:
            ranks.append(merged)
            known.add(merged)
        rewritten: Counter[tuple[bytes, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    out.append(merged)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            rewritten[tuple(out)] += count
        words = rewritten
    return ranks


def tekken_json(vocab_size: int, special_tokens: int = TINY_TEKKEN_SPECIAL_TOKENS) -> dict[str, Any]:
    """A Tekken tokenizer file (mistral-common's tekken.json, version v7) of `vocab_size` ids: the
    control tokens of Mistral's instruct format first (<unk>, <s>, </s>, [INST], [/INST], ...,
    [SYSTEM_PROMPT]), fillers up to `special_tokens`, then a byte-level BPE learnt from the built-in corpus."""
    import base64

    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    named = [dict(token, token_str=str(token["token_str"])) for token in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    fillers = [
        {"rank": rank, "token_str": f"<SPECIAL_{rank}>", "is_control": True}
        for rank in range(len(named), special_tokens)
    ]
    vocab = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(piece).decode(),
            "token_str": piece.decode("utf-8", errors="ignore") or None,
        }
        for rank, piece in enumerate(byte_bpe_ranks(training_corpus(), vocab_size - special_tokens))
    ]
    return {
        "config": {
            "pattern": TEKKEN_PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": vocab_size,
            "default_num_special_tokens": special_tokens,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": named + fillers,
    }


def make_tiny_mistral_verifier(
    directory: str | Path,
    seed: int = 0,
    initializer_range: float = 0.02,
    dtype: str = "float32",
    overwrite: bool = False,
    num_layers: int = 8,
) -> Path:
    """Write a random-weight Mistral Large 3 in Mistral's own format to `directory`: params.json
    (TINY_MISTRAL_LARGE_3_PARAMS), consolidated.safetensors under Mistral's tensor names (each expert's
    w1 / w2 / w3 apart) and tekken.json; no config.json. The weights are transformers' Mistral 4 model
    (speculators.verifier.mistral_format.transformers_config_dict) initialised with `seed`."""
    import torch
    from safetensors.torch import save_file

    params = {**json.loads(json.dumps(TINY_MISTRAL_LARGE_3_PARAMS)), "n_layers": num_layers}
    config = transformers_config_dict(hf_config_from_params(params))
    torch.manual_seed(seed)
    model = transformers_model({**config, "initializer_range": initializer_range}, getattr(torch, dtype))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, width = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for expert, fused in enumerate(tensor):
                tensors[mistral_tensor_name(f"{prefix}.{expert}.gate_proj.weight")] = fused[:width]
                tensors[mistral_tensor_name(f"{prefix}.{expert}.up_proj.weight")] = fused[width:]
        elif name.endswith(".mlp.experts.down_proj"):
            for expert, down in enumerate(tensor):
                tensors[mistral_tensor_name(f"{name.removesuffix('.down_proj')}.{expert}.down_proj.weight")] = down
        else:
            tensors[mistral_tensor_name(name)] = tensor
    directory = Path(directory)
    with atomic_directory(directory, lambda old: (old / "tiny_verifier.json").is_file(), overwrite) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "consolidated.safetensors"))
        (tmp / "params.json").write_text(json.dumps(params, indent=2) + "\n")
        (tmp / "tekken.json").write_text(json.dumps(tekken_json(params["vocab_size"])) + "\n")
        (tmp / "tiny_verifier.json").write_text(json.dumps({"family": "mistral_large_3", "seed": seed}) + "\n")
    return directory
