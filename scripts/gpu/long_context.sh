#!/bin/bash
# Long-context checks on an NVIDIA H200 (torch 2.11, flash_attn.cute 4.0.0b36, triton,
# 16 CPU cores, 128 GiB RAM). Steps, chosen by name on the command line (default: all of them,
# about 20 minutes: more than one 10-minute device command, so split it, e.g.
# `long_context.sh targets bench` and `long_context.sh huge`):
#   env          versions, memory, /dev/shm (40 s)
#   triton-late  the Triton kernel broken past 32k keys is caught at 64k, the correct one
#                passes (90 s; 26 s on 2026-12-01)
#   targets      the gpu-long targets: 64k prefill and the 128k decodes through flash-attn-cute
#                (240 s; the prefill alone took 53 s with a cold compile on 2026-12-01)
#   huge         a K and V of 2^31 + 2^17 elements each (gpu-huge): build (~45 s), then
#                flash-attn-cute and Triton's correct and int32-offset kernels (420 s; it did
#                not finish in 150 s on 2026-12-01)
#   bench        benchmarks/bench_long_context.py, per-phase cost against S (300 s)
# Run from the repository root after
#   export PYTHONPATH=$PWD/src:$PWD:$PYTHONPATH
# with CuTe DSL and flash_attn.cute importable (installed, or from wheels: docs/gpu.md#devkit).
# One pytest invocation per step, each under `timeout`, printing as it goes (-s), logs in $OUT
# (default /tmp/long2-out); a summary table last.
set -u
OUT="${OUT:-/tmp/long2-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTEST=(python3 -m pytest -p no:cacheprovider -x --tb=short -s -rs -m gpu)
declare -a NAMES RCS SECS

step() {  # step NAME TIMEOUT_S command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  echo "=== $name (timeout ${limit}s): $*" | tee "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log" | grep -vE '^\s*$' | tail -n 30
  local rc=${PIPESTATUS[0]}
  NAMES+=("$name"); RCS+=("$rc"); SECS+=($((SECONDS - start)))
}

STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env triton-late targets huge bench)
for name in "${STEPS[@]}"; do
  case $name in
    env) step env 40 bash -c "
python3 -c 'import torch, triton; print(\"torch\", torch.__version__, torch.cuda.get_device_name(), \"triton\", triton.__version__)'
python3 -c 'import flash_attn.cute; print(\"flash_attn.cute ok\")'
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
free -g | head -2; df -h /dev/shm /tmp | tail -2; nproc" ;;
    triton-late) step triton-late 90 "${PYTEST[@]}" src/attention_crossval/properties/test_long_context_gpu.py \
      -k triton_late_rescale ;;
    targets) step targets 240 "${PYTEST[@]}" src/attention_crossval/properties/test_long_context_gpu.py \
      -k flash_attn_cute_at_long_context ;;
    huge) step huge 420 "${PYTEST[@]}" src/attention_crossval/properties/test_long_context_gpu.py -k above_2_31 ;;
    bench) step bench 300 python3 benchmarks/bench_long_context.py ;;
    *) echo "unknown step $name (env, triton-late, targets, huge, bench)"; exit 2 ;;
  esac
done

echo
echo "summary (logs in $OUT):"
printf '%-14s %5s %6s  %s\n' step rc secs result
for i in "${!NAMES[@]}"; do
  log="$OUT/${NAMES[$i]}.log"
  result=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-90)  # pytest's or the step's last line
  [ "${RCS[$i]}" = 124 ] && result="TIMEOUT ($result)"
  printf '%-14s %5s %6s  %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}" "$result"
done
