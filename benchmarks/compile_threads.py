"""How far Triton's compiler runs in parallel: decode attention compiled for sm_90 (an H100/H200), needing no GPU,
in variants that differ only in their page size, one after another, in threads of one process, and in processes.

    python benchmarks/compile_threads.py [--variants 2]

A cold start compiles each of the engine's kernels one at a time as the warmups first launch them; if threads
compile side by side, a warmup that hands its compiles to a pool could take most of that time off start-up."""
import argparse
import os
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.attention.paged_decode import _decode_attention

SM90 = GPUTarget("cuda", 90, 32)
# the argument types and constants the engine launches it with for Qwen3-0.6B in bf16
SIGNATURE = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
             "counters_ptr": "*i32", "scale_log2": "fp32", "value_scale": "fp32", "split_len": "i32",
             "num_splits": "i32", "q_stride": "i32", "out_stride": "i32", "bt_stride": "i32",
             "cache_block_stride": "i32", "cache_token_stride": "i32", "cache_head_stride": "i32"}
CONSTANTS = dict(NUM_KV_HEADS=8, GROUP=2, BLOCK_H=16, HEAD_DIM=128, BLOCK_N=64, MAX_SPLITS=16, FP8_KV=False)


def compile_variant(page: int) -> float:
    """Seconds to compile one variant, into an empty cache of its own (so nothing is found there)."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-threads-")
    constants = dict(CONSTANTS, PAGE=page)
    signature = dict(SIGNATURE, **{name: "constexpr" for name in constants})
    began = time.perf_counter()
    triton.compile(ASTSource(_decode_attention, signature, constants), target=SM90,
                   options={"num_warps": 4, "num_stages": 2})
    return time.perf_counter() - began


def timed(run) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", type=int, default=2, help="compiles per way (default 2)")
    args = parser.parse_args()
    if args.variants < 1:
        parser.error(f"--variants {args.variants}: at least 1")
    pages = iter(range(64, 1 << 30, 64))  # a page size of its own for every compile: none is ever found cached
    compile_variant(next(pages))  # the compiler's own first-use costs, outside the timings
    serial = timed(lambda: [compile_variant(next(pages)) for _ in range(args.variants)])
    threads = [threading.Thread(target=compile_variant, args=(next(pages),)) for _ in range(args.variants)]
    threaded = timed(lambda: ([t.start() for t in threads], [t.join() for t in threads]))
    with ProcessPoolExecutor(args.variants) as pool:
        list(pool.map(compile_variant, [next(pages) for _ in range(args.variants)]))  # the workers' imports
        batch = [next(pages) for _ in range(args.variants)]
        in_processes = timed(lambda: list(pool.map(compile_variant, batch)))
    print(f"decode attention for sm_90, {args.variants} variants (triton {triton.__version__}, {os.cpu_count()} "
          f"cores): one after another {serial:.2f} s, in {args.variants} threads {threaded:.2f} s, in "
          f"{args.variants} processes {in_processes:.2f} s")


if __name__ == "__main__":
    main()
