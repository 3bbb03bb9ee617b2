"""Training-time-test loss and metrics (docs/eagle3.md).

Step s scores the drafter's step-s outputs at [:, :T-s] against the verifier's distribution at
[:, s:] (forward KL(p_verifier || q_draft) over the draft vocab), where the loss mask holds and the
target lies in the same packed document. Per step: loss, full accuracy (argmax agrees) and
conditional accuracy (agrees given every earlier step of the same chain was scored and agreed).
Counts are returned as sums so they aggregate exactly over packs, ranks and logging windows.

Logits are computed only at scored positions (the loss mask is typically half of a pack), both for
the drafter (pass its normed outputs and `lm_head`) and for the verifier targets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def verifier_target_logits(
    target_states: torch.Tensor, final_norm: nn.Module, lm_head_rows: torch.Tensor
) -> torch.Tensor:
    """Verifier logits restricted to the draft vocab: lm_head(final_norm(y)) rows, in fp32, for the
    given states (pass only the scored positions' states to compute nothing else)."""
    with torch.no_grad():
        return (final_norm(target_states.to(lm_head_rows.dtype)) @ lm_head_rows.T).float()


# Rows per tile in the [n x draft vocab] passes. Whole-tensor fp32 temporaries (~50 MB each) came
# fresh from the OS every time (page faults and zeroing: about a third of a CPU training step);
# tiles of 128 rows (4 MB in fp32) reuse two buffers per call and stay in cache.
ROW_CHUNK = 128


def row_chunks(n: int) -> list[slice]:
    return [slice(start, min(start + ROW_CHUNK, n)) for start in range(0, n, ROW_CHUNK)]


class TileBuffers:
    """Reusable [ROW_CHUNK, D] fp32 tiles: one for logits rows, one (made on first use) for gathered
    target rows."""

    def __init__(self, logits: torch.Tensor, target_p: torch.Tensor):
        shape = (min(ROW_CHUNK, logits.shape[0]), logits.shape[1])
        self.x = torch.empty(shape, dtype=target_p.dtype, device=logits.device)
        self.p: torch.Tensor | None = None
        self.target_p = target_p

    def logits(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        x = self.x[: rows.stop - rows.start]
        return x.copy_(logits[rows])  # fp32 (or wider) for the reductions

    def targets(self, target_rows: torch.Tensor | None, rows: slice) -> torch.Tensor:
        if target_rows is None:
            return self.target_p[rows]
        if self.p is None:
            self.p = torch.empty_like(self.x)
        return torch.index_select(self.target_p, 0, target_rows[rows], out=self.p[: rows.stop - rows.start])


def target_distribution(target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verifier's probabilities [n, D] (fp32), sum p log p [n] and argmax [n], tile by tile."""
    n = target_logits.shape[0]
    p = torch.empty(target_logits.shape, dtype=torch.float32, device=target_logits.device)
    neg_entropy = torch.empty(n, dtype=torch.float32, device=target_logits.device)
    ids = torch.empty(n, dtype=torch.long, device=target_logits.device)
    tiles = TileBuffers(target_logits, p)
    for rows in row_chunks(n):
        shifted = tiles.logits(target_logits, rows)
        top, ids[rows] = shifted.max(-1)
        shifted.sub_(top.unsqueeze(-1))  # log p = shifted - log z
        z = torch.exp(shifted, out=p[rows]).sum(-1)
        p[rows] /= z.unsqueeze(-1)
        neg_entropy[rows] = torch.linalg.vecdot(p[rows], shifted) - z.log()
    return p, neg_entropy, ids


class KLFromLogits(torch.autograd.Function):
    """Per-row KL(p || softmax(logits)) = sum p log p - sum p logits + logsumexp(logits), and the
    row's argmax, with the gradient softmax(logits) - p computed in place. `target_rows` picks each
    logits row's target row (gathered per tile, never as a whole [n, D] copy). Every [n, D] pass
    runs over row tiles; no fp32 [n, D] tensor is kept for backward."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target_p: torch.Tensor,
        neg_entropy: torch.Tensor,
        target_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = logits.shape[0]
        lse = torch.empty(n, dtype=target_p.dtype, device=logits.device)
        cross = torch.empty_like(lse)
        predicted = torch.empty(n, dtype=torch.long, device=logits.device)
        tiles = TileBuffers(logits, target_p)
        for rows in row_chunks(n):
            x = tiles.logits(logits, rows)
            top, predicted[rows] = x.max(-1)  # the max for a stable logsumexp, and the argmax
            cross[rows] = torch.linalg.vecdot(x, tiles.targets(target_rows, rows))
            lse[rows] = x.sub_(top.unsqueeze(-1)).exp_().sum(-1).log_().add_(top)
        ctx.save_for_backward(logits, target_p, lse, target_rows)
        ctx.mark_non_differentiable(predicted)
        entropy_term = neg_entropy if target_rows is None else neg_entropy[target_rows]
        return entropy_term - cross + lse, predicted

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: torch.Tensor | None) -> tuple[torch.Tensor, None, None, None]:
        logits, target_p, lse, target_rows = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        tiles = TileBuffers(logits, target_p)
        for rows in row_chunks(logits.shape[0]):
            q = tiles.logits(logits, rows).sub_(lse[rows].unsqueeze(-1)).exp_()
            grad_logits[rows] = q.sub_(tiles.targets(target_rows, rows)).mul_(grad[rows].unsqueeze(-1))
        return grad_logits, None, None, None


def scored_chain_starts(loss_mask: torch.Tensor, document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """bool [B, T - step]: chain starts t whose step-`step` draft is scored (the target t + step is
    in the loss mask and in t's document)."""
    span = loss_mask.shape[1] - step
    return loss_mask.bool()[:, step:] & (document_ids[:, :span] == document_ids[:, step:])


def later_steps_needed(loss_mask: torch.Tensor, document_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
    """bool [B, T]: positions scored at some step >= 1. Past step 0 a position's chain only feeds
    itself (its hidden state and its diagonal keys), so the other positions need no later steps."""
    needed = torch.zeros(loss_mask.shape, dtype=torch.bool, device=loss_mask.device)
    for step in range(1, num_steps):
        needed[:, : loss_mask.shape[1] - step] |= scored_chain_starts(loss_mask, document_ids, step)
    return needed


def ttt_loss(
    step_outputs: list[torch.Tensor],
    target_logits: torch.Tensor,
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    decay: float = 1.0,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    hits: list[torch.Tensor] | None = None,
    first_step_mask: torch.Tensor | None = None,
    objective: tuple[str, str, float] = ("kl", "decay", 3.0),
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Total loss (sum over steps of decay**s x the masked-mean loss) and per-step count sums [steps].

    `objective` is (loss, position weights, LK eta) (models/draft_losses.py): the per-row loss (KL by
    default) and `decay` (decay**s) or `dpace` (D-PACE's weights per chain start, `decay` unused).

    `step_outputs` are per-step logits [B, T, D], or normed hidden states [B, T, H] with `lm_head`.
    `target_logits` are the verifier's, either [B, T, D] or only at the positions some step scores
    [needed.sum(), D] (in row-major order; `needed` is the loss mask, or its union with
    `first_step_mask`). `first_step_mask` [B, T], when given, is what step 0 scores instead of the
    loss mask (e.g. every position, while the later steps keep to the answers). A `hits` list
    receives, per step s, the bool [B, T - s] of chain starts whose step-s draft is scored and
    agrees (for `replay_decoding`).
    """
    from speculators.models.draft_losses import dpace_total, row_loss  # (it builds on this module's tiles)

    loss, position_weights, eta = objective
    length = loss_mask.shape[1]
    needed = loss_mask.bool()
    if first_step_mask is not None:
        needed = needed | first_step_mask.bool()
    if target_logits.dim() == 3:
        target_logits = target_logits[needed]
    target_p, neg_entropy, target_ids = target_distribution(target_logits)  # one row per needed position
    row_of = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    row_of[needed] = torch.arange(target_p.shape[0], device=needed.device)

    chain_ok = torch.ones_like(needed)
    total = target_p.new_zeros(())
    starts: list[torch.Tensor] = []  # for D-PACE, per step: its scored chain starts, their losses and cross-entropies
    losses: list[torch.Tensor] = []
    cross_entropies: list[torch.Tensor] = []
    sums: dict[str, list[torch.Tensor]] = {k: [] for k in ("kl", "count", "correct", "cond_correct", "cond_count")}
    for step, output in enumerate(step_outputs):
        span = length - step
        scored_from = first_step_mask if step == 0 and first_step_mask is not None else loss_mask
        mask = scored_chain_starts(scored_from, document_ids, step)
        rows = mask.nonzero(as_tuple=True)  # (batch, chain start t); target position t + step
        targets = row_of[:, step:][rows]
        scored = output[:, :span][rows]
        logits = lm_head(scored) if lm_head is not None else scored
        per_row, predicted, cross_entropy = row_loss(loss, logits, target_p, neg_entropy, target_ids, targets, eta)
        count = mask.sum()
        if position_weights == "dpace":
            starts.append(rows[0] * length + rows[1])
            losses.append(per_row)
            cross_entropies.append(cross_entropy)
        else:
            total = total + decay**step * per_row.sum() / count.clamp(min=1)
        hit = predicted == target_ids[targets]
        correct = torch.zeros_like(mask)
        correct[rows] = hit
        chain_ok = chain_ok[:, :span]
        if hits is not None:
            hits.append(correct)
        sums["kl"].append(per_row.sum().detach())  # (named kl before the other losses: the objective's loss)
        sums["count"].append(count)
        sums["correct"].append(hit.sum())
        sums["cond_correct"].append((correct & chain_ok).sum())
        sums["cond_count"].append((mask & chain_ok).sum())
        chain_ok = chain_ok & correct  # an unscored step breaks the chain
    if position_weights == "dpace":
        total = dpace_total(starts, losses, cross_entropies, num_chains=needed.numel())
    return total, {k: torch.stack(v).double() for k, v in sums.items()}


def summarize(sums: dict[str, torch.Tensor]) -> dict[str, list[float] | float]:
    """Per-step loss / full_acc / cond_acc and the expected acceptance length from count sums; with
    replay sums (validation), the replayed acceptance length and its per-position acceptance rates."""
    count = sums["count"].clamp(min=1)
    cond = (sums["cond_correct"] / sums["cond_count"].clamp(min=1)).tolist()
    metrics: dict[str, list[float] | float] = {
        "loss": (sums["kl"] / count).tolist(),
        "full_acc": (sums["correct"] / count).tolist(),
        "cond_acc": cond,
        "acceptance_length": expected_acceptance_length(cond),
    }
    if "replay_rounds" in sums:
        rounds = float(sums["replay_rounds"].sum())
        accepted = sums["replay_accepted"]
        metrics["replayed_acceptance_length"] = 1.0 + float(accepted.sum()) / rounds if rounds else 0.0
        metrics["replayed_acceptance_per_position"] = (accepted / max(rounds, 1.0)).tolist()
        metrics["replayed_rounds"] = int(rounds)
    return metrics


def expected_acceptance_length(cond_acc: list[float]) -> float:
    """1 + sum_k prod_{s<k} cond_acc_s: mean tokens per verifier step for chain drafting."""
    total, run = 1.0, 1.0
    for rate in cond_acc:
        run *= rate
        total += run
    return total


def output_targets(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: supervised positions whose target token is still part of the answer.

    Pack position u targets token u + 2 of its sample (training_data.py); the last position of a
    supervised run targets the token after the turn's end token, which decoding never outputs.
    """
    mask = loss_mask.bool()
    inside = torch.zeros_like(mask)
    inside[:, :-1] = mask[:, :-1] & mask[:, 1:] & (document_ids[:, :-1] == document_ids[:, 1:])
    return inside


def replay_decoding(
    hits: list[torch.Tensor],
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_tokens: int,
    in_vocab: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Decoding replayed on teacher-forced chains: count sums {replay_rounds [1], replay_accepted [K]}.

    On the verifier's own greedy answers, decoding with K = `num_tokens` drafts goes: the prefill
    outputs a turn's first token; each round then drafts K tokens from the last output token,
    accepts the leading drafts that equal the verifier's choices and outputs one more token of the
    verifier's. Chain start u's step-s draft is the round's s-th draft, so a round at u accepts the
    leading run of `hits[s][u]`, and the next round starts at u + accepted + 1. Unlike the expected
    acceptance (every position starting a chain), rounds start right after rejections, as they do in
    decoding. `in_vocab` [B, T] marks targets whose full-vocabulary greedy token is in the draft
    vocabulary (decoding rejects the rest; default: all). Equals `speculators evaluate`'s acceptance
    on the same answers when the forward passes agree (tests/unit/train/test_train.py).
    """
    steps = min(num_tokens, len(hits))
    mask = loss_mask.bool()
    inside = output_targets(mask, document_ids)
    if in_vocab is not None:
        inside &= in_vocab.bool()
    ok = [(hits[s] & inside[:, s:]).tolist() for s in range(steps)]
    same_run = (mask[:, 1:] & mask[:, :-1] & (document_ids[:, 1:] == document_ids[:, :-1])).tolist()
    rounds, accepted = 0, [0] * num_tokens
    for b, row in enumerate(mask.tolist()):
        for u, supervised in enumerate(row):
            if not supervised or (u > 0 and same_run[b][u - 1]):
                continue
            # A supervised run starts at u (the turn's first token came from the prefill) and ends at `end`.
            end = u
            while end < len(same_run[b]) and same_run[b][end]:
                end += 1
            start = u
            while start < end:  # a round at each chain start before the run's last position
                rounds += 1
                run = 0
                while run < steps and start < len(ok[run][b]) and ok[run][b][start]:
                    accepted[run] += 1
                    run += 1
                start += run + 1
    return {
        "replay_rounds": torch.tensor([float(rounds)], dtype=torch.float64),
        "replay_accepted": torch.tensor(accepted, dtype=torch.float64),
    }
