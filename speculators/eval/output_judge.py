"""The lossless comparison of the two servers' greedy outputs: token ids prompt by prompt, and where they
part, the judge's verdict (`OutputJudge`, speculators.eval.lossless's rule): a numerical near-tie of the
verifier, or diverged, decided from the baseline server's own logits or a transformers re-score."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from speculators.errors import SpeculatorsError
from speculators.eval.evaluate import pixel_inputs
from speculators.eval.lossless import LosslessJudge, top_two
from speculators.serving.engine import gpu_count
from speculators.verifier.architectures import adapter_for
from speculators.verifier.loading import (
    dtype_from_name,
    load_verifier,
    load_verifier_config,
    mistral_hub_params,
    resolve_verifier_source,
)
from speculators.verifier.quantization import path_noise, vllm_dtype
from speculators.verifier.vision import request_images

if TYPE_CHECKING:
    from speculators.verifier.loading import Verifier

# The share of a device's memory the re-score's weights may take (the rest: activations, the CUDA context).
RESCORE_MEMORY_SHARE = 0.9
GIB = 2**30
# The baseline server's largest logits per output position that the judge reads (greedy_outputs' top_logits).
JUDGE_TOP_LOGITS = 20  # vLLM's default --max-logprobs
SERVED_TIE_ULPS = 8  # two implementations (vLLM's kernels, transformers') each round by up to ~4 ulps


class OutputJudge(LosslessJudge):
    """Why two served outputs for one prompt differ. At the first differing token id, the verifier's
    logits there decide, by the lossless judge's rule (speculators.eval.lossless: if both tokens' logits
    are within the tie tolerance of its top logit, the flip is a numerical near-tie; otherwise the
    outputs diverged). The logits come from the baseline server itself where it reported them
    (`served_top`: its raw logits at that position, whose context is the common prefix), so no copy of
    the verifier is loaded: a 70B-675B verifier fits only the GPUs its servers ran on. Where they cannot
    decide (the other token is not among the reported ones and the last of them lies within the
    tolerance; an FP8 verifier's split beyond it, which needs its evaluation-order noise,
    quantization.path_noise), or without them, the verifier is run in transformers on the served
    prompt ids plus the common prefix, on the GPUs when there are any (the servers have stopped by then)
    or the CPU; where its weights (counted from its config) cannot fit that placement, the split is left
    not judged (counted as diverged) with one line naming the re-score that could not run (rescore_refusal).
    The default tolerance is SERVED_TIE_ULPS ulps of the top logit: the servers' logits and
    a re-score's come from different kernels, so their rounding errors add up (measured: up to 5 bf16
    ulps on SmolLM2). With an FP8 verifier the re-score runs the same FP8 arithmetic."""

    def __init__(
        self,
        verifier: str,
        dtype: str,
        tie_tolerance: float | None = None,
        tie_ulps: int = SERVED_TIE_ULPS,
        quantization: str | None = None,
        max_chunk: int = 1,
    ):

        # The servers' dtype (an FP8 verifier's is bf16) and the same FP8 arithmetic (quantization.Fp8Linear).
        self.dtype: str = vllm_dtype(dtype, quantization)
        super().__init__(self.dtype, tie_tolerance, tie_ulps)
        self.source, self.quantization = verifier, quantization
        self.max_chunk = max_chunk  # the speculator server verifies up to K+1 tokens a pass (path_noise)
        self.verifier: Verifier | None = None
        self.refusal: str | None = None  # why the re-score cannot place the verifier (placement_refusal)
        self.refusal_checked = False

    def __call__(
        self,
        prompt_ids: list[int],
        baseline_ids: list[int],
        speculator_ids: list[int],
        messages: list[dict[str, Any]] | None = None,
        served_top: list[list[list[float]]] | None = None,
    ) -> dict[str, Any]:
        """`messages`: the request's, whose images (image_url data URLs) a vision-language verifier sees;
        `served_top`: the baseline server's largest logits per output position (greedy_outputs)."""
        import torch

        position = self.split(baseline_ids, speculator_ids)
        if position is None:  # one output is a prefix of the other: nothing to attribute to a near-tie
            return {"status": "diverged", "position": min(len(baseline_ids), len(speculator_ids))}
        if served_top is not None and position < len(served_top):
            verdict = self.from_served_logits(served_top[position], baseline_ids, speculator_ids, position)
            if verdict is not None:
                return verdict
        if self.verifier is None:
            refusal = self.placement_refusal()
            if refusal is not None:
                served = (baseline_ids[position], speculator_ids[position])
                return {
                    "status": "diverged",
                    "position": position,
                    "reason": f"not judged: the transformers re-score of tokens {served[0]} / {served[1]} at output "
                    f"position {position} could not run: {refusal}",
                }
            try:
                self.verifier = load_verifier(
                    self.source, dtype=self.dtype, device="auto", quantization=self.quantization
                )
            except SpeculatorsError as error:  # an FP8 verifier transformers cannot reproduce (an MoE family)
                if not self.quantization:
                    raise
                return {"status": "diverged", "position": position, "reason": f"not judged: {error}"}
        with torch.inference_mode():
            context = [*prompt_ids, *baseline_ids[:position]]
            vision = pixel_inputs(self.verifier, context, request_images(messages or []))
            device = self.verifier.model.device
            vision = {k: v.to(device) for k, v in (vision or {}).items()}
            logits = self.verifier.model(input_ids=torch.tensor([context], device=device), **vision).logits[0, -1:]
            logits = logits.float().cpu()
        top, top_logit, second, _ = top_two(logits)[0]
        # How far each served token's logit lies below the verifier's top one (0 for the top token itself).
        served = (baseline_ids[position], speculator_ids[position])
        below_top = [top_logit - logits[0, token].item() for token in served]
        tolerance = self.tolerance_at(top_logit)
        noise = None
        if self.quantization and max(below_top) > tolerance:  # an FP8 verifier's own noise at this point
            noise = path_noise(self.verifier.model, context, max_chunk=self.max_chunk)
            tolerance = max(tolerance, noise)
        return self.verdict(position, served, below_top, tolerance, [top, second], "transformers re-score", noise)

    def placement_refusal(self) -> str | None:
        """Why the re-score cannot place the verifier on this machine (rescore_refusal), decided once from
        its config before any weight is read; None where it fits or its size cannot be told."""
        if not self.refusal_checked:
            self.refusal_checked = True
            weights = verifier_weight_bytes(self.source, self.dtype)
            if weights is not None:
                whole = read_whole_into_host(self.source)
                self.refusal = rescore_refusal(weights, gpu_memory(), host_memory_available(), whole)
            if self.refusal:
                print(f"[bench] lossless judge: no transformers re-score: {self.refusal}", flush=True)
        return self.refusal

    def from_served_logits(
        self, top: list[list[float]], baseline_ids: list[int], speculator_ids: list[int], position: int
    ) -> dict[str, Any] | None:
        """The verdict from the baseline server's largest logits at the split, or None where they cannot
        give it (see the class)."""
        logits = {int(token): value for token, value in top}
        top_logit, top_two = top[0][1], [int(token) for token, _ in top[:2]]
        tolerance = self.tolerance_at(top_logit)
        served = (baseline_ids[position], speculator_ids[position])
        if served[0] not in logits:  # the baseline's own greedy token is always among them
            return None
        below_top = [top_logit - logits[served[0]]]
        if served[1] in logits:
            below_top.append(top_logit - logits[served[1]])
        elif top_logit - top[-1][1] <= tolerance:
            return None  # somewhere below the last reported logit, which is itself within the tolerance
        else:
            return {
                "status": "diverged",
                "position": position,
                "below_top": [below_top[0], None],  # the speculator's token: below every reported logit
                "below_top_at_least": top_logit - top[-1][1],
                "tolerance": tolerance,
                "baseline_token": served[0],
                "speculator_token": served[1],
                "verifier_top_two": top_two,
                "judged_from": "served logits",
            }
        if max(below_top) > tolerance and self.quantization:
            return None  # beyond the tolerance an FP8 verifier's own noise decides: a re-score
        return self.verdict(position, served, below_top, tolerance, top_two, "served logits")

    def verdict(
        self,
        position: int,
        served: tuple[int, int],
        below_top: list[float],
        tolerance: float,
        top_two: list[int],
        judged_from: str,
        noise: float | None = None,
    ) -> dict[str, Any]:
        """The report's entry for a split: a near-tie when both served tokens lie within `tolerance` of the
        verifier's top logit (the judge's status), else diverged."""
        return {
            "status": self.status(below_top, tolerance),
            "position": position,
            "margin": abs(below_top[0] - below_top[1]),
            "below_top": below_top,
            "tolerance": tolerance,
            "path_noise": noise,
            "baseline_token": served[0],
            "speculator_token": served[1],
            "verifier_top_two": top_two,
            "judged_from": judged_from,
        }


def compare_served_outputs(
    baseline: list[dict[str, Any]], speculator: list[dict[str, Any]], judge: OutputJudge
) -> dict[str, Any]:
    """Token ids prompt by prompt: identical, a numerical near-tie (the judge's verdict) or diverged."""
    if [o["messages"] for o in baseline] != [o["messages"] for o in speculator]:
        raise SpeculatorsError("the two servers' greedy outputs are for different prompts; this is a bug")
    differences = []
    for base, spec in zip(baseline, speculator, strict=True):
        if base["token_ids"] == spec["token_ids"]:
            continue
        verdict: dict[str, Any] = {"status": "diverged", "reason": "the servers tokenized the prompt differently"}
        if base["prompt_token_ids"] == spec["prompt_token_ids"]:
            verdict = judge(
                base["prompt_token_ids"], base["token_ids"], spec["token_ids"], base["messages"], base.get("top_logits")
            )
        content = base["messages"][-1]["content"]
        text = content if isinstance(content, str) else " ".join(p.get("text", "[image]") for p in content)
        differences.append({"prompt": text[:80], **verdict})
    return {
        "compared": len(baseline),
        "identical": len(baseline) - len(differences),
        "near_tie": sum(d["status"] == "near_tie" for d in differences),
        "diverged": sum(d["status"] == "diverged" for d in differences),
        "differences": differences,
    }


def verifier_weight_bytes(source: str, dtype: str) -> int | None:
    """The verifier's weights in `dtype`, counted on the meta device from its config (nothing is allocated or
    read); None where transformers cannot build the model from its config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config, _ = load_verifier_config(source)
        auto = AutoModelForImageTextToText if adapter_for(config.model_type).vision_language else AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)
    except (SpeculatorsError, ValueError, OSError, KeyError, RuntimeError):
        return None
    return sum(p.numel() for p in model.parameters()) * dtype_from_name(dtype).itemsize


def read_whole_into_host(source: str) -> bool:
    """Whether load_verifier reads the checkpoint into host memory whole and then onto one GPU: Mistral's
    format (the others spread over every GPU with a device map)."""
    try:
        kind, location = resolve_verifier_source(source)
        return kind == "mistral" or (kind == "hub" and mistral_hub_params(location) is not None)
    except SpeculatorsError:
        return False


def gpu_memory() -> list[int]:
    """Bytes of each GPU this process sees (after the servers stopped: it initialises CUDA)."""
    import torch

    return [torch.cuda.get_device_properties(i).total_memory for i in range(gpu_count())]


def host_memory_available() -> int:
    """The host's available memory in bytes (/proc/meminfo); very large where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def rescore_refusal(weights: int, gpus: list[int], host_available: int, whole_in_host: bool) -> str | None:
    """Why the transformers re-score cannot hold a verifier of `weights` bytes, or None where it can: with
    GPUs, on all of them (a device map), or on one after reading it whole into host memory (`whole_in_host`,
    Mistral's format); without, in host memory. Each may hold RESCORE_MEMORY_SHARE of its memory."""
    size = f"its weights ({weights / GIB:,.1f} GiB)"
    if whole_in_host and weights > RESCORE_MEMORY_SHARE * host_available:
        return (
            f"{size} are read whole into host memory ({host_available / GIB:,.1f} GiB available) in its Mistral "
            f"format; judge from the served logits, or give the judge a Hugging Face copy of the verifier"
        )
    if gpus:
        budget, where = (gpus[0], "one GPU") if whole_in_host else (sum(gpus), f"the {len(gpus)} GPUs together")
        if weights > RESCORE_MEMORY_SHARE * budget:
            return f"{size} do not fit {where} ({budget / GIB:,.1f} GiB) beside the activations"
        return None
    if weights > RESCORE_MEMORY_SHARE * host_available:
        return f"{size} do not fit this host's {host_available / GIB:,.1f} GiB of available memory (no GPU)"
    return None
