"""The lossless judge: is a speculative output the verifier's own greedy output?

One rule for every check here (`speculators evaluate`'s two decoders in transformers, `speculators
bench`'s two vLLM servers): identical token ids; or, at the first position where they differ, a
numerical near-tie of the verifier: both tokens' logits lie within the tie tolerance of its top logit
there (verifying K+1 tokens at once rounds differently from decoding one at a time, so two candidates
that close may swap); anything else diverged, which is a bug. The tolerance is an explicit value, or
`tie_ulps` units in the last place of the top logit in the verifier's dtype (default_tie_tolerance).

Where the logits at the split come from is each caller's own: evaluate reads both decoders' top two
at that position (evaluate.compare_outputs), bench (compare_served_outputs) the baseline server's reported logits or a
transformers re-score (output_judge.OutputJudge), and an FP8 verifier's evaluation-order noise may widen the
tolerance (quantization.path_noise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_TIE_ULPS = 4
TIE_CANDIDATES = 8  # logits kept per generated token for the judge (top_candidates)


def top_two(logits: torch.Tensor) -> list[tuple[int, float, int, float]]:
    """(top id, its logit, second id, its logit) per row of [T, V] logits. Every decoder and judge takes
    its token from here, so exact ties (common in bf16) break the same way."""
    values, ids = logits.float().topk(2, dim=-1)
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [(int(i[0]), float(v[0]), int(i[1]), float(v[1])) for i, v in rows]


def top_candidates(logits: torch.Tensor, count: int = TIE_CANDIDATES) -> list[list[tuple[int, float]]]:
    """The `count` largest (id, logit) per row of [T, V] logits: what the judge reads when a split's token is
    not the other decoder's second (bf16 rounds logits near 20 to steps of 0.125, so three or more tokens can
    tie at the top, and either decoder may pick any of them)."""
    values, ids = logits.float().topk(min(count, logits.shape[-1]), dim=-1)
    rows = zip(ids.tolist(), values.tolist(), strict=True)  # (tolist: Python ints and floats)
    return [list(zip(row_ids, row_values, strict=True)) for row_ids, row_values in rows]


def default_tie_tolerance(dtype: torch.dtype, logit: float, ulps: int = DEFAULT_TIE_ULPS) -> float:
    """`ulps` units in the last place of the top logit in the verifier's dtype (bf16 at 20: 0.125)."""
    import math

    import torch

    exponent = math.floor(math.log2(abs(logit))) if logit else 0
    return ulps * torch.finfo(dtype).eps * 2.0 ** max(exponent, 0)


class LosslessJudge:
    """The rule of this module for a verifier computing in `dtype` (a torch dtype or its name): where two
    outputs split (`split`), the tie tolerance at a top logit (`tolerance_at`: `tie_tolerance` when
    given, else `tie_ulps` ulps of that logit) and the verdict (`status`) from how far each of the two
    tokens' logits lies below the verifier's top logit at the split."""

    def __init__(self, dtype: torch.dtype | str, tie_tolerance: float | None = None, tie_ulps: int = DEFAULT_TIE_ULPS):
        self.dtype, self.tie_tolerance, self.tie_ulps = dtype, tie_tolerance, tie_ulps

    @staticmethod
    def split(expected: Sequence[int], actual: Sequence[int]) -> int | None:
        """The first position at which the two outputs' token ids differ; None where they agree as far as
        the shorter one goes (identical, or one stopped where the other did not: nothing a near-tie explains)."""
        return next((i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b), None)

    def tolerance_at(self, top_logit: float) -> float:
        if self.tie_tolerance is not None:
            return self.tie_tolerance
        import torch

        dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
        return default_tie_tolerance(dtype, top_logit, self.tie_ulps)

    @staticmethod
    def status(below_top: Sequence[float], tolerance: float) -> str:
        """`near_tie` when every token's logit lies within `tolerance` below the top logit, else `diverged`."""
        return "near_tie" if max(below_top) <= tolerance else "diverged"
