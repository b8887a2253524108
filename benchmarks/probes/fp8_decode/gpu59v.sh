# issue 59 (branch only): the FP8 decode-kernel variants in probe/variants/ against main's kernel on one GPU, in one
# process (probe/time_variants.py): outputs vs float32 and vs main, CUDA-graph times over (BLOCK_N, warps, stages) at the
# anchor and 0.6B shapes, bf16 (main, TUNED) for reference. Run from the repository root after
# `source .device/setup.sh; export PYTHONPATH=$PWD:$PYTHONPATH`; extra arguments go to time_variants.py
# (e.g. --variants ..., --stages 2,3). Writes $OUT/time_variants.log (progress and the table), $OUT/results.md (the
# table), $OUT/results.json (every setting: us, GB/s, errors), $OUT/sass_device.md (SASS counts compiled there).
set -uo pipefail
export PYTHONUNBUFFERED=1
: "${OUT:?OUT must name the results folder}"
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader; } \
  2>&1 | tee "$OUT/time_variants.log"
timeout 255 python3 probe/time_variants.py --out "$OUT" "$@" 2>&1 | grep -v "TRITON_DEFAULT_FP_FUSION\|warn_once(" \
  | tee -a "$OUT/time_variants.log"
echo "time_variants.py exit ${PIPESTATUS[0]}" | tee -a "$OUT/time_variants.log"
# the same compiles' SASS counts with the device's Triton and ptxas (a check on the CPU-side table), 30 s at most
timeout 30 python3 probe/sass59.py probe/variants/{main_paged_decode,a_asm_impure,c2_asm_v_only,w_wgmma_v_asm}.py \
  --settings 64,2,2 64,4,3 128,4,2 --group 4 --jobs 8 > "$OUT/sass_device.md" 2>&1
