"""bench.py with every block-scaled FP8 checkpoint layer run row-wise (one scale per output row, as per-channel
checkpoints have), optionally with Hopper's fast accumulation: python probe/bench_rowwise.py [--fast] <bench flags>.
The scales are made equal along each row of blocks before the fold, so the fold applies (random weights: speed only).
"""
import runpy
import sys

import nanovllm.quantization.fp8_linear as fl

fold = fl.fold_to_channel
fl.fold_to_channel = lambda scale, rows: fold(scale.amax(dim=1, keepdim=True).expand_as(scale).contiguous(), rows)
args = sys.argv[1:]
if "--fast" in args:
    args.remove("--fast")
    fl.FAST_ACCUM = True
sys.argv = ["bench.py"] + args
runpy.run_path("bench.py", run_name="__main__")
