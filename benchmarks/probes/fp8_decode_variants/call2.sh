# Issue 59, second call: the merge change (both heads, 4 slices in flight; bit-identical) on the GPU, the 8B
# anchor (block-scaled as the product runs it, then row-wise and row-wise fast-accumulating as per-channel/per-tensor
# checkpoints would), microbench rows for the docs, bench.py FP8/bf16 A/B.
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
F='^INFO\|transformers\|Warn\|_warn_once\|Loading weights'
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
timeout 90 python3 -m pytest -q -s -p no:logging -p no:cacheprovider -m gpu tests/test_paged_decode_cuda.py tests/test_fp8_kv_cache.py 2>&1 | grep -v "$F" > $OUT/tests.log; tail -2 $OUT/tests.log; el
python3 -c "from nanovllm.utils.random_checkpoint import default_checkpoint; default_checkpoint('Llama-3.1-8B-FP8')" | tail -1; el
{ echo "== 8B block (product)"; timeout 130 python3 bench.py --shape Llama-3.1-8B-FP8 --workload 1000-1000 --runs 2 --kv-cache-dtype fp8 2>&1 | grep -E "tok/s|weights|linear layers" | tail -4; el
  echo "== 8B row-wise"; timeout 120 python3 probe/bench_rowwise.py --shape Llama-3.1-8B-FP8 --workload 1000-1000 --runs 2 --kv-cache-dtype fp8 2>&1 | grep -E "tok/s|linear layers" | tail -3; el
  echo "== 8B row-wise fast"; timeout 120 python3 probe/bench_rowwise.py --fast --shape Llama-3.1-8B-FP8 --workload 1000-1000 --runs 2 --kv-cache-dtype fp8 2>&1 | grep -E "tok/s|linear layers" | tail -3; el
} 2>&1 | tee $OUT/bench8b.log
