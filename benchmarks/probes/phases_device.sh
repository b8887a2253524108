set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; nproc
(timeout 60 python3 probe/fillthreads.py enum; timeout 70 python3 probe/fillthreads.py bounded) 2>&1 | grep -v "^INFO\|transformers\|Warn" | tee $OUT/fillthreads.log
timeout 110 python3 -m pytest -q -p no:logging -m gpu tests/test_structured_outputs.py 2>&1 | tail -3 | tee $OUT/gpu_tests.log
timeout 260 python3 probe/phases.py Qwen3-0.6B 2048 enum 1 4 2>&1 | grep -v "^INFO\|transformers\|Warn" | tee $OUT/phases.log
