#!/usr/bin/env bash
# Downloads into DIR (default .whl, git-ignored) the wheels scripts/gpu_suite.sh installs on a GPU machine that has
# no network and runs CPython 3.12 with torch, triton, transformers, grpcio, protobuf, pytest and numpy already:
# the engine's and the services' other dependencies at the versions of ./.venv where they are pure Python, xgrammar
# with the tvm-ffi seen working on Hopper, py-spy for PYSPY=1 stages. FLASHINFER=1 adds flashinfer (its kernels
# compile at first use). Further packages: extra arguments (NAME or NAME==VERSION; their dependencies not fetched).
# The carried tree is capped at 64 MiB: `du -sh DIR` is printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}; shift || true
mkdir -p "$dir"
venv_pin() {  # NAME -> NAME==VERSION as installed in .venv (NAME alone when it is not)
  local v; v=$(.venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1" 2>/dev/null)
  if [ -n "$v" ]; then echo "$1==$v"; else echo "$1"; fi
}
pure=(grpcio protobuf msgspec pyzmq gguf fastapi starlette uvicorn annotated-doc redis hiredis grpcio-health-checking
  grpcio-reflection googleapis-common-protos opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
  opentelemetry-proto opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
  opentelemetry-instrumentation opentelemetry-instrumentation-grpc pytest-timeout sniffio
  pydantic pydantic-core annotated-types typing-inspection uvloop httptools)
specs=()
for name in "${pure[@]}"; do specs+=("$(venv_pin "$name")"); done
specs+=(xgrammar==0.2.8 apache-tvm-ffi==0.1.11 py-spy)
[ -n "${FLASHINFER:-}" ] && specs+=(flashinfer-python==0.6.7.post3 cuda-tile nvidia-cudnn-frontend)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --platform manylinux_2_5_x86_64 -d "$dir" "${specs[@]}" "$@"
du -sh "$dir"
