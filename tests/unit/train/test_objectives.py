"""The training objectives (--loss, --position-weights): each tiled loss against a plain computation on whole
tensors, D-PACE in the TTT loss against a per-chain loop, and short runs of every algorithm under every loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.nn import functional as F

from speculators.errors import SpeculatorsError
from speculators.models.draft_losses import LK_ALPHA_FLOOR, LOSSES, row_loss
from speculators.models.ttt import ROW_CHUNK, target_distribution, ttt_loss
from speculators.train.trainer import train
from tests.unit.train.test_train import config_for, interrupt_at_checkpoint, resume_refusal

ETA = 3.0


def plain_loss(loss: str, logits: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row on whole tensors, from the definitions: the loss and the cross-entropy to what it trains toward."""
    log_q, log_p = F.log_softmax(logits, -1), F.log_softmax(target_logits, -1)
    q, p = log_q.exp(), log_p.exp()
    soft_cross_entropy = -(p * log_q).sum(-1)
    kl = (p * (log_p - log_q)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    acceptance = torch.minimum(p, q).sum(-1)
    if loss == "kl":
        return kl, soft_cross_entropy
    if loss == "ce":
        hard = F.cross_entropy(logits, target_logits.argmax(-1), reduction="none")
        return hard, hard
    if loss == "tv":
        return tv, soft_cross_entropy
    if loss == "lk-alpha":
        return -acceptance.clamp(min=LK_ALPHA_FLOOR).log(), soft_cross_entropy
    blend = torch.exp(-ETA * acceptance.detach())
    return blend * kl + (1 - blend) * tv, soft_cross_entropy


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("restricted", [False, True], ids=["all-rows", "target-rows"])
def test_each_loss_equals_a_plain_computation_in_value_and_gradient(loss, restricted):
    torch.manual_seed(3)
    rows, vocab = 2 * ROW_CHUNK + 9, 17  # several row tiles and a partial one
    logits = (2 * torch.randn(rows, vocab, dtype=torch.float64)).requires_grad_()
    target_logits = 2 * torch.randn(rows + 6 if restricted else rows, vocab, dtype=torch.float64)
    target_rows = torch.randperm(rows + 6)[:rows] if restricted else None
    _, _, target_ids = target_distribution(target_logits)
    log_p = F.log_softmax(target_logits, -1)  # the distribution in fp64, for a tight comparison
    p, neg_entropy = log_p.exp(), (log_p.exp() * log_p).sum(-1)
    weights = torch.rand(rows, dtype=torch.float64)

    tiled, predicted, cross_entropy = row_loss(loss, logits, p, neg_entropy, target_ids, target_rows, ETA)
    (tiled * weights).sum().backward()
    tiled_grad, logits.grad = logits.grad.clone(), None
    scored_targets = target_logits if target_rows is None else target_logits[target_rows]
    plain, plain_cross_entropy = plain_loss(loss, logits, scored_targets)
    (plain * weights).sum().backward()

    torch.testing.assert_close(tiled, plain, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(tiled_grad, logits.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(cross_entropy, plain_cross_entropy.detach(), rtol=1e-10, atol=1e-12)
    assert torch.equal(predicted, logits.argmax(-1))
    assert not cross_entropy.requires_grad


def test_lk_alpha_is_clipped_without_gradient_where_the_distributions_do_not_overlap():
    logits = torch.tensor([[40.0, 0.0, 0.0], [1.0, 0.0, 0.5]], dtype=torch.float64, requires_grad=True)
    target_logits = torch.tensor([[0.0, 40.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    log_p = F.log_softmax(target_logits, -1)
    value, _, _ = row_loss("lk-alpha", logits, log_p.exp(), (log_p.exp() * log_p).sum(-1), target_logits.argmax(-1))
    value.sum().backward()
    assert value[0].item() == pytest.approx(-math.log(LK_ALPHA_FLOOR))
    assert torch.equal(logits.grad[0], torch.zeros(3, dtype=torch.float64))
    assert logits.grad[1].abs().sum() > 0


def plain_dpace(confidences: list[float | None]) -> list[float]:
    """D-PACE's weights of one chain, a position at a time (None: not scored)."""
    smoothed = [1.0 if c is None else 0.5 * c + 0.5 for c in confidences]
    prefix = [math.prod(smoothed[: k + 1]) for k in range(len(smoothed))]
    return [
        0.0 if confidences[k] is None else sum(prefix[j] for j in range(k, len(prefix)) if confidences[j] is not None)
        for k in range(len(confidences))
    ]


@pytest.mark.parametrize("loss", ["kl", "tv"])
def test_dpace_in_the_ttt_loss_equals_a_per_chain_loop(loss):
    """Each chain start's steps weigh what D-PACE gives from that chain's confidences (exp(-cross-entropy)),
    detached; a step's weighted losses are averaged over its scored chain starts, then summed over steps."""
    torch.manual_seed(5)
    B, T, D, steps = 2, 10, 7, 3
    step_logits = [torch.randn(B, T, D, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    targets = torch.randn(B, T, D, dtype=torch.float64)
    mask = torch.rand(B, T) > 0.25
    documents = torch.tensor([[0] * 6 + [1] * 4, [0] * 10])
    total, _ = ttt_loss(step_logits, targets, mask, documents, objective=(loss, "dpace", ETA))
    grads = torch.autograd.grad(total, step_logits)

    per_step: list[dict[tuple[int, int], tuple[torch.Tensor, float]]] = [{} for _ in range(steps)]
    for s in range(steps):
        for b in range(B):
            for t in range(T - s):
                if mask[b, t + s] and documents[b, t] == documents[b, t + s]:
                    value, cross_entropy = plain_loss(loss, step_logits[s][b, t][None], targets[b, t + s][None])
                    per_step[s][(b, t)] = (value[0], math.exp(-cross_entropy.item()))
    expected = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            confidences = [per_step[s][(b, t)][1] if (b, t) in per_step[s] else None for s in range(steps)]
            for s, weight in enumerate(plain_dpace(confidences)):
                if (b, t) in per_step[s]:
                    expected = expected + weight * per_step[s][(b, t)][0] / len(per_step[s])
    # (ttt_loss holds the verifier's distribution in fp32)
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, torch.autograd.grad(expected, step_logits), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


ALGORITHMS = {
    "eagle3": {},
    "peagle": dict(algorithm="peagle", cod_ratio=0.7, cod_ratio_min=0.3, mask_token_id=5),
    "dflash": dict(algorithm="dflash", max_anchors=32),
}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_every_algorithm_trains_under_every_loss_and_names_it(store, peaked_verifier, tmp_path, algorithm, loss):
    """Two steps (D-PACE where the algorithm has it and the loss is an LK one): finite losses, and the log's
    lines and the summary name the objective."""
    weights = "dpace" if loss.startswith("lk") else "decay"
    config = config_for(
        store, peaked_verifier, tmp_path, max_steps=2, log_every=1, eval_every=2, loss=loss, position_weights=weights,
        **ALGORITHMS[algorithm],
    )  # fmt: skip
    summary = train(config)
    named = {"loss": loss, "position_weights": weights, **({"lk_eta": "3.0"} if loss == "lk-lambda" else {})}
    rows = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [row["event"] for row in rows] == ["train", "train", "validation"]
    assert all(row["objective"] == named for row in rows)
    assert all(math.isfinite(value) for row in rows for value in row["loss"])
    assert summary.objective == named
    assert json.loads((tmp_path / "summary.json").read_text())["objective"] == named


def test_a_resume_under_another_objective_is_refused(store, peaked_verifier, tmp_path):
    output = tmp_path / "run"
    config = config_for(store, peaked_verifier, output, max_steps=4, checkpoint_every=2)
    interrupt_at_checkpoint(config, 2)
    changes = {
        "loss": ("with --loss kl", "asks for --loss tv", "resume with --loss kl", "tv"),
        "position_weights": (
            "with --position-weights decay",
            "asks for --position-weights dpace",
            "resume with --position-weights decay",
            "dpace",
        ),
        "lk_eta": ("with --lk-eta 3.0", "asks for --lk-eta 1.0", "resume with --lk-eta 3.0", 1.0),
    }
    for name, (trained, asks, fix, value) in changes.items():
        with pytest.raises(SpeculatorsError, match=resume_refusal(output, trained, asks, fix)):
            train(config.model_copy(update={name: value}))


def test_bad_objective_settings_are_one_sentence(store, peaked_verifier, tmp_path):
    from speculators.flags import build
    from speculators.settings import TrainConfig

    base = dict(store=str(store), verifier=str(peaked_verifier), output=str(tmp_path))
    with pytest.raises(SpeculatorsError, match=r"^--loss 'mse': input should be 'kl', 'ce', 'tv', 'lk-alpha' or"):
        build(TrainConfig, {**base, "loss": "mse"})
    with pytest.raises(SpeculatorsError, match=r"^--position-weights 'linear': input should be 'decay' or 'dpace'$"):
        build(TrainConfig, {**base, "position_weights": "linear"})
    with pytest.raises(SpeculatorsError, match=r"^--lk-eta 0.0: input should be greater than 0$"):
        build(TrainConfig, {**base, "lk_eta": 0.0})


def test_dflash_takes_d_pace_from_either_flag():
    """--position-weights dpace and DFlash's older --dflash-loss dpace both give D-PACE slot weights."""
    from speculators.settings import TrainConfig

    def weighting(**flags: str) -> str:
        return TrainConfig(store="s", verifier="v", output="o", **flags).objective["position_weights"]

    assert weighting(algorithm="dflash") == "decay"
    assert weighting(algorithm="dflash", position_weights="dpace") == "dpace"
    assert weighting(algorithm="dflash", dflash_loss="dpace") == "dpace"
    assert weighting(dflash_loss="dpace") == "decay"  # (DFlash's flag only)
