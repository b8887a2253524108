#!/usr/bin/env bash
# Everything that needs the GPU, in one device call:
#   source .device/setup.sh && bash tests/run_gpu.sh [bench args]
# GPU tests, then bench.py (cold + warm) on each GPU attention backend, then a short summary table.
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
echo
echo "| check | result |"
echo "| --- | --- |"
echo "| GPU tests | $(tail -n 1 "$out/gpu_tests.log") (rc $tests_rc) |"
for backend in triton flash_attn; do
  log="$out/bench_$backend.log"
  grep -E "^device:" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
  grep -E "\((cold|warm)" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
  grep -E "^peak GPU" "$log" | sed "s/^/| bench $backend | /; s/$/ |/"
done
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
