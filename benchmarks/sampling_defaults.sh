#!/usr/bin/env bash
# Each model family's sampling defaults on one GPU, from the repository root of a CUDA machine:
#   bash benchmarks/sampling_defaults.sh [sampling_speed.py args]
# The sampling GPU tests (each option's distribution against a float64 reference, top-p's floors on full rows;
# not the engine-level seeded test), then sampling_speed.py's table on the chat workload (plain, Qwen3, Llama 3.1,
# Qwen2.5, min_p, seeded; the Qwen3-0.6B random checkpoint is written on first use). MICROBENCH=1 adds
# microbench_sampler.py (device time per sampling step, and top-p's search alone over a few sizes) in between.
# Logs and the table (sampling_speed.md) go to $OUT, or /tmp.
set -uo pipefail
out=${OUT:-/tmp}
export OUT=$out PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$SECONDS
python3 -m pytest -q -s -p no:logging -m gpu tests/test_gpu_top_p_floor.py tests/test_gpu_sampling.py \
  -k "not preemption" 2>&1 | tee "$out/sampling_gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
tests_s=$((SECONDS - start))
if [ "${MICROBENCH:-0}" = 1 ]; then
  python3 benchmarks/microbench_sampler.py 2>&1 | tee "$out/microbench_sampler.log"
fi
python3 benchmarks/sampling_speed.py --warmup-requests 512 "$@" 2>&1 | tee "$out/sampling_speed.log"
bench_rc=${PIPESTATUS[0]}
echo
echo "GPU tests: $(tail -n 1 "$out/sampling_gpu_tests.log") (rc $tests_rc, $tests_s s); sampling_speed rc $bench_rc;" \
     "$((SECONDS - start)) s in all"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
