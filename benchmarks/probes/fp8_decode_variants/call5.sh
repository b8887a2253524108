# compute-sanitizer memcheck on the CUDA kernel's tests: the float32 cases alone (full error list), then the CUDA
# graph test alone (what its 4 errors are).
set -uo pipefail
source .device/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
for k in float32 graph; do
  echo "== memcheck -k $k"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 70 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --kernel-name kns=fp8_paged_decode \
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_paged_decode_cuda.py -k $k 2>&1 | grep -E "^=========|passed|failed|Error" | head -40
done 2>&1 | tee $OUT/memcheck.log
