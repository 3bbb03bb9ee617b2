"""The training objectives on a drafter's logits, row by row, and D-PACE's position weights (docs/training.md).

Every loss compares the drafter's q = softmax(logits) with the verifier's p over the draft vocabulary, per
scored row: `kl` KL(p || q) (models/ttt.py KLFromLogits), `ce` the cross-entropy to the verifier's greedy
token, `tv` the total variation 1 - alpha with alpha = sum_v min(p_v, q_v) (the acceptance rate of
speculative sampling), and the LK losses of Samarin et al. (arXiv 2602.23881): `lk-alpha` -log(alpha) and
`lk-lambda` lambda KL + (1 - lambda) TV with lambda = exp(-eta alpha), alpha not differentiated. Like
KLFromLogits, every [n, D] pass runs over row tiles and nothing [n, D] in fp32 is kept for backward.
"""

from __future__ import annotations

from typing import Any

import torch

from speculators.models.ttt import KLFromLogits, TileBuffers, row_chunks

LOSSES = ("kl", "ce", "tv", "lk-alpha", "lk-lambda")
# -log(alpha) is clipped where the overlap vanishes (no gradient there): the reference library's floor
LK_ALPHA_FLOOR = 1e-5
DPACE_ALPHA = 0.5  # the D-PACE paper's confidence smoothing


class DistanceFromLogits(torch.autograd.Function):
    """Per-row `ce`, `tv`, `lk-alpha` or `lk-lambda` between softmax(logits) and the verifier's rows, the row's
    argmax, and its cross-entropy to what it trains toward (the greedy token for `ce`, p otherwise; detached,
    for D-PACE). `target_rows` picks each logits row's target row, as in KLFromLogits.

    Gradients per row, q = softmax(logits), S = {v: q_v <= p_v}, s = sum_{v in S} q_v:
    ce: q - onehot(greedy); d(1 - alpha)/dlogits_v = q_v (s - [v in S]); -log(alpha): that over alpha;
    lk-lambda: lambda (q - p) + (1 - lambda) x the TV gradient. Backward recomputes q tile by tile.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target_p: torch.Tensor,
        neg_entropy: torch.Tensor,
        target_ids: torch.Tensor,
        target_rows: torch.Tensor | None,
        loss: str,
        eta: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        greedy = target_ids if target_rows is None else target_ids[target_rows]
        lse = torch.empty(n, dtype=target_p.dtype, device=logits.device)
        cross, overlap, below = torch.empty_like(lse), torch.empty_like(lse), torch.empty_like(lse)
        predicted = torch.empty(n, dtype=torch.long, device=logits.device)
        tiles = TileBuffers(logits, target_p)
        for rows in row_chunks(n):
            x = tiles.logits(logits, rows)
            predicted[rows] = x.argmax(-1)
            lse[rows] = torch.logsumexp(x, -1)
            if loss == "ce":
                continue
            p = tiles.targets(target_rows, rows)
            cross[rows] = torch.linalg.vecdot(x, p)
            q = x.sub_(lse[rows].unsqueeze(-1)).exp_()  # as backward recomputes it: the same set S
            overlap[rows] = torch.minimum(q, p).sum(-1)
            below[rows] = torch.where(q <= p, q, 0.0).sum(-1)
        if loss == "ce":
            value = lse - logits.gather(1, greedy.unsqueeze(1)).squeeze(1).to(lse.dtype)
            cross_entropy, kl_weight, tv_weight = value.clone(), None, None  # (a copy: only this one is detached)
        else:
            cross_entropy = lse - cross
            value, kl_weight, tv_weight = distance_terms(loss, overlap, cross_entropy, neg_entropy, target_rows, eta)
        ctx.loss = loss
        ctx.save_for_backward(logits, target_p, lse, below, greedy, target_rows, kl_weight, tv_weight)
        ctx.mark_non_differentiable(predicted, cross_entropy)
        return value, predicted, cross_entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        logits, target_p, lse, below, greedy, target_rows, kl_weight, tv_weight = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        tiles = TileBuffers(logits, target_p)
        for rows in row_chunks(logits.shape[0]):
            q = tiles.logits(logits, rows).sub_(lse[rows].unsqueeze(-1)).exp_()
            if ctx.loss == "ce":
                q[torch.arange(q.shape[0], device=q.device), greedy[rows]] -= 1.0
                grad_logits[rows] = q.mul_(grad[rows].unsqueeze(-1))
                continue
            p = tiles.targets(target_rows, rows)
            tv_grad = q * (below[rows].unsqueeze(-1) - (q <= p).to(q.dtype))
            row_grad = tv_grad.mul_(tv_weight[rows].unsqueeze(-1)).add_((q - p).mul_(kl_weight[rows].unsqueeze(-1)))
            grad_logits[rows] = row_grad.mul_(grad[rows].unsqueeze(-1))
        return grad_logits, None, None, None, None, None, None


def distance_terms(
    loss: str,
    overlap: torch.Tensor,
    cross_entropy: torch.Tensor,
    neg_entropy: torch.Tensor,
    target_rows: torch.Tensor | None,
    eta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the loss from the overlap alpha, and the weights of the KL and TV gradients in its gradient."""
    tv = 1.0 - overlap
    zero = torch.zeros_like(tv)
    if loss == "tv":
        return tv, zero, torch.ones_like(tv)
    if loss == "lk-alpha":
        clipped = overlap.clamp(min=LK_ALPHA_FLOOR)
        return -clipped.log(), zero, torch.where(overlap > LK_ALPHA_FLOOR, 1.0 / clipped, zero)
    if loss == "lk-lambda":
        kl = (neg_entropy if target_rows is None else neg_entropy[target_rows]) + cross_entropy
        blend = torch.exp(-eta * overlap)  # lambda: KL's pull while the overlap is small, TV's once it is large
        return blend * kl + (1.0 - blend) * tv, blend, 1.0 - blend
    raise ValueError(f"unknown loss {loss!r}: one of {', '.join(LOSSES)}")


def row_loss(
    loss: str,
    logits: torch.Tensor,
    target_p: torch.Tensor,
    neg_entropy: torch.Tensor,
    target_ids: torch.Tensor,
    target_rows: torch.Tensor | None = None,
    eta: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The objective `loss` per logits row, the row's argmax and its (detached) cross-entropy to what it trains
    toward. `target_p`, `neg_entropy` and `target_ids` are models.ttt.target_distribution's."""
    if loss == "kl":
        kl, predicted = KLFromLogits.apply(logits, target_p, neg_entropy, target_rows)
        entropy_term = neg_entropy if target_rows is None else neg_entropy[target_rows]
        return kl, predicted, kl.detach() - entropy_term
    value, predicted, cross_entropy = DistanceFromLogits.apply(
        logits, target_p, neg_entropy, target_ids, target_rows, loss, eta
    )
    return value, predicted, cross_entropy


def dpace_weights(cross_entropy: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """D-PACE's weights [N, K] of the K draft positions of N chains (arXiv 2605.18810): position k weighs the
    suffix sum over scored j >= k of the prefix products of the smoothed confidences (1 - a) exp(-CE) + a,
    computed without gradient; unscored positions weigh 0 and leave the products alone."""
    with torch.no_grad():
        confidence = torch.exp(-cross_entropy.float())
        smooth = torch.where(scored, (1 - DPACE_ALPHA) * confidence + DPACE_ALPHA, torch.ones_like(confidence))
        prefix = torch.cumprod(smooth, dim=-1) * scored
        return prefix.flip(-1).cumsum(-1).flip(-1) * scored


def dpace_total(
    chains: list[torch.Tensor], losses: list[torch.Tensor], cross_entropies: list[torch.Tensor], num_chains: int
) -> torch.Tensor:
    """Sum over draft positions k of the mean over the rows scored at k of D-PACE weight x loss. Position k's
    rows belong to chains `chains[k]` (indices below `num_chains`), with per-row `losses[k]` and
    `cross_entropies[k]`."""
    positions = len(chains)
    device = losses[0].device
    cross_entropy = torch.zeros(num_chains, positions, dtype=torch.float32, device=device)
    scored = torch.zeros(num_chains, positions, dtype=torch.bool, device=device)
    for k, rows in enumerate(chains):
        cross_entropy[rows, k] = cross_entropies[k].float()
        scored[rows, k] = True
    weights = dpace_weights(cross_entropy, scored)
    total = losses[0].new_zeros(())
    for k, rows in enumerate(chains):
        total = total + (weights[rows, k].to(losses[k].dtype) * losses[k]).sum() / max(rows.numel(), 1)
    return total
