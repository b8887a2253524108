# issue 59 (branch issue-59-vt only): the FP8 decode kernel reading V transposed per page (probe/vt_decode.py)
# against main's FP8 and bf16 kernels on one GPU (probe/time_vt.py: outputs vs float32 and vs main, CUDA-graph times
# over (BLOCK_N, warps, stages) at the anchor and 0.6B shapes), then the same kernels' SASS counts compiled there.
# Run from the repository root after `source .device/setup.sh; export PYTHONPATH=$PWD:$PYTHONPATH`, with OUT set:
#   bash probe/gpu59vt.sh [time_vt.py arguments, e.g. --shapes anchor]
# Writes $OUT/time_vt.log (progress and the table), $OUT/results.md (the table), $OUT/results.json (every setting),
# $OUT/sass_device.md (SASS counts with the device's Triton and ptxas). About 2-3 minutes on an H200.
set -uo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must name the results folder}"
mkdir -p "$OUT"
{ date -u; git log -1 --format='%H %s' | cut -c1-120
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader; } \
  2>&1 | tee "$OUT/time_vt.log"
timeout 170 python3 probe/time_vt.py --out "$OUT" "$@" 2>&1 | grep -v "TRITON_DEFAULT_FP_FUSION\|warn_once(" \
  | tee -a "$OUT/time_vt.log"
echo "time_vt.py exit ${PIPESTATUS[0]}" | tee -a "$OUT/time_vt.log"
# a check on the CPU-side SASS table (probe/sass_cpu.md), 25 s at most
timeout 25 python3 probe/sass59vt.py --kernels main-fp8 vt0m2 --settings 64,2,2 64,4,2 128,4,2 --group 4 \
  --jobs 8 > "$OUT/sass_device.md" 2>&1
echo "sass59vt.py exit $?" | tee -a "$OUT/time_vt.log"
