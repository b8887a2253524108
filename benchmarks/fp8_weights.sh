#!/usr/bin/env bash
# FP8 weights end to end, on a GPU machine, from the repository root:
#   bash benchmarks/fp8_weights.sh [shape ...]        # default: Qwen3-8B
#   WORKLOADS=default MODES="bf16 fp8-ckpt" RUNS=3 bash benchmarks/fp8_weights.sh Qwen3-8B   # a part of it
# For each shape: bench.py warm throughput with bf16 weights, FP8 weights quantized at load (per channel), a
# published-layout FP8 checkpoint (block scales), and the latter with the FP8 KV cache, on the default and the
# prefill-heavy workload; then a summary table. The random checkpoints are written on first use (minutes for 8B).
set -uo pipefail
out=${OUT:-/tmp}
runs=${RUNS:-3}
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(Qwen3-8B)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
declare -A modes=([bf16]="" [fp8-load]="--quantization fp8" [fp8-ckpt]="FP8" [fp8-ckpt+kv]="FP8 --kv-cache-dtype fp8")
read -r -a workloads <<< "${WORKLOADS:-default prefill-heavy}"
read -r -a mode_list <<< "${MODES:-bf16 fp8-load fp8-ckpt fp8-ckpt+kv}"
rc=0
for shape in "${shapes[@]}"; do
  for workload in "${workloads[@]}"; do
    for mode in "${mode_list[@]}"; do
      args=${modes[$mode]}
      target=$shape
      if [[ $args == FP8* ]]; then target=$shape-FP8; args=${args#FP8}; fi
      log="$out/fp8_${shape}_${workload}_${mode}.log"
      python3 bench.py --runs "$runs" --shape "$target" --workload "$workload" $args 2>&1 | tee "$log"
      [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    done
  done
done
echo
echo "| shape | workload | weights | warm tok/s | KV blocks |"
echo "| --- | --- | --- | --- | --- |"
for shape in "${shapes[@]}"; do
  for workload in "${workloads[@]}"; do
    for mode in "${mode_list[@]}"; do
      log="$out/fp8_${shape}_${workload}_${mode}.log"
      warm=$(grep -E "\(warm" "$log" | sed -E 's/.*Throughput: ([0-9]+) tok\/s.*/\1/')
      blocks=$(grep -oE "KV blocks: [0-9]+" "$log" | grep -oE "[0-9]+")
      echo "| $shape | $workload | $mode | ${warm:-failed} | ${blocks:-?} |"
    done
  done
done
exit $rc
