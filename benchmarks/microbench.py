"""One microbenchmark entry point per subsystem; every subcommand but --help needs a CUDA GPU.

    python benchmarks/microbench.py decode      decode attention alone (ours against flash-attn's paged kernel)
    python benchmarks/microbench.py fp8-decode  the decode kernel over a bf16 and an FP8 KV cache
    python benchmarks/microbench.py gemm        a decode step's matmuls: cuBLAS against a split-K Triton kernel
    python benchmarks/microbench.py fp8-gemm    one layer's matmuls: bf16 against the FP8 kernels, with errors
    python benchmarks/microbench.py moe         one MoE layer's experts: fused Triton against a per-expert loop
    python benchmarks/microbench.py prefill     prefill alone through the engine, tokens/s, then a kernel profile
    python benchmarks/microbench.py sampler     the sampler alone per sampling option, device and host time

`python benchmarks/microbench.py SUBCOMMAND --help` gives a subcommand's options and what it measures. The timers
(graph_time_us: calls captured in a CUDA graph and replayed; loop_time_us: an eager loop) are shared by all.
"""
import argparse
import functools
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from random import randint, seed

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.attention.paged_decode import TUNED, default_max_splits, paged_decode_attention
from nanovllm.attention.paged_decode_cuda import decode_kernel
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.fused_moe import TileConfig, experts_torch, experts_triton, route, tile_config
from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_flashinfer import flashinfer_block_mm, flashinfer_fits
from nanovllm.quantization.fp8_fused import Fp8Input
from nanovllm.quantization.fp8_linear import quantize_blockwise
from nanovllm.quantization.kv_quant import quantize
from nanovllm.sampling import top_p_passes
from nanovllm.sampling.floors import LargestLogits
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.top_p_floor import ScratchLayout, top_p_floors
from nanovllm.utils.random_checkpoint import SHAPES, default_checkpoint


def graph_time_us(calls: list[Callable[[], object]], repeat: int = 1) -> float:
    """Device time per call of `calls` (run in order, `repeat` times), replayed from one CUDA graph as the
    engine replays decode steps, so no Python launch cost is in the figure."""
    for call in calls:  # compile and warm up outside the capture
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeat * len(calls))


def loop_time_us(fn: Callable[[], object], iters: int = 30) -> float:
    """Time per call of `fn` called back to back, launches included (after one untimed call): for calls that
    cannot be captured in a graph or whose host work is part of what is measured."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


# --- decode --------------------------------------------------------------------------------------------------------

DECODE_DOC = """\
Decode attention alone, on the GPU: flash-attn's paged kernel against ours, as effective HBM bandwidth.

    python benchmarks/microbench.py decode [--heads 16 --kv-heads 8]

The batch mimics the middle of bench.py's run: 256 sequences, contexts uniform in [100, 2048], 256-token pages
scattered over the cache, a full-width block table (as the CUDA graphs see it).
"""


@triton.jit
def _read_all(x_ptr, out_ptr, per_program, BLOCK: tl.constexpr):
    # the attention kernel's ceiling: every byte read once, as wide and as many at a time as the GPU allows
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, per_program, BLOCK):
        acc += tl.load(x_ptr + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _paged_read(k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, split_len, bt_stride,
                cache_block_stride, cache_token_stride, cache_head_stride,
                HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    # decode attention's memory traffic alone: the same grid, pages and chunks, with a sum in place of the math
    kv_head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK_N):
        page = tl.load(block_tables_ptr + seq * bt_stride + first // PAGE).to(tl.int64)
        tokens = first + tl.arange(0, BLOCK_N)
        valid = tokens < end
        offsets = (page * cache_block_stride + (tokens % PAGE)[:, None] * cache_token_stride
                   + kv_head * cache_head_stride + dims[None, :])
        acc += tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + (seq * tl.num_programs(0) + kv_head) * tl.num_programs(2) + split, tl.sum(acc))


def paged_read_us(k_cache, v_cache, block_tables, context_lens, splits: int, block_n: int = 64,
                  warps: int = 4) -> float:
    batch, (_, page, kv_heads, head_dim) = context_lens.numel(), k_cache.shape
    split_len = triton.cdiv(triton.cdiv(block_tables.size(1) * page, splits), block_n) * block_n
    num_splits = triton.cdiv(block_tables.size(1) * page, split_len)
    out = torch.empty(batch * kv_heads * num_splits, dtype=torch.float32, device=k_cache.device)
    call = functools.partial(_paged_read[(kv_heads, batch, num_splits)], k_cache, v_cache, block_tables,
                             context_lens, out, split_len, block_tables.stride(0), *k_cache.stride()[:3],
                             HEAD_DIM=head_dim, PAGE=page, BLOCK_N=block_n, num_warps=warps)
    return graph_time_us([call], repeat=50)


def streaming_read_ceiling() -> None:
    """HBM read bandwidth with no paging, no scattering and no arithmetic to speak of."""
    x = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")  # 2 GiB, 40x the L2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print("| streaming read of 2 GiB | us | GB/s |")
    print("| --- | --- | --- |")
    for programs_per_sm, block, warps in itertools.product((4, 8, 16), (2048, 8192), (4, 8)):
        programs = sms * programs_per_sm
        per_program = x.numel() // programs // block * block
        out = torch.empty(programs, dtype=torch.float32, device="cuda")
        call = functools.partial(_read_all[(programs,)], x, out, per_program, BLOCK=block, num_warps=warps)
        us = graph_time_us([call], repeat=5)
        print(f"| {programs_per_sm} programs/SM, {block} per load, {warps} warps | {us:.0f} | "
              f"{programs * per_program * 2 / us / 1e3:.0f} |")
    us = graph_time_us([lambda: x.sum(dtype=torch.float32)], repeat=5)
    print(f"| torch x.sum() | {us:.0f} | {x.numel() * 2 / us / 1e3:.0f} |")


def decode(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py decode", description=DECODE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--paged-read", action="store_true", help="time the kernel's K/V reads without its math")
    parser.add_argument("--ceiling", action="store_true", help="only time a plain streaming read of HBM")
    args = parser.parse_args(argv)
    if args.ceiling:
        return streaming_read_ceiling()
    torch.manual_seed(0)
    page, head_dim, width = 256, 128, 16
    num_blocks = args.batch * width + 100
    k_cache = torch.randn(num_blocks, page, args.kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(args.batch, args.heads, head_dim, dtype=torch.bfloat16, device="cuda")
    context_lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), dtype=torch.int32,
                                 device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda")[: args.batch * width].view(args.batch, width).int()
    gbytes = context_lens.sum().item() * args.kv_heads * head_dim * 2 * 2 / 1e9
    scale = head_dim ** -0.5

    from flash_attn import flash_attn_with_kvcache

    def flash(num_splits: int = 0):
        return flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                       block_table=block_tables, softmax_scale=scale, causal=True,
                                       num_splits=num_splits).squeeze(1)

    reference = flash()
    counters = torch.zeros(args.batch * args.kv_heads, dtype=torch.int32, device="cuda")
    print(f"batch {args.batch}, heads {args.heads}/{args.kv_heads}, KV read {gbytes * 1e3:.0f} MB per call")
    print("| kernel | us | GB/s | max abs diff vs flash-attn |")
    print("| --- | --- | --- | --- |")
    for splits in (0, 1, 2, 4, 8):
        ms = graph_time_us([functools.partial(flash, splits)], repeat=50) / 1e3
        print(f"| flash-attn num_splits={splits} | {ms * 1e3:.1f} | {gbytes / ms * 1e3:.0f} | - |")
    if args.paged_read:  # the same traffic without the attention math: how much of the gap is the math?
        splits = default_max_splits(args.batch, args.kv_heads)
        ours = functools.partial(paged_decode_attention, q, k_cache, v_cache, block_tables, context_lens, scale,
                                 counters)
        us = graph_time_us([ours], repeat=50)
        print(f"| attention, {splits} slices | {us:.1f} | {gbytes / us * 1e6:.0f} | - |")
        for block_n, warps in ((64, 4), (64, 8), (128, 8)):
            us = paged_read_us(k_cache, v_cache, block_tables, context_lens, splits, block_n, warps)
            name = f"paged read only, {splits} slices, n={block_n} w={warps}"
            print(f"| {name} | {us:.1f} | {gbytes / us * 1e6:.0f} | - |")
        return
    configs = [(64, 4, 2, None)]  # the defaults
    if args.sweep:
        configs = list(itertools.product((32, 64, 128), (4,), (2,), (4, 8, 16, 32, 64)))
    for block_n, warps, stages, splits in configs:
        ours = functools.partial(paged_decode_attention, q, k_cache, v_cache, block_tables, context_lens, scale,
                                 counters, block_n=block_n, num_warps=warps, num_stages=stages, max_splits=splits)
        try:
            diff = (ours().float() - reference.float()).abs().max().item()
            ms = graph_time_us([ours], repeat=50) / 1e3
        except Exception as exc:  # a config may not fit in shared memory
            print(f"| triton n={block_n} w={warps} s={stages} splits={splits} | failed: {type(exc).__name__} | | |")
            continue
        print(f"| triton n={block_n} w={warps} s={stages} splits={splits} | {ms * 1e3:.1f} | "
              f"{gbytes / ms * 1e3:.0f} | {diff:.2e} |")
    # the same data with each page stored head by head ([blocks, kv_heads, page, head_dim] in memory): a
    # (sequence, head) program then reads contiguous 16 KB runs instead of 256-byte rows 2 KB apart
    head_major = [c.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for c in (k_cache, v_cache)]
    for splits in (None, 4):
        ours = functools.partial(paged_decode_attention, q, *head_major, block_tables, context_lens, scale, counters,
                                 max_splits=splits)
        diff = (ours().float() - reference.float()).abs().max().item()
        ms = graph_time_us([ours], repeat=50) / 1e3
        print(f"| triton head-major pages, splits={splits} | {ms * 1e3:.1f} | {gbytes / ms * 1e3:.0f} | {diff:.2e} |")


# --- fp8-decode ----------------------------------------------------------------------------------------------------

FP8_DECODE_DOC = """\
The paged decode kernels over a bf16 cache and an FP8 cache (one scale per layer, the engine's; the FP8 cache by
the Triton kernel and by the CUDA one where it runs), on the GPU: time and effective bandwidth of the bytes read,
against the FP8 bytes read alone through the same pages (the fastest of 4-32 slices per sequence), and (--sweep)
every chunk size / warps / stages setting of the Triton kernel and other slice counts of each.

    python benchmarks/microbench.py fp8-decode                       # the long-context shape (64 x 6k-14.8k)
    python benchmarks/microbench.py fp8-decode --batch 256 --min-context 100 --max-context 2048   # bench.py's
    python benchmarks/microbench.py fp8-decode --sweep               # the table paged_decode.TUNED comes from
    python benchmarks/microbench.py fp8-decode --flashinfer          # and FlashInfer's decode over the same FP8
                                                                      # cache, query in bf16 (needs nvcc: JIT)

Also prints each output's largest difference from the bf16 one: a kernel that rounds the query or the
probabilities to e4m3 shows it there. FlashInfer's wrapper cannot be captured in a graph here, so its rows and a
row of ours are timed as calls back to back, launches included.
"""


def fp8_decode(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py fp8-decode", description=FP8_DECODE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=6000)
    parser.add_argument("--max-context", type=int, default=14800)
    parser.add_argument("--sweep", action="store_true", help="time every (BLOCK_N, warps, stages) per cache dtype")
    parser.add_argument("--flashinfer", action="store_true",
                        help="also FlashInfer's paged decode (tensor cores and CUDA cores) over the FP8 cache")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    page, head_dim = 256, 128
    width = -(-max(args.max_context, 4096) // page)
    num_blocks = args.batch * width + 16
    k = torch.randn(num_blocks, page, args.kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(args.batch, args.heads, head_dim, dtype=torch.bfloat16, device="cuda")
    context_lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), dtype=torch.int32,
                                 device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda")[: args.batch * width].view(args.batch, width).int()
    counters = torch.zeros(args.batch * args.kv_heads, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    k_scale, v_scale = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    tokens = context_lens.sum().item() * args.kv_heads
    fp8_bytes = tokens * head_dim * 2
    cuda = decode_kernel(q, args.heads // args.kv_heads) is not None
    cases = [("bf16", k, v, {}, tokens * head_dim * 2 * 2),
             ("fp8, Triton kernel", k8, v8, dict(k_scale=k_scale, v_scale=v_scale, fp8_kernel="triton"), fp8_bytes)]
    if cuda:
        cases.append(("fp8, CUDA kernel", k8, v8, dict(k_scale=k_scale, v_scale=v_scale), fp8_bytes))
    # the ceiling: the FP8 cache's bytes read through the same pages, summed (seen as bf16 pairs), with whichever
    # slice count and warps read fastest: neither kernel's own slicing is taken as given
    ceiling_us = min(paged_read_us(k8.view(torch.bfloat16), v8.view(torch.bfloat16), block_tables, context_lens,
                                   slices, block_n=64, warps=warps)
                     for warps in (2, 4, 8) for slices in (4, 8, 16, 32))
    print(f"batch {args.batch}, heads {args.heads}/{args.kv_heads}, contexts {args.min_context}-{args.max_context}; "
          f"FP8 bytes read through the same pages alone: {ceiling_us:.1f} us, {fp8_bytes / ceiling_us / 1e3:.0f} GB/s")
    print("| KV cache | us | MB read | GB/s | speed-up vs bf16 | of the FP8 read ceiling | max abs diff vs bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    reference, base = None, None
    for name, kc, vc, scales, nbytes in cases:
        call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                 **scales)
        out = call().float()
        reference = out if reference is None else reference
        us = graph_time_us([call], repeat=20)
        base = base or us
        print(f"| {name} | {us:.1f} | {nbytes / 1e6:.0f} | {nbytes / us / 1e3:.0f} | {base / us:.2f}x | "
              f"{ceiling_us / us * nbytes / fp8_bytes:.0%} | {(out - reference).abs().max().item():.2e} |")
    if args.flashinfer:
        ours = functools.partial(paged_decode_attention, q, k8, v8, block_tables, context_lens, scale, counters,
                                 k_scale=k_scale, v_scale=v_scale)
        nbytes = fp8_bytes
        for name, call in [("fp8, ours, calls back to back", ours)] + flashinfer_fp8_decode_calls(
                q, k8, v8, block_tables, context_lens, page, scale, k_scale, v_scale):
            out = call().float()
            us = loop_time_us(call, iters=50)
            print(f"| {name} | {us:.1f} | {nbytes / 1e6:.0f} | {nbytes / us / 1e3:.0f} | {base / us:.2f}x | "
                  f"{(out - reference).abs().max().item():.2e} |")
    if not args.sweep:
        return
    print("\n| KV cache | BLOCK_N | warps | stages | us | GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, kc, vc, scales, nbytes in cases[:2]:  # the Triton kernel's settings
        timings = {}
        for block_n, warps, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4)):
            call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                     block_n=block_n, num_warps=warps, num_stages=stages, **scales)
            try:
                timings[block_n, warps, stages] = graph_time_us([call], repeat=10)
            except Exception as error:  # a setting that needs more shared memory than the GPU has
                print(f"| {name} | {block_n} | {warps} | {stages} | failed: {type(error).__name__} | |")
        for setting, us in sorted(timings.items(), key=lambda item: item[1])[:5]:
            print(f"| {name} | {setting[0]} | {setting[1]} | {setting[2]} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
        tuned = TUNED[name != "bf16"]
        print(f"| {name} (TUNED {tuned}) | | | | {timings.get(tuned, float('nan')):.1f} | |")
    for name, kc, vc, scales, _ in cases:  # slices per sequence other than each kernel's rule
        for splits in (4, 8, 16, 32):
            call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                     max_splits=splits, **scales)
            print(f"| {name} (max_splits {splits}) | | | | {graph_time_us([call], repeat=10):.1f} | |")


def flashinfer_fp8_decode_calls(q, k8, v8, block_tables, context_lens, page: int, scale: float, k_scale: float,
                                v_scale: float) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """FlashInfer's batched paged decode over our FP8 cache (its NHD layout is ours), query in bf16: with tensor
    cores and with CUDA cores, each planned once for these sequences."""
    import flashinfer
    pages = (context_lens + page - 1) // page
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=q.device)
    indptr[1:] = torch.cumsum(pages, 0)
    indices = torch.cat([row[:count] for row, count in zip(block_tables, pages.tolist())]).int()
    last_page_len = (context_lens - (pages - 1) * page).int()
    calls = []
    for tensor_cores in (True, False):
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last_page_len, q.size(1), k8.size(2), q.size(2), page,
                     q_data_type=torch.bfloat16, kv_data_type=k8.dtype, sm_scale=scale)
        label = f"fp8, FlashInfer {getattr(wrapper, 'resolved_backend', '?')}, " + (
            "tensor cores" if tensor_cores else "CUDA cores")
        calls.append((label, functools.partial(wrapper.run, q, (k8, v8), k_scale=k_scale, v_scale=v_scale)))
    return calls


# --- gemm ----------------------------------------------------------------------------------------------------------

GEMM_DOC = """\
Decode-step matmuls alone, on the GPU: cuBLAS (F.linear) against a split-K Triton kernel, per shape and batch.

    python benchmarks/microbench.py gemm [--hidden 1024 --intermediate 3072 --heads 16 --kv-heads 8]

Weights rotate through enough copies to overflow L2, as in a decode step where ~1 GB of other weights and KV
pass between two uses of the same matrix. Timed inside a CUDA graph, as the engine runs decode.
"""


@triton.jit
def _skinny_gemm(x_ptr, w_ptr, y_ptr, part_ptr, counters_ptr, M, N, K, x_stride, y_stride, k_per_split,
                 split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWAP: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    if SWAP:  # (W x^T)^T: the weight rows fill the MMA's M side, the few token rows its N side
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
            x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_tile + k, mask=col_ok[:, None], other=0.0)
            acc_t = tl.dot(w, tl.trans(x), acc_t)
        acc = tl.trans(acc_t)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
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


def default_config(m: int, n: int, k: int) -> dict:
    """Tile sizes and K split for an (m x k) @ (k x n) product; from `microbench.py gemm --sweep`."""
    block_n = 64
    split_k = 1
    while split_k < 8 and triton.cdiv(n, block_n) * split_k < 256 and k % (128 * split_k * 2) == 0:
        split_k *= 2
    return dict(block_n=block_n, block_k=128, split_k=split_k, num_stages=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor | None = None,
                out: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T -> [m, n] in x's dtype, float32 accumulation.

    `counters` is int32 scratch of at least cdiv(m, 128) * cdiv(n, block_n) zeros, left at zero."""
    m, k = x.shape
    n = weight.size(0)
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.size(1) == k
    config = {**default_config(m, n, k), **config}
    block_n, block_k, split_k = config["block_n"], config["block_k"], config["split_k"]
    assert k % (block_k * split_k) == 0, (k, block_k, split_k)
    swap = config.get("swap", False)
    block_m = config.get("block_m") or min(128, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    if counters is None:
        counters = torch.zeros(grid[0] * grid[2], dtype=torch.int32, device=x.device)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else x
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    _skinny_gemm[grid](x, weight, out, part, counters, m, n, k, x.stride(0), out.stride(0), k // split_k, split_k,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, num_warps=config.get("warps", 4),
                       num_stages=config["num_stages"])
    return out


def gemm(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py gemm", description=GEMM_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batches", default="16,64,128,256")
    parser.add_argument("--sweep", action="store_true", help="try every tile config, not just the default choice")
    parser.add_argument("--swap-sweep", action="store_true", help="sweep the swapped-operand kernel")
    parser.add_argument("--blas", default="cublas", choices=("cublas", "cublaslt"), help="torch's BLAS backend")
    args = parser.parse_args(argv)
    torch.backends.cuda.preferred_blas_library(args.blas)
    h, d = args.hidden, 128
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * d, h), "o": (h, args.heads * d),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate), "lm_head": (151936, h)}
    print("| shape | M | cuBLAS us | cuBLAS TB/s | triton us | triton config | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    totals: dict[tuple[str, int], float] = {}
    for (name, (n, k)), m in itertools.product(shapes.items(), [int(b) for b in args.batches.split(",")]):
        copies = max(1, -(-128 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        cublas = graph_time_us([lambda w=w, o=o, x=x: torch.matmul(x, w.t(), out=o) for w, o in zip(weights, outs)],
                               repeat=3)
        expected = F.linear(x, weights[0]).float()
        totals[("cublas", m)] = totals.get(("cublas", m), 0.0) + cublas * (1 if name == "lm_head" else 28)
        counters = torch.zeros(4096, dtype=torch.int32, device="cuda")  # left at zero by the kernel
        configs = [None]
        if args.sweep and name != "lm_head":
            configs = list(itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4,)))
        if args.swap_sweep and name != "lm_head":
            configs = [(bn, bk, sk, 3, swap, bm) for bn, bk, sk, swap, bm in itertools.product(
                (64, 128), (128, 256), (1, 2, 4, 8, 16), (False, True), (16, 64)) if bm <= max(16, m)]
        best = (float("inf"), None, 0.0)
        for config in configs:
            options = {} if config is None else dict(zip(("block_n", "block_k", "split_k", "num_stages", "swap",
                                                          "block_m"), config))
            if options and (k % (options["block_k"] * options["split_k"]) or n < options["block_n"]):
                continue
            try:
                diff = (skinny_gemm(x, weights[0], counters, **options).float() - expected).abs().max().item()
                calls = [functools.partial(skinny_gemm, x, w, counters, o, **options) for w, o in zip(weights, outs)]
                us = graph_time_us(calls, repeat=3)
            except Exception as exc:  # noqa: BLE001 - a config may not fit; report and go on
                print(f"| {name} | {m} | config {options} failed: {type(exc).__name__} |")
                continue
            if us < best[0]:
                best = (us, options or "default", diff)
        totals[("triton", m)] = totals.get(("triton", m), 0.0) + best[0] * (1 if name == "lm_head" else 28)
        print(f"| {name} {n}x{k} | {m} | {cublas:.1f} | {n * k * 2 / cublas / 1e6:.2f} | {best[0]:.1f} | "
              f"{best[1]} | {best[2]:.1e} |")
        del weights, outs
    for m in sorted({m for _, m in totals}):
        print(f"per decode step at M={m} (28 layers + LM head): cuBLAS {totals[('cublas', m)]:.0f} us, "
              f"triton {totals[('triton', m)]:.0f} us")


# --- fp8-gemm ------------------------------------------------------------------------------------------------------

FP8_GEMM_DOC = """\
One decoder layer's four matmuls on the GPU: bf16 against row-wise FP8, cuBLAS's block-wise FP8 and FlashInfer's
block-wise FP8 (when installed, on Hopper), per number of rows, with each FP8 kernel's error against float32.

    python benchmarks/microbench.py fp8-gemm [--shape Qwen3-8B,Llama-3.1-8B] [--rows 1,16,64,256,8192] [--out DIR]

Each FP8 mode is timed with the activation quantization the engine runs before it (nanovllm/quantization/fp8_linear.py,
"+quant") and without it (the matmul alone, on the engine's own padded input); row-wise also with Hopper's fast
accumulation ("fast"). Speed-ups are against bf16 F.linear at the same rows. Weights rotate through enough copies
to overflow L2, as in a forward pass where the other layers' weights pass between two uses of the same matrix;
timed inside a CUDA graph, as decode runs.

Error: max |y - ref| / max |ref| over the layer's outputs (the GPU tests' bar is 1%) and mean |y - ref| / mean |ref|,
against the same quantization multiplied in float32, the worst of the four layers. The routing table at the end
takes, per row count, the faster of cuBLAS and FlashInfer (the matmul alone: both read the same quantized input)
among those within the bar and no more than 1.25x cuBLAS's mean error, and prints it as fp8_routes.MEASURED_ROUTES.
--out writes the tables (markdown) and the measurements (JSON) there.
"""


ROWS = "1,2,4,8,16,24,31,32,48,64,96,128,192,256,384,512,1024,2048,4096,8192"
MAX_ERROR, MEAN_ERROR_VS_CUBLAS = 0.01, 1.25


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of qkv, o, gate_up and down for one layer of a dense shape."""
    c = SHAPES[shape]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, c["hidden_size"]), "o": (c["hidden_size"], q),
            "gate_up": (2 * c["intermediate_size"], c["hidden_size"]),
            "down": (c["hidden_size"], c["intermediate_size"])}


def flashinfer_ready(device: torch.device) -> str | None:
    """Why FlashInfer's modes are left out, or None."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "not a Hopper GPU"
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"flashinfer does not import ({error})"
    return None


def fp8_gemm(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py fp8-gemm", description=FP8_GEMM_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="Qwen3-8B,Llama-3.1-8B", help="comma-separated dense shapes")
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--copies", type=int, default=4, help="weight copies rotated per layer (past L2)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the tables and JSON")
    parser.add_argument("--producers", action="store_true",
                        help="time RMSNorm and SiLU-and-mul writing the quantized input against the op, then the "
                             "quantization kernel (quantization/fp8_fused.py)")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    fp8.SCALED_MM_ON_GPU = True  # the kernels themselves, whether or not the engine uses them yet
    rowwise, blockwise = fp8.fp8_supported(device)
    no_flashinfer = flashinfer_ready(device)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, row-wise FP8: {rowwise}, "
          f"block-wise FP8: {blockwise}, FlashInfer: {no_flashinfer or 'yes'}")
    if not rowwise:
        raise SystemExit("this GPU has no FP8 matmul (needs compute capability 8.9 or later)")
    g = torch.Generator(device).manual_seed(0)
    if args.producers:
        return producers(args, g, device)
    modes = ["bf16", "row+quant", "row", "row fast", "block+quant", "block", "fi+quant", "fi"]
    modes = [m for m in modes if (blockwise or not m.startswith("block")) and (not no_flashinfer or
                                                                                 not m.startswith("fi"))]
    lines, results = [], {}
    for shape in args.shape.split(","):
        results[shape] = measure(shape, [int(r) for r in args.rows.split(",")], modes, args.copies, g, device, lines)
    if "fi" in modes:
        routing(results, lines)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_gemm.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)


def emit(lines: list[str], text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def make_weights(shape: str, copies: int, g: torch.Generator, device: torch.device) -> dict:
    weights = {}
    for name, (n, k) in layer_shapes(shape).items():
        layer = []
        for _ in range(copies):
            w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
            w8, scale = fp8.quantize_per_channel(w)
            channel = fp8.Fp8Weight(w8, scale, "channel", scale.view(1, -1))
            b8, block_scale = quantize_blockwise(w)
            block = fp8.Fp8Weight(b8, block_scale, "block", fp8.block_kernel_scale(block_scale))
            if flashinfer_fits(n, k):
                block.flashinfer_scale = block_scale.float().contiguous()
            layer.append((w, channel, block))
        weights[name] = layer
    return weights


def measure(shape: str, row_counts: list[int], modes: list[str], copies: int, g: torch.Generator,
            device: torch.device, lines: list[str]) -> dict:
    weights = make_weights(shape, copies, g, device)
    fp8_modes = [m for m in modes if m != "bf16"]
    emit(lines, f"\n{shape}: us per call, speed-up against bf16, and error against float32 (max / mean, worst layer)")
    emit(lines, "| rows | layer | " + " | ".join(f"{m} us" for m in modes) + " | " +
         " | ".join(f"{m} x" for m in fp8_modes) + " | row err | block err | fi err |")
    emit(lines, "|" + " --- |" * (2 + len(modes) + len(fp8_modes) + 3))
    out = {}
    for rows in row_counts:
        totals = dict.fromkeys(modes, 0.0)
        errors = {"row": (0.0, 0.0), "block": (0.0, 0.0), "fi": (0.0, 0.0)}
        for name, layer in weights.items():
            x = torch.randn(rows, layer[0][0].size(1), generator=g, device=device, dtype=torch.bfloat16)
            inputs = (fp8.quantized_input(x, None), fp8.quantized_input(x, fp8.BLOCK, 4))
            times = {}
            for mode in modes:
                calls = [_call(mode, x, channel, block, w, inputs) for w, channel, block in layer]
                try:
                    times[mode] = graph_time_us(calls, repeat=4) if calls[0] else float("nan")
                except RuntimeError as error:  # a mode this torch or GPU lacks: say so, time the others
                    print(f"{mode} at {rows} rows, {name}: {str(error).splitlines()[0][:200]}")
                    times[mode] = float("nan")
                totals[mode] += times[mode]
            for kind, error in layer_errors(x, *layer[0][1:], inputs, modes).items():
                errors[kind] = tuple(max(a, b) for a, b in zip(errors[kind], error))
            _row(lines, rows, name, times, modes, fp8_modes, {})
        _row(lines, rows, "layer", totals, modes, fp8_modes, errors)
        out[rows] = {"us": totals, "errors": errors}
    return out


def _call(mode, x, channel, block, w, inputs):
    (x8_row, xs_row), (x8_group, xs_group) = inputs
    rows = x.size(0)
    if mode == "bf16":
        return lambda: F.linear(x, w)
    if mode == "row+quant":
        return lambda: fp8.fp8_linear(x, channel, None)
    if mode == "block+quant":
        return lambda: fp8.fp8_linear(x, block, None)
    if mode.startswith("fi"):
        if block.flashinfer_scale is None:
            return None
        if mode == "fi+quant":
            return lambda: flashinfer_block_mm(x, block)
        return lambda: flashinfer_block_mm(Fp8Input(x8_group, xs_group, rows, x.dtype), block)
    if mode.startswith("row"):
        return lambda: torch._scaled_mm(x8_row, channel.weight.t(), scale_a=xs_row, scale_b=channel.kernel_scale,
                                        out_dtype=torch.bfloat16, use_fast_accum=mode.endswith("fast"))
    return lambda: F.scaled_mm(x8_group, block.weight.t(), xs_group, fp8.ACT_1x128, block.kernel_scale,
                               fp8.WEIGHT_128x128, output_dtype=torch.bfloat16)[:rows]


def relative_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (y.float() - ref).abs()
    return (diff.max() / ref.abs().max()).item(), (diff.mean() / ref.abs().mean()).item()


@torch.inference_mode()
def layer_errors(x, channel, block, inputs, modes) -> dict[str, tuple[float, float]]:
    """Each FP8 kernel's output against its own quantization multiplied in float32 (the activations as the engine
    quantizes them, the weights dequantized)."""
    (x8_row, xs_row), (x8_group, xs_group) = inputs
    rows = x.size(0)
    errors = {}
    ref = (x8_row[:rows].float() * xs_row[:rows]) @ (channel.weight.float() * channel.scale.unsqueeze(1)).t()
    errors["row"] = relative_errors(fp8.fp8_linear(x, channel, None), ref)
    if "block" in modes:
        x_dq = (x8_group[:rows].float() * xs_group[:rows].repeat_interleave(fp8.BLOCK, 1))
        ref = x_dq @ fp8.dequantize_blocks(block.weight, block.scale, torch.float32).t()
        errors["block"] = relative_errors(fp8.fp8_linear(x, block, None), ref)
        if "fi" in modes and block.flashinfer_scale is not None:
            errors["fi"] = relative_errors(flashinfer_block_mm(Fp8Input(x8_group, xs_group, rows, x.dtype), block),
                                           ref)
    return errors


def routing(results: dict, lines: list[str]) -> None:
    """Per row count, the faster accurate block-scaled kernel over every shape measured (all must agree for
    FlashInfer to win a row count), and the routes that gives."""
    emit(lines, "\n| rows | " + " | ".join(f"{s} cuBLAS / FlashInfer us" for s in results) + " | kernel |")
    emit(lines, "|" + " --- |" * (2 + len(results)))
    winners = []
    for rows in next(iter(results.values())):
        cells, wins = [], True
        for measured in results.values():
            us, errors = measured[rows]["us"], measured[rows]["errors"]
            accurate = errors["fi"][0] <= MAX_ERROR and errors["fi"][1] <= MEAN_ERROR_VS_CUBLAS * errors["block"][1]
            wins &= accurate and us["fi"] < us["block"]
            cells.append(f"{us['block']:.1f} / {us['fi']:.1f}{'' if accurate else ' (inaccurate)'}")
        winners.append((rows, "flashinfer" if wins else "cublas"))
        emit(lines, f"| {rows} | " + " | ".join(cells) + f" | {winners[-1][1]} |")
    emit(lines, f"\nsuggested for nanovllm/quantization/fp8_routes.py: MEASURED_ROUTES = {suggest_routes(winners)!r}")


def suggest_routes(winners: list[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """Routes from the winner at each measured row count: an entry ends at the last row count of a run of equal
    winners, so a row count between two measured ones takes the larger one's winner; past the last entry, cuBLAS."""
    routes = [(rows, kernel) for (rows, kernel), following in zip(winners, winners[1:] + [(0, None)])
              if kernel != following[1]]
    while routes and routes[-1][1] == "cublas":
        routes.pop()
    return tuple(routes)


def producers(args: argparse.Namespace, g: torch.Generator, device: torch.device) -> None:
    """The ops before the block-scaled matmuls, per row count: unfused (the op, then the quantization kernel)
    against fused, in us."""
    from nanovllm.layers.activation import silu_and_mul
    from nanovllm.layers.layernorm import add_rms_norm
    from nanovllm.quantization.fp8_fused import rms_norm_quantized, silu_and_mul_quantized

    c = SHAPES[args.shape.split(",")[0]]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    print("| rows | add+RMSNorm, quantize | fused | SiLU-and-mul, quantize | fused |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        x, residual = (torch.randn(rows, hidden, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        gate_up = torch.randn(rows, 2 * inter, generator=g, device=device, dtype=torch.bfloat16)
        calls = [lambda x, residual: fp8.quantized_input(add_rms_norm(x, residual, weight, 1e-6)[0], 128, 4),
                 lambda x, residual: rms_norm_quantized(x, weight, 1e-6, residual)]
        times = [graph_time_us([functools.partial(call, x, residual)], repeat=20) for call in calls]
        times += [graph_time_us([functools.partial(call, gate_up)], repeat=20)
                  for call in (lambda y: fp8.quantized_input(silu_and_mul(y), 128, 4), silu_and_mul_quantized)]
        print(f"| {rows} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


def _row(lines: list[str], rows: int, name: str, times: dict[str, float], modes: list[str], fp8_modes: list[str],
         errors: dict[str, tuple[float, float]]) -> None:
    base = times["bf16"]
    error_cells = [f"{errors[k][0]:.4f} / {errors[k][1]:.4f}" if errors.get(k, (0.0, 0.0))[0] else ""
                   for k in ("row", "block", "fi")]
    emit(lines, f"| {rows} | {name} | " + " | ".join(f"{times[m]:.1f}" for m in modes) + " | " +
         " | ".join(f"{base / times[m]:.2f}" for m in fp8_modes) + " | " + " | ".join(error_cells) + " |")


# --- moe -----------------------------------------------------------------------------------------------------------

MOE_DOC = """\
One MoE layer's experts alone on the GPU: the fused Triton path against a per-expert loop, per batch size.

    python benchmarks/microbench.py moe [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--sweep]

Defaults are Qwen3-30B-A3B's shapes at TP=1 (--inter 384 for one rank of TP=2). Routing is random and uniform.
The fused path is timed both eagerly and replayed from a CUDA graph (as the engine's decode runs it); the loop
(the CPU path, which asks the host which experts are in use) can only run eagerly. GB/s counts the weights of the
experts in use once, the floor a step cannot beat; several layers' weights rotate past L2.
"""


def calls(run, x, layers, weights, ids, *config) -> list:
    """One call of `run` per layer's weights (bound now, not when called)."""
    return [lambda w13=w13, w2=w2: run(x, w13, w2, weights, ids, *config) for w13, w2 in layers]


def moe(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py moe", description=MOE_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--batches", default="1,8,32,64,128,256,512,4096,16384")
    parser.add_argument("--layers", type=int, default=4, help="weight copies rotated through (past L2)")
    parser.add_argument("--sweep", action="store_true", help="every tile configuration per batch")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    layers = [((torch.randn(args.experts, 2 * args.inter, args.hidden, dtype=dtype, device=device) * 0.02),
               (torch.randn(args.experts, args.hidden, args.inter, dtype=dtype, device=device) * 0.02))
              for _ in range(args.layers)]
    expert_bytes = 3 * args.inter * args.hidden * 2
    print(f"{torch.cuda.get_device_name()}: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"inter {args.inter}, bf16; times per layer")
    print(f"{'tokens':>6} {'experts used':>12} {'loop us':>9} {'fused eager':>11} {'fused graph':>11} {'GB/s':>6} "
          f"{'speedup':>7}  tiles")
    for batch in map(int, args.batches.split(",")):
        x = torch.randn(batch, args.hidden, dtype=dtype, device=device)
        weights, ids = route(torch.randn(batch, args.experts, device=device), args.top_k, True)
        used = ids.unique().numel()
        config = tile_config(ids.numel(), args.experts)
        fused = calls(experts_triton, x, layers, weights, ids, config)
        graph_us = graph_time_us(fused)
        eager_us = sum(loop_time_us(call, 20) for call in fused) / len(fused)
        loop = calls(experts_torch, x, layers, weights, ids)
        loop_us = sum(loop_time_us(call, 5) for call in loop) / len(loop)
        print(f"{batch:>6} {used:>12} {loop_us:>9.1f} {eager_us:>11.1f} {graph_us:>11.1f} "
              f"{used * expert_bytes / graph_us / 1e3:>6.0f} {loop_us / graph_us:>6.1f}x  {config}")
        if args.sweep:
            # taller tiles than twice the pairs an expert gets would be mostly padding
            pairs_per_expert = ids.numel() / args.experts
            heights = [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * pairs_per_expert]
            for m, n, k, warps, stages in itertools.product(heights, (32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
                candidate = TileConfig(m, n, k, warps, stages)
                try:
                    us = graph_time_us(calls(experts_triton, x, layers, weights, ids, candidate))
                except Exception as error:  # out of shared memory for this tile shape
                    print(f"       {candidate}: {type(error).__name__}")
                    continue
                print(f"       {candidate}: {us:8.1f} us, {used * expert_bytes / us / 1e3:5.0f} GB/s")


# --- prefill -------------------------------------------------------------------------------------------------------

PREFILL_DOC = """\
Prefill alone: how fast does the engine turn prompts into KV cache, and which kernels take the time?

    python benchmarks/microbench.py prefill [--num-seqs 256]

bench.py's cold run spends ~0.3 s more than a warm run, all in prefill steps (benchmarks/diag_cold_run.py,
removed after f011e37): the prompts that later runs find in the prefix cache. This runs bench.py's prompt
lengths with one output token each, fresh prompts every trial (so nothing is cached), and reports tokens/s and
matmul TFLOP/s, then profiles one trial by kernel.
"""


def prefill(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="microbench.py prefill", description=PREFILL_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--profile-first", action="store_true", help="profile the first trial's CPU side too")
    args = parser.parse_args(argv)
    llm = LLM(default_checkpoint("Qwen3-0.6B"), max_model_len=4096)
    llm.generate(["warm up"], SamplingParams(max_tokens=1), use_tqdm=False)
    hf = llm.model_runner.config.hf_config
    # weights a prompt token passes through (the LM head only sees each sequence's last token)
    layer_params = sum(p.numel() for name, p in llm.model_runner.model.named_parameters()
                       if ".layers." in name and p.dim() == 2)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)

    def prompts(trial: int) -> list[list[int]]:
        seed(1000 + trial)
        return [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(args.num_seqs)]

    for trial in range(args.trials):
        batch = prompts(trial)
        tokens = sum(map(len, batch))
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        reserved = torch.cuda.memory_reserved()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if trial == 0 and args.profile_first:  # what the first large prefill of a process does on the CPU
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(batch, params, use_tqdm=False)
                torch.cuda.synchronize()
        else:
            llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        new_segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
        new_gib = (torch.cuda.memory_reserved() - reserved) / 2**30
        print(f"trial {trial + 1}: {tokens} prompt tokens in {elapsed:.3f} s: {tokens / elapsed:,.0f} tok/s, "
              f"matmuls {2 * layer_params * tokens / elapsed / 1e12:.0f} TFLOP/s ({hf.num_hidden_layers} layers); "
              f"{new_segments} new allocator segments ({new_gib:.2f} GiB)")
        if trial == 0 and args.profile_first:
            events = prof.key_averages()
            print("  first trial, top CPU self time:")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
                print(f"  {e.key[:80]:<80} {e.self_cpu_time_total / 1e6:6.3f} s  x{e.count}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(args.trials), params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) / 1e6
    print(f"profiled later trial: GPU kernels {total:.3f} s")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.key[:80]:<80} {e.device_time_total / 1e6:6.3f} s  x{e.count}")
    llm.exit()


# --- sampler -------------------------------------------------------------------------------------------------------

SAMPLER_DOC = """\
The sampler alone on the GPU, per step: each sampling option's device time and the host's time to prepare it.

    python benchmarks/microbench.py sampler

bf16 logits over Qwen3's 151,936-token vocabulary, as the LM head hands them over; device time by CUDA events over
repeated calls, host time by the wall clock of `prepare` + launching (the sampler runs outside the CUDA graphs, as
here; with a penalty every call copies the histories, as a prefill does). Also the step that replaces a topk over the
vocabulary: the 20 largest logits found chunk-wise; and top-p's floor search alone at 512 rows, for logits as flat
as a random model's (std 0.64) and as spread as these (std 1), with the rounds its rows took, over a few sizes.
"""


VOCAB = 151936
OPTIONS = {"plain": {}, "seeded": dict(seed=0), "top_k=20,top_p=0.95": dict(top_k=20, top_p=0.95),
           "min_p=0.05": dict(min_p=0.05), "top_p=0.9": dict(top_p=0.9), "top_p=0.9 (sorted)": dict(top_p=0.9),
           "top_k=20,top_p=0.8,T=0.7,repetition=1.05": dict(top_k=20, top_p=0.8, temperature=0.7,
                                                            repetition_penalty=1.05)}


def host_us(fn, iters: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds * 1e6 / iters


def sampler(argv: list[str]) -> None:
    argparse.ArgumentParser(prog="microbench.py sampler", description=SAMPLER_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    sampler = Sampler(device=torch.device("cuda"))
    print("| rows | sampling | device us | host us (prepare + launch) |")
    print("| --- | --- | --- | --- |")
    for rows in (64, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
        for name, options in OPTIONS.items():
            seqs = [Sequence(list(range(i, i + 100)), SamplingParams(**{"temperature": 0.6, **options, **(
                {"seed": i} if "seed" in options else {})})) for i in range(rows)]
            sampler.top_p_by_sort = name.endswith("(sorted)")
            tensors = sampler.prepare(seqs)
            device = loop_time_us(lambda logits=logits, tensors=tensors: sampler(logits, tensors))
            host = host_us(lambda logits=logits, seqs=seqs: sampler(logits, sampler.prepare(seqs)))
            print(f"| {rows} | {name} | {device:.0f} | {host:.0f} |")
        topk_us = loop_time_us(lambda logits=logits: logits.topk(20, dim=-1))
        pool_us = loop_time_us(lambda logits=logits: LargestLogits(logits, 20, chunked=True))
        print(f"| {rows} | the 20 largest: torch.topk over the vocabulary | {topk_us:.0f} | |")
        print(f"| {rows} | the 20 largest: chunk maxima, then topk over 20 chunks | {pool_us:.0f} | |")
    print()
    print("| top-p's floor search, 512 rows, T 0.6, top_p 0.9 | logits' std | device us | rows by rounds |")
    print("| --- | --- | --- | --- |")
    rows = torch.arange(512, device="cuda")
    temperatures, top_p = torch.full((512,), 0.6, device="cuda"), torch.full((512,), 0.9, device="cuda")
    for std in (0.64, 1.0):
        logits = (torch.randn(512, VOCAB, device="cuda") * std).to(torch.bfloat16)
        for sizes in (dict(), dict(num_warps=8), dict(tile_rows=128), dict(tile_rows=512, num_warps=8),
                      dict(row_warps=8)):
            floors = torch.full((512,), float("-inf"), device="cuda")
            scratch = top_p_floors(logits, rows, temperatures, top_p, floors, **sizes)
            layout = ScratchLayout(4096, 8192, sizes.get("tile_rows", 256))
            rounds = scratch[:, layout.state_at + top_p_passes.ROUNDS.value].int().cpu().numpy()
            device = loop_time_us(lambda logits=logits, floors=floors, sizes=sizes: top_p_floors(
                logits, rows, temperatures, top_p, floors, **sizes))
            print(f"| {sizes or 'default'} | {std} | {device:.0f} | {np.bincount(rounds).tolist()} |")


SUBCOMMANDS = {"decode": decode, "fp8-decode": fp8_decode, "gemm": gemm, "fp8-gemm": fp8_gemm, "moe": moe,
               "prefill": prefill, "sampler": sampler}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SUBCOMMANDS:
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    SUBCOMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
