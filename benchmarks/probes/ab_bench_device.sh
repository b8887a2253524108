set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader; date -u; git log --oneline -1 2>/dev/null
HEAD_PP=$PYTHONPATH; BASE_PP=$PWD/.ab-base:${PYTHONPATH#$PWD:}
python3 -c "from nanovllm.utils.random_checkpoint import default_checkpoint as d; d('Qwen3-0.6B')" | tail -1
for i in 1 2; do
  for side in base head; do
    if [ $side = base ]; then (cd .ab-base && PYTHONPATH=$BASE_PP timeout 140 python3 bench.py --runs 3 2>&1 | grep -v "^INFO\|Warn" | tail -4 | sed "s/^/[$side $i] /"); else PYTHONPATH=$HEAD_PP timeout 140 python3 bench.py --runs 3 2>&1 | grep -v "^INFO\|Warn" | tail -4 | sed "s/^/[$side $i] /"; fi
  done
done 2>&1 | tee $OUT/ab58.log
timeout 120 python3 benchmarks/structured_outputs.py --shape Qwen3-0.6B --strings enum --rounds 3 2>&1 | grep -v "^INFO\|transformers\|Warn" | tail -9 | tee $OUT/so06_enum.log
timeout 120 python3 benchmarks/structured_outputs.py --shape Qwen3-0.6B --rounds 3 2>&1 | grep -v "^INFO\|transformers\|Warn" | tail -9 | tee $OUT/so06_bounded.log
