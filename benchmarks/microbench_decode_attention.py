"""Decode attention alone, on the GPU: flash-attn's paged kernel against ours, as effective HBM bandwidth.

    python benchmarks/microbench_decode_attention.py [--heads 16 --kv-heads 8]

The batch mimics the middle of bench.py's run: 256 sequences, contexts uniform in [100, 2048], 256-token pages
scattered over the cache, a full-width block table (as the CUDA graphs see it).
"""
import argparse
import functools
import itertools

import torch
import triton
import triton.language as tl
from cuda_timing import graph_time_us

from nanovllm.attention.paged_decode import paged_decode_attention


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=100)
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--paged-read", action="store_true", help="time the kernel's K/V reads without its math")
    parser.add_argument("--ceiling", action="store_true", help="only time a plain streaming read of HBM")
    args = parser.parse_args()
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
        from nanovllm.attention.paged_decode import default_max_splits
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


if __name__ == "__main__":
    main()
