set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
(python3 -c "from nanovllm.utils.random_checkpoint import default_checkpoint as d; d('Qwen3-8B'); d('Qwen3-0.6B')" > /tmp/ckpt.log 2>&1 &)
timeout 150 python3 -m pytest -q -p no:logging -m gpu tests/test_structured_outputs.py tests/test_gpu_sampling.py tests/test_sampler.py tests/test_gpu_top_p_floor.py 2>&1 | tail -3 | tee $OUT/gpu_tests.log
while pgrep -f "default_checkpoint as d" >/dev/null; do sleep 2; done; date -u
timeout 290 python3 benchmarks/structured_outputs.py --shape Qwen3-8B --rounds 2 2>&1 | grep -v "^INFO\|transformers\|Warn" | tail -3
timeout 120 python3 benchmarks/structured_outputs.py --shape Qwen3-0.6B --strings enum --rounds 3 2>&1 | grep -v "^INFO\|transformers\|Warn" | tail -3
