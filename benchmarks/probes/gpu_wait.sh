# A/B of the device-side mask wait (this tree) against main before it (.ab-base), Qwen3-0.6B shape, one GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1
source .device/setup.sh >/dev/null && source .device-xg/setup.sh >/dev/null
export PYTHONPATH=$PWD:${PYTHONPATH:-}
F='^INFO\|transformers\|Warn'
python3 -c "from nanovllm.utils.random_checkpoint import default_checkpoint; default_checkpoint('Qwen3-0.6B')" | tail -1
timeout 200 python3 -m pytest -q -p no:logging -m gpu tests/test_mask_kernel.py tests/test_structured_outputs.py tests/test_sampler.py 2>&1 | tail -8 | tee $OUT/gpu_tests.log
for side in new base new; do
  dir=.; [ $side = base ] && dir=.ab-base
  echo "== $side phases"; (cd $dir && PYTHONPATH=$PWD:$PYTHONPATH timeout 110 python3 $OLDPWD/probe/phases3.py Qwen3-0.6B 4096 enum 2>&1 | grep -v "$F" | grep "==\|step decode\|step prefill\|wait for answer\|m launch\|m finish\|confirm")
done 2>&1 | tee $OUT/ab.log
timeout 150 python3 benchmarks/structured_outputs.py --shape Qwen3-0.6B --strings enum --rounds 2 2>&1 | grep -v "$F" | tail -12 | tee $OUT/bench06.log
