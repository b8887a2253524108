#!/usr/bin/env bash
# Everything that needs the GPU, in one device call:
#   source .device/setup.sh && bash tests/run_gpu.sh [bench args]
# GPU tests, then bench.py (cold + warm), then a short summary table. Logs go to $OUT (or /tmp) when set.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pytest -q -s -p no:logging -m gpu tests/ 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
python3 bench.py --runs 4 "$@" 2>&1 | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
echo
echo "| check | result |"
echo "| --- | --- |"
echo "| GPU tests | $(tail -n 1 "$out/gpu_tests.log") (rc $tests_rc) |"
grep -E "^device:" "$out/bench.log" | sed 's/^/| bench setup | /; s/$/ |/'
grep -E "\((cold|warm)" "$out/bench.log" | sed 's/^/| bench | /; s/$/ |/'
grep -E "^peak GPU" "$out/bench.log" | sed 's/^/| bench | /; s/$/ |/'
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
