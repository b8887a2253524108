"""Decode attention over the paged KV cache (one query token per sequence), split along the context.

Decode is bound by reading the KV cache, so this kernel is built around one idea: read every cached K/V row
exactly once, for all query heads that share it (GQA), with enough independent programs in flight to keep HBM
busy. Each program takes one (sequence, KV head, slice of the context) and keeps an online softmax; a second
small kernel merges the slices of a sequence by their log-sum-exp.
"""
import torch
import triton
import triton.language as tl


def default_max_splits(batch: int, num_kv_heads: int) -> int:
    """Slices per sequence: about 2048 (sequence, KV head, slice) programs keep an H200 busy. Measured with
    tests/microbench_decode_attention.py: 8 is best from 16 sequences up, 64 for 4 sequences."""
    return min(64, max(8, triton.next_power_of_2(2048 // (batch * num_kv_heads))))


@triton.jit
def _decode_attention_partial(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, split_len, num_splits, q_stride, bt_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * split_len
    if start >= context_len:
        return
    end = tl.minimum(start + split_len, context_len)

    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_mask = tl.arange(0, BLOCK_H) < GROUP  # the group is padded to BLOCK_H rows for tl.dot
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :], mask=head_mask[:, None], other=0.0)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    row_stride = NUM_KV_HEADS * HEAD_DIM
    for first in range(start, end, BLOCK_N):
        # BLOCK_N divides PAGE and split_len is a multiple of BLOCK_N, so a chunk never straddles two pages
        page = tl.load(block_tables_ptr + seq * bt_stride + first // PAGE).to(tl.int64)
        tokens = first + tl.arange(0, BLOCK_N)
        valid = tokens < end
        rows = page * PAGE + tokens % PAGE
        offsets = rows[:, None] * row_stride + kv_head * HEAD_DIM + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2  # base-2 logits: exp2 is the cheap instruction
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(running_max - new_max)
        denominator = denominator * rescale + tl.sum(probs, 1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    part = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits + split
    tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc / denominator[:, None],
             mask=head_mask[:, None])
    tl.store(part_lse_ptr + part, running_max + tl.log2(denominator), mask=head_mask)


@triton.jit
def _decode_attention_merge(
    part_out_ptr, part_lse_ptr, context_lens_ptr, out_ptr, split_len, num_splits, out_stride,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, MAX_SPLITS)
    used = splits < tl.cdiv(tl.load(context_lens_ptr + seq), split_len)
    part = (seq * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part, mask=used, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a padding row (context 0) has no slices: output zeros
    weights = tl.exp2(lse - top)
    dims = tl.arange(0, HEAD_DIM)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
    tl.store(out_ptr + seq * out_stride + head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                           max_splits: int | None = None) -> torch.Tensor:
    """q [batch, heads, head_dim]; caches [blocks, page, kv_heads, head_dim]; block_tables [batch, width] int32.

    Returns [batch, heads, head_dim]. Sequence i attends to its first context_lens[i] cached tokens; every
    context length must be at least 1 (a row of zeros, as CUDA-graph padding has, produces zeros).
    """
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert block_tables.stride(1) == 1 and head_dim == triton.next_power_of_2(head_dim)
    group = num_heads // num_kv_heads
    block_n = min(block_n, page)
    max_splits = max_splits or default_max_splits(batch, num_kv_heads)
    # a static split count (the grid must not depend on device values under CUDA graphs): the widest table
    # holds width * page tokens; slices are whole chunks, sized so at most max_splits are needed
    max_context = block_tables.size(1) * page
    split_len = triton.cdiv(triton.cdiv(max_context, max_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, split_len)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_attention_partial[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_out, part_lse,
        scale * 1.4426950408889634, split_len, num_splits, q.stride(0), block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE=page, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    out = torch.empty_like(q)
    _decode_attention_merge[(batch, num_heads)](
        part_out, part_lse, context_lens, out, split_len, num_splits, out.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, MAX_SPLITS=triton.next_power_of_2(max_splits),
    )
    return out
