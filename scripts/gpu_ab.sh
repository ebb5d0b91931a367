#!/usr/bin/env bash
# Two trees on one GPU in one call, stage by stage in turn: for each stage of AB_STAGES, every tree of AB_TREES
# runs it through gpu_suite.sh (TREE=dir) into $OUT/<name>/, online results tagged with the name. The order
# alternates per stage, so that neither tree always runs first on a warming machine. E.g. the headline figures
# of the tree before a change (git archive BASE services kernels loadtests | tar -x -C .base) and this one:
#   AB_TREES="base=.base new=." AB_STAGES="one-batch online offline" ONE_BATCH_SHAPES=llama-3.1-8b \
#     ONLINE_WORKLOAD=random ONLINE_PROMPTS=80 bash scripts/gpu_ab.sh      (carry .whl .gpu-model .base)
# Stage limits as in gpu_suite.sh (TIMEOUT_<stage>); AB_TIMEOUT_S bounds the whole run (default 590 s). A stage
# named again runs again (e.g. AB_STAGES="online online": base, new, new, base), its online results tagged
# <name>-r2, -r3, ... At the end everything under $OUT but device.txt is packed into $OUT/ab.tar.gz, and a table of
# the figures printed, with each online run's per-request TTFT differences against the first tree's on the same
# prompts (scripts/ab_table.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
deadline=$(( $(date +%s) + ${AB_TIMEOUT_S:-590} ))
read -r -a trees <<< "${AB_TREES:?AB_TREES names the trees: name=dir ...}"
turn=0
declare -A seen=()
for stage in ${AB_STAGES:?AB_STAGES names the stages}; do
  seen[$stage]=$(( ${seen[$stage]:-0} + 1 ))
  again=""; (( ${seen[$stage]} > 1 )) && again="-r${seen[$stage]}"
  order=("${trees[@]}")
  if (( turn % 2 == 1 )); then order=(); for (( i=${#trees[@]}-1; i>=0; i-- )); do order+=("${trees[i]}"); done; fi
  turn=$(( turn + 1 ))
  for item in "${order[@]}"; do
    name=${item%%=*} dir=${item#*=}
    left=$(( deadline - $(date +%s) ))
    if (( left < 20 )); then echo "=== $name $stage: skipped (the run's time is spent)"; continue; fi
    echo "=== $name $stage$again (tree $dir, $left s left)"
    timeout "$left" env TREE="$dir" OUT="$OUT/$name" ONLINE_TAG="$name$again" STAGES="$stage" SUITE_PACK=0 \
      bash scripts/gpu_suite.sh \
      > "$OUT/$name-$stage$again.txt" 2>&1
    grep -E "^=== stage" "$OUT/$name-$stage$again.txt" | tail -1
  done
done
python3 scripts/ab_table.py "$OUT" "${trees[@]%%=*}"
(cd "$OUT" && tar czf ab.tar.gz --remove-files $(ls | grep -vx -e device.txt -e ab.tar.gz)) && echo "packed into $OUT/ab.tar.gz"
