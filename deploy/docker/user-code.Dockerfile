# The Dagster user-code image: the code location (gRPC server) and the run workers it launches.
# No CUDA: heavy steps run in the GPU workload image, one pod per step (Pipes).
# Build from the repository root:  docker build -f deploy/docker/user-code.Dockerfile -t speculators-user-code:0.1.0 .
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DAGSTER_HOME=/opt/dagster/dagster_home

WORKDIR /opt/speculators
# torch from the CPU index first (the project depends on it; the code location never imports it).
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md workspace.yaml deploy/docker/constraints.txt ./
COPY speculators ./speculators
COPY speculators_assets ./speculators_assets
RUN pip install -c constraints.txt . && mkdir -p "$DAGSTER_HOME"

EXPOSE 3030
# The Helm chart passes dagsterApiGrpcArgs; this default serves the same code location standalone.
CMD ["dagster", "api", "grpc", "--module-name", "speculators_assets", "--attribute", "defs", "--host", "0.0.0.0", "--port", "3030"]
