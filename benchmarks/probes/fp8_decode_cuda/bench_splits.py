"""bench.py with the FP8 decode's slice rule replaced:
    python benchmarks/probes/fp8_decode_cuda/bench_splits.py TARGET <bench.py flags>

(TARGET 0: the product's rule; else slices = next power of two of TARGET / (batch * kv_heads), 4..64)."""
import runpy
import sys

import triton

import nanovllm.attention.paged_decode as pd

target = int(sys.argv[1])
if target:
    def rule(batch: int, kv_heads: int) -> int:
        return min(64, max(4, triton.next_power_of_2(-(-target // (batch * kv_heads)))))

    pd.default_max_splits = rule
sys.argv = ["bench.py"] + sys.argv[2:]
runpy.run_path("bench.py", run_name="__main__")
