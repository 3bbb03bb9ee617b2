"""Training-time-test loss and metrics (spec/eagle3.md).

Step s scores logits[:, :T-s] against the verifier's distribution at [:, s:] (forward
KL(p_verifier || q_draft) over the draft vocab), where the loss mask holds and the target lies in
the same packed document. Per step: loss, full accuracy (argmax agrees) and conditional accuracy
(agrees given all earlier steps of the same chain agreed). Counts are returned as sums so they
aggregate exactly over packs, ranks and logging windows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F


def verifier_target_logits(target_states: torch.Tensor, final_norm: Any, lm_head_rows: torch.Tensor) -> torch.Tensor:
    """Verifier logits restricted to the draft vocab: rows of lm_head(final_norm(y)), in fp32."""
    with torch.no_grad():
        normed = final_norm(target_states.to(lm_head_rows.dtype))
        return (normed @ lm_head_rows.T).float()


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    decay: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total loss (sum over steps of decay**s x masked-mean KL) and per-step count sums [steps]."""
    length = target_logits.shape[1]
    target_logp = F.log_softmax(target_logits.float(), dim=-1)
    target_ids = target_logp.argmax(-1)
    chain_ok = torch.ones_like(loss_mask, dtype=torch.bool)
    total = target_logits.new_zeros(())
    sums: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "count", "correct", "cond_correct", "cond_count")}
    for step, logits in enumerate(step_logits):
        span = length - step
        draft_logp = F.log_softmax(logits[:, :span].float(), dim=-1)
        p_logp = target_logp[:, step:]
        mask = loss_mask[:, step:].bool() & (document_ids[:, :span] == document_ids[:, step:])
        kl = (p_logp.exp() * (p_logp - draft_logp)).sum(-1)
        count = mask.sum()
        kl_sum = (kl * mask).sum()
        total = total + decay**step * kl_sum / count.clamp(min=1)
        correct = draft_logp.argmax(-1) == target_ids[:, step:]
        chain_ok = chain_ok[:, :span]
        sums["kl"].append(kl_sum.detach())
        sums["count"].append(count)
        sums["correct"].append((correct & mask).sum())
        sums["cond_correct"].append((correct & mask & chain_ok).sum())
        sums["cond_count"].append((mask & chain_ok).sum())
        chain_ok = chain_ok & correct
    return total, {k: torch.stack(v).double() for k, v in sums.items()}


def summarize(sums: dict[str, torch.Tensor]) -> dict[str, list[float] | float]:
    """Per-step loss / full_acc / cond_acc and the expected acceptance length from count sums."""
    count = sums["count"].clamp(min=1)
    cond = (sums["cond_correct"] / sums["cond_count"].clamp(min=1)).tolist()
    return {
        "loss": (sums["kl"] / count).tolist(),
        "full_acc": (sums["correct"] / count).tolist(),
        "cond_acc": cond,
        "acceptance_length": expected_acceptance_length(cond),
    }


def expected_acceptance_length(cond_acc: list[float]) -> float:
    """1 + sum_k prod_{s<k} cond_acc_s: mean tokens per verifier step for chain drafting."""
    total, run = 1.0, 1.0
    for rate in cond_acc:
        run *= rate
        total += run
    return total
