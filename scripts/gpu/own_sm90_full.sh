#!/bin/bash
# own-sm90-full (GQA, varlen, windows) on an H200 (first run 2026-12-01, without knobs: passed);
# from the repository root, after
#   export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH
# with CuTe DSL and flash_attn.cute importable (installed, or from wheels: docs/gpu.md#devkit).
# 1. the kernel suite for own-sm90-full (timeout 240 s);
# 2. the targeted SM90 cases: own-sm90's six (its PTX changed by a few instructions) and
#    own-sm90-full's eight (GQA, NaN padding in a partial block, empty sequences, windows),
#    each under every harness check (timeout 120 s);
# 3. a timing of own-sm90, own-sm90-full and flash_attn.cute on two shapes (timeout 120 s).
# Logs go to $OUT (default /tmp/sm90-out); the summary is printed last and kept in summary.txt.
OUT="${OUT:-/tmp/sm90-out}"
mkdir -p "$OUT"
export CUTE_DSL_ARCH=sm_90a
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
summary=()

run() {  # run NAME LIMIT_S COMMAND...: log to $OUT/NAME.log, one summary line
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "==== $name (timeout $limit s): $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  local last
  last=$(grep -E "passed|failed|error|skipped|TFLOP|Error" "$OUT/$name.log" | tail -n 1)
  [ "$rc" = 124 ] && last="TIMEOUT; $last"
  summary+=("$name: rc=$rc in $((SECONDS - start)) s: ${last:-no result line}")
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
run suite-full 240 python3 -m pytest -p no:cacheprovider -q -rs --tb=short -x \
  src/attention_crossval/properties/test_kernels.py -m gpu --kernel own-sm90-full --hypothesis-seed=1
run targeted 120 python3 -m pytest -p no:cacheprovider -q -rs --tb=short \
  src/attention_crossval/properties/test_own_kernels.py -m gpu -k targeted --hypothesis-seed=1
run bench 120 python3 "$here/bench_own_sm90_full.py"
grep -E "^bench" "$OUT/bench.log" > "$OUT/bench.txt"

{
  echo "==== summary ($(cat "$OUT/gpu.txt"))"
  printf '%s\n' "${summary[@]}"
  cat "$OUT/bench.txt"
} | tee "$OUT/summary.txt"
