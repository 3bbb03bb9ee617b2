"""The keys of the shipped variants' artifacts, pinned: a change to how a step derives its key (or to a
variant's settings) re-keys artifacts that exist under every storage root, so it must show here, on
purpose. Each key from fixed inputs where it hashes content (prompt sources, conversations, the store,
the published drafter), so only the variant and the derivation decide it."""

from __future__ import annotations

import pytest

from speculators_assets.variants import load_variants
from speculators_assets.workload import benchmark_key, hidden_states_key, raw_prompts_key, trained_drafter_key

FINGERPRINT, CONVERSATIONS, STORE, DRAFTER = "f" * 16, "c" * 64, "0123456789ab", "ba9876543210"

# variant -> keys of raw_prompts, verifier_hidden_states, trained_drafter and benchmark_report
# (speculator_checkpoint's is the drafter's)
KEYS = {
    "gpt_oss_120b": ("88b1ad0e7cf0", "aee7cd69f7c8", "8d0fee525ba5", "0721fd75a25e"),
    "gpt_oss_20b": ("88b1ad0e7cf0", "82c39c788e7d", "613a159680b7", "0721fd75a25e"),
    "llama3_1_8b": ("88b1ad0e7cf0", "66c21202f85d", "6c64ade51fb3", "0721fd75a25e"),
    "llama3_3_70b": ("88b1ad0e7cf0", "2db3eda263b1", "23ad77fc6df9", "0721fd75a25e"),
    "llama3_3_70b_fp8": ("88b1ad0e7cf0", "d0b1fbd46f25", "23ad77fc6df9", "2a69c887099b"),
    "mistral_large_3": ("88b1ad0e7cf0", "ea632d659ea7", "7557595d7ea0", "0721fd75a25e"),
    "qwen3_14b": ("88b1ad0e7cf0", "6335a9dc3878", "b94a4aa6f746", "0721fd75a25e"),
    "qwen3_235b_a22b": ("88b1ad0e7cf0", "12a7bee48696", "7f667d610697", "0721fd75a25e"),
    "qwen3_30b_a3b": ("88b1ad0e7cf0", "86a3a30def87", "a6807c9ff15a", "0721fd75a25e"),
    "qwen3_32b": ("88b1ad0e7cf0", "7e026fd31ab4", "d8c6a4195e0a", "0721fd75a25e"),
    # qwen3_8b's store keeps the DFlash partition's five aux layers beside EAGLE-3's three (re-keyed for them)
    "qwen3_8b": ("88b1ad0e7cf0", "1d8e358e3d12", "31538243df5a", "0721fd75a25e"),
    "qwen3_8b_dflash": ("88b1ad0e7cf0", "1d8e358e3d12", "e61b3443c317", "56c5df9d1979"),  # qwen3_8b's data
    "qwen3_vl_235b_a22b": ("be2b87cf1983", "d6b25ea6350c", "df34acbc2c3f", "0721fd75a25e"),
    "qwen3_vl_8b": ("be2b87cf1983", "4a8d5fb6e1c2", "ce28f61c8807", "0721fd75a25e"),
    # the demo: a pool of 1,800 first turns, its shortest kept until 291,392 tokens (re-keyed for them); its
    # benchmark's answers up to 192 tokens and 4 greedy prompts (re-keyed for the 30-minute budget)
    "smollm2_135m": ("7d100cd9bcb6", "c728ff734b51", "62af1c8012a8", "894c8498ed97"),
    "smollm2_135m_full": ("90399ddb5b28", "228105f2aa7e", "5beabbff2c9f", "d1f45cabbd4a"),
    # data_from smollm2_135m: its prompts' and store's keys are that partition's
    "smollm2_135m_dflash": ("7d100cd9bcb6", "c728ff734b51", "9555acdfd39d", "1413b283c63e"),
    "smollm2_135m_peagle": ("7d100cd9bcb6", "c728ff734b51", "8a7cd9991163", "f8cd70862116"),
    # the demo's data with streamed hidden states: its prompts' key is the demo's; its store is an index (own key)
    # and its drafter's key holds how the states are computed
    "smollm2_135m_streamed": ("7d100cd9bcb6", "efff466e27d4", "e0750d5a0d20", "894c8498ed97"),
}


@pytest.fixture(autouse=True)
def shipped_variants_only(monkeypatch):
    """The package's variants alone: a session fixture of the same worker (conftest's `lineage`) may have
    pointed SPECULATORS_VARIANTS_DIR at tiny test variants."""
    monkeypatch.delenv("SPECULATORS_VARIANTS_DIR", raising=False)


def test_every_shipped_variant_has_its_keys_pinned():
    assert sorted(load_variants()) == sorted(KEYS)


@pytest.mark.parametrize("name", sorted(KEYS))
def test_a_shipped_variant_keeps_its_artifact_keys(name):
    v = load_variants()[name]
    fingerprints = {source: FINGERPRINT for source in [*v.prompts.validation_sources, *v.prompts.sources]}
    keys = (
        raw_prompts_key(v, fingerprints),
        hidden_states_key(v, CONVERSATIONS, v.verifier),
        trained_drafter_key(v, STORE),
        benchmark_key(v, DRAFTER),
    )
    assert keys == KEYS[name]
