#!/usr/bin/env bash
# Install radixmesh and serve the default model (SmolLM2-135M-Instruct) over HTTP: the OpenAI
# API under /v1 and SGLang's native API, on CUDA when available, else CPU. Extra arguments go
# to `radixmesh serve` (e.g. --port 8080 --model /path/to/hf-dir).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh run
exec .venv/bin/radixmesh serve "$@"
