set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; nproc
F='^INFO\|transformers\|Warn'
timeout 200 python3 -m pytest -q -p no:logging -m gpu tests/test_mask_kernel.py tests/test_structured_outputs.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
timeout 150 python3 probe/phases2.py Qwen3-0.6B 4096 enum 2>&1 | grep -v "$F" | tail -60 | tee $OUT/phases.log
for i in 1 2; do
 echo "== new $i"; timeout 150 python3 benchmarks/structured_outputs.py --strings enum --rounds 3 2>&1 | grep -v "$F" | grep "round\|median\|Error\|error"
 echo "== base $i"; (cd .ab-base && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python3 benchmarks/structured_outputs.py --strings enum --rounds 3 2>&1 | grep -v "$F" | grep "round\|median\|Error\|error")
done 2>&1 | tee $OUT/ab.log
