# Issue 59, third call: microbench rows for the docs, the Llama layer's FP8 matmuls, bench.py FP8/bf16 A/B.
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
F='^INFO\|transformers\|Warn\|_warn_once\|Loading weights'
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s]"; }
{ for shape in "--batch 512 --heads 32 --kv-heads 8 --min-context 1500 --max-context 1700" "--batch 256 --heads 16 --kv-heads 8 --min-context 100 --max-context 2048" "" "--batch 32 --heads 16 --kv-heads 8 --min-context 100 --max-context 2048"; do
  echo "== fp8-decode $shape"; timeout 60 python3 benchmarks/microbench.py fp8-decode $shape 2>&1 | grep -v "$F" | tail -8; done; el; } 2>&1 | tee $OUT/micro.log
{ for kv in fp8 auto fp8 auto; do echo "== default $kv"; timeout 45 python3 bench.py --runs 3 --kv-cache-dtype $kv 2>&1 | grep -E "warm|cold"; done; el
  for kv in fp8 auto; do echo "== long $kv"; timeout 70 python3 bench.py --runs 2 --workload long-context --kv-cache-dtype $kv 2>&1 | grep -E "warm|cold"; done; el; } 2>&1 | tee $OUT/bench.log
timeout 80 python3 benchmarks/microbench.py fp8-gemm --shape Llama-3.1-8B --rows 512,2048,8192 2>&1 | grep -v "$F" | tail -30 > $OUT/gemm.log; el
