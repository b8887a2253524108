"""A decode step's matmuls as the step runs them, one after another (28 layers x qkv, o, gate_up, down), on the
GPU: cuBLAS against a split-K Triton kernel that can prefetch its weights into L2 and launch early.

    PYTHONPATH=tests python docs/experiments/gemm_chain_prefetch_pdl.py [--batches 16,64,128,256]
        [--block-n 32,64 --block-k 128 --stages 3 --programs 132,264 --prefetch 0,1 --pdl 0,1]

Each layer matmul here moves 4-12 MB of weights, so a lone kernel spends most of its time ramping up (cuBLAS
reads them at 0.7-2 TB/s, tests/microbench_gemm.py). Two ideas against that: (1) each program first asks for
its whole weight slice with one bulk L2 prefetch per row, so the DRAM pipe fills at once instead of
num_stages tiles at a time; (2) programmatic dependent launch: a kernel lets the next one start at once, and
that one prefetches its weights (which do not depend on the kernel before) before it waits for it.
Timed inside a CUDA graph, as the engine replays decode steps; the output of each matmul feeds the next.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from cuda_timing import graph_time_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chain_gemm(x_ptr, w_ptr, y_ptr, part_ptr, counters_ptr, M, N, K, x_stride, y_stride, k_per_split, split_k,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k_start = split * k_per_split
    w_rows = w_ptr + cols.to(tl.int64) * K + k_start
    if PREFETCH:
        _prefetch_l2(w_rows, tl.where(col_ok, k_per_split * 2, 0))
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * x_stride + k_start + ks[None, :]
    w_tile = w_rows[:, None] + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_tile + k, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + rows[:, None] * y_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if split_k == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
        return
    tile_part = part_ptr + rows[:, None] * N + cols[None, :]
    tl.store(tile_part + split * M * N, acc, mask=mask)
    tl.debug_barrier()
    counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for other in range(0, split_k):
            total += tl.load(tile_part + other * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter, 0)


def chain_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, part: torch.Tensor, counters: torch.Tensor,
               block_n: int, programs: int, prefetch: bool, pdl: bool, block_k: int = 128, stages: int = 3) -> None:
    """out = x @ weight.T, K split until there are about `programs` programs."""
    m, k = x.shape
    n = weight.size(0)
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split_k = 1
    while tiles * split_k < programs and k % (block_k * split_k * 2) == 0:
        split_k *= 2
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _chain_gemm[grid](x, weight, out, part, counters, m, n, k, x.stride(0), out.stride(0), k // split_k, split_k,
                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, PDL=pdl,
                      num_warps=4, num_stages=stages, launch_pdl=pdl)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,64,128,256")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--block-n", default="32,64")
    parser.add_argument("--block-k", default="128")
    parser.add_argument("--stages", default="3")
    parser.add_argument("--programs", default="132,264", help="split K until a matmul has about this many programs")
    parser.add_argument("--prefetch", default="0,1")
    parser.add_argument("--pdl", default="0,1")
    args = parser.parse_args()
    h, q, kv, inter = 1024, 16 * 128, 8 * 128, 3072
    shapes = [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * inter, h), ("down", h, inter)]
    weights = [[torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5 for _, n, k in shapes]
               for _ in range(args.layers)]
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")  # left at zero by the kernel
    print("| M | variant | us per step | us per matmul | max abs diff (qkv) |")
    print("| --- | --- | --- | --- | --- |")
    for m in [int(b) for b in args.batches.split(",")]:
        bufs = {"hidden": torch.randn(m, h, dtype=torch.bfloat16, device="cuda"),
                "qkv": torch.empty(m, q + 2 * kv, dtype=torch.bfloat16, device="cuda"),
                "gate_up": torch.empty(m, 2 * inter, dtype=torch.bfloat16, device="cuda")}
        part = torch.empty(16 * m * 2 * inter, dtype=torch.float32, device="cuda")
        # (input, output) per matmul: qkv reads hidden, o reads the q part, gate_up reads hidden, down the gate part
        wiring = [(bufs["hidden"], bufs["qkv"]), (bufs["qkv"][:, :q], bufs["hidden"]),
                  (bufs["hidden"], bufs["gate_up"]), (bufs["gate_up"][:, :inter], bufs["hidden"])]
        def step(fn, wiring=wiring):
            return [lambda w=w, x=x, y=y: fn(x, w, y) for layer in weights for w, (x, y) in zip(layer, wiring)]

        us = graph_time_us(step(lambda x, w, y: torch.matmul(x, w.t(), out=y)))
        print(f"| {m} | cuBLAS | {us * len(shapes) * args.layers:.0f} | {us:.2f} | - |")
        lists = [[int(v) for v in getattr(args, name).split(",")]
                 for name in ("block_n", "block_k", "stages", "programs", "prefetch", "pdl")]
        for block_n, block_k, stages, programs, prefetch, pdl in itertools.product(*lists):
            options = dict(block_n=block_n, block_k=block_k, stages=stages, programs=programs, prefetch=bool(prefetch),
                           pdl=bool(pdl))
            expected = F.linear(bufs["hidden"], weights[0][0]).float()
            try:
                chain_gemm(bufs["hidden"], weights[0][0], bufs["qkv"], part, counters, **options)
                diff = (bufs["qkv"].float() - expected).abs().max().item()
                us = graph_time_us(step(lambda x, w, y, o=options, p=part: chain_gemm(x, w, y, p, counters, **o)))
            except Exception as exc:  # noqa: BLE001 - a tile config may not fit in shared memory; go on
                print(f"| {m} | triton {options} | failed: {type(exc).__name__} | | |")
                continue
            print(f"| {m} | triton {options} | {us * len(shapes) * args.layers:.0f} | {us:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
