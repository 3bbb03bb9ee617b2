"""How much of held-out answer text a draft vocabulary of each size can draft at all, in one run.

    python benchmarks/vocab_coverage.py --store STORE [--sizes 4096,8192,16384,32768]

A verifier token outside the draft vocabulary is a rejected draft whatever the drafter learned, so
the share of the validation samples' supervised tokens inside the vocabulary bounds acceptance. The
vocabulary is built from the training samples' answers as `speculators vocab` builds it (most
frequent first, then the lowest unused ids: BPE's earliest merges), and, for comparison, with the
training prompts' tokens filling the free slots before the lowest ids (answers echo their prompts).
Use a store whose validation samples come from a validation source (`natural:validation`), so the
figure is about text the training generator did not write.
"""

from __future__ import annotations

import argparse


def main() -> None:
    import torch

    from speculators.data.store import HiddenStateStore
    from speculators.train.data import is_validation
    from speculators.train.vocab import count_supervised_tokens, select_draft_vocab

    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--sizes", default="4096,8192,16384,32768")
    args = parser.parse_args()

    store = HiddenStateStore(args.store)
    answers, manifest = count_supervised_tokens(args.store)  # what `speculators vocab` counts
    vocab_size = answers.numel()
    prompts, held_out = (torch.zeros(vocab_size, dtype=torch.long) for _ in range(2))
    for entry in manifest.samples:
        ids, mask = store.read_tokens(entry.shard)
        mask = mask.bool()
        if is_validation(entry.id, 0.0):
            held_out += torch.bincount(ids[mask], minlength=vocab_size)
        else:
            prompts += torch.bincount(ids[~mask], minlength=vocab_size)
    total = int(held_out.sum())
    unseen = int(held_out[answers == 0].sum())
    print(
        f"store {args.store}: {int(answers.sum()):,} training answer tokens ({int((answers > 0).sum()):,} distinct), "
        f"{total:,} validation answer tokens, {unseen / total:.1%} of them never in a training answer\n"
    )
    print("| draft vocab | held-out tokens inside: answers, then lowest ids | answers, prompts, then lowest ids |")
    print("|---:|---:|---:|")
    for size in map(int, args.sizes.split(",")):
        plain = select_draft_vocab(answers, size).selected
        # Prompt tokens rank after every answer token: scale answer counts above any prompt count.
        prompted = select_draft_vocab(answers * (int(prompts.max()) + 1) + prompts, size).selected
        inside = [float(held_out[selected].sum()) / total for selected in (plain, prompted)]
        print(f"| {size:,} | {inside[0]:.2%} | {inside[1]:.2%} |")


if __name__ == "__main__":
    main()
