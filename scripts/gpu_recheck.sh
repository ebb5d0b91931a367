#!/usr/bin/env bash
# The GPU tests that failed in the first H100 run of the merged features (2026-11-25), each file in its
# own process, then the headline figures of scripts/gpu_suite.sh: 8B batch-1 decode and offline 500.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
STAGES=none bash scripts/gpu_suite.sh > /dev/null 2>&1   # wheels and the package layout, as the suite sets them up
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export RADIXMESH_CACHE_DIR=/tmp/radixmesh-cache RADIXMESH_TEST_TOKENIZER_DIR=$PWD/.gpu-model
t() { timeout "$1" python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -rfE "${@:2}"; }
{
  t 150 tests/gpu/test_mm_gpu.py -k "qwen2_vl-graphs or qwen2_5_vl-graphs or qwen2_vl-chunked"
  t 100 tests/gpu/test_hicache_gpu.py -k "test_scheduler_with_graphs"
  t 60 tests/gpu/test_hot_path_gpu.py -k "test_grammar_rows_stay_sync_free"
  t 120 tests/gpu/test_fp8_gpu.py -k "like_eager or matches_quantization_at_load"
} > "$OUT/recheck-tests.log" 2>&1
grep -E "passed|failed|^FAILED|^ERROR" "$OUT/recheck-tests.log"
RM="python3 -m radixmesh.cli"
timeout 120 $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 256 \
  --context-length 8192 --cuda-graph-max-bs 8 --result-file "$OUT/one-batch.jsonl" > "$OUT/one-batch.log" 2>&1
tail -3 "$OUT/one-batch.log"
timeout 230 $RM bench offline --model-shape llama-3.1-8b --num-prompts 500 --random-input-len 4096 \
  --random-output-len 2048 --random-range-ratio 0.0 --context-length 8192 --result-file "$OUT/offline.jsonl" \
  > "$OUT/offline.log" 2>&1
grep -E "output_throughput|duration_s" "$OUT/offline.log" | head -3
