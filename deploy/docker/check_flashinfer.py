"""Build-time check of the GPU workload image: FlashInfer's precompiled kernels are installed, at the version of
flashinfer-python (the one vLLM pins). vLLM turns FlashInfer off without flashinfer-cubin unless nvcc and ninja
are there (vllm/utils/flashinfer.py, has_flashinfer), and this image has no nvcc; on Hopper and later it also
wants flashinfer-jit-cache wherever FlashInfer publishes one for torch's CUDA (12.9 and later), else FlashInfer
compiles kernels at first use, which needs nvcc too.

  python check_flashinfer.py 0.7.0.post1     # exit 1 with one line per problem
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version


def public(text: str) -> str:
    """A version without its local label (flashinfer-jit-cache's `+cu129`)."""
    return text.split("+", 1)[0]


def kernel_problems(wanted: str, installed: Callable[[str], str], cuda: str | None) -> list[str]:
    """What is missing or mismatched for FlashInfer `wanted` with torch built for CUDA `cuda`."""
    packages = ["flashinfer-python", "flashinfer-cubin"]
    if cuda is not None and tuple(int(part) for part in cuda.split(".")[:2]) >= (12, 9):
        packages.append("flashinfer-jit-cache")
    problems = []
    for name in packages:
        try:
            found = public(installed(name))
        except PackageNotFoundError:
            problems.append(f"{name} is not installed; run `vllm download-kernels` after installing vLLM")
            continue
        if found != wanted:
            problems.append(f"{name} is {found}, not {wanted}: FlashInfer refuses kernels of another version")
    return problems


def main() -> None:
    import torch

    problems = kernel_problems(sys.argv[1], version, torch.version.cuda)
    for problem in problems:
        print(f"check_flashinfer: {problem}", file=sys.stderr)
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
