"""DFlash's training attention over each chunk's visible context against one dense masked attention over the
whole pack, in one run: forward + backward seconds of the drafter body on real packs.

    python benchmarks/dflash_attention.py --store STORE [--packs 3] [--repeats 3] [--anchors 128,512]
        [--layers 1,2]

The packs are the store's first training packs (2,048-token budget, its real documents); anchors are drawn as
the trainer draws them (`draw_anchors`); the drafter is SmolLM2-135M-sized (hidden 576, 9 heads, 3 KV heads,
MLP 1,536), random weights, fp32 (bf16 autocast where the CPU computes bf16). "dense" is the same forward with
one span holding every block and the whole pack under the [N, T] visibility mask (the computation before
chunking); "chunked" is `training_forward`. The two alternate, repeat by repeat, so a load on the machine
falls on both; the table gives each one's median and their ratio, and the largest output difference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculators.models.dflash import ContextSpan, ContextStates, DFlashDrafter, build_dflash_config
from speculators.precision import native_bf16
from speculators.train.data import PackedStore
from speculators.train.dflash_objective import draw_anchors

LAYER = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
}
BLOCK = 8


def dense_forward(drafter: DFlashDrafter, pack, anchors: torch.Tensor) -> torch.Tensor:
    """training_forward as one span over the whole pack with the dense [N, T] visibility mask."""
    states = drafter.context_states(pack.aux_hidden_states[0])[None]
    context = ContextStates(states, drafter.rotary(pack.position_ids - 1, states.dtype))
    documents = pack.document_ids[0]
    indices = torch.arange(documents.numel())
    visible = (documents[None, :] == documents[anchors, None]) & (indices[None, :] <= anchors[:, None])
    positions = pack.position_ids[0, anchors, None] + torch.arange(BLOCK)
    span = ContextSpan(0, anchors.numel(), 0, documents.numel(), visible)
    return drafter(pack.input_ids[0, anchors], positions, context, [span])[:, 1:]


def forward_backward(
    drafter: DFlashDrafter, packs: list, anchors: list[torch.Tensor], dense: bool, autocast: bool
) -> tuple[float, list[torch.Tensor]]:
    """Seconds of forward + backward over every pack, and the outputs."""
    outputs = []
    started = time.perf_counter()
    for pack, chosen in zip(packs, anchors, strict=True):
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            if dense:
                out = dense_forward(drafter, pack, chosen)
            else:
                inputs = (pack.input_ids, pack.aux_hidden_states, pack.position_ids, pack.document_ids)
                out = drafter.training_forward(*inputs, chosen)
        out.float().square().mean().backward()
        outputs.append(out.detach().float())
    seconds = time.perf_counter() - started
    drafter.zero_grad(set_to_none=True)
    return seconds, outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store", required=True)
    parser.add_argument("--packs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--anchors", default="128,512")
    parser.add_argument("--layers", default="1,2")
    args = parser.parse_args()
    store = PackedStore(args.store, 2048, dtype=torch.float32, validation_share=0.0)
    plan = store.pack_plan(0)[: args.packs]
    packs = [store.load_pack(indices) for indices in plan]
    autocast = native_bf16("cpu")
    print(
        f"{len(packs)} packs of {[p.num_tokens for p in packs]} tokens, documents per pack "
        f"{[int(p.document_ids.max()) + 1 for p in packs]}; autocast {'bf16' if autocast else 'off (fp32)'}; "
        f"{torch.get_num_threads()} threads\n"
    )
    print("| layers | anchors | dense s | chunked s | dense / chunked | largest output difference |")
    print("|---:|---:|---:|---:|---:|---:|")
    for layers in (int(n) for n in args.layers.split(",")):
        config = build_dflash_config(
            {**LAYER, "num_hidden_layers": layers},
            verifier_name="smollm2",
            verifier_architectures=["LlamaForCausalLM"],
            draft_vocab_size=8192,
            aux_layer_ids=[2, 15, 27],
            block_size=BLOCK,
            mask_token_id=16,
            dtype="float32",
        )
        drafter = DFlashDrafter(config)
        drafter.attach_verifier_embeddings(torch.randn(LAYER["vocab_size"], LAYER["hidden_size"]) * 0.02)
        for count in (int(n) for n in args.anchors.split(",")):
            anchors = [draw_anchors(p.loss_mask, p.document_ids, BLOCK - 1, count, i) for i, p in enumerate(packs)]
            times: dict[str, list[float]] = {"dense": [], "chunked": []}
            difference = 0.0
            for repeat in range(args.repeats + 1):  # (the first is a warm-up)
                dense_seconds, dense_out = forward_backward(drafter, packs, anchors, True, autocast)
                chunked_seconds, chunked_out = forward_backward(drafter, packs, anchors, False, autocast)
                if repeat:
                    times["dense"].append(dense_seconds)
                    times["chunked"].append(chunked_seconds)
                for a, b in zip(dense_out, chunked_out, strict=True):
                    difference = max(difference, (a - b).abs().max().item())
            dense, chunked = statistics.median(times["dense"]), statistics.median(times["chunked"])
            print(
                f"| {layers} | {count} | {dense:.3f} | {chunked:.3f} | **{dense / chunked:.2f}x** | {difference:.2e} |"
            )


if __name__ == "__main__":
    main()
