#!/usr/bin/env bash
# The GPU tests and benchmarks in one call, for a CUDA machine with torch and triton but no
# network (wheels for the rest are carried in .whl, fetched by ../shared/tools/fetch-gpu-wheels.sh
# plus msgspec pyzmq gguf pytest pluggy iniconfig py-spy, and for the services fastapi starlette uvicorn
# annotated-doc redis hiredis grpcio grpcio-health-checking grpcio-reflection protobuf googleapis-common-protos and the
# opentelemetry api, sdk, semantic-conventions, proto, exporter-otlp-proto-grpc, exporter-otlp-proto-common,
# exporter-otlp-common, instrumentation and instrumentation-grpc at the versions of .venv; xgrammar needs
# apache-tvm-ffi; flashinfer and cudnn-frontend only for --attention-backend flashinfer (64 MiB in all);
# the default model's tokenizer files in .gpu-model,
# copied there by scripts/gpu_tokenizer_model.py --stage; Redis for the services in .gpu-redis, staged by
# scripts/gpu_redis.sh). Results go to $OUT as JSON.
#   STAGES="tests hot-path kernel one-batch offline profile-offline online services trace-split compare grpc-api" bash scripts/gpu_suite.sh
#   STAGES=serve-vs-services TIMEOUT_serve_vs_services=580: serve and the services on the same workloads (issue 18;
#   SVS_WORKLOADS, SVS_CLUSTER_ARGS e.g. "--gateway-args='--detokenize service'"; SVS_EXTRA="direct embedded
#   embedded-async embedded-approx router-async router-grpc direct-grpc" adds gateways straight to the worker, routing
#   in their own process, through a second router whose index lookups are awaited, or with Generate over gRPC on
#   both hops (no lanes) or on the direct hop)
#   STAGES=tp STAGE_TIMEOUT_S=600 bash scripts/gpu_suite.sh     # tensor parallelism: needs 2 GPUs (tp-bench, tp-custom)
#   STAGES="tp-tests tp-70b" then STAGES=tp-70b-offline TIMEOUT_tp_70b_offline=580 (70B shape at TP 2, two H200s)
#   FP8 (issue 21): STAGES="fp8-tests fp8-kernel fp8-one-batch fp8-capacity fp8-accuracy fp8-offline" bash scripts/gpu_suite.sh
#   Issue 50 in one call on two GPUs (the FP8 sweep and FP8 vs bf16 offline on one, the text workload's TTFT through
#   serve and the services on the other):
#     STAGES=pair PAIR0="fp8-decode-sweep" PAIR1="online services fp8-fused-tests" ONLINE_PROMPTS=80 \
#       TIMEOUT_pair=595 TIMEOUT_fp8_decode_sweep=590 TIMEOUT_online=330 TIMEOUT_services=200 bash scripts/gpu_suite.sh
#   STAGES=front-end (issue 50, CPU only, ~1 minute): serve's front end per prompt over a stub scheduler, 1 and 4
#   tokenizer threads (`radixmesh bench front-end`); then STAGES=online for the TTFT of both workloads
#   STAGES="mm-tests images" bash scripts/gpu_suite.sh     (multimodal: LLaVA / Qwen2-VL)
#   STAGES="pd-tests pd-transfer pd-goodput" (two GPUs: P/D); a stage's own time limit: TIMEOUT_<stage>=S (- as _)
#   KV over NIXL (issue 49; the NIXL wheel in .whl: bash scripts/nixl_gpu_wheel.sh, 12.5 MiB):
#   STAGES="pd-nixl-transfer pd-nixl-tests" TIMEOUT_pd_nixl_transfer=580, then
#   STAGES=pd-goodput PD_TRANSPORT=nixl TIMEOUT_pd_goodput=590 (PD_UCX_TLS=tcp,cuda_copy: the workers' UCX over TCP;
#   PD_CONFIGS=a or b: one of the two clusters per call)
#   STAGES=faults TIMEOUT_faults=600 (two GPUs, issue 51): kill -9 and rolling restart under load, 8B shape workers
#   STAGES="hicache" (one GPU); STAGES="peer-fetch" needs two GPUs (it says "skipped" with one)
#   STAGES="spec-tests spec-same spec-unrelated spec-unrelated-raw spec-ngram" bash scripts/gpu_suite.sh (speculation)
#   STAGES=spec-oracle TIMEOUT_spec_oracle=420: issue 47's targets (oracle drafts at a 1B draft's cost, acceptance 1.0 /
#   0.7; own-weights draft); STAGES=spec-eagle: random 8B-shape EAGLE / EAGLE-3 heads (a cycle's cost, exactness), as
#   chains (3 steps) and as trees (top-4, 3 steps, 8 draft tokens), then the tree-mask kernel tests on the GPU
#   STAGES=lora: LoRA adapters in the engine (GPU tests, then `bench lora`: 16 adapters in a batch of 32 vs the base;
#   LORA_KERNELS="auto rows" TIMEOUT_lora=590: the bench once per decode kernel set; LORA_OVERLAP="side on off": the mixed
#   batch once per --lora-overlap setting in each bench run, against the same base figures; LORA_PROFILE=1: also the
#   kernel tables of batch-1 decode steps without and with an adapter, --profile-bs1)
#   STAGES="lora-tests lora-pdl-mutants lora-layer1 lora-bs1" LORA_WIDTHS="32 64 128 256": issue 46's batch 1 alone (the
#   PDL test of the epilogue GEMVs and two broken kernel copies it must catch; one layer per epilogue width; `bench lora
#   --profile-bs1`); STAGES=moe-mixtral (two GPUs): Mixtral-8x7B EP 2 vs TP 2 at batches 1 and 64 alone
#   STAGES="moe-kernels lora-kernels" TIMEOUT_moe_kernels=590: the MoE and batched-LoRA kernels (issues 48, 46): GPU
#   tests, the CPU kernel tests compiled, the benchmarks (MoE tile sweep at MOE_SWEEP_MS) and a table of each at the end
#   STAGES=moe-small TIMEOUT_moe_small=590 (issue 48, one GPU): the MoE small-batch path vs the sorted one per M and
#   its tile sweep (bench_moe_small); STAGES=moe-small-decode: Qwen3-30B-A3B batch-1 decode with each path
#   (RADIXMESH_MOE_PATH=sorted, then auto; MOE_DECODE_PATHS="auto block": the whole-block kernel against today's);
#   STAGES=moe-block: the whole-block kernel's GPU tests and its bench against the four-launch chain
#   STAGES=attn-block: the one-launch attention half's GPU tests and its bench (check, trace, sweep) against today's
#   launches; STAGES=attn-block-decode: batch-1 decode of ATTN_DECODE_SHAPES (default qwen3-30b-a3b) with
#   RADIXMESH_ATTN_BLOCK set to each of ATTN_DECODE_MODES (default "off on")
#   STAGES=moe TIMEOUT_moe=590 (issue 48, two GPUs, about 6 minutes): Qwen3-30B-A3B batch-1 decode against its bandwidth
#   floor (active experts + attention + embeddings over the measured copy bandwidth), the 500-prompt offline run of
#   Qwen3-30B-A3B (with --profile: the MoE kernels' share) beside the dense Qwen3-8B's on the other GPU at the same
#   time, then Mixtral-8x7B on both GPUs at EP 2 and at TP 2 (experts sliced), batches 1 and 64; a table at the end
#   (MOE_PROMPTS: offline prompts, default 500), and Mixtral at EP 2 with --enable-dp-attention (eager).
#   STAGES="qwen3-fusion-tests qwen3-gemv qwen3-fusion" TIMEOUT_qwen3_gemv=590 (issue 48, one GPU): Qwen3's batch-1
#   fusions (q/k norms in the q/k/v GEMV, the router with its norm): GPU tests, the GEMV sets with a sweep
#   (QWEN3_GEMV_SETS="qwen3-30b-a3b qwen3-8b"), Qwen3-30B-A3B batch-1 decode with and without --disable-gemv-fusion
#   STAGES=moe-tests: the MoE model GPU tests (two GPUs for EP 2). STAGES=moe-dp TIMEOUT_moe_dp=590 (two GPUs): EP 2 with
#   and without data-parallel attention, both eager, Qwen3-30B-A3B and Mixtral-8x7B at batches 1, 16 and 64
#   STAGES=decode-sweep: decode attention's split counts, tiles and grid orders at the offline run's batch sizes
#   STAGES=extend-rows: the extend kernel's new-token K/V read from their own rows vs their slots, both block orders,
#   and its tiles
#   STAGES="extend-kernel prefill-profile": where a prefill's time goes (the extend kernel's tiles against torch SDPA,
#   one 8B prefill's kernels and host phases, with and without --enable-dense-prefill)
#   STEP_TRACE=1 STAGES=online: also the scheduler's step timeline, summed up per request (scripts/step_trace_summary.py)
#   REQUEST_TRACE=1 (with STEP_TRACE=1): also the front end's request trace, and each request's TTFT phase by phase
#   from the client's send to its first text (scripts/request_timeline.py -> online[-TAG]-WORKLOAD-timeline.json)
#   ONLINE_TAG=x SERVE_ARGS=--disable-launch-pacing STAGES=online: the online results land in online-x-WORKLOAD.json (a
#   second call's online-WORKLOAD.json would replace the first one's while $OUT holds too few files to be packed); compare
#   two such runs request by request with `radixmesh bench paired online-random.json online-x-random.json`
#   TREE=dir: run another tree's package (dir/services, dir/kernels, dir/loadtests) with this suite, e.g. the tree
#   before a refactor, on the same machine (issue 44):
#     git archive main services kernels loadtests | (mkdir -p base && tar -x -C base)   # before the upload
#     for t in base . base .; do TREE=$t ONLINE_TAG=$(basename $(realpath $t)) OUT=out/$(basename $(realpath $t)) \
#       STAGES="one-batch offline online" TIMEOUT_offline=580 bash scripts/gpu_suite.sh; done
#   then compare out/*/one-batch.jsonl and offline.jsonl, and `radixmesh bench paired` the two online-*-random.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/site
STAGES=${STAGES:-"tests hot-path kernel one-batch"}
# (once per machine and wheel set: two suites started side by side on two GPUs share /tmp/site)
wheel_stamp=/tmp/site/.wheels-$(ls .whl 2>/dev/null | sha256sum | cut -c1-16)
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -f "$wheel_stamp" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  touch "$wheel_stamp"
fi
# the package without an install step: radixmesh = services/radixmesh, radixmesh.kernels = kernels/radixmesh/kernels
# (TREE: another tree's package, run by this suite)
TREE=$(realpath "${TREE:-$PWD}")
echo "package from $TREE"
export PYTHONPATH=$TREE/services:$TREE/kernels:$TREE:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# (PYTHONSAFEPATH: `python -m` must not put the working directory first, where this tree's loadtests would shadow
# TREE's)
export PYTHONSAFEPATH=1
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer RADIXMESH_CACHE_DIR=/tmp/radixmesh-cache
export RADIXMESH_TEST_TOKENIZER_DIR=${TOKENIZER_DIR:-$PWD/.gpu-model}
RM="python3 -m radixmesh.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.txt"

STAGE_TIMEOUT_S=${STAGE_TIMEOUT_S:-240}
stage_limit() {  # stage_limit STAGE: TIMEOUT_<stage> when set; for online, the server's start (90 s) plus each
  # workload's send time (prompts / rate) and 60 s of tail, so the default two workloads of 100 prompts finish (the
  # flat 240 s cut the second one off, 2026-12-01); else STAGE_TIMEOUT_S
  local own; own=$(eval echo "\${TIMEOUT_${1//-/_}:-}")
  if [ -n "$own" ]; then echo "$own"; return; fi
  if [ "$1" = online ]; then
    local n; n=$(echo ${ONLINE_WORKLOAD:-${ONLINE_WORKLOADS:-random random-ids}} | wc -w)
    python3 -c "import math; print(90 + $n * (math.ceil(${ONLINE_PROMPTS:-100} / ${ONLINE_RATE:-1}) + 60))"
    return
  fi
  echo "$STAGE_TIMEOUT_S"
}
# PYSPY=1: the online and services stages sample every process of the server with py-spy (carried in
# .whl) for PYSPY_S seconds; raw stacks land in $OUT/pyspy-<stage>.tar.gz (summarise with scripts/pyspy_summary.py).
spy() {  # spy STAGE NAME=PID ...
  [ -n "${PYSPY:-}" ] || return 0
  local stage=$1; shift
  mkdir -p /tmp/pyspy-$stage
  for np in "$@"; do
    "${PYSPY_BIN:-/tmp/site/bin/py-spy}" record -p "${np#*=}" -f raw -r 100 -d "${PYSPY_S:-100}" -o "/tmp/pyspy-$stage/${np%%=*}.txt" \
      > /dev/null 2>&1 &
    SPY_PIDS="${SPY_PIDS:-} $!"
  done
}
spy_collect() {  # spy_collect STAGE: wait for the samplers, pack their stacks
  [ -n "${PYSPY:-}" ] || return 0
  wait $SPY_PIDS 2>/dev/null; SPY_PIDS=""
  tar czf "$OUT/pyspy-$1.tar.gz" -C /tmp "pyspy-$1"
}
nixl_env() {  # NIXL's UCX CUDA module needs libcudart.so.13: the one torch's wheel brings (nvidia/cu13/lib)
  local nv
  nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null) || return 0
  [ -d "$nv/cu13/lib" ] && export LD_LIBRARY_PATH="$nv/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  python3 -c 'import nixl_cu13' 2>/dev/null || echo "NIXL is not importable: put it in .whl (bash scripts/nixl_gpu_wheel.sh)"
}
run_stage() {  # every stage is time-boxed and logged whole under $OUT
  local stage=$1
  echo "=== stage $stage"
  case $stage in
    tests)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_triton_kernels_gpu.py \
        tests/gpu/test_fused_kernels_gpu.py
      # the CPU kernel tests run on the GPU too (compiled, not interpreted)
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_fused_kernels.py \
        tests/unit/test_decode_inputs_kernel.py tests/unit/test_argmax_kernel.py tests/unit/test_triton_kernels.py \
        tests/unit/test_gemv_kernel.py tests/unit/test_gemv_fused_kernel.py tests/unit/test_gemv_rope_kernel.py \
        tests/unit/test_tp_kernels.py \
        tests/unit/test_kv_host_kernels.py \
        -k "not scheduler"
      # the one-shot all-reduce kernel over CUDA IPC between two processes (on one GPU here)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_custom_all_reduce_gpu.py ;;
    gpu-tests)  # every GPU test file, newest features first, without stopping at a failure (10 minutes at most)
      python3 -m pytest -v -p no:cacheprovider -m gpu --timeout 240 -rfE tests/gpu/test_fp8_gpu.py \
        tests/gpu/test_speculative_gpu.py tests/gpu/test_spec_graphs_gpu.py tests/gpu/test_mm_gpu.py tests/gpu/test_hicache_gpu.py \
        tests/gpu/test_custom_all_reduce_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_hot_path_gpu.py \
        tests/gpu/test_triton_kernels_gpu.py tests/gpu/test_fused_kernels_gpu.py tests/gpu/test_kv_transfer_gpu.py \
        tests/gpu/test_tensor_parallel_gpu.py tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py \
        tests/gpu/test_lora_engine_gpu.py tests/gpu/test_lora_overlap_gpu.py tests/gpu/test_lora_gemv_pdl_gpu.py ;;
    pdl-tests)  # programmatic dependent launch: decode kernel chains in graphs vs without PDL, engine vs transformers
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/gpu/test_pdl_gpu.py tests/gpu/test_engine_gpu.py
      python3 -m pytest -q -p no:cacheprovider -rfE tests/unit/test_gemv_rope_kernel.py tests/unit/test_gemv_fused_kernel.py ;;
    prefill-graph-tests)  # one-request prefills through CUDA graphs against eager passes (float32 and FP8 pools), then
      # the hot-path checks and the engine against transformers with the graphs on (their default);
      # TIMEOUT_prefill_graph_tests=400 (150 s ran out within the engine tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_graph_capture_gpu.py \
        tests/gpu/test_prefill_graphs_gpu.py tests/gpu/test_hot_path_gpu.py tests/gpu/test_engine_gpu.py ;;
    decode-stream-tests)  # prefills beside running decode steps (two streams) against one stream, then the
      # hot-path checks (the two streams are on by default there; prefill-graph-tests runs the engine tests too)
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_decode_stream_gpu.py \
        tests/gpu/test_hot_path_gpu.py ;;
    engine-tests)
      python3 -m pytest -v -x -p no:cacheprovider -m gpu tests/gpu/test_engine_gpu.py ;;
    hot-path)  # no implicit host-device sync in scheduling, launch, sampling, results (graphs + overlap)
      python3 -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_hot_path_gpu.py ;;
    kernel)
      python3 -m radixmesh.kernels.bench_decode --batch 64 --seq-len 2048 --heads 32 --kv-heads 8 --head-dim 128 \
        --dtype bf16
      # batch-1 decode in a graph at the one-batch benchmark's mean length: launched splits vs time
      for dim in 128 64; do for splits in 32 16 8 5 3; do
        python3 -m radixmesh.kernels.bench_decode --batch 1 --seq-len 1152 --heads 32 --kv-heads 8 --head-dim $dim \
          --dtype bf16 --cuda-graph --num-kv-splits $splits
      done; done ;;
    decode-sweep)  # decode attention at the offline run's batches (lengths 256-6,144, mean ~3,200): split counts,
      # tiles and grid orders on the same inputs; then the default with each request's slots in one run
      for bs in 168 112 48; do
        python3 -m radixmesh.kernels.bench_decode --batch $bs --min-seq-len 256 --seq-len 6144 --sweep \
          --warmup 5 --iters 60 | tee -a "$OUT/decode-sweep.jsonl"
      done
      python3 -m radixmesh.kernels.bench_decode --batch 168 --min-seq-len 256 --seq-len 6144 --slots contiguous \
        | tee -a "$OUT/decode-sweep.jsonl" ;;
    decode-small)  # the same at the small batches of online serving, in CUDA graphs as the engine runs them
      for bs in 4 8 16 32; do
        python3 -m radixmesh.kernels.bench_decode --batch $bs --min-seq-len 256 --seq-len 6144 --sweep --cuda-graph \
          --sweep-tiles 64,4,2 --sweep-splits 2 3 5 9 16 24 32 --warmup 5 --iters 100 | tee -a "$OUT/decode-small.jsonl"
      done
      for splits in 33 64; do  # one long request
        python3 -m radixmesh.kernels.bench_decode --batch 1 --seq-len 32768 --cuda-graph --num-kv-splits $splits \
          | tee -a "$OUT/decode-small.jsonl"
      done ;;
    extend-rows)  # the extend kernel reading the new tokens' K/V from their own rows vs through their slots, and
      # its query blocks heaviest first vs in order (default tiles, checked against the reference), then the tiles
      # (this replaced the stage extend-order, which timed the two orders alone)
      python3 -m radixmesh.kernels.bench_extend --new-len 1024 2048 3072 4096 --check | tee "$OUT/extend-rows.jsonl"
      python3 -m radixmesh.kernels.bench_extend --new-len 1024 --requests 4 --prefix-len 512 --check \
        | tee -a "$OUT/extend-rows.jsonl"
      python3 -m radixmesh.kernels.bench_extend --new-len 2048 4096 --sweep | tee -a "$OUT/extend-rows.jsonl" ;;
    extend-kernel)  # prefill attention: the Triton kernel's tiles (default and a sweep) vs torch SDPA's backends
      python3 -m radixmesh.kernels.bench_extend --new-len 1024 2048 4096 --sweep --sdpa | tee "$OUT/extend-kernel.jsonl"
      python3 -m radixmesh.kernels.bench_extend --new-len 4096 --requests 2 --prefix-len 1024 --sweep \
        | tee -a "$OUT/extend-kernel.jsonl"
      # what a prompt length never seen before costs each library (cuDNN builds a plan per shape)
      python3 -m radixmesh.kernels.bench_extend --new-len 2048 --churn 8 | tee -a "$OUT/extend-kernel.jsonl" ;;
    extend-ab)  # the extend kernel of this tree against another revision's file (EXTEND_BASE_FILE, e.g. from
      # `git show REV:kernels/radixmesh/kernels/extend_attention.py`), every tile of the sweep, checked, both in turn
      for kfile in "" "${EXTEND_BASE_FILE:?EXTEND_BASE_FILE names the other kernel file}"; do
        python3 -m radixmesh.kernels.bench_extend --new-len 1024 2048 3072 4096 --sweep --check \
          ${kfile:+--kernel-file "$kfile"} | tee -a "$OUT/extend-ab.jsonl"
        python3 -m radixmesh.kernels.bench_extend --new-len 1024 --requests 4 --prefix-len 512 --sweep --check \
          ${kfile:+--kernel-file "$kfile"} | tee -a "$OUT/extend-ab.jsonl"
      done ;;
    prefill-gemm)  # a prefill's four 8B projections through cuBLAS at every M from 1,024 to 4,096 (step 64): as the model
      # runs them, on M rounded up to 128 / 256, with the weight stored transposed, through cuBLASLt (where the rate dips)
      # (then, every 256 rows, PyTorch's TunableOp: the fastest GEMM solution it finds per shape)
      python3 -m radixmesh.kernels.bench_prefill_gemm --rows ${PREFILL_GEMM_ROWS:-1024:4160:64} \
        | tee "$OUT/prefill-gemm.jsonl"
      python3 -m radixmesh.kernels.bench_prefill_gemm --rows ${PREFILL_GEMM_TUNED_ROWS:-1024:4160:256} \
        --variants linear tuned | tee -a "$OUT/prefill-gemm.jsonl" ;;
    prefill-profile)  # one 8B request's prefill alone at the online workload's lengths: wall, kernels by kind;
      # with the Triton kernel alone (the default), then with cuDNN's attention for long prompts
      for extra in "" --enable-dense-prefill; do
        $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 512 1024 2048 3072 4096 \
          --output-len 8 --context-length 8192 --profile-prefill --result-file "$OUT/prefill-profile.jsonl" $extra
      done ;;
    gemv)  # batch-1 linear layers of the 1B and 8B shapes: our GEMV (default and best of a sweep) vs cuBLAS
      python3 -m radixmesh.kernels.bench_gemv --sweep | tee "$OUT/gemv.jsonl" ;;
    gemv-fused)  # the batch-1 GEMVs as a step launches them (plain, gated, rope), default tiles vs a sweep
      # (TIMEOUT_gemv_fused=560; FP8 8B first, then the TP 2 shards, then bf16 8B)
      for args in "--sets llama-3.1-8b --weights fp8" "--sets llama-3.1-8b-tp2" "--sets llama-3.1-8b --weights bf16"; do
        python3 -m radixmesh.kernels.bench_gemv_fused $args --sweep | tee -a "$OUT/gemv-fused.jsonl"
      done ;;
    one-batch)  # ONE_BATCH_SHAPES (default "llama-3.2-1b llama-3.1-8b"); FUSION_BASELINE=1: also the 8B without the
      # GEMV prologue fusion (--disable-gemv-fusion);
      # PDL_BASELINE=1: also the 8B without programmatic dependent launch (--disable-pdl)
      for run in ${ONE_BATCH_SHAPES:-llama-3.2-1b llama-3.1-8b} ${FUSION_BASELINE:+llama-3.1-8b:--disable-gemv-fusion} \
          ${PDL_BASELINE:+llama-3.1-8b:--disable-pdl}; do
        $RM bench one-batch --model-shape "${run%%:*}" --batch-size 1 --input-len 1024 --output-len 256 \
          --context-length 8192 --cuda-graph-max-bs 8 --profile-graph --result-file "$OUT/one-batch.jsonl" \
          $([ "${run#*:}" != "$run" ] && echo "${run#*:}")
      done ;;
    offline)  # the 500-prompt offline workload (OFFLINE_SHAPE: another model shape, OFFLINE_PROMPTS, OFFLINE_ARGS)
      $RM bench offline --model-shape ${OFFLINE_SHAPE:-llama-3.1-8b} --num-prompts ${OFFLINE_PROMPTS:-500} --random-input-len 4096 --random-output-len 2048 \
        --random-range-ratio 0.0 --context-length 8192 --result-file "$OUT/offline.jsonl" ${OFFLINE_ARGS:-} ;;
    online)  # SGLang's online-latency workload through `serve`: 100 prompts at 1 req/s, in <= 4,096, out <= 2,048.
      # ONLINE_WORKLOADS (default "random random-ids") run one after the other on one server, each with 2 warm-up
      # requests and the prefix cache flushed first (the same seed's text and ids share tokens), into
      # online[-TAG]-WORKLOAD.json: `random` (text the server tokenizes, as SGLang's CI sends it) is
      # the headline figure; `random-ids` (token ids in) the line without tokenization. ONLINE_WORKLOAD=W: W alone.
      # ONLINE_WORKLOADS="random random-text-ids random-ids" adds `random`'s text sent as the server's ids of it: the
      # same prompts token for token, so its pairing with `random` (text-vs-text-ids.json) is the text path's cost
      # alone; random-ids' prompts are a few percent shorter, and TTFT is convex in length (text-vs-ids.json).
      # The first server on a fresh machine is slower (its first 20 requests +21 ms; benchmarks README, eleventh
      # session): compare settings on one machine after a first run, or per request on the same prompts.
      # (ONLINE_SHAPE, ONLINE_IN, ONLINE_OUT: another model shape and lengths, e.g. to try the stage on a CPU)
      runs=$(( $(cat /tmp/radixmesh-online-runs 2>/dev/null || echo 0) + 1 )); echo $runs > /tmp/radixmesh-online-runs
      echo "online run $runs on this machine${SERVE_ARGS:+ (serve args: $SERVE_ARGS)}"
      model=$(python3 scripts/gpu_tokenizer_model.py ${ONLINE_SHAPE:-llama-3.1-8b} "${TOKENIZER_DIR:-.gpu-model}" \
        /tmp/smol-vocab-${ONLINE_SHAPE:-llama-3.1-8b})
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      trace=""  # STEP_TRACE=1: the scheduler's per-step timeline (RADIXMESH_STEP_TRACE), summed up below
      [ -n "${STEP_TRACE:-}" ] && trace="$OUT/step-trace${ONLINE_TAG:+-$ONLINE_TAG}-{pid}.jsonl"
      rtrace=""  # REQUEST_TRACE=1: the front end's per-request timeline (RADIXMESH_REQUEST_TRACE), joined below
      [ -n "${REQUEST_TRACE:-}" ] && rtrace="$OUT/request-trace${ONLINE_TAG:+-$ONLINE_TAG}-{pid}.jsonl"
      RADIXMESH_STEP_TRACE="$trace" RADIXMESH_REQUEST_TRACE="$rtrace" $RM serve --model "$model" --load-format dummy --context-length 8192 --port "$port" \
        ${SERVE_ARGS:-} > "$OUT/online${ONLINE_TAG:+-$ONLINE_TAG}-server.log" 2>&1 &
      server=$!
      for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null || ! kill -0 $server 2>/dev/null && break; sleep 1; done
      spy online "front=$server" $(for p in $(pgrep -P $server); do echo "child-$p=$p"; done)
      for w in ${ONLINE_WORKLOAD:-${ONLINE_WORKLOADS:-random random-ids}}; do
        echo "online workload $w"
        $RM bench serving --backend sglang --port "$port" --workload "$w" --num-prompts ${ONLINE_PROMPTS:-100} \
          --random-input-len ${ONLINE_IN:-4096} --random-output-len ${ONLINE_OUT:-2048} --random-range-ratio 0.0 --request-rate ${ONLINE_RATE:-1} \
          --warmup-requests 2 --disable-tqdm --tokenizer "$model" --flush-cache \
          --output-file "$OUT/online${ONLINE_TAG:+-$ONLINE_TAG}-$w.json"
      done
      spy_collect online
      # the scheduler's own counters: how many prefills ran beside a decode step (the decode stream is on), retractions
      curl -sf "http://127.0.0.1:$port/server_info" | python3 -c 'import json, sys; d = json.load(sys.stdin)
print("server counters:", {k: v for k, v in sorted(d.items()) if k.startswith(("num_prefills_", "num_releases_"))
                           or k in ("num_retractions", "num_forward_passes")})' || echo "no /server_info"
      kill -INT $server; wait $server
      pre="$OUT/online${ONLINE_TAG:+-$ONLINE_TAG}"  # text against ids request by request: TTFT and slope differences
      if [ -f "$pre-random.json" ] && [ -f "$pre-random-ids.json" ]; then
        $RM bench paired "$pre-random-ids.json" "$pre-random.json" --output-file "$pre-text-vs-ids.json"
      fi
      if [ -f "$pre-random.json" ] && [ -f "$pre-random-text-ids.json" ]; then  # the same prompts: text path alone
        $RM bench paired "$pre-random-text-ids.json" "$pre-random.json" --output-file "$pre-text-vs-text-ids.json"
      fi
      for f in $(ls "$OUT"/step-trace${ONLINE_TAG:+-$ONLINE_TAG}-*.jsonl 2>/dev/null); do
        python3 scripts/step_trace_summary.py "$f" --json "${f%.jsonl}-summary.json"
      done
      # each request's TTFT phase by phase, client to scheduler and back (scripts/request_timeline.py)
      fronts=$(ls "$OUT"/request-trace${ONLINE_TAG:+-$ONLINE_TAG}-*.jsonl 2>/dev/null)
      steps=$(ls "$OUT"/step-trace${ONLINE_TAG:+-$ONLINE_TAG}-*[0-9].jsonl 2>/dev/null | head -1)
      for w in ${fronts:+${ONLINE_WORKLOAD:-${ONLINE_WORKLOADS:-random random-ids}}}; do
        echo "request timeline, $w"
        python3 scripts/request_timeline.py "$pre-$w.json" --front $fronts ${steps:+--steps "$steps"} \
          --json "$pre-$w-timeline.json"
      done ;;
    front-end)  # issue 50: serve's front-end time per prompt (request -> the scheduler holds its token ids) on this
      # host's CPU, over a stub scheduler (no GPU): text, chat and ids at 1k and 4k tokens, the tokenizer pool at one
      # thread (every prompt encoded whole) and at FRONT_END_WORKERS (default 4: long prompts in pieces on 4 threads)
      model=$(python3 scripts/gpu_tokenizer_model.py ${ONLINE_SHAPE:-llama-3.1-8b} "${TOKENIZER_DIR:-.gpu-model}" \
        /tmp/smol-vocab-${ONLINE_SHAPE:-llama-3.1-8b})
      # FRONT_END_PIECES="1536 768": the 4k prompts again at each shortest piece (RADIXMESH_TOKENIZE_MIN_PIECE_CHARS)
      # on FRONT_END_WORKERS threads, into front-end-w<workers>-p<chars>.json
      for workers in 1 ${FRONT_END_WORKERS:-4}; do
        echo "front end, --tokenizer-workers $workers"
        $RM bench front-end --model "$model" --num-prompts ${FRONT_END_PROMPTS:-40} --tokenizer-workers $workers \
          --output-file "$OUT/front-end-w$workers.json"
      done
      for chars in ${FRONT_END_PIECES:-}; do
        echo "front end, --tokenizer-workers ${FRONT_END_WORKERS:-4}, pieces of >= $chars characters"
        RADIXMESH_TOKENIZE_MIN_PIECE_CHARS=$chars $RM bench front-end --model "$model" \
          --num-prompts ${FRONT_END_PROMPTS:-40} --tokenizer-workers ${FRONT_END_WORKERS:-4} \
          --output-file "$OUT/front-end-w${FRONT_END_WORKERS:-4}-p$chars.json"
      done ;;
    services|trace-split)
      # services: the online workload through gateway -> tokenizer -> router -> worker (Redis), SERVICES_WORKLOADS
      # (default: random: text, which the gateway tokenizes with its copy of the tokenizer) into services-WORKLOAD.json;
      # SERVICES_GATEWAY_ARGS: the gateway's flags (e.g. "--tokenize service": every prompt through the tokenizer
      # service), SERVICES_TAG=x: into services-x-WORKLOAD.json.
      # trace-split: traced runs of the services and of serve (20 prompts each), their spans summed up by
      # scripts/trace_split.py: where the time to first token goes on each path.
      model=$(python3 scripts/gpu_tokenizer_model.py ${ONLINE_SHAPE:-llama-3.1-8b} "${TOKENIZER_DIR:-.gpu-model}" \
        /tmp/smol-vocab-${ONLINE_SHAPE:-llama-3.1-8b})
      export PATH="${REDIS_DIR:-$PWD/.gpu-redis}/bin:$PATH" \
        LD_LIBRARY_PATH="${REDIS_DIR:-$PWD/.gpu-redis}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      [ "${PD_TRANSPORT:-}" = nixl ] && nixl_env
      bench="--backend sglang --random-input-len ${ONLINE_IN:-4096} --random-output-len ${ONLINE_OUT:-2048} \
        --random-range-ratio 0.0 --request-rate ${ONLINE_RATE:-1} --warmup-requests 2 --disable-tqdm --tokenizer $model"
      up="--workers 1 --model $model --load-format dummy --worker-args=--context-length=8192 --timeout-s 400"
      if [ "$stage" = services ]; then
        url=$($RM cluster up $up --gateway-args="${SERVICES_GATEWAY_ARGS:-}" --state-dir /tmp/cluster-plain | tail -1)
        spy services $(python3 -c 'import json; s = json.load(open("/tmp/cluster-plain/state.json"))
print(" ".join(f"{n}={p}" for n, p in s["pids"].items() if n != "redis"))') \
          $(w=$(python3 -c 'import json; print(json.load(open("/tmp/cluster-plain/state.json"))["pids"]["worker-0"])'); \
            for p in $(pgrep -P $w); do echo "worker-child-$p=$p"; done)
        for w in ${SERVICES_WORKLOADS:-random}; do
          echo "services workload $w"
          $RM bench serving --base-url "$url" $bench --workload "$w" --num-prompts ${ONLINE_PROMPTS:-100} --flush-cache \
            --output-file "$OUT/services${SERVICES_TAG:+-$SERVICES_TAG}-$w.json"
        done
        spy_collect services
        $RM cluster down --state-dir /tmp/cluster-plain
        return
      fi
      python3 scripts/trace_split.py collect --port 4317 --out /tmp/spans-services.json & collector=$!
      url=$($RM cluster up $up --state-dir /tmp/cluster-traced --otlp-endpoint http://127.0.0.1:4317 | tail -1)
      $RM bench serving --base-url "$url" $bench --workload random-ids --num-prompts 20 --output-file /tmp/services-traced.json \
        | grep -E "Median (TTFT|ITL)"
      $RM cluster down --state-dir /tmp/cluster-traced
      sleep 2; kill $collector; wait $collector
      python3 scripts/trace_split.py summarize /tmp/spans-services.json --json "$OUT/split-services.json"
      python3 scripts/trace_split.py collect --port 4318 --out /tmp/spans-serve.json & collector=$!
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      $RM serve --model "$model" --load-format dummy --context-length 8192 --port "$port" \
        --otlp-endpoint http://127.0.0.1:4318 > "$OUT/serve-traced.log" 2>&1 & server=$!
      for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null || ! kill -0 $server 2>/dev/null && break; sleep 1; done
      $RM bench serving --port "$port" $bench --workload random-ids --num-prompts 20 --output-file /tmp/serve-traced.json \
        | grep -E "Median (TTFT|ITL)"
      kill -INT $server; wait $server; sleep 1; kill $collector; wait $collector
      python3 scripts/trace_split.py summarize /tmp/spans-serve.json --json "$OUT/split-serve.json" ;;
    serve-vs-services)
      # `serve`, then the services (cluster up with metrics), on the same seeded online workloads, one after the
      # other on this GPU; scripts/serve_vs_services.py writes both results side by side with the differences and
      # the router's added latency under each load. Workloads as NAME:RATE:IN:OUT:PROMPTS.
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      export PATH="${REDIS_DIR:-$PWD/.gpu-redis}/bin:$PATH" \
        LD_LIBRARY_PATH="${REDIS_DIR:-$PWD/.gpu-redis}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      [ "${PD_TRANSPORT:-}" = nixl ] && nixl_env
      workloads=${SVS_WORKLOADS:-"rate1:1:4096:2048:100 rate8:8:2048:512:300"}
      svs_bench() {  # svs_bench "TARGET FLAGS" OUTPUT NAME:RATE:IN:OUT:PROMPTS GATEWAY_METRICS_URL
        local n rate in out num; IFS=: read -r n rate in out num <<< "$3"
        local gw="$OUT/gw-$(basename "$2" .json)"  # the front end's TTFT and TTFT-overhead histograms around the run
        curl -s "$4" | grep -E '^(# (HELP|TYPE) )?radixmesh_(ttft_overhead|time_to_first_token)_seconds' > "$gw-before.txt"
        $RM bench serving $1 --backend sglang --workload random-ids --random-input-len "$in" --random-output-len "$out" \
          --random-range-ratio 0.0 --request-rate "$rate" --num-prompts "$num" --warmup-requests 2 --disable-tqdm \
          --tokenizer "$model" --output-file "$2" | grep -E "Median (TTFT|ITL)"
        curl -s "$4" | grep -E '^(# (HELP|TYPE) )?radixmesh_(ttft_overhead|time_to_first_token)_seconds' > "$gw-after.txt"
      }
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      $RM serve --model "$model" --load-format dummy --context-length 8192 --port "$port" ${SERVE_ARGS:-} \
        > "$OUT/svs-serve.log" 2>&1 & server=$!
      for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null || ! kill -0 $server 2>/dev/null && break; sleep 1; done
      for w in $workloads; do echo "serve ${w%%:*}"; svs_bench "--port $port" "$OUT/serve-${w%%:*}.json" "$w" \
        "http://127.0.0.1:$port/metrics"; done
      kill -INT $server; wait $server
      url=$($RM cluster up --workers 1 --model "$model" --load-format dummy --worker-args=--context-length=8192 \
        --timeout-s 400 --metrics --state-dir /tmp/cluster-svs ${SVS_CLUSTER_ARGS:-} | tail -1)
      router=$(python3 -c 'import json; u = json.load(open("/tmp/cluster-svs/state.json"))["metrics_urls"]
print([v for k, v in u.items() if k.startswith("router")][0])')
      for w in $workloads; do
        echo "services ${w%%:*}"; curl -s "$router" > "$OUT/router-${w%%:*}-before.txt"
        if [ "${w%%:*}" = "${SVS_SPY:-}" ]; then  # SVS_SPY=rate8 PYSPY=1: py-spy on every service during that load
          spy svs $(python3 -c 'import json; s = json.load(open("/tmp/cluster-svs/state.json"))
print(" ".join(f"{n}={p}" for n, p in s["pids"].items() if n != "redis"))')
        fi
        svs_bench "--base-url $url" "$OUT/services-${w%%:*}.json" "$w" "$url/metrics"
        curl -s "$router" > "$OUT/router-${w%%:*}-after.txt"
      done
      spy_collect svs
      curl -s "$url/ready" > "$OUT/svs-gateway-ready.json"
      # more gateways over the same worker, tokenizer and Redis, SVS_EXTRA="direct embedded embedded-approx": straight
      # to the worker (no router); routing in the gateway's process (--embedded-router) with the cluster's policy
      # and Redis index; the same with approx-tree (the router's own prefix tree, no Redis on the request path)
      read -r tok wk redis_url <<< "$(python3 -c 'import json; s = json.load(open("/tmp/cluster-svs/state.json"))
print(s["tokenizer_address"], s["worker_addresses"][0], s["redis_url"] or "")')"
      for arm in ${SVS_EXTRA:-}; do
        gport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        rt=""; gw_extra=()
        case $arm in
          direct) target=(--worker "$wk") ;;
          direct-grpc) target=(--worker "$wk"); gw_extra=(--generate-transport grpc) ;;
          embedded) target=(--embedded-router "--workers $wk${redis_url:+ --redis-url $redis_url}") ;;
          embedded-async) target=(--embedded-router "--workers $wk --index-lookup async${redis_url:+ --redis-url $redis_url}") ;;
          embedded-approx) target=(--embedded-router "--workers $wk --policy approx-tree") ;;
          router-async)  # a second router process on the same worker and Redis, its index lookups awaited
            rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
            mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
            $RM router --port "$rport" --metrics-port "$mport" --workers "$wk" --index-lookup async \
              ${redis_url:+--redis-url "$redis_url"} > "$OUT/svs-router-async.log" 2>&1 & rt=$!
            target=(--router "127.0.0.1:$rport") ;;
          router-grpc)  # a second router process on the same worker and Redis, Generate over gRPC on both hops
            rport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
            mport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
            $RM router --port "$rport" --metrics-port "$mport" --workers "$wk" --generate-transport grpc \
              --lane-port -1 ${redis_url:+--redis-url "$redis_url"} > "$OUT/svs-router-grpc.log" 2>&1 & rt=$!
            target=(--router "127.0.0.1:$rport"); gw_extra=(--generate-transport grpc) ;;
        esac
        $RM gateway --port "$gport" --tokenizer "$tok" "${target[@]}" "${gw_extra[@]}" > "$OUT/svs-$arm.log" 2>&1 & gw=$!
        for _ in $(seq 120); do curl -sf "http://127.0.0.1:$gport/ready" >/dev/null && break; sleep 0.5; done
        for w in $workloads; do  # the same seeded prompts again: empty the worker's cache first
          curl -s -X POST "http://127.0.0.1:$gport/flush_cache" > /dev/null; sleep 1
          [ -n "$rt" ] && curl -s "http://127.0.0.1:$mport/metrics" > "$OUT/rt-$arm-${w%%:*}-before.txt"
          echo "$arm ${w%%:*}"; svs_bench "--base-url http://127.0.0.1:$gport" "$OUT/$arm-${w%%:*}.json" "$w" \
            "http://127.0.0.1:$gport/metrics"
          [ -n "$rt" ] && curl -s "http://127.0.0.1:$mport/metrics" > "$OUT/rt-$arm-${w%%:*}-after.txt"
        done
        kill -INT $gw; wait $gw
        [ -n "$rt" ] && { kill -INT $rt; wait $rt; }
      done
      $RM cluster down --state-dir /tmp/cluster-svs
      python3 scripts/serve_vs_services.py "$OUT" $(for w in $workloads; do echo "${w%%:*}"; done) \
        --out "$OUT/serve-vs-services.json" ;;
    grpc-hop)  # the floor under the services path: one gRPC hop of a streamed request, nothing else running
      python3 scripts/grpc_hop_bench.py --out "$OUT/grpc-hop.json" ;;
    grpc-api)  # what the public gRPC API adds over HTTP on one `serve` (8B shape): paired, interleaved requests
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      gport=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
      $RM serve --model "$model" --load-format dummy --context-length 8192 --port "$port" --grpc-port "$gport" \
        > "$OUT/grpc-api-server.log" 2>&1 & server=$!
      for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null || ! kill -0 $server 2>/dev/null && break; sleep 1; done
      $RM bench grpc-vs-http --port "$port" --grpc-target "127.0.0.1:$gport" --num-pairs 40 --prompt-words 256 \
        --output-len 64 --output-file "$OUT/grpc-vs-http.json"
      $RM bench grpc-vs-http --port "$port" --grpc-target "127.0.0.1:$gport" --num-pairs 40 --prompt-words 256 \
        --output-len 64 --chat --output-file "$OUT/grpc-vs-http-chat.json"
      kill -INT $server; wait $server ;;
    profile-offline)  # the offline workload with every batch timed on the device and kernel windows traced
      $RM bench offline --model-shape ${OFFLINE_SHAPE:-llama-3.1-8b} --num-prompts ${OFFLINE_PROMPTS:-500} --random-input-len 4096 \
        --random-output-len 2048 --random-range-ratio 0.0 --context-length 8192 --profile \
        --result-file "$OUT/offline-profile.jsonl" ${OFFLINE_ARGS:-} ;;
    compare)
      common="--model-shape llama-3.1-8b --num-prompts ${COMPARE_PROMPTS:-200} --random-input-len 2048 \
        --random-output-len 1024 --random-range-ratio 0.0 --context-length 8192 --result-file $OUT/compare.jsonl"
      $RM bench offline $common
      $RM bench offline $common --disable-overlap-schedule
      $RM bench offline $common --disable-cuda-graph
      $RM bench offline $common --disable-cuda-graph --attention-backend flashinfer ;;
    structured)  # JSON-schema decoding vs unconstrained at batch 64; jump-forward on and off (forward passes)
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      common="--model $model --load-format dummy --num-prompts 64 --input-len 512 --max-new-tokens 256 \
        --context-length 4096 --result-file $OUT/structured.jsonl"
      $RM bench structured $common --schema person --profile-host
      $RM bench structured $common --schema long-keys --profile-host
      $RM bench structured $common --schema long-keys --enable-jump-forward ;;
    tp)  # 2 GPUs: TP 2 vs TP 1 (tests), NCCL all-reduce at decode sizes, 8B batch-1 decode at TP 1 and 2
      run_stage tp-bench && run_stage tp-custom
      python3 -m pytest -v -x -p no:cacheprovider -m gpu tests/gpu/test_tensor_parallel_gpu.py ;;
    tp-bench)  # 2 GPUs: 8B batch-1 decode at TP 1 and TP 2 over NCCL (first: the tests below have hung at teardown)
      gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
      if [ "$gpus" -lt 2 ]; then echo "stage $stage needs 2 GPUs; $gpus visible: skipped"; return 1; fi
      for args in "--tp-size 1" "--tp-size 2"; do
        $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 128 \
          --context-length 8192 --cuda-graph-max-bs 8 $args --result-file "$OUT/tp-one-batch.jsonl"
      done ;;
    tp-pair)  # 2 GPUs: 8B batch-1 decode, TP 1 vs TP 2 with the custom all-reduce (FUSION_BASELINE=1: also both unfused;
      # PDL_BASELINE=1: also both without programmatic dependent launch)
      runs="1: 2:--enable-custom-all-reduce"
      [ -n "${FUSION_BASELINE:-}" ] && runs="$runs 1:--disable-gemv-fusion 2:--enable-custom-all-reduce,--disable-gemv-fusion"
      [ -n "${PDL_BASELINE:-}" ] && runs="$runs 1:--disable-pdl 2:--enable-custom-all-reduce,--disable-pdl"
      for run in $runs; do
        $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 128 \
          --context-length 8192 --cuda-graph-max-bs 8 --tp-size "${run%%:*}" $(echo "${run#*:}" | tr , ' ') \
          --result-file "$OUT/tp-one-batch.jsonl"
      done ;;
    tp-custom)  # 2 GPUs: the custom all-reduce kernel (tests, all-reduce sizes vs NCCL), then TP 2 decode with it
      python3 -m pytest -v -x -p no:cacheprovider -m gpu tests/gpu/test_custom_all_reduce_gpu.py \
        && python3 -m radixmesh.engine.distributed.bench_allreduce --tp-size 2 --hidden 4096 --rows 1 4 16 64 256 \
          --custom --result-file "$OUT/tp-allreduce.jsonl" \
        && $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 128 \
          --context-length 8192 --cuda-graph-max-bs 8 --tp-size 2 --enable-custom-all-reduce \
          --result-file "$OUT/tp-one-batch.jsonl" ;;
    tp-tests)  # 2 GPUs: TP 2 vs TP 1 greedy tokens, then the custom all-reduce kernel's tests
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/gpu/test_tensor_parallel_gpu.py \
        tests/gpu/test_custom_all_reduce_gpu.py ;;
    tp-70b)  # 2 GPUs: Llama-3.1-70B shape at TP 2 (custom all-reduce): each GPU's copy bandwidth and the all-reduce of
      # one 8192-wide row, then batch-1 decode with its steps' kernels profiled (the all-reduce share of a step)
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      python3 -m radixmesh.engine.distributed.bench_allreduce --tp-size 2 --hidden 8192 --rows 1 4 16 64 --custom \
        --result-file "$OUT/tp70b-allreduce.jsonl" \
        && $RM bench one-batch --model-shape llama-3.1-70b --batch-size 1 --input-len 1024 --output-len 128 \
          --context-length 8192 --cuda-graph-max-bs 8 --tp-size 2 --enable-custom-all-reduce --profile-graph \
          --result-file "$OUT/tp70b-one-batch.jsonl" ;;
    tp-70b-offline)  # 2 GPUs: the 500-prompt offline workload on the Llama-3.1-70B shape at TP 2 (TIMEOUT_tp_70b_offline=580)
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      $RM bench offline --model-shape llama-3.1-70b --tp-size 2 --enable-custom-all-reduce \
        --num-prompts ${OFFLINE_PROMPTS:-500} --random-input-len 4096 --random-output-len 2048 --random-range-ratio 0.0 \
        --context-length 8192 --result-file "$OUT/tp70b-offline.jsonl" ;;
    fp8-tests)  # FP8 kernels vs their references (compiled) and FP8 engine paths on small random models
      python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/gpu/test_fp8_gpu.py -s
      python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_kernels.py ;;
    fp8-kernel)  # 8B layer shapes: bf16 cuBLAS vs torch._scaled_mm vs the Triton FP8 GEMM per M; FP8 GEMV at M = 1
      python3 -m radixmesh.kernels.bench_fp8 ${FP8_KERNEL_ARGS:-} | tee "$OUT/fp8-kernel.jsonl" ;;  # FP8_KERNEL_ARGS=--gemv-sweep
    fp8-one-batch)  # 8B batch-1 decode with FP8 weights (target >= 300 tok/s), then with FP8 weights + FP8 KV
      for run in auto fp8_e4m3 ${FUSION_BASELINE:+auto:--disable-gemv-fusion} ${PDL_BASELINE:+auto:--disable-pdl}; do
        $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 --input-len 1024 --output-len 256 \
          --context-length 8192 --cuda-graph-max-bs 8 --quantization fp8 --kv-cache-dtype "${run%%:*}" --profile-graph \
          --result-file "$OUT/fp8-one-batch.jsonl" $([ "${run#*:}" != "$run" ] && echo "${run#*:}")
      done ;;
    fp8-offline)  # the offline workload with FP8 weights + FP8 KV (target >= 4,300 output tok/s)
      $RM bench offline --model-shape ${OFFLINE_SHAPE:-llama-3.1-8b} --num-prompts ${OFFLINE_PROMPTS:-500} --random-input-len 4096 \
        --random-output-len 2048 --random-range-ratio 0.0 --context-length 8192 --quantization fp8 \
        --kv-cache-dtype fp8_e4m3 --result-file "$OUT/fp8-offline.jsonl" ${OFFLINE_ARGS:-} ;;
    fp8-fused-tests)  # issue 50: the FP8 quantizing norm/SiLU kernels and the FP8 decode widenings and tiles, compiled
      python3 -m pytest -q -rfE -p no:cacheprovider -m gpu tests/gpu/test_fp8_fused_gpu.py
      python3 -m pytest -q -p no:cacheprovider tests/unit/test_fp8_fused_kernels.py tests/unit/test_fp8_kernels.py ;;
    fp8-decode-sweep)  # issue 50: decode attention over an FP8 KV pool at the offline run's batches (lengths 256-6,144):
      # tiles (SWEEP_TILES_FP8) x widenings (f32, direct, f16) at the engine's split count and one split, each checked
      # against the reference; bf16 at its defaults on the same inputs for the bandwidth. Then the best (bench_decode
      # --pick, the least time over the batches) runs the offline workload with FP8 weights + FP8 KV through
      # RADIXMESH_DECODE_FP8_TILES/_WIDEN, and bf16 runs it on the same GPU: the FP8 / bf16 ratio (target >= 1.1).
      # FP8_SWEEP_BATCHES (default "256 168 64"); FP8_SWEEP_ONLY=1: the sweep alone; FP8_BASELINE=1: also FP8 offline
      # at the kernel's default tiles; FP8_MAX_RUNNING=N: also FP8 offline with N running requests (an FP8 pool holds
      # twice the tokens). About 7 minutes on an H200 (TIMEOUT_fp8_decode_sweep=590).
      for bs in ${FP8_SWEEP_BATCHES:-256 168 64}; do
        python3 -m radixmesh.kernels.bench_decode --batch $bs --min-seq-len 256 --seq-len 6144 --dtype fp8_e4m3 \
          --sweep --sweep-tiles fp8 --sweep-widen f32 direct f16 --sweep-splits 1 --grid-orders head-major --check \
          --warmup 5 --iters 40 | tee -a "$OUT/fp8-decode-sweep.jsonl"
        python3 -m radixmesh.kernels.bench_decode --batch $bs --min-seq-len 256 --seq-len 6144 --dtype bf16 \
          --warmup 5 --iters 40 | tee -a "$OUT/fp8-decode-sweep.jsonl"
      done
      best=$(python3 -m radixmesh.kernels.bench_decode --pick "$OUT/fp8-decode-sweep.jsonl") \
        || { echo "fp8-decode-sweep: no tiles measured at every batch"; return 1; }
      echo "$best" | tee "$OUT/fp8-decode-best.txt"
      [ -n "${FP8_SWEEP_ONLY:-}" ] && return 0
      offline="bench offline --model-shape llama-3.1-8b --num-prompts ${OFFLINE_PROMPTS:-500} --random-input-len 4096 \
        --random-output-len 2048 --random-range-ratio 0.0 --context-length 8192 --result-file $OUT/fp8-vs-bf16.jsonl"
      fp8="--quantization fp8 --kv-cache-dtype fp8_e4m3"
      env $best $RM $offline $fp8
      [ -n "${FP8_BASELINE:-}" ] && $RM $offline $fp8
      [ -n "${FP8_MAX_RUNNING:-}" ] && env $best $RM $offline $fp8 --max-running-requests $FP8_MAX_RUNNING \
        --cuda-graph-max-bs $FP8_MAX_RUNNING
      $RM $offline
      python3 - "$OUT/fp8-vs-bf16.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
bf16 = [r for r in rows if not r.get("quantization")]
for r in rows:
    ratio = f", {r['output_throughput_tok_s'] / bf16[-1]['output_throughput_tok_s']:.3f}x bf16" if bf16 else ""
    print(f"{r.get('quantization') or 'bf16'} KV {r['kv_cache_dtype']} tiles {r.get('decode_fp8_tiles', 'default')} "
          f"widen {r.get('decode_fp8_widen', 'f32')} running {r['max_running_requests']}: "
          f"{r['output_throughput_tok_s']:.1f} out tok/s ({r['duration_s']:.1f} s){ratio}")
PY
      ;;
    pair)  # two suites side by side on two GPUs: PAIR0="stages" on GPU 0 into $OUT/gpu0, PAIR1="stages" on GPU 1 into
      # $OUT/gpu1 (each stage bounded by its own TIMEOUT_<stage>; TIMEOUT_pair bounds both)
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      CUDA_VISIBLE_DEVICES=0 OUT="$OUT/gpu0" STAGES="${PAIR0:-}" bash scripts/gpu_suite.sh > "$OUT/pair-gpu0.log" 2>&1 &
      first=$!
      CUDA_VISIBLE_DEVICES=1 OUT="$OUT/gpu1" STAGES="${PAIR1:-}" bash scripts/gpu_suite.sh > "$OUT/pair-gpu1.log" 2>&1
      wait $first
      tail -n 40 "$OUT/pair-gpu0.log" "$OUT/pair-gpu1.log" ;;
    fp8-capacity)  # KV tokens that fit next to the 8B weights: bf16 / FP8 weights x bf16 / FP8 KV, one process each
      for variant in none/auto none/fp8_e4m3 fp8/auto fp8/fp8_e4m3; do
        $RM bench kv-capacity --model-shape llama-3.1-8b --context-length 8192 --variants $variant \
          --result-file "$OUT/fp8-capacity.jsonl"
      done ;;
    fp8-accuracy)  # FP8 weights + KV vs bf16: next-token logits of 100 random prompts, 1B and 8B shapes, real kernels
      for shape in llama-3.2-1b llama-3.1-8b; do
        $RM bench fp8-accuracy --model-shape $shape --load-format dummy --kv-cache-dtype fp8_e4m3 \
          --context-length 8192 --result-file "$OUT/fp8-accuracy.jsonl"
      done ;;
    moe-mixtral)  # issue 48's two-GPU target alone: Mixtral-8x7B at EP 2 and at TP 2, batches 1 and 64 (moe's last part;
      # MIXTRAL_DP=1: also EP 2 with --enable-dp-attention, eager), and the table
      for ep in 2 1; do
        $RM bench one-batch --model-shape mixtral-8x7b --tp-size 2 --ep-size $ep --batch-size 1 64 --input-len 1024 \
          --output-len 128 --context-length 4096 --cuda-graph-max-bs 64 --result-file "$OUT/moe-mixtral.jsonl" \
          > "$OUT/moe-mixtral-ep$ep.log" 2>&1 || tail -n 20 "$OUT/moe-mixtral-ep$ep.log"
      done
      if [ -n "${MIXTRAL_DP:-}" ]; then
        $RM bench one-batch --model-shape mixtral-8x7b --tp-size 2 --ep-size 2 --enable-dp-attention \
          --disable-cuda-graph --batch-size 1 64 --input-len 1024 --output-len 128 --context-length 4096 \
          --result-file "$OUT/moe-mixtral.jsonl" > "$OUT/moe-mixtral-dp.log" 2>&1 || tail -n 20 "$OUT/moe-mixtral-dp.log"
      fi
      python3 scripts/moe_table.py "$OUT" ;;
    moe-tests)  # Qwen3-MoE and Mixtral in CUDA graphs vs eager vs transformers, the layer vs the torch reference, FP8
      # experts, EP 2 / TP 2 vs one GPU (two GPUs)
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/gpu/test_moe_models_gpu.py ;;
    moe)  # issue 48's targets (see the header); the runs on the two GPUs overlap where they can
      offline="--num-prompts ${MOE_PROMPTS:-500} --random-input-len 4096 --random-output-len 2048 --random-range-ratio 0.0 \
        --context-length 8192"
      ( CUDA_VISIBLE_DEVICES=0 $RM bench one-batch --model-shape qwen3-30b-a3b --batch-size 1 --input-len 1024 \
          --output-len 256 --context-length 8192 --cuda-graph-max-bs 8 --bandwidth-floor --profile-graph \
          --result-file "$OUT/moe-one-batch.jsonl" > /tmp/moe-one-batch.log 2>&1
        CUDA_VISIBLE_DEVICES=0 $RM bench offline --model-shape qwen3-30b-a3b $offline --profile \
          --result-file "$OUT/moe-offline.jsonl" > /tmp/moe-offline-moe.log 2>&1 ) & moe=$!
      CUDA_VISIBLE_DEVICES=1 $RM bench offline --model-shape qwen3-8b $offline --result-file "$OUT/moe-offline.jsonl" \
        > /tmp/moe-offline-dense.log 2>&1
      wait $moe
      tail -n 3 /tmp/moe-one-batch.log /tmp/moe-offline-moe.log /tmp/moe-offline-dense.log
      for ep in 2 1; do  # Mixtral-8x7B on two GPUs: EP 2 (whole experts per GPU), then TP 2 (every expert halved)
        $RM bench one-batch --model-shape mixtral-8x7b --tp-size 2 --ep-size $ep --batch-size 1 64 --input-len 1024 \
          --output-len 128 --context-length 4096 --cuda-graph-max-bs 64 --result-file "$OUT/moe-mixtral.jsonl" \
          > /tmp/moe-mixtral-ep$ep.log 2>&1 || tail -n 20 /tmp/moe-mixtral-ep$ep.log
      done
      # EP 2 with data-parallel attention (each GPU attends over its own half of the batch; eager passes only)
      $RM bench one-batch --model-shape mixtral-8x7b --tp-size 2 --ep-size 2 --enable-dp-attention --disable-cuda-graph \
        --batch-size 1 64 --input-len 1024 --output-len 128 --context-length 4096 \
        --result-file "$OUT/moe-mixtral.jsonl" > /tmp/moe-mixtral-dp.log 2>&1 || tail -n 20 /tmp/moe-mixtral-dp.log
      python3 scripts/moe_table.py "$OUT" ;;
    moe-dp)  # data-parallel attention on two GPUs: Qwen3-30B-A3B and Mixtral-8x7B at EP 2, eager, with and without it
      # (batches 1, 16 and 64; the same --disable-cuda-graph on both sides), then the table
      for shape in qwen3-30b-a3b mixtral-8x7b; do
        for dp in "" --enable-dp-attention; do
          $RM bench one-batch --model-shape $shape --tp-size 2 --ep-size 2 $dp --disable-cuda-graph \
            --batch-size 1 16 64 --input-len 1024 --output-len 64 --context-length 4096 \
            --result-file "$OUT/moe-dp.jsonl" > /tmp/moe-dp-$shape$dp.log 2>&1 || tail -n 20 /tmp/moe-dp-$shape$dp.log
        done
      done
      python3 scripts/moe_table.py "$OUT" ;;
    moe-kernels)  # fused MoE at the Qwen3-30B-A3B and Mixtral-8x7B shapes: tests, then per M = 1..256 the layer and
      # its parts (bf16, FP8 W8A16 and W8A8, checked against moe_ref) vs the copy bandwidth, the bf16 tile sweep
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_moe_gpu.py
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_moe_kernels.py
      python3 -m radixmesh.kernels.bench_moe --check --sweep --sweep-ms ${MOE_SWEEP_MS:-1 16 64 256} \
        | tee "$OUT/moe-kernels.jsonl"
      python3 -m radixmesh.kernels.bench_moe --table "$OUT/moe-kernels.jsonl" ;;
    moe-small)  # the MoE small-batch path (issue 48): GPU tests, the CPU tests compiled, then per M = 1..16 the
      # small path vs the sorted path (Qwen3-30B-A3B, Mixtral-8x7B; bf16, FP8 W8A16; checked against moe_ref) with
      # its tile sweep at MOE_SWEEP_MS (default 1 4) for MOE_SMALL_SWEEP_WEIGHTS (default bf16); MOE_SMALL_SWEEP=0: no
      # sweep; MOE_SMALL_ARGS: more arguments of the bench (e.g. "--shapes qwen3-30b-a3b --ms 1 2 4 8")
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_moe_small_gpu.py
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_moe_small.py
      python3 -m radixmesh.kernels.bench_moe_small --check ${MOE_SMALL_ARGS:-} \
        $([ "${MOE_SMALL_SWEEP:-1}" = 1 ] && echo --sweep --sweep-ms ${MOE_SWEEP_MS:-1 4} \
          --sweep-weights ${MOE_SMALL_SWEEP_WEIGHTS:-bf16}) | tee "$OUT/moe-small.jsonl"
      python3 -m radixmesh.kernels.bench_moe_small --table "$OUT/moe-small.jsonl" ;;
    qwen3-fusion-tests)  # Qwen3's batch-1 fusions (issue 48): the q/k norms inside the q/k/v + rotary + KV-store GEMV,
      # the MoE router with the post-attention norm, the q/k norms + rotary + KV store inside the decode attention;
      # engine vs transformers, fused vs unfused, the kernels at real shapes, then the CPU kernel tests compiled
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_qwen3_fusion_gpu.py tests/gpu/test_decode_rope_gpu.py
      python3 -m pytest -q -p no:cacheprovider -rfE tests/unit/test_gemv_rope_kernel.py tests/unit/test_gemv_norm_out_kernel.py \
        tests/unit/test_decode_rope.py ;;
    qwen3-gemv)  # the batch-1 GEMVs of QWEN3_GEMV_SETS (default qwen3-30b-a3b; also qwen3-8b) in bf16, default tiles and a
      # sweep (the tiles at K=2048), the fused q/k/v and router next to the launches they replace (*-split)
      python3 -m radixmesh.kernels.bench_gemv_fused --sets ${QWEN3_GEMV_SETS:-qwen3-30b-a3b} --weights bf16 --sweep \
        | tee -a "$OUT/qwen3-gemv.jsonl" ;;
    qwen3-fusion)  # Qwen3-30B-A3B batch-1 decode against its bandwidth floor per RADIXMESH_QWEN3_FUSION setting
      # (QWEN3_FUSION_SETTINGS, default "router 1 0": the router with its norm alone as by default, both fusions,
      # neither), each with the graph's kernel profile
      for fusion in ${QWEN3_FUSION_SETTINGS:-router 1 0}; do  # RADIXMESH_QWEN3_FUSION values (router: that one alone)
        RADIXMESH_QWEN3_FUSION=$fusion $RM bench one-batch --model-shape qwen3-30b-a3b --batch-size 1 --input-len 1024 \
          --output-len 256 --context-length 8192 --cuda-graph-max-bs 8 --bandwidth-floor --profile-graph \
          --result-file "$OUT/qwen3-fusion-one-batch.jsonl" > /tmp/qwen3-fusion$fusion.log 2>&1 \
          || tail -n 20 /tmp/qwen3-fusion$fusion.log
        tail -n 3 /tmp/qwen3-fusion$fusion.log
      done ;;
    moe-block)  # the whole MoE block of one token in one persistent kernel (issue 48): GPU tests, the CPU tests
      # compiled, then per layer the four-launch chain vs the block kernel with a sweep (bench_moe_block)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_moe_block_gpu.py
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_moe_block.py
      python3 -m radixmesh.kernels.bench_moe_block --check ${MOE_BLOCK_ARGS:---sweep} | tee "$OUT/moe-block.jsonl" ;;
    attn-block)  # the attention half of a decode token in one persistent kernel (issue 48): GPU tests, the CPU tests
      # compiled, then per layer today's launches vs the block (bench_attn_block: check, trace, sweep)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_attn_block_gpu.py
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_attn_block.py
      python3 -m radixmesh.kernels.bench_attn_block ${ATTN_BLOCK_ARGS:---check --trace --sweep} \
        | tee "$OUT/attn-block.jsonl" ;;
    attn-block-decode)  # batch-1 decode with RADIXMESH_ATTN_BLOCK at each of ATTN_DECODE_MODES, per shape
      for shape in ${ATTN_DECODE_SHAPES:-qwen3-30b-a3b}; do
        for mode in ${ATTN_DECODE_MODES:-off on}; do
          RADIXMESH_ATTN_BLOCK=$mode $RM bench one-batch --model-shape "$shape" --batch-size 1 --input-len 1024 \
            --output-len 256 --context-length 8192 --cuda-graph-max-bs 8 --bandwidth-floor --profile-graph \
            --result-file "$OUT/attn-block-decode.jsonl" > /tmp/attn-block-decode-$shape-$mode.log 2>&1 \
            || tail -n 20 /tmp/attn-block-decode-$shape-$mode.log
          echo "== $shape RADIXMESH_ATTN_BLOCK=$mode"; tail -n 3 /tmp/attn-block-decode-$shape-$mode.log
        done
      done ;;
    moe-small-decode)  # Qwen3-30B-A3B batch-1 decode against its bandwidth floor, the MoE layer on each path
      # (MOE_DECODE_PATHS, default "sorted auto": RADIXMESH_MOE_PATH=sorted, then auto, the small-batch path at batch
      # 1; block: the whole-block kernel), with the graph's kernel profile
      for path in ${MOE_DECODE_PATHS:-sorted auto}; do
        RADIXMESH_MOE_PATH=$path $RM bench one-batch --model-shape qwen3-30b-a3b --batch-size 1 --input-len 1024 \
          --output-len 256 --context-length 8192 --cuda-graph-max-bs 8 --bandwidth-floor --profile-graph \
          --result-file "$OUT/moe-small-decode-$path.jsonl" > /tmp/moe-small-decode-$path.log 2>&1 \
          || tail -n 20 /tmp/moe-small-decode-$path.log
        tail -n 3 /tmp/moe-small-decode-$path.log
      done ;;
    lora)  # issue 46: adapters in the engine (graphs vs eager vs CPU), then 16 rank-16 adapters mixed in a batch of 32
      # vs the base model, batch 1 with and without an adapter, and a run-time load (8B shape, random weights);
      # LORA_KERNELS="auto rows": one run per --lora-kernels setting (auto: the adapter in the batch-1 GEMVs'
      # epilogues, the per-row launches above one row; rows: the per-row launches at every batch, unfused at batch 1);
      # LORA_OVERLAP="side on off": the mixed batch on one LoRA engine per --lora-overlap setting (on: the shrink on a
      # side stream beside the base GEMM; side: the expand there too; auto: side at decode batches above one row);
      # LORA_PROFILE=1: --profile-bs1, the kernels of batch-1 decode steps on the base engine and on the LoRA engine
      # with one adapter (torch.profiler, top 40 per step; base_bs1_profile and lora_bs1_profile in lora.jsonl)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_lora_engine_gpu.py tests/gpu/test_lora_gpu.py \
        tests/gpu/test_lora_overlap_gpu.py tests/gpu/test_lora_gemv_pdl_gpu.py
      for kernels in ${LORA_KERNELS:-auto}; do
        $RM bench lora --model-shape llama-3.1-8b --num-adapters 16 --rank 16 --batch-size 32 --input-len 256 \
          --output-len 128 --lora-kernels "$kernels" --lora-overlap ${LORA_OVERLAP:-auto} --result-file "$OUT/lora.jsonl" \
          $([ "${LORA_PROFILE:-}" = 1 ] && echo --profile-bs1)
      done ;;
    lora-layer1)  # layer-1 of bench_lora: one 8B layer's projections at batch 1 with the adapter in the GEMVs'
      # epilogues against the fused GEMVs alone, checked against float32; LORA_WIDTHS="64 256": once per epilogue width
      python3 -m radixmesh.kernels.bench_lora --cases layer-1 --kernels epilogue --check \
        $([ -n "${LORA_WIDTHS:-}" ] && echo --epilogue-widths $LORA_WIDTHS) | tee "$OUT/lora-layer1.jsonl" ;;
    lora-bs1)  # `bench lora` (issue 46's figures) with the kernel tables of batch-1 steps (--profile-bs1), no tests
      $RM bench lora --model-shape llama-3.1-8b --num-adapters 16 --rank 16 --batch-size 32 --input-len 256 \
        --output-len 128 --result-file "$OUT/lora.jsonl" --profile-bs1 ;;
    lora-pdl-mutants)  # the PDL test of the LoRA GEMVs must fail on each of two broken copies of the kernels: a
      # GEMV that never waits for its shrink, a shrink that lets its GEMV start before the kernel before it ended
      for mutant in gemv-no-wait shrink-early; do
        rm -rf /tmp/mutant && cp -r "$TREE/kernels" /tmp/mutant
        python3 - "$mutant" <<'PY' || { echo "mutant $mutant: could not be made (see above)"; continue; }
import sys
name = sys.argv[1]
path, old, new = {
    "gemv-no-wait": ("gemv.py", "        if HAS_LORA:\n            gdc_wait()\n", ""),
    "shrink-early": ("lora_gemv.py", "        gdc_wait()  # everything", "        gdc_launch_dependents()\n        gdc_wait()  #"),
}[name]
f = "/tmp/mutant/radixmesh/kernels/" + path
text = open(f).read()
assert old in text, (name, "the code to break is not there")
open(f, "w").write(text.replace(old, new, 1))
PY
        if PYTHONPATH=/tmp/mutant:$PYTHONPATH python3 -m pytest -q -x -p no:cacheprovider -m gpu \
            tests/gpu/test_lora_gemv_pdl_gpu.py -k "plain and slow" > "$OUT/mutant-$mutant.log" 2>&1; then
          grep -q " passed" "$OUT/mutant-$mutant.log" && echo "mutant $mutant: NOT caught (the test passed)" \
            || echo "mutant $mutant: not tried (the test was skipped)"
        else
          echo "mutant $mutant: caught"; grep -E "^E |passed|failed" "$OUT/mutant-$mutant.log" | head -4
        fi
      done ;;
    lora-tests)  # the LoRA GPU tests alone (engine: graphs vs eager vs CPU per kernel set; kernels)
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/gpu/test_lora_engine_gpu.py tests/gpu/test_lora_gpu.py \
        tests/gpu/test_lora_overlap_gpu.py tests/gpu/test_lora_gemv_pdl_gpu.py ;;
    lora-kernels)  # batched LoRA at the 8B projections: tests, then the adapters' cost next to cuBLAS's base GEMMs
      # (32 decode rows over 16 rank-16 adapters, batch 1, four 512-token prefill segments; then slots sized for rank 64)
      # for each decode kernel set: per row (the old launches), grouped by adapter, fused shrink+expand; then
      # layer-1: batch 1 against the fused GEMVs a step runs, with the adapter in their epilogue (epilogue) or not;
      # overlap_us: base and LoRA with the shrink on a side stream beside the GEMM, the expand after both
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_lora_gpu.py tests/gpu/test_lora_overlap_gpu.py \
        tests/gpu/test_lora_gemv_pdl_gpu.py
      python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_lora_kernels.py tests/unit/test_lora_gemv.py \
        tests/unit/test_bench_lora_gemv.py tests/unit/test_lora_overlap.py
      python3 -m radixmesh.kernels.bench_lora --check | tee "$OUT/lora-kernels.jsonl"
      python3 -m radixmesh.kernels.bench_lora --cases decode layer-1 --max-rank 64 | tee -a "$OUT/lora-kernels.jsonl"
      python3 -m radixmesh.kernels.bench_lora --table "$OUT/lora-kernels.jsonl" ;;
    mm-tests)  # tiny LLaVA and Qwen2-VL on CUDA (triton, graphs, overlap, chunked) vs transformers' greedy tokens
      python3 -m pytest -v -x -p no:cacheprovider -m gpu tests/gpu/test_mm_gpu.py ;;
    images)  # 7B multimodal shapes: TTFT with one image + short question; 32 image questions, shared vs distinct image
      $RM bench images --model-shape llava-1.5-7b --image-size 336 --batch-size 32 --output-len 64 \
        --context-length 4096 --cuda-graph-max-bs 32 --result-file "$OUT/images.jsonl"
      $RM bench images --model-shape qwen2-vl-7b --image-size 448 --batch-size 32 --output-len 64 \
        --context-length 4096 --cuda-graph-max-bs 32 --result-file "$OUT/images.jsonl" ;;
    hicache-tests)  # host tier and peer fetch GPU tests (the peer-fetch one needs two GPUs)
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfEs tests/gpu/test_hicache_gpu.py ;;
    hicache)  # host tier: its GPU tests, then multi-turn sessions 3x the device pool with and without it (8B)
      python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_hicache_gpu.py
      $RM bench hicache --model-shape llama-3.1-8b --context-length 8192 --max-total-tokens 32768 \
        --cuda-graph-max-bs 8 --num-turns 4 --turn-input-len 1024 --output-len 32 --max-concurrency 6 \
        --working-set-ratio 3 --hicache-ratio 3.5 --result-file "$OUT/hicache.jsonl" ;;
    peer-fetch)  # prefix sharing, two workers on two GPUs (cuda-ipc): TTFT of a 16k-token prefix fetched vs recomputed
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      $RM bench peer-fetch --device cuda --model "$model" --load-format dummy --context-length 20000 \
        --prefix-len 16384 --samples 3 --result-file "$OUT/peer-fetch.jsonl" ;;
    pd-goodput)  # 2 GPUs, 8B shape: goodput (TTFT <= 1 s, p99 ITL <= 50 ms) of (a) 2 unified workers vs (b) 1 prefill +
      # 1 decode worker (--kv-transport $PD_TRANSPORT, cuda-ipc by default; nixl), one GPU each (cluster up --gpus
      # auto); prompts 2k-8k tokens, outputs 256-1024, $PD_PROMPTS (80) at each of $PD_RATES req/s (32 per rate were
      # too few: the ratio varied from 1.1x to 1.8x). About 8 minutes (2 x H200) with the defaults: STAGE_TIMEOUT_S=600
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      export PATH="${REDIS_DIR:-$PWD/.gpu-redis}/bin:$PATH" \
        LD_LIBRARY_PATH="${REDIS_DIR:-$PWD/.gpu-redis}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      [ "${PD_TRANSPORT:-}" = nixl ] && nixl_env
      for cfg in ${PD_CONFIGS:-a b}; do  # PD_CONFIGS=b: the P/D run alone (a second call, within one's 10 minutes)
        tiers="--workers 2" wargs="--context-length=10240 ${PD_WORKER_ARGS:-}" state=/tmp/cluster-pd-$cfg files=""
        [ $cfg = b ] && tiers="--prefill-workers 1 --decode-workers 1" wargs="$wargs --kv-transport ${PD_TRANSPORT:-cuda-ipc}"
        [ -n "${PD_UCX_TLS:-}" ] && export UCX_TLS=$PD_UCX_TLS
        rm -f /tmp/pd-$cfg-*.json
        if ! $RM cluster up $tiers --model "$model" --load-format dummy --worker-args="$wargs" --timeout-s 400 \
            --state-dir $state > /tmp/pd-up-$cfg.txt; then
          cat /tmp/pd-up-$cfg.txt; echo "config $cfg: cluster up failed"; continue
        fi
        cat /tmp/pd-up-$cfg.txt; url=$(tail -1 /tmp/pd-up-$cfg.txt)
        for rate in ${PD_RATES:-2 4 6}; do
          $RM bench serving --base-url "$url" --backend sglang --workload random-ids --random-input-len 8192 \
            --random-range-ratio 0.25 --random-output-len 1024 --num-prompts ${PD_PROMPTS:-80} --request-rate $rate --seed ${rate%.*} \
            --warmup-requests 2 --disable-tqdm --tokenizer "$model" --output-file /tmp/pd-$cfg-$rate.json \
            || tail -n 15 $state/logs/*-[0-9]*.log
          [ -f /tmp/pd-$cfg-$rate.json ] && files="$files /tmp/pd-$cfg-$rate.json"
        done
        $RM cluster down --state-dir $state
        [ -n "$files" ] && $RM bench goodput $files --ttft-ms ${PD_TTFT_MS:-1000} --itl-p99-ms ${PD_ITL_P99_MS:-50} \
          --label "$cfg${PD_TRANSPORT:+-$PD_TRANSPORT}${PD_UCX_TLS:+-$PD_UCX_TLS}" --result-file "$OUT/pd-goodput.jsonl"
      done ;;
    pd-nixl-transfer)  # issue 49: the 8B shape's KV between two processes on two GPUs: grpc, then nixl over UCX's GPU
      # path and over TCP (UCX_TLS=tcp,cuda_copy: a link between nodes), each beside the plain copy and a bare NIXL
      # READ of the same bytes as one block; scattered slots (a busy pool) and one run (a fresh pool). ~8 minutes.
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      nixl_env
      kv="$RM bench kv-transfer --device cuda --num-tokens 1024 4096 16384 --result-file $OUT/kv-transfer-nixl.jsonl"
      $kv --transport grpc --repeats 3 --warmup 1
      for tls in "" "tcp,cuda_copy"; do
        for slots in random contiguous; do
          env ${tls:+UCX_TLS=$tls} $kv --transport nixl --slots $slots --repeats 10 --warmup 3
        done
      done
      env UCX_TLS=tcp,cuda_copy $kv --transport nixl --mode direct --slots contiguous --repeats 5 --warmup 2
      python3 scripts/kv_transfer_summary.py "$OUT/kv-transfer-nixl.jsonl" ;;
    pd-nixl-tests)  # issue 49: nixl on two GPUs (bench in every mode, staged export ordering, workers that do not
      # share their GPUs pick nixl and give grpc's tokens, over UCX's default transports and over TCP)
      nixl_env
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/gpu/test_kv_transfer_nixl_gpu.py ;;
    faults)  # 2 GPUs, 8B shape, random weights: two unified workers (one GPU each) and two routers under streaming
      # load; kill -9 of the busiest worker mid-stream, then a rolling restart (SIGTERM, drain, restart, one at a time).
      # Reports failed requests, tokens lost / duplicated, texts changed and the migrations' stall. STAGE_TIMEOUT_S=600
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      model=$(python3 scripts/gpu_tokenizer_model.py llama-3.1-8b "${TOKENIZER_DIR:-.gpu-model}" /tmp/smol-vocab-8b)
      export PATH="${REDIS_DIR:-$PWD/.gpu-redis}/bin:$PATH" LD_LIBRARY_PATH="${REDIS_DIR:-$PWD/.gpu-redis}/lib"
      $RM bench faults --scenarios ${FAULT_SCENARIOS:-worker-kill,rolling-restart} --workers 2 --routers 2 \
        --model "$model" --load-format dummy --worker-args="--context-length 4096 ${FAULT_WORKER_ARGS:-}" \
        --worker-drain-s ${FAULT_DRAIN_S:-2} --concurrency ${FAULT_CONCURRENCY:-16} --max-tokens ${FAULT_MAX_TOKENS:-256} \
        --timeout-s 120 --output-file "$OUT/faults-gpu.json" --markdown-file "$OUT/faults-gpu.md" ;;
    pd-tests)  # 2 GPUs: cuda-ipc vs grpc greedy tokens (8B shape), faults (prefill worker stopped / killed)
      python3 -m pytest -v -p no:cacheprovider -m gpu -rfE tests/gpu/test_kv_transfer_gpu.py ;;
    pd-transfer)  # prefill-to-decode KV of the 8B shape between two processes on two GPUs (cuda-ipc) vs a plain copy
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "skipped: needs two GPUs"; return 0; }
      for mode in direct staging; do  # direct: the default; staging: the earlier path, for comparison
        $RM bench kv-transfer --device cuda --num-tokens 1024 4096 16384 --repeats 10 --mode $mode \
          --result-file "$OUT/kv-transfer.jsonl"
      done
      # the same prompts' prefill on one of these GPUs (the transfer must take < 10% of it)
      CUDA_VISIBLE_DEVICES=0 $RM bench one-batch --model-shape llama-3.1-8b --batch-size 1 \
        --input-len 1024 4096 16384 --output-len 4 --context-length 16640 --disable-cuda-graph \
        --result-file "$OUT/pd-prefill.jsonl" ;;
    spec-tests)  # speculative decoding: Triton verify beside CUDA graphs, exact greedy, device rejection sampling;
      # the draft loop's graphs against its eager run and pass-by-pass drafting, EAGLE heads over the target's graphs
      python3 -m pytest -v -x -p no:cacheprovider -m gpu tests/gpu/test_speculative_gpu.py tests/gpu/test_spec_graphs_gpu.py ;;
    spec-same|spec-unrelated|spec-unrelated-raw|spec-ngram)  # 8B shape, random weights, batch 1/8/32: plain vs spec
      spec="--model-shape llama-3.1-8b --workload random --batch-sizes 1,8,32 --input-len 512 --output-len 256 \
        --context-length 4096 --max-total-tokens 32768 --cuda-graph-max-bs 32 --result-file $OUT/spec.jsonl ${SPEC_ARGS:-}"
      case $stage in
        spec-same)  # (a) a draft with the target's own weights: every draft accepted, the machinery's best case
          $RM bench speculative $spec --speculative-algorithm draft --speculative-draft-model llama-3.1-8b \
            --speculative-draft-load-format dummy --disable-speculative-backoff ;;
        spec-unrelated)  # (b) an unrelated random 1B-shape draft: nothing accepted, the back-off limits the cost
          $RM bench speculative $spec --speculative-algorithm draft --speculative-draft-model llama-3.2-1b \
            --speculative-draft-load-format dummy ;;
        spec-unrelated-raw)  # (b) without the back-off: the raw cost of drafting and verifying for nothing
          $RM bench speculative $spec --speculative-algorithm draft --speculative-draft-model llama-3.2-1b \
            --speculative-draft-load-format dummy --disable-speculative-backoff ;;
        spec-ngram)
          $RM bench speculative $spec --speculative-algorithm ngram ;;
      esac ;;
    spec-oracle)  # issue 47's targets in one stage (8B shape, random weights, 4 drafts, no back-off): oracle drafts
      # at the 1B shape's cost (acceptance 1.0 and 0.7, batch 1 and 8), then a draft with the target's own weights
      spec="--model-shape llama-3.1-8b --workload random --input-len 512 --output-len 256 --context-length 4096 \
        --max-total-tokens 32768 --cuda-graph-max-bs 32 --speculative-num-draft-tokens 4 --disable-speculative-backoff \
        --result-file $OUT/spec-oracle.jsonl ${SPEC_ARGS:-}"
      $RM bench speculative $spec --oracle --oracle-acceptance 1.0,0.7 --batch-sizes 1,8 --rounds ${SPEC_ROUNDS:-3} \
        --speculative-draft-model llama-3.2-1b --speculative-draft-load-format dummy --profile-cycles
      $RM bench speculative $spec --batch-sizes 1 --speculative-algorithm draft --speculative-draft-model llama-3.1-8b \
        --speculative-draft-load-format dummy
      python3 scripts/spec_oracle_summary.py "$OUT/spec-oracle.jsonl" ;;
    spec-eagle)  # EAGLE / EAGLE-3 heads of the 8B shape (random weights: nothing accepted, so this measures a cycle's
      # cost and exactness), 3 steps, batch 1 and 8, no back-off
      for alg in eagle eagle3; do
        python3 -c "import json, os, sys; d = f'/tmp/{sys.argv[1]}-8b'; os.makedirs(d, exist_ok=True); json.dump({
          'architectures': ['LlamaForCausalLMEagle3' if sys.argv[1] == 'eagle3' else 'LlamaForCausalLM'],
          'hidden_size': 4096, 'intermediate_size': 14336, 'num_hidden_layers': 1, 'num_attention_heads': 32,
          'num_key_value_heads': 8, 'head_dim': 128, 'vocab_size': 128256, 'draft_vocab_size': 32000,
          'rope_theta': 500000.0, 'max_position_embeddings': 4096, 'rms_norm_eps': 1e-5}, open(d + '/config.json', 'w'))" $alg
        $RM bench speculative --model-shape llama-3.1-8b --workload random --batch-sizes 1,8 --input-len 512 \
          --output-len 256 --context-length 4096 --max-total-tokens 32768 --cuda-graph-max-bs 32 \
          --speculative-algorithm $alg --speculative-draft-model /tmp/$alg-8b --speculative-draft-load-format dummy \
          --speculative-num-steps 3 --disable-speculative-backoff --result-file $OUT/spec-eagle.jsonl ${SPEC_ARGS:-}
        # tree drafts: top-4 branches, 3 steps, 8 tokens verified per tree (its root and 7 nodes) with a tree mask
        $RM bench speculative --model-shape llama-3.1-8b --workload random --batch-sizes 1,8 --input-len 512 \
          --output-len 256 --context-length 4096 --max-total-tokens 32768 --cuda-graph-max-bs 32 \
          --speculative-algorithm $alg --speculative-draft-model /tmp/$alg-8b --speculative-draft-load-format dummy \
          --speculative-eagle-topk 4 --speculative-num-steps 3 --speculative-num-draft-tokens 8 \
          --disable-speculative-backoff --result-file $OUT/spec-eagle.jsonl ${SPEC_ARGS:-}
      done
      # the tree mask in the extend kernel at real shapes, and the tree tests on the GPU (the Triton kernel compiled)
      python3 -m pytest -q -p no:randomly -p no:cacheprovider tests/unit/test_tree_attention.py 2>&1 | tail -5 ;;
    *) echo "unknown stage $stage" ;;
  esac
}
for stage in $STAGES; do
  limit=$(stage_limit "$stage")  # TIMEOUT_pd_goodput=500: one stage's own limit
  timeout "$limit" bash -c "$(declare -f run_stage spy spy_collect nixl_env); RM='$RM' OUT='$OUT' TREE='$TREE' run_stage $stage" \
    > "$OUT/$stage.log" 2>&1
  echo "=== stage $stage: exit $? (log: $stage.log)"; tail -5 "$OUT/$stage.log"
done
ls -la "$OUT"
# the device tool brings back at most 8 files: past 7, pack them all into one (device.txt stays beside it;
# SUITE_PACK=0: never, when a caller packs, as gpu_ab.sh does)
if [ "${SUITE_PACK:-1}" != 0 ] && [ "$(ls "$OUT" | wc -l)" -gt 7 ]; then
  (cd "$OUT" && tar czf suite.tar.gz --remove-files $(ls | grep -vx -e device.txt -e suite.tar.gz)) \
    && echo "packed into $OUT/suite.tar.gz"
fi
