"""bench.py with the FP8 cache's decode kernel chosen:
    python benchmarks/probes/fp8_decode_cuda/bench_ab.py {cuda|triton} <bench.py flags>
"""
import runpy
import sys

if sys.argv[1] == "triton":
    import nanovllm.attention.paged_decode as pd
    pd.decode_kernel = lambda q, group: None
sys.argv = ["bench.py"] + sys.argv[2:]
runpy.run_path("bench.py", run_name="__main__")
