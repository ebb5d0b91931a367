#!/usr/bin/env bash
# Install radixmesh and run it on the default model (SmolLM2-135M-Instruct, CPU or GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh run
exec .venv/bin/radixmesh generate --prompt "${PROMPT:-What is the capital of France?}" --temperature 0 "$@"
