#!/usr/bin/env bash
# The restructuring into rooms (quantization/, sampling/, attention/qk_norm_rope.py) on a GPU, in one call from the
# repository root of a CUDA machine with flash-attn:
#   BASE_DIR=/path/to/a/checkout/before/it bash benchmarks/layering_ab.sh
#   BASE_REV=main bash benchmarks/layering_ab.sh      # or a revision, extracted with git archive
# 1. The GPU tests of what moved: sampling, FP8 weights (and the fused producers), the FP8 KV cache, q/k-norm +
#    RoPE, the Triton compile checks of the kernels, and the model families.
# 2. bench.py's default workload, this tree (B) against the one before (A), interleaved A B A B so drift in the
#    machine falls on both; the warm throughputs and B / A.
# Logs go to $OUT (or /tmp) when set.
set -uo pipefail
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
here=$PWD
base=${BASE_DIR:-}
if [ -z "$base" ]; then
  base=$(mktemp -d)
  git archive "${BASE_REV:-main}" | tar -x -C "$base" || { echo "no BASE_DIR and git archive failed"; exit 2; }
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
PYTHONPATH=$here python3 -m pytest -q -s -p no:logging -m gpu tests/test_gpu_sampling.py tests/test_sampler.py \
  tests/test_gpu_fp8_weights.py tests/test_fp8_fused.py tests/test_gpu_fp8_kv.py tests/test_fp8_kv_cache.py \
  tests/test_qk_norm_rope.py tests/test_triton_compile.py "tests/test_gpu.py::test_family_matches_transformers" \
  2>&1 | tee "$out/layering_gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
bench_rc=0
for round in 1 2; do
  for side in A B; do
    dir=$([ $side = A ] && echo "$base" || echo "$here")
    # each tree's own bench.py, so its directory (first on sys.path) is the nanovllm it imports
    (cd "$dir" && PYTHONPATH=$dir python3 bench.py --runs 3 "$@") 2>&1 | tee "$out/layering_bench_${side}${round}.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
  done
done
warm() { grep -E "\(warm" "$out/layering_bench_$1.log" | sed -E 's/.*Throughput: ([0-9]+) tok\/s.*/\1/'; }
echo
echo "| check | result |"
echo "| --- | --- |"
echo "| GPU tests | $(tail -n 1 "$out/layering_gpu_tests.log") (rc $tests_rc) |"
for run in A1 B1 A2 B2; do echo "| bench $run warm tok/s | $(warm $run) |"; done
a=$(( $(warm A1) + $(warm A2) )); b=$(( $(warm B1) + $(warm B2) ))
echo "| B / A (warm, both rounds) | $(python3 -c "print(f'{$b / $a:.3f}')") |"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
