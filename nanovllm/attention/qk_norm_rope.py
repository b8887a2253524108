"""The attention backends' first kernel: Qwen3's per-head q/k RMSNorm, RoPE and the write of the new keys and values
into the paged KV cache (plain or FP8), in one launch per layer."""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.quantization.kv_quant import FP8, to_fp8


@triton.jit
def _norm_rope_heads(x_ptr, weight_ptr, cos, sin, eps,
                     NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """Both halves of every head of one token, normalised (NORM) and rotated, in the input's dtype."""
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < NUM_HEADS
    offsets = heads * 2 * HALF + dims
    x1 = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + offsets + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    n1, n2 = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(n1 * n1, 1) + tl.sum(n2 * n2, 1)) / (2 * HALF) + eps)[:, None]
        # round where the unfused modules round: after normalising, after the weight, after rotating
        w1 = tl.load(weight_ptr + dims).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + dims).to(tl.float32)
        n1 = ((n1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        n2 = ((n2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (n1 * cos - n2 * sin).to(dtype), (n2 * cos + n1 * sin).to(dtype), offsets, mask


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, positions_ptr, cos_sin_ptr, q_weight_ptr,
                         k_weight_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, eps,
                         k_inverse_scale, v_inverse_scale, NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
                         BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr, STORE_KV: tl.constexpr,
                         FP8_KV: tl.constexpr, NORM: tl.constexpr):
    # q and k in separate programs: twice the programs of one per token, each half as long (small batches
    # are latency-bound)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin_ptr + position * 2 * HALF + dims)
    sin = tl.load(cos_sin_ptr + position * 2 * HALF + HALF + dims)
    if tl.program_id(1) == 0:
        q1, q2, q_offsets, q_mask = _norm_rope_heads(q_ptr + token * q_stride, q_weight_ptr, cos, sin, eps,
                                                     NUM_Q_HEADS, BLOCK_Q, HALF, NORM)
        q_out = q_out_ptr + token * NUM_Q_HEADS * 2 * HALF
        tl.store(q_out + q_offsets, q1, mask=q_mask)
        tl.store(q_out + q_offsets + HALF, q2, mask=q_mask)
    else:
        k1, k2, k_offsets, k_mask = _norm_rope_heads(k_ptr + token * k_stride, k_weight_ptr, cos, sin, eps,
                                                     NUM_K_HEADS, BLOCK_K, HALF, NORM)
        k_out = k_out_ptr + token * NUM_K_HEADS * 2 * HALF
        tl.store(k_out + k_offsets, k1, mask=k_mask)
        tl.store(k_out + k_offsets + HALF, k2, mask=k_mask)
        if STORE_KV:  # the cache write too: one launch per layer fewer than a separate store kernel
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int32 slot * row width can pass 2**31
            if slot >= 0:  # -1: CUDA-graph padding
                row = slot * NUM_K_HEADS * 2 * HALF
                v_in, v_out = v_ptr + token * v_stride + k_offsets, v_cache_ptr + row + k_offsets
                v1 = tl.load(v_in, mask=k_mask, other=0.0)
                v2 = tl.load(v_in + HALF, mask=k_mask, other=0.0)
                if FP8_KV:  # the rows as rounded to the model's dtype, quantised as kv_quant.quantize does
                    fp8 = k_cache_ptr.dtype.element_ty
                    tl.store(k_cache_ptr + row + k_offsets, to_fp8(k1, k_inverse_scale, fp8), mask=k_mask)
                    tl.store(k_cache_ptr + row + k_offsets + HALF, to_fp8(k2, k_inverse_scale, fp8), mask=k_mask)
                    tl.store(v_out, to_fp8(v1, v_inverse_scale, fp8), mask=k_mask)
                    tl.store(v_out + HALF, to_fp8(v2, v_inverse_scale, fp8), mask=k_mask)
                else:
                    tl.store(k_cache_ptr + row + k_offsets, k1, mask=k_mask)
                    tl.store(k_cache_ptr + row + k_offsets + HALF, k2, mask=k_mask)
                    tl.store(v_out, v1, mask=k_mask)
                    tl.store(v_out + HALF, v2, mask=k_mask)


@dataclass
class KVDestination:
    """Where a layer's new keys and values go: cache slot slot_mapping[i] for token i (-1 = none)."""

    v: torch.Tensor  # [tokens, kv_heads, head_dim], may be a view into the packed qkv row
    k_cache: torch.Tensor  # [blocks, page, kv_heads, head_dim], contiguous
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float = 1.0  # an FP8 cache's per-layer scales (quantization/kv_quant.py)
    v_scale: float = 1.0


def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None,
                 k_weight: torch.Tensor | None, eps: float, cos_sin_cache: torch.Tensor,
                 kv_destination: KVDestination | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of q and k followed by RoPE, in one kernel launch instead of three or four;
    with `kv_destination`, the rotated keys and the values are written into the KV cache in the same launch.
    Without norm weights (None: Llama, Qwen2) only RoPE and the cache write.

    q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] may be views into one packed qkv row; the
    results are new contiguous tensors, equal to rotary(q_norm(q), k_norm(k)) computed by the modules.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    norm = q_weight is not None
    assert norm == (k_weight is not None)
    num_k_heads = k.size(1)
    assert q.stride(1) == k.stride(1) == head_dim and q.stride(2) == k.stride(2) == 1
    assert head_dim % 2 == 0 and head_dim // 2 == triton.next_power_of_2(head_dim // 2)
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(num_tokens, num_k_heads, head_dim, dtype=k.dtype, device=k.device)
    dest = kv_destination
    if dest is not None:
        assert dest.v.stride(1) == head_dim and dest.v.stride(2) == 1 and dest.slot_mapping.numel() == num_tokens
        assert dest.k_cache.is_contiguous() and dest.v_cache.is_contiguous()
    fp8 = dest is not None and dest.k_cache.dtype == FP8
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, 2)](
            q, k, k if dest is None else dest.v, q.stride(0), k.stride(0), 0 if dest is None else dest.v.stride(0),
            positions, cos_sin_cache, q_weight if norm else cos_sin_cache, k_weight if norm else cos_sin_cache,
            q_out, k_out,
            *((k_out, k_out) if dest is None else (dest.k_cache, dest.v_cache)),
            positions if dest is None else dest.slot_mapping, eps,
            *((1.0 / dest.k_scale, 1.0 / dest.v_scale) if fp8 else (1.0, 1.0)),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, BLOCK_Q=triton.next_power_of_2(num_q_heads),
            BLOCK_K=triton.next_power_of_2(num_k_heads), HALF=head_dim // 2, STORE_KV=dest is not None,
            FP8_KV=fp8, NORM=norm,
        )
    return q_out, k_out
