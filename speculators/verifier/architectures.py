"""What differs between verifier families (where their modules are, how a drafter is sized for them),
and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from speculators.errors import SpeculatorsError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedConfig, PreTrainedModel

    from speculators.models.config import DraftLayerType


@dataclass(frozen=True)
class ArchitectureAdapter:
    """What differs between verifier families, and nothing else."""

    family: str
    draft_layer_type: DraftLayerType = "llama"
    # MoE verifiers have no dense MLP width to copy: the draft MLP gets `moe_draft_mlp_ratio` x hidden.
    moe_draft_mlp_ratio: int | None = None
    # Where the language model's modules (embed_tokens, layers, norm) are, in the model and its weights.
    language_model: str = "model"
    # Vision-language verifiers take images: loaded as image-text-to-text models, fed pixel inputs.
    vision_language: bool = False

    def decoder_layers(self, model: PreTrainedModel) -> nn.ModuleList:
        return cast("nn.ModuleList", model.get_submodule(f"{self.language_model}.layers"))

    def final_norm(self, model: PreTrainedModel) -> nn.Module:
        return model.get_submodule(f"{self.language_model}.norm")

    def base_model(self, model: PreTrainedModel) -> nn.Module:
        """The model without its lm_head (a vision-language one with its vision tower)."""
        return model.get_submodule("model")

    def head_tensors(self) -> dict[str, str]:
        """Checkpoint names of the input embeddings, the lm_head and the final norm."""
        return {
            "embedding": f"{self.language_model}.embed_tokens.weight",
            "lm_head": "lm_head.weight",
            "norm": f"{self.language_model}.norm.weight",
        }

    def draft_intermediate_size(self, config: PreTrainedConfig) -> int:
        text = text_config_of(config)
        if self.moe_draft_mlp_ratio is not None:
            return self.moe_draft_mlp_ratio * text.hidden_size
        return int(text.intermediate_size)


def text_config_of(config: PreTrainedConfig) -> PreTrainedConfig:
    """The language model's config: itself, or a vision-language config's `text_config`."""
    return config.get_text_config()


ADAPTERS = {
    "llama": ArchitectureAdapter("llama"),
    "mistral": ArchitectureAdapter("mistral"),
    "qwen2": ArchitectureAdapter("qwen2"),
    "qwen3": ArchitectureAdapter("qwen3"),
    "qwen3_moe": ArchitectureAdapter("qwen3_moe", moe_draft_mlp_ratio=3),
    # GPT-OSS: the published drafters use the expert width (== hidden) for the draft MLP.
    "gpt_oss": ArchitectureAdapter("gpt_oss"),
    # Qwen3-VL: a Qwen3 (MoE) language model under model.language_model, with a vision tower whose
    # deepstack features are added to the first layers' outputs (so the aux states depend on the pixels).
    "qwen3_vl": ArchitectureAdapter("qwen3_vl", "qwen3", language_model="model.language_model", vision_language=True),
    "qwen3_vl_moe": ArchitectureAdapter(
        "qwen3_vl_moe", "qwen3", moe_draft_mlp_ratio=3, language_model="model.language_model", vision_language=True
    ),
    # DeepSeek-V3 (and Mistral Large 3, which vLLM runs as a DeepSeek-V3 subclass): MLA attention, MoE
    # after `first_k_dense_replace` dense layers. The decoder layers keep the residual stream as every
    # family does, so the capture hooks apply unchanged. The draft MLP copies the dense layers' width
    # (`intermediate_size`, a width the verifier really has), as vLLM's own DeepSeek EAGLE-3 drafter
    # does (deepseek_eagle3.py: a dense MLP of config.intermediate_size).
    "deepseek_v3": ArchitectureAdapter("deepseek_v3"),
}


def adapter_for(model_type: str) -> ArchitectureAdapter:
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise SpeculatorsError(
            f"verifier architecture '{model_type}' is not supported; supported: {', '.join(sorted(ADAPTERS))}"
        ) from None
