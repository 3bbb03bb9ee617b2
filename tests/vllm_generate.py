"""Run vLLM (offline LLM, CPU build) greedily over prompts; print JSON with token ids and spec-decode counters.

Usage: python vllm_generate.py VERIFIER_DIR PROMPTS_JSON [DRAFTER_DIR K]
Run in its own process: vLLM spawns workers and keeps global state.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    from vllm import LLM, SamplingParams

    verifier, prompts = sys.argv[1], json.loads(sys.argv[2])
    options = {}
    if len(sys.argv) > 3:
        options["speculative_config"] = {
            "method": "eagle3",
            "model": sys.argv[3],
            "num_speculative_tokens": int(sys.argv[4]),
        }
    llm = LLM(
        model=verifier,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **options,
    )
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "value", None)
            if hasattr(metric, "values"):
                counters[metric.name] = list(metric.values)
    result = {"token_ids": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
