set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u
#timeout 150 python3 -m pytest -q -p no:logging -m gpu tests/test_structured_outputs.py 2>&1 | tail -3 | tee $OUT/gpu_tests.log
timeout 330 python3 probe/phases.py Qwen3-0.6B 2048 enum 0.0005 0.0001 0.00002 2>&1 | grep -v "^INFO\|transformers\|Warn" | tee $OUT/phases.log
