#!/usr/bin/env bash
# The GPU tests and benchmarks in one call, for a CUDA machine with torch and triton but no
# network (wheels for the rest are carried in .whl, fetched by ../shared/tools/fetch-gpu-wheels.sh
# plus msgspec pyzmq gguf pytest pluggy iniconfig). Results go to $OUT as JSON.
#   STAGES="tests kernel one-batch offline compare" bash scripts/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/site /tmp/pkg
STAGES=${STAGES:-"tests kernel one-batch"}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
# the package layout without an install step: radixmesh = services/, radixmesh.kernels = kernels/
rm -rf /tmp/pkg/radixmesh /tmp/pkg/loadtests
cp -r services /tmp/pkg/radixmesh && cp -r kernels /tmp/pkg/radixmesh/kernels && cp -r loadtests /tmp/pkg/loadtests
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer RADIXMESH_CACHE_DIR=/tmp/radixmesh-cache
RM="python3 -m radixmesh.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.txt"

for stage in $STAGES; do
  echo "=== stage $stage"
  case $stage in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -40
      python3 -m pytest -q -p no:cacheprovider tests/unit/test_triton_kernels.py 2>&1 | tail -5 ;;
    kernel)
      python3 -m radixmesh.kernels.bench_decode --batch 64 --seq-len 2048 --heads 32 --kv-heads 8 --head-dim 128 \
        --dtype bf16 | tee "$OUT/kernel.json" ;;
    one-batch)
      for shape in llama-3.2-1b llama-3.1-8b; do
        $RM bench one-batch --model-shape "$shape" --batch-size 1 --input-len 1024 --output-len 256 \
          --context-length 8192 --result-file "$OUT/one-batch.jsonl" 2>&1 | tail -3
      done ;;
    offline)
      $RM bench offline --model-shape llama-3.1-8b --num-prompts 500 --random-input-len 4096 --random-output-len 2048 \
        --random-range-ratio 0.0 --context-length 8192 --result-file "$OUT/offline.jsonl" 2>&1 | tail -3 ;;
    compare)
      common="--model-shape llama-3.1-8b --num-prompts ${COMPARE_PROMPTS:-200} --random-input-len 2048 \
        --random-output-len 1024 --random-range-ratio 0.0 --context-length 8192 --result-file $OUT/compare.jsonl"
      $RM bench offline $common 2>&1 | tail -1
      $RM bench offline $common --disable-overlap-schedule 2>&1 | tail -1
      $RM bench offline $common --disable-cuda-graph 2>&1 | tail -1
      $RM bench offline $common --disable-cuda-graph --attention-backend flashinfer 2>&1 | tail -1 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
ls -la "$OUT"
