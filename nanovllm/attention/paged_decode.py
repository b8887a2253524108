"""Decode attention over the paged KV cache (one query token per sequence), split along the context.

Decode is bound by reading the KV cache, so this kernel is built around one idea: read every cached K/V row
exactly once, for all query heads that share it (GQA), with enough independent programs in flight to keep HBM
busy. Each program takes one (sequence, KV head, slice of the context) and keeps an online softmax; the last
slice of a sequence to finish merges the slices by their log-sum-exp.

An FP8 cache (quantization/kv_quant.py) halves the bytes read. Its rows are widened to float16, not bf16: e4m3 ->
float16 is one instruction per pair on Hopper (to bf16 it is a sequence of integer ops, which made the kernel
slower than on a bf16 cache), every e4m3 value is exact in float16, and so is the bf16 query in the range
attention sees. The layer's key scale is folded into the softmax scale and its value scale into the output, so
nothing is multiplied per element.
"""
import torch
import triton
import triton.language as tl

from nanovllm.attention.paged_decode_cuda import decode_kernel
from nanovllm.quantization.kv_quant import FP8

# the most slices default_max_splits gives a sequence; the merge reads this many log-sum-exps at once (masked past a
# sequence's own), so that one compiled variant serves every batch size
MERGE_WIDTH = 16


def default_max_splits(batch: int, num_kv_heads: int) -> int:
    """Slices per sequence (of the table's full width): about a thousand (sequence, KV head, slice) programs
    keep HBM busy at small batches; once the batch alone gives that many, fewer and longer slices merge less
    (the sweep is `benchmarks/microbench.py decode --sweep`)."""
    if batch * num_kv_heads >= 1024:
        return 4
    return min(MERGE_WIDTH, max(8, triton.next_power_of_2(1024 // (batch * num_kv_heads))))


# cuda_max_splits' constants: measured on an H200, applied on every GPU the CUDA kernel runs on
CUDA_TARGET_WARPS = 4096
CUDA_FEW_SLICES_FROM = 2048  # (sequence, KV head) pairs
CUDA_MAX_SPLITS = 32


def cuda_max_splits(batch: int, num_kv_heads: int) -> int:
    """Slices per sequence for the CUDA FP8 kernel. A warp walks its slice 16 tokens at a time with one step's loads
    in flight, so below 2,048 (sequence, KV head) pairs it needs more, shorter slices than the Triton kernel's
    programs do: about 4,096 warps, 8 to 32 slices. From 2,048 pairs on, 4, as the Triton rule gives: there more
    slices only add float32 partials to write and merge (measured: docs/fp8_kv_cache.md, Decode kernel)."""
    pairs = batch * num_kv_heads
    if pairs >= CUDA_FEW_SLICES_FROM:
        return 4
    return min(CUDA_MAX_SPLITS, max(8, triton.next_power_of_2(triton.cdiv(CUDA_TARGET_WARPS, pairs))))


# num_splits and MAX_SPLITS would otherwise vary with the batch size (default_max_splits), each value a compile of
# its own: in a cold start, inside the CUDA-graph capture of the sizes that need it
@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counters_ptr, scale_log2, value_scale, split_len, num_splits, q_stride, out_stride, bt_stride,
    cache_block_stride, cache_token_stride, cache_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, FP8_KV: tl.constexpr,
):
    # scale_log2: the softmax scale (times the key scale of an FP8 cache) in base 2; value_scale: an FP8 cache's
    # value scale, applied once to each slice's output
    # KV heads vary fastest in the grid: the programs of one sequence's heads start together and read the same
    # cache rows (a token's heads sit side by side), which HBM serves faster than one head of many sequences
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    slices = tl.cdiv(context_len, split_len)  # this sequence's share of the num_splits slots
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_mask = tl.arange(0, BLOCK_H) < GROUP  # the group is padded to BLOCK_H rows for tl.dot
    dims = tl.arange(0, HEAD_DIM)
    out_rows = out_ptr + seq * out_stride + heads[:, None] * HEAD_DIM + dims[None, :]
    if context_len == 0:  # a CUDA-graph padding row: zeros, so nothing downstream sees garbage
        if split == 0:
            tl.store(out_rows, tl.zeros([BLOCK_H, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=head_mask[:, None])
        return
    start = split * split_len
    if start >= context_len:
        return
    end = tl.minimum(start + split_len, context_len)

    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :], mask=head_mask[:, None], other=0.0)
    if FP8_KV:
        q = q.to(tl.float16)
    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for first in range(start, end, BLOCK_N):
        # BLOCK_N divides PAGE and split_len is a multiple of BLOCK_N, so a chunk never straddles two pages
        page = tl.load(block_tables_ptr + seq * bt_stride + first // PAGE).to(tl.int64)
        tokens = first + tl.arange(0, BLOCK_N)
        valid = tokens < end
        offsets = (page * cache_block_stride + (tokens % PAGE)[:, None] * cache_token_stride
                   + kv_head * cache_head_stride + dims[None, :])
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # base-2 logits: exp2 is the cheap instruction
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        denominator = denominator * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max
    if FP8_KV:
        acc = acc * value_scale

    if slices == 1:
        tl.store(out_rows, (acc / denominator[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        return
    first_part = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits
    tl.store(part_out_ptr + (first_part + split)[:, None] * HEAD_DIM + dims[None, :], acc / denominator[:, None],
             mask=head_mask[:, None])
    tl.store(part_lse_ptr + first_part + split, running_max + tl.log2(denominator), mask=head_mask)
    # The last slice to finish merges them all (no second kernel launch per layer). The barrier orders every
    # thread's stores before the release of the ticket; the partials are read back from L2 (.cg), past any
    # stale L1 line, and the counter is left at 0 for the next call.
    tl.debug_barrier()
    counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel") == slices - 1:
        splits = tl.arange(0, MAX_SPLITS)
        lse = tl.load(part_lse_ptr + first_part[:, None] + splits[None, :], cache_modifier=".cg",
                      mask=head_mask[:, None] & (splits[None, :] < slices), other=float("-inf"))
        top = tl.where(head_mask, tl.max(lse, 1), 0.0)
        merged = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        for other in range(0, slices):
            weight = tl.exp2(tl.load(part_lse_ptr + first_part + other, mask=head_mask, other=0.0,
                                     cache_modifier=".cg") - top)
            part = tl.load(part_out_ptr + (first_part + other)[:, None] * HEAD_DIM + dims[None, :],
                           mask=head_mask[:, None], other=0.0, cache_modifier=".cg")
            merged += weight[:, None] * part
            total += weight
        tl.store(out_rows, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        tl.atomic_xchg(counter, 0)


# (BLOCK_N, num_warps, num_stages) per cache dtype, from `benchmarks/microbench.py fp8-decode --sweep` on an H200
TUNED = {False: (64, 4, 2), True: (64, 2, 2)}


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           counters: torch.Tensor | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None, max_splits: int | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0, fp8_kernel: str = "cuda") -> torch.Tensor:
    """q [batch, heads, head_dim]; caches [blocks, page, kv_heads, head_dim]; block_tables [batch, width] int32.
    An FP8 cache holds K / k_scale and V / v_scale (one number each for the layer), and is read by the CUDA
    kernel (paged_decode_fp8.cu) where it runs, else (or with fp8_kernel="triton") by this file's.

    Returns [batch, heads, head_dim]: sequence i attends to its first context_lens[i] cached tokens (a row
    with context 0, as CUDA-graph padding has, gets zeros). `counters` is int32 scratch of at least
    batch * kv_heads zeros, which the kernel leaves at zero; reuse one buffer across calls to save a memset.
    `max_splits` (slices per sequence) defaults to the kernel's own rule: cuda_max_splits or default_max_splits.
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride() and k_cache.dtype == v_cache.dtype
    assert block_tables.stride(1) == 1 and head_dim == triton.next_power_of_2(head_dim)
    fp8 = k_cache.dtype == FP8
    assert fp8 or (k_cache.dtype == q.dtype and k_scale == v_scale == 1.0)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    assert counters.numel() >= batch * num_kv_heads and counters.dtype == torch.int32
    tuned_block_n, tuned_warps, tuned_stages = TUNED[fp8]
    block_n = min(block_n or tuned_block_n, page)
    group = num_heads // num_kv_heads
    cuda_kernel = None
    if fp8 and fp8_kernel == "cuda":
        split_len = _split_len(block_tables, page, block_n, max_splits or cuda_max_splits(batch, num_kv_heads))
        cuda_kernel = decode_kernel(q, group, (k_cache, v_cache, block_tables, context_lens, counters), split_len)
    if cuda_kernel is None:
        split_len = _split_len(block_tables, page, block_n, max_splits or default_max_splits(batch, num_kv_heads))
    num_splits = triton.cdiv(block_tables.size(1) * page, split_len)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale_log2 = scale * k_scale * 1.4426950408889634  # base-2 logits: exp2 is the cheap instruction
    if cuda_kernel is not None:
        cuda_kernel.launch((num_kv_heads, batch, num_splits),
                           [q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters],
                           [scale_log2, v_scale],
                           [split_len, num_splits, group, num_kv_heads, page],
                           [q.stride(0), out.stride(0), block_tables.stride(0), *k_cache.stride()[:3]])
        return out
    _decode_attention[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, counters,
        scale_log2, v_scale, split_len, num_splits, q.stride(0), out.stride(0),
        block_tables.stride(0), *k_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, MAX_SPLITS=max(MERGE_WIDTH, triton.next_power_of_2(num_splits)), FP8_KV=fp8,
        num_warps=num_warps or tuned_warps, num_stages=num_stages or tuned_stages,
    )
    return out


def _split_len(block_tables: torch.Tensor, page: int, block_n: int, max_splits: int) -> int:
    """A static slice length (the grid must not depend on device values under CUDA graphs): the widest table holds
    width * page tokens; slices are whole chunks, sized so at most max_splits are needed."""
    max_context = block_tables.size(1) * page
    return triton.cdiv(triton.cdiv(max_context, max_splits), block_n) * block_n
