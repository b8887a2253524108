# Issue 59, last call: compute-sanitizer (memcheck, synccheck) on the CUDA kernel's tests, only that kernel
# instrumented, no caching allocator (so an access past a tensor is past its allocation); then FlashInfer's exact
# (bf16 query) paged decode over the FP8 cache against ours at the anchor shape (JIT compiled inside this run).
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
echo "sanitizer: ${CS:-none}"
if [ -n "$CS" ]; then
  for tool in memcheck synccheck; do
    echo "== $tool"; PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $([ $tool = memcheck ] && echo 90 || echo 60) $CS --tool $tool --kernel-name kns=fp8_paged_decode --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_paged_decode_cuda.py -k "float32 or graph" 2>&1 | grep -v "^INFO" | tail -6; echo "rc ${PIPESTATUS[0]}"; el
  done
fi 2>&1 | tee $OUT/sanitizer.log
source .device-fi/setup.sh >/dev/null
timeout 180 python3 benchmarks/microbench.py fp8-decode --batch 512 --heads 32 --kv-heads 8 --min-context 1500 --max-context 1700 --flashinfer 2>&1 | grep -v "^INFO" | tail -9 | tee $OUT/fi_anchor.log; el
