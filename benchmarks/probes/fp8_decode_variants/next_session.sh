# Issue 59, first GPU call of the next session (one H200, about 8-9 minutes):
# 1. the final code's FP8 acceptance on both checkpoints (the last run was cut after the first; its prefix-cache
#    mode sat exactly on the 3-point bar, now compared in whole tokens), and the CUDA kernel's tests;
# 2. decode-kernel variants prepared on CPU (never run): three-step prefetch (t3), 2/4 warps per slice (mw), the
#    merge with its loads in flight together (merge);
# 3. bench.py FP8 with the main kernel against the best variant of 2, default and long-context.
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
F='^INFO\|transformers\|Warn\|_warn_once\|Loading weights'
timeout 260 python3 -m pytest -q -s -p no:logging -p no:cacheprovider -m gpu tests/test_gpu_fp8_kv.py tests/test_paged_decode_cuda.py tests/test_fp8_kv_cache.py 2>&1 | grep -v "$F" > $OUT/acceptance.log; tail -3 $OUT/acceptance.log
timeout 150 python3 probe/variants59.py probe/paged_decode_fp8_t3.cu probe/paged_decode_fp8_mw.cu:4 probe/paged_decode_fp8_mw.cu:2 probe/paged_decode_fp8_merge.cu 2>&1 | grep -v "$F" | tee $OUT/variants.log | tail -3
best=$(grep "^BEST " $OUT/variants.log | cut -d" " -f2); best=${best:-probe/paged_decode_fp8_mw.cu:4}
{ for kernel in main $best main $best; do
  echo "== default fp8 $kernel"; timeout 50 python3 probe/bench_kernel.py $kernel --runs 3 --kv-cache-dtype fp8 2>&1 | grep -E "warm|cold"
done
for kernel in main $best; do
  echo "== long fp8 $kernel"; timeout 60 python3 probe/bench_kernel.py $kernel --runs 2 --workload long-context --kv-cache-dtype fp8 2>&1 | grep -E "warm|cold"
done; } 2>&1 | tee $OUT/bench.log
