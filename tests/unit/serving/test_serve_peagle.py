"""vLLM (CPU build) serves our trained P-EAGLE checkpoint: eagle3 with parallel drafting, lossless, and the
acceptance our offline evaluator measures."""

from __future__ import annotations

import pytest

from speculators.serving.serve import ServerSettings, VllmServer, acceptance_from_counters
from tests.unit.eval.test_parallel_proposer import train_peaked_peagle
from tests.unit.serving.test_serve_bench import NEW_TOKENS, SERVER, K, completions, served_baseline  # noqa: F401


def offline_peagle_totals(verifier_dir, prompts, checkpoint) -> dict:
    from speculators.eval.evaluate import evaluate, load_proposer
    from speculators.eval.parallel_proposer import PEagleProposer
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(verifier_dir, dtype="float32")
    proposer = load_proposer("speculator", verifier, str(checkpoint), "float32")
    assert isinstance(proposer, PEagleProposer)
    return evaluate(verifier, prompts, proposer, K, NEW_TOKENS, stop_at_eos=False, progress=False).totals()


def test_the_server_asks_vllm_for_eagle3_with_parallel_drafting(store, peaked_verifier, tmp_path):
    from speculators.train.trainer import TrainConfig, train

    options = dict(algorithm="peagle", mask_token_id=5, max_steps=1, token_budget=128, precision="fp32")
    train(TrainConfig(store=str(store), verifier=str(peaked_verifier), output=str(tmp_path / "r"), **options))
    settings = ServerSettings(verifier=str(peaked_verifier), speculator=str(tmp_path / "r" / "drafter"), **SERVER)
    assert settings.speculative_config() == {
        "method": "eagle3",
        "parallel_drafting": True,
        "model": str((tmp_path / "r" / "drafter").resolve()),
        "num_speculative_tokens": 3,
    }


@pytest.mark.slow
def test_vllm_serves_our_trained_peagle_checkpoint_losslessly_with_the_offline_acceptance(
    store,
    peaked_verifier,
    served_baseline,  # noqa: F811
    tmp_path,
):
    """fp32 greedy outputs equal the baseline server's token for token; one forward drafts K (vLLM's parallel
    drafting), and the served acceptance is our evaluator's within 2%."""
    drafter = train_peaked_peagle(store, peaked_verifier, tmp_path / "run")
    prompts, baseline, _ = served_baseline
    token_prompts = [ids for _, ids in prompts]
    settings = ServerSettings(
        verifier=str(peaked_verifier), **SERVER, speculator=str(drafter), log_path=tmp_path / "speculator.log"
    )
    with VllmServer(settings) as server:
        assert server.speculative is not None and server.speculative["parallel_drafting"] is True
        before = server.metrics()
        speculative = completions(server.url, server.model_name, token_prompts)
        served = acceptance_from_counters(before, server.metrics())
    # vLLM skips mask_hidden with this warning when parallel drafting is off; on, it loads it.
    assert "Skipping loading mask_hidden" not in (tmp_path / "speculator.log").read_text()
    assert speculative == baseline  # fp32: not one token changed
    assert served["drafts"] > 0 and served["draft_tokens"] == K * served["drafts"]
    offline = offline_peagle_totals(peaked_verifier, prompts, drafter)
    print(
        f"served {served['acceptance_length']:.4f} {served['acceptance_per_position']}, offline "
        f"{offline['acceptance_length']:.4f} {offline['acceptance_per_position']} over {served['drafts']} drafts"
    )
    assert served["acceptance_length"] > 1.5
    assert served["acceptance_length"] == pytest.approx(offline["acceptance_length"], rel=0.02)
    assert served["acceptance_per_position"] == pytest.approx(offline["acceptance_per_position"], abs=0.05)
