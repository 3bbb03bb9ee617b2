"""P-EAGLE drafter: the EAGLE-3 drafter that drafts all K tokens in one forward (docs/peagle.md).

The layers are EAGLE-3's (`Eagle3Drafter`); P-EAGLE adds a learned `mask_hidden` (one value per element
of the concatenated aux states, n*Ht) and a mask token. vLLM serves it as `eagle3` with parallel drafting
(vllm/v1/spec_decode/llm_base_proposer.py); one drafter forward per verifier step holds, causally:

    the shifted EAGLE pairs (t_{i+1}, fc(aux_i)) at position i       (the prefix not yet drafted over)
    the bonus slot (t_{n+1}, fc(aux_n)) at n                          -> draft 1
    K-1 mask slots (embed(mask_token_id), fc(mask_hidden)) at n+1 .. n+K-1  -> drafts 2 .. K

Training (COD sampling, `cod_sample`): depth 0 is the EAGLE-3 first step at every position; the element
(a, d) of depth d >= 1 is a mask slot at position a + d that sees the depth-0 keys of its document up to
anchor a and its own chain (a, 1..d), and is scored against the verifier's distribution at a + d.
Depth d keeps max(r^d, r_min) of the scored positions, drawn among the chains kept at depth d - 1.

Checkpoint: the EAGLE-3 tensors plus `mask_hidden` [1, 1, n*Ht]; config.json says speculators_model_type
"peagle", `mask_token_id`, and writes `norm_before_residual` explicitly (vLLM's P-EAGLE default is false,
EAGLE-3's true). vLLM's P-EAGLE config reader copies neither `fc_norm` nor `norm_output`, so a P-EAGLE
drafter never has per-state fc norms (the config refuses them); `norm_output` only changes the hidden state
handed to a next draft forward, which parallel drafting never runs.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn

from speculators.errors import SpeculatorsError
from speculators.models.config import Eagle3Config
from speculators.models.eagle3 import Eagle3Drafter, TTTMask

# The hidden state of a mask slot is fc(mask_hidden); its scale before input_norm matters not, so a unit
# Gaussian draw (the reference library's) starts it as a typical normalised aux state.
MASK_HIDDEN_INIT_STD = 1.0


class PEagleConfig(Eagle3Config):
    """Top level of a P-EAGLE speculator `config.json` (EAGLE-3's plus the mask token)."""

    speculators_model_type: str = "peagle"
    architectures: list[str] = Field(default_factory=lambda: ["PEagleSpeculator"])
    mask_token_id: int = Field(ge=0, description="the token id of the mask slots' input embedding")
    norm_before_residual: bool = False  # vLLM's reading of a P-EAGLE config without it

    @model_validator(mode="after")
    def _peagle_consistent(self) -> PEagleConfig:
        if self.fc_norm:
            raise ValueError(
                "fc_norm is true, but vLLM's P-EAGLE reader (update_peagle) drops it and would serve the drafter "
                "without its per-state norms; train P-EAGLE without --fc-norm (and from a warm start without fc_norm)"
            )
        if self.mask_token_id >= self.verifier_vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the verifier vocab of {self.verifier_vocab_size}; "
                f"pick a token id below {self.verifier_vocab_size} (a special token chat text never holds)"
            )
        return self

    @property
    def parameter_count(self) -> int:
        return super().parameter_count + self.num_aux_states * self.verifier_hidden_size

    def extra_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Tensors beyond EAGLE-3's: mask_hidden, stored [1, 1, n*Ht] as the reference library does."""
        return {"mask_hidden": ((1, 1, self.num_aux_states * self.verifier_hidden_size), "float")}

    def vllm_method(self) -> dict[str, Any]:
        return {"method": "eagle3", "parallel_drafting": True}  # vLLM's reading of "peagle"

    def to_json_dict(self) -> dict[str, Any]:
        return {**super().to_json_dict(), "mask_token_id": self.mask_token_id}


def peagle_config_from(base: Eagle3Config, mask_token_id: int) -> PEagleConfig:
    """The P-EAGLE config of a drafter shaped like EAGLE-3 config `base` (a new drafter's, or a warm start's),
    with its mask token; fc_norm is refused, the norm placements are otherwise `base`'s."""
    from pydantic import ValidationError

    fields = base.to_json_dict()
    fields["speculators_model_type"] = "peagle"
    fields["speculators_config"]["algorithm"] = "peagle"
    fields["architectures"] = ["PEagleSpeculator"]
    fields["norm_output"] = False  # (never read: no second draft forward)
    try:
        return PEagleConfig(**fields, mask_token_id=mask_token_id)
    except ValidationError as error:
        raise SpeculatorsError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None


class PEagleDrafter(Eagle3Drafter):
    """EAGLE-3's layers plus `mask_hidden`; `parallel_draft` is vLLM's one forward, `cod_forward` training's."""

    config_class: type[Eagle3Config] = PEagleConfig
    config: PEagleConfig

    def __init__(self, config: PEagleConfig):
        if not isinstance(config, PEagleConfig):
            raise SpeculatorsError(
                f"a P-EAGLE drafter needs a P-EAGLE config, not speculators_model_type "
                f"'{config.speculators_model_type}'; build it with peagle_config_from(config, mask_token_id)"
            )
        self.mask_hidden_size = config.num_aux_states * config.verifier_hidden_size
        super().__init__(config)  # (calls reset_parameters, which draws mask_hidden too)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, seed: int | None = None) -> None:
        super().reset_parameters(std, seed)
        generator = None if seed is None else torch.Generator().manual_seed(seed + 1)
        draw = torch.randn(1, 1, self.mask_hidden_size, generator=generator) * MASK_HIDDEN_INIT_STD
        if not hasattr(self, "mask_hidden"):
            self.mask_hidden = nn.Parameter(draw)
        else:
            self.mask_hidden.copy_(draw)

    @classmethod
    def from_eagle3(cls, eagle3: Eagle3Drafter, mask_token_id: int, seed: int = 0) -> PEagleDrafter:
        """A P-EAGLE drafter starting from EAGLE-3 drafter `eagle3`'s weights (same layers, vocab and aux
        layers), with a fresh mask_hidden: a warm start for parallel drafting."""
        drafter = cls(peagle_config_from(eagle3.config, mask_token_id))
        drafter.reset_parameters(seed=seed)
        state = {k: v for k, v in eagle3.state_dict().items() if not k.startswith("embed_tokens.")}
        missing, unexpected = drafter.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"mask_hidden"}:
            raise SpeculatorsError(f"EAGLE-3 weights do not fit the P-EAGLE drafter: {missing + unexpected}")
        if eagle3.embed_tokens is not None:
            drafter.attach_verifier_embeddings(eagle3.embed_tokens.weight, save=eagle3.save_embeddings)
        return drafter.to(eagle3.fc.weight.dtype)

    @classmethod
    def from_warm_start(cls, drafter: Eagle3Drafter, mask_token_id: int, seed: int) -> PEagleDrafter:
        """The registry's warm start from another algorithm (EAGLE-3): its layers, a fresh mask_hidden."""
        return cls.from_eagle3(drafter, mask_token_id, seed=seed)

    # ----- the mask slots' inputs ---------------------------------------------------------------

    def mask_inputs(self, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The input embedding [1, count, H] and hidden state [1, count, H] of `count` mask slots."""
        mask_ids = torch.full((1, count), self.config.mask_token_id, dtype=torch.long, device=device)
        embeds = self.embed(mask_ids)
        hidden = self.project_aux(self.mask_hidden.reshape(1, 1, -1)).expand(1, count, -1)
        return embeds, hidden

    # ----- inference: vLLM's one forward ------------------------------------------------------------

    @torch.no_grad()
    def parallel_draft(
        self,
        aux_hidden_states: torch.Tensor,
        next_token_ids: torch.Tensor,
        num_tokens: int,
        position_ids: torch.Tensor | None = None,
        past_key_values: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Draft `num_tokens` target ids [1, K] in one forward, as vLLM does.

        aux_hidden_states [1, T, 3*Ht] are the verifier's states of the T positions the drafter has not
        seen, next_token_ids [1, T] the token after each (the last: the bonus token the verifier just
        produced), `past_key_values` the drafter's keys/values of the positions before them. Returns the
        drafts and this forward's keys/values of the T real positions (the mask slots' are dropped: vLLM
        overwrites them with the next step's tokens).
        """
        length = next_token_ids.shape[1]
        past_length = 0 if not past_key_values or past_key_values[0] is None else past_key_values[0][0].shape[2]
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=next_token_ids.device)[None]
        masks = num_tokens - 1
        mask_embeds, mask_hidden = self.mask_inputs(masks, next_token_ids.device)
        embeds = torch.cat([self.embed(next_token_ids), mask_embeds], dim=1)
        hidden = torch.cat([self.project_aux(aux_hidden_states), mask_hidden.to(aux_hidden_states.dtype)], dim=1)
        following = position_ids[:, -1:] + torch.arange(1, masks + 1, device=position_ids.device)
        positions = torch.cat([position_ids, following], dim=1)
        out = self(None, hidden, positions, None, past_key_values, inputs_embeds=embeds)
        draft_ids = out.logits[0, length - 1 :].argmax(-1)  # the bonus slot and the mask slots
        real_kv = [(k[:, :, :length], v[:, :, :length]) for k, v in out.new_key_values]
        return self.draft_to_target(draft_ids)[None], real_kv

    # ----- training: COD-sampled depths -------------------------------------------------------------

    def cod_forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        chains: list[torch.Tensor],
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Normed outputs per depth: [1, T, H] for depth 0 (every position, EAGLE-3's first step), then
        [1, len(chains[d-1]), H] for depth d, whose element i is the mask slot (chains[d-1][i], d).

        `chains[d-1]` are the anchors a kept at depth d (ascending; each kept at depth d-1 too, see
        `cod_sample`). One packed sequence (batch 1); documents stay apart.
        """
        length = input_ids.shape[1]
        first = self(
            input_ids,
            self.project_aux(aux_hidden_states),
            position_ids,
            TTTMask.from_document_ids(document_ids, 0),
            compute_logits=False,
        )
        outputs = [first.normed]
        anchors = torch.cat(chains) if chains else input_ids.new_zeros(0)
        if anchors.numel() == 0:  # (mask_hidden still takes part, with a zero gradient: DDP expects every parameter)
            empty = first.normed.new_zeros(1, 0, first.normed.shape[-1]) + 0 * self.mask_hidden.sum()
            return outputs + [empty for _ in chains]
        depths = torch.cat([torch.full_like(c, d + 1) for d, c in enumerate(chains)])
        embeds, hidden = self.mask_inputs(anchors.numel(), input_ids.device)
        mask = cod_attention_mask(anchors, depths, document_ids[0], length)
        out = self(
            None,
            hidden.to(first.normed.dtype),
            position_ids[:, anchors] + depths[None],
            mask,
            first.new_key_values,
            inputs_embeds=embeds,
            compute_logits=False,
        )
        return outputs + list(out.normed.split([c.numel() for c in chains], dim=1))


def cod_attention_mask(
    anchors: torch.Tensor, depths: torch.Tensor, document_ids: torch.Tensor, length: int
) -> torch.Tensor:
    """bool [1, 1, M, T + M]: mask element (a, d) sees the depth-0 positions j <= a of a's document and the
    elements (a, d') of its own chain with d' <= d."""
    positions = torch.arange(length, device=anchors.device)
    context = (positions[None, :] <= anchors[:, None]) & (document_ids[None, :] == document_ids[anchors][:, None])
    chain = (anchors[:, None] == anchors[None, :]) & (depths[None, :] <= depths[:, None])
    return torch.cat([context, chain], dim=1)[None, None]


def cod_sample(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_depths: int,
    ratio: float,
    ratio_min: float,
    generator: torch.Generator,
) -> list[torch.Tensor]:
    """COD sampling of one packed sequence: per depth d = 1 .. num_depths-1, the ascending anchors a kept.

    A chain (a, d) is a candidate when (a, d-1) was kept (depth 0 keeps every position) and its target a + d
    is scored and in a's document; depth d keeps max(ratio^d, ratio_min) x the scored positions of them,
    drawn with `generator` (seeded by the caller, so a resumed run draws alike)."""
    mask, docs = loss_mask[0].bool(), document_ids[0]
    length = mask.numel()
    scored = int(mask.sum())
    alive = torch.arange(length, device=mask.device)
    chains = []
    for depth in range(1, num_depths):
        target = alive + depth
        inside = target < length
        alive, target = alive[inside], target[inside]
        alive = alive[mask[target] & (docs[target] == docs[alive])]
        keep = min(alive.numel(), round(max(ratio**depth, ratio_min) * scored))
        pick = torch.randperm(alive.numel(), generator=generator)[:keep].to(alive.device)
        alive = alive[pick].sort().values
        chains.append(alive)
    return chains
