"""Issue 59 probe (branch only): main's FP8 decode kernel (nanovllm/attention/paged_decode.py) reading V from a
transposed page layout, V^T [num_blocks, kv_heads, head_dim, PAGE] (a page's tokens contiguous per (head, dim)),
K as on main [num_blocks, PAGE, kv_heads, head_dim].

Why: in acc[H, D] += P[H, N] @ V[N, D] the reduction dim is N (tokens). On main V's tokens are strided, so the
8-bit tile is the transposed operand, which Hopper's ldmatrix cannot transpose for 8-bit data: Triton reads it
from shared memory one byte at a time (128 LDS.U8 per warp per 64 tokens at (64, 2, 2)). With V^T the reduction
dim is contiguous for V as head_dim is for K in q @ trans(k).

VT_FORM picks how the product is written (all read the same V^T tile [HEAD_DIM, BLOCK_N]):
  0: dot(p, trans(vt.to(f16)))      cast, then transpose the view
  1: dot(p, trans(vt).to(f16))      transpose, then cast
  2: acc^T[D, H] += dot(vt, trans(p))  (V^T as the A operand, M = HEAD_DIM; the accumulator transposed)
  3: the control: V in main's layout (pass main's v_cache), dot(p, v) as main: main's kernel with this file's
     loop (V_MASK), to tell the layout's effect from the loop's
V_MASK picks how tokens past the slice's end are kept out of V (K is masked as on main):
  0: V^T's load masked per token: the mask varies along V^T's contiguous dim, so the load is not vectorized
     (one byte per LDG, no cp.async): kept as the first try, which showed it
  1: V^T read unmasked everywhere (inside the page, so in bounds): correct only while stale cache bytes are
     finite (0 * NaN = NaN); a bound on the speed, not a product form
  2: whole chunks unmasked; the last partial chunk of a slice (at most one) peeled, its V zeroed past the end
     in registers after an unmasked load
Everything else (grid, slices, merge, scales) is main's, line for line.
"""
import torch
import triton
import triton.language as tl

from nanovllm.attention.paged_decode import MERGE_WIDTH, default_max_splits
from nanovllm.quantization.kv_quant import FP8


@triton.jit
def _chunk(q, acc, running_max, denominator, first, end, k_cache_ptr, vt_cache_ptr, block_tables_ptr, seq, kv_head,
           scale_log2, bt_stride, cache_block_stride, cache_token_stride, cache_head_stride, vt_block_stride,
           vt_head_stride, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
           VT_FORM: tl.constexpr, MASK_K: tl.constexpr, V_MODE: tl.constexpr):
    """One chunk of BLOCK_N tokens (inside one page) into the online softmax. MASK_K: K's load and the scores
    masked past `end` (as on main). V_MODE: 0 V^T's load masked past `end` (per byte along its contiguous dim,
    which stops vectorized / cp.async loads); 1 V^T read unmasked (always inside the page); 2 read unmasked and
    zeroed past `end` in registers (a stale row may hold anything; 0 * NaN would poison acc)."""
    dims = tl.arange(0, HEAD_DIM)
    page = tl.load(block_tables_ptr + seq * bt_stride + first // PAGE).to(tl.int64)
    tokens = first + tl.arange(0, BLOCK_N)
    valid = tokens < end
    k_offsets = (page * cache_block_stride + (tokens % PAGE)[:, None] * cache_token_stride
                 + kv_head * cache_head_stride + dims[None, :])
    if MASK_K:
        k = tl.load(k_cache_ptr + k_offsets, mask=valid[:, None], other=0.0).to(q.dtype)
    else:
        k = tl.load(k_cache_ptr + k_offsets).to(q.dtype)
    if VT_FORM == 3:  # the control: V in main's layout, read as K is
        v_offsets = k_offsets
        v_mask = valid[:, None]
    else:  # V^T [HEAD_DIM, BLOCK_N]
        v_offsets = page * vt_block_stride + kv_head * vt_head_stride + dims[:, None] * PAGE + (tokens % PAGE)[None, :]
        v_mask = valid[None, :]
    if V_MODE == 0:
        v8 = tl.load(vt_cache_ptr + v_offsets, mask=v_mask, other=0.0)
    else:
        v8 = tl.load(vt_cache_ptr + v_offsets)
    if VT_FORM == 1:
        v = tl.trans(v8).to(tl.float16)  # [BLOCK_N, HEAD_DIM]
        if V_MODE == 2:
            v = tl.where(valid[:, None], v, 0.0)
    else:
        v = v8.to(tl.float16)  # V^T (forms 0, 2) or V (form 3)
        if V_MODE == 2:
            v = tl.where(v_mask, v, 0.0)
    scores = tl.dot(q, tl.trans(k)) * scale_log2
    if MASK_K:
        scores = tl.where(valid[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    probs = tl.exp2(scores - new_max[:, None])
    rescale = tl.exp2(running_max - new_max)
    denominator = denominator * rescale + tl.sum(probs, 1)
    if VT_FORM == 0:
        acc = acc * rescale[:, None] + tl.dot(probs.to(tl.float16), tl.trans(v))
    elif VT_FORM == 1 or VT_FORM == 3:
        acc = acc * rescale[:, None] + tl.dot(probs.to(tl.float16), v)
    else:
        acc = acc * rescale[None, :] + tl.dot(v, tl.trans(probs.to(tl.float16)))
    return new_max, denominator, acc


@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention_vt(
    q_ptr, k_cache_ptr, vt_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counters_ptr, scale_log2, value_scale, split_len, num_splits, q_stride, out_stride, bt_stride,
    cache_block_stride, cache_token_stride, cache_head_stride, vt_block_stride, vt_head_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr, VT_FORM: tl.constexpr,
    V_MASK: tl.constexpr,
):
    # vt_cache: [blocks, kv_heads, HEAD_DIM, PAGE], PAGE contiguous (its dim stride is PAGE)
    kv_head = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    slices = tl.cdiv(context_len, split_len)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_mask = tl.arange(0, BLOCK_H) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    out_rows = out_ptr + seq * out_stride + heads[:, None] * HEAD_DIM + dims[None, :]
    if context_len == 0:
        if split == 0:
            tl.store(out_rows, tl.zeros([BLOCK_H, HEAD_DIM], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=head_mask[:, None])
        return
    start = split * split_len
    if start >= context_len:
        return
    end = tl.minimum(start + split_len, context_len)

    q = tl.load(q_ptr + seq * q_stride + heads[:, None] * HEAD_DIM + dims[None, :], mask=head_mask[:, None], other=0.0)
    q = q.to(tl.float16)
    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_H], tl.float32)
    if VT_FORM == 2:
        acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)  # transposed
    else:
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if V_MASK == 2:  # whole chunks unmasked, then the last partial chunk (if any) with its V zeroed past `end`
        full_end = start + (end - start) // BLOCK_N * BLOCK_N
        for first in range(start, full_end, BLOCK_N):
            running_max, denominator, acc = _chunk(
                q, acc, running_max, denominator, first, end, k_cache_ptr, vt_cache_ptr, block_tables_ptr, seq,
                kv_head, scale_log2, bt_stride, cache_block_stride, cache_token_stride, cache_head_stride,
                vt_block_stride, vt_head_stride, HEAD_DIM, PAGE, BLOCK_N, VT_FORM, False, 1)
        if full_end < end:
            running_max, denominator, acc = _chunk(
                q, acc, running_max, denominator, full_end, end, k_cache_ptr, vt_cache_ptr, block_tables_ptr, seq,
                kv_head, scale_log2, bt_stride, cache_block_stride, cache_token_stride, cache_head_stride,
                vt_block_stride, vt_head_stride, HEAD_DIM, PAGE, BLOCK_N, VT_FORM, True, 2)
    else:
        for first in range(start, end, BLOCK_N):
            running_max, denominator, acc = _chunk(
                q, acc, running_max, denominator, first, end, k_cache_ptr, vt_cache_ptr, block_tables_ptr, seq,
                kv_head, scale_log2, bt_stride, cache_block_stride, cache_token_stride, cache_head_stride,
                vt_block_stride, vt_head_stride, HEAD_DIM, PAGE, BLOCK_N, VT_FORM, True, 0 if V_MASK == 0 else 1)
    if VT_FORM == 2:
        acc = tl.trans(acc)
    acc = acc * value_scale

    if slices == 1:
        tl.store(out_rows, (acc / denominator[:, None]).to(out_ptr.dtype.element_ty), mask=head_mask[:, None])
        return
    first_part = (seq * NUM_KV_HEADS * GROUP + heads) * num_splits
    tl.store(part_out_ptr + (first_part + split)[:, None] * HEAD_DIM + dims[None, :], acc / denominator[:, None],
             mask=head_mask[:, None])
    tl.store(part_lse_ptr + first_part + split, running_max + tl.log2(denominator), mask=head_mask)
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


TUNED_VT = (64, 2, 2)  # main's FP8 setting until the GPU says otherwise


def transpose_v(v_cache: torch.Tensor) -> torch.Tensor:
    """[blocks, page, kv_heads, head_dim] -> [blocks, kv_heads, head_dim, page], same values."""
    return v_cache.permute(0, 2, 3, 1).contiguous()


def paged_decode_attention_vt(q: torch.Tensor, k_cache: torch.Tensor, vt_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                              counters: torch.Tensor | None = None, block_n: int | None = None,
                              num_warps: int | None = None, num_stages: int | None = None,
                              max_splits: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                              form: int = 0, v_mask: int = 2) -> torch.Tensor:
    """As main's paged_decode_attention, FP8 only, with V as transpose_v gives it (form 3: main's V)."""
    batch, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    # float16 only for the CPU check (time_vt.py --interpret-check: the interpreter turns e4m3 NaN into 480)
    assert k_cache.stride(3) == 1 and k_cache.dtype == vt_cache.dtype and k_cache.dtype in (FP8, torch.float16)
    if form == 3:  # the control: vt_cache is main's V
        assert vt_cache.shape == k_cache.shape and vt_cache.stride() == k_cache.stride()
    else:
        assert vt_cache.shape == (k_cache.shape[0], num_kv_heads, head_dim, page)
        assert vt_cache.stride(3) == 1 and vt_cache.stride(2) == page
    assert block_tables.stride(1) == 1 and head_dim == triton.next_power_of_2(head_dim)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=q.device)
    tuned_block_n, tuned_warps, tuned_stages = TUNED_VT
    block_n = min(block_n or tuned_block_n, page)
    max_splits = max_splits or default_max_splits(batch, num_kv_heads)
    max_context = block_tables.size(1) * page
    split_len = triton.cdiv(triton.cdiv(max_context, max_splits), block_n) * block_n
    num_splits = triton.cdiv(max_context, split_len)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _decode_attention_vt[(num_kv_heads, batch, num_splits)](
        q, k_cache, vt_cache, block_tables, context_lens, out, part_out, part_lse, counters,
        scale * k_scale * 1.4426950408889634, v_scale, split_len, num_splits, q.stride(0), out.stride(0),
        block_tables.stride(0), *k_cache.stride()[:3], vt_cache.stride(0), vt_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads // num_kv_heads)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=block_n, MAX_SPLITS=max(MERGE_WIDTH, triton.next_power_of_2(num_splits)), VT_FORM=form,
        V_MASK=v_mask,
        num_warps=num_warps or tuned_warps, num_stages=num_stages or tuned_stages,
    )
    return out
