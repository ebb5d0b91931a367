#!/usr/bin/env bash
# Several gpu_suite.sh runs side by side, each on its own GPUs, in one device call:
#   LANES="base new" LANE_base="0|TREE=.base ONLINE_TAG=base|one-batch offline online" \
#     LANE_new="1|ONLINE_TAG=new|one-batch offline online" LANES_TIMEOUT_S=520 bash scripts/gpu_lanes.sh
# LANE_<name> is "GPUS|VAR=VALUE ...|stages": the lane's CUDA_VISIBLE_DEVICES, its environment, its STAGES. Each lane
# writes $OUT/<name>/ and $OUT/<name>.log; LANES_TIMEOUT_S bounds every lane (each stage keeps its TIMEOUT_<stage>).
# The wheels in .whl are installed once before the lanes start (the suites share /tmp/site). At the end everything
# under $OUT but device.txt is packed into $OUT/lanes.tar.gz (the device tool brings back few files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
OUT="$OUT" STAGES=setup bash scripts/gpu_suite.sh > "$OUT/setup.log" 2>&1  # wheels, device.txt ("unknown stage")
pids=()
for name in ${LANES:?LANES names the lanes}; do
  var="LANE_$name"
  IFS='|' read -r gpus envs stages <<< "${!var:?$var is not set}"
  echo "lane $name: GPUs $gpus, ${envs:-no extra environment}, stages: $stages"
  # shellcheck disable=SC2086  # envs are VAR=VALUE words
  env CUDA_VISIBLE_DEVICES="$gpus" OUT="$OUT/$name" $envs STAGES="$stages" \
    timeout "${LANES_TIMEOUT_S:-560}" bash scripts/gpu_suite.sh > "$OUT/$name.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for name in $LANES; do echo "===== lane $name"; grep -E "^=== stage" "$OUT/$name.log"; done
(cd "$OUT" && tar czf lanes.tar.gz --remove-files $(ls | grep -vx -e device.txt -e lanes.tar.gz)) \
  && echo "packed into $OUT/lanes.tar.gz"
