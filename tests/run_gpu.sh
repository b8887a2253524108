#!/usr/bin/env bash
# Everything that needs the GPU, in one script, from the repository root of a CUDA machine with flash-attn:
#   bash tests/run_gpu.sh [bench args]
# GPU tests, then bench.py (cold + warm) on each GPU attention backend, then the triton backend with an FP8 KV
# cache on the default workload and bf16/FP8 on the long-context one, then a short summary table.
# Logs go to $OUT (or /tmp) when set.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -s -p no:logging -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
bench_rc=0
for backend in triton flash_attn; do
  python3 bench.py --runs 4 --attention-backend $backend "$@" 2>&1 | tee "$out/bench_$backend.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
done
# name: bench.py arguments (the FP8 KV cache against bf16 on the default and the long-context workloads)
declare -A kv_runs=([triton_fp8]="--kv-cache-dtype fp8" [long_bf16]="--workload long-context"
                    [long_fp8]="--workload long-context --kv-cache-dtype fp8")
kv_names="triton_fp8 long_bf16 long_fp8"
for name in $kv_names; do
  python3 bench.py --runs 4 --attention-backend triton ${kv_runs[$name]} "$@" 2>&1 | tee "$out/bench_$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
done
echo
echo "| check | result |"
echo "| --- | --- |"
echo "| GPU tests | $(tail -n 1 "$out/gpu_tests.log") (rc $tests_rc) |"
for backend in triton flash_attn $kv_names; do
  log="$out/bench_$backend.log"
  grep -E "^device:" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
  grep -E "\((cold|warm)" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
  grep -E "^peak GPU" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
done
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
