import functools
import re
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.kv_cache import LayerKV
from nanovllm.attention.qk_norm_rope import qk_norm_rope
from nanovllm.quantization.kv_quant import to_fp8
from nanovllm.utils.context import Context


@triton.jit
def _store_kvcache_kernel(
    key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)  # int32 slot * row width can pass 2**31
    if slot == -1:  # the token's KV is already cached (or it is padding)
        return
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < D
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
    tl.store(k_cache_ptr + slot * D + offsets, key, mask=mask)
    tl.store(v_cache_ptr + slot * D + offsets, value, mask=mask)


@triton.jit
def _store_kvcache_fp8_kernel(
    key_ptr, key_stride, value_ptr, value_stride, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_inverse_scale,
    v_inverse_scale, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot == -1:
        return
    offsets = tl.arange(0, BLOCK_D)
    mask = offsets < D
    key = tl.load(key_ptr + token * key_stride + offsets, mask=mask, other=0.0)
    value = tl.load(value_ptr + token * value_stride + offsets, mask=mask, other=0.0)
    tl.store(k_cache_ptr + slot * D + offsets, to_fp8(key, k_inverse_scale, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * D + offsets, to_fp8(value, v_inverse_scale, v_cache_ptr.dtype.element_ty),
             mask=mask)


# the flash-attn releases whose extension's varlen_fwd takes the arguments varlen_attention passes (2.8's flash_api)
EXTENSION_SIGNATURE = ((2, 8), (3, 0))


@functools.cache
def _extension_varlen_fwd() -> Callable | None:
    """flash-attn's varlen forward as its extension exports it, where its signature is the one known here.

    flash_attn_varlen_func reaches the same kernel through an autograd Function and a torch custom op, whose
    wrapper imports TorchDynamo at its first call (about a second of every engine's start-up) and adds its
    dispatch to every layer of every prefill."""
    import flash_attn
    from flash_attn import flash_attn_interface

    first, after = EXTENSION_SIGNATURE
    if not first <= tuple(int(part) for part in re.findall(r"\d+", flash_attn.__version__)[:2]) < after:
        return None
    return flash_attn_interface.flash_attn_gpu.varlen_fwd  # the extension flash-attn itself chose for this device


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                     block_table: torch.Tensor | None) -> torch.Tensor:
    """Causal attention over packed sequences, flash_attn_varlen_func's for inference: q (tokens, heads, dim); k
    and v packed like q, or a paged cache (blocks, block size, KV heads, dim) read through `block_table`. Each
    tensor's last dimension must be contiguous and the head size a multiple of 8 (the extension refuses others;
    flash_attn_varlen_func would copy or pad them)."""
    varlen_fwd = _extension_varlen_fwd()
    if varlen_fwd is None:
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                      max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, softmax_scale=scale,
                                      causal=True, block_table=block_table)
    # out, seqused_k, leftpad_k, block_table, alibi_slopes, ..., dropout, scale, zero_tensors, causal, window
    # left/right, softcap, return_softmax, generator
    out, *_ = varlen_fwd(q, k, v, None, cu_seqlens_q, cu_seqlens_k, None, None, block_table, None, max_seqlen_q,
                         max_seqlen_k, 0.0, scale, False, True, -1, -1, 0.0, False, None)
    return out


def store_kvcache(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Token i's K/V rows [tokens, kv_heads, head_dim] into cache slot slot_mapping[i] (-1 = skip), one program
    per token, quantised with the layer's scales if the cache is FP8. k and v may be views into the packed qkv
    row."""
    num_tokens, num_heads, head_dim = k.shape
    D = num_heads * head_dim
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(1) == head_dim
    assert cache.k.is_contiguous() and cache.v.is_contiguous() and slot_mapping.numel() == num_tokens
    if cache.quantized:
        _store_kvcache_fp8_kernel[(num_tokens,)](
            k, k.stride(0), v, v.stride(0), cache.k, cache.v, slot_mapping, 1.0 / cache.k_scale,
            1.0 / cache.v_scale, D, triton.next_power_of_2(D),
        )
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, k.stride(0), v, v.stride(0), cache.k, cache.v, slot_mapping, D, triton.next_power_of_2(D)
    )


@triton.jit
def _dequantize_blocks_kernel(k_cache_ptr, v_cache_ptr, blocks_ptr, k_out_ptr, v_out_ptr, k_scale, v_scale,
                              BLOCK_ELEMENTS: tl.constexpr, CHUNK: tl.constexpr):
    used = tl.program_id(0)
    block = tl.load(blocks_ptr + used).to(tl.int64)
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < BLOCK_ELEMENTS
    source, destination = block * BLOCK_ELEMENTS + offsets, used.to(tl.int64) * BLOCK_ELEMENTS + offsets
    key = tl.load(k_cache_ptr + source, mask=mask).to(tl.float32) * k_scale
    value = tl.load(v_cache_ptr + source, mask=mask).to(tl.float32) * v_scale
    tl.store(k_out_ptr + destination, key.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + destination, value.to(v_out_ptr.dtype.element_ty), mask=mask)


def dequantized_blocks(cache: LayerKV, context: Context, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn reads no FP8 cache: the blocks this step's tables use (context.used_blocks, each once, found by
    the host with the tables, so no layer waits for the device), dequantised into new [blocks, block_size,
    kv_heads, head_dim] tensors that context.used_block_tables point into: one kernel reads each FP8 element once
    and writes it once in `dtype` (kv_quant.dequantize's result, bit for bit). Only prefills over a cached prefix
    come here (a prefix-cache hit, a later chunk, a preempted sequence's recompute); the scratch is as large as
    those sequences' contexts in `dtype`, and lives for one layer."""
    blocks = context.used_blocks
    k = torch.empty(blocks.numel(), *cache.k.shape[1:], dtype=dtype, device=cache.k.device)
    v = torch.empty_like(k)
    block_elements, chunk = cache.k[0].numel(), 4096
    if blocks.numel():
        _dequantize_blocks_kernel[(blocks.numel(), triton.cdiv(block_elements, chunk))](
            cache.k, cache.v, blocks, k, v, cache.k_scale, cache.v_scale, block_elements, chunk,
        )
    return k, v


class FlashAttnBackend(AttentionBackend):
    """The reference nano-vllm's path: q/k norms and RoPE, then Triton store_kvcache; flash-attn varlen prefill
    (paged when a prefix is cached) and flash-attn's paged decode (flash_attn_with_kvcache)."""

    name = "flash_attn"

    def check_block_size(self, block_size: int) -> None:
        if block_size % 256 != 0:
            raise ValueError(f"kvcache_block_size={block_size}: flash-attn's paged KV needs a multiple of 256")

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope: nn.Module, qk_norms: tuple[nn.Module, nn.Module] | None, cache: LayerKV | None,
                       slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Qwen3's q/k norms and RoPE in the triton backend's kernel, not the torch.compile'd modules: with those,
        # eager decode differed from CUDA-graph decode in a process where other engines had run first, and the
        # two backends' q/k paths are now the same bits
        if qk_norms is None:
            q, k = qk_norm_rope(positions, q, k, None, None, 0.0, rope.cos_sin_cache)
        else:
            q_norm, k_norm = qk_norms
            q, k = qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache)
        if cache is not None:
            self.store(k, v, cache, slot_mapping)
        return q, k

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        store_kvcache(k, v, cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None, context: Context,
                scale: float) -> torch.Tensor:
        block_tables = context.block_tables
        if block_tables is not None:  # a cached prefix: read all keys from the paged cache
            k, v = cache.k, cache.v
            if cache.quantized:
                (k, v), block_tables = dequantized_blocks(cache, context, q.dtype), context.used_block_tables
        return varlen_attention(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k, context.max_seqlen_q,
                                context.max_seqlen_k, scale, block_tables)

    def decode(self, q: torch.Tensor, cache: LayerKV, context: Context, scale: float) -> torch.Tensor:
        from flash_attn import flash_attn_with_kvcache

        assert not cache.quantized, "Config refuses kv_cache_dtype='fp8' with attention_backend='flash_attn'"
        return flash_attn_with_kvcache(q.unsqueeze(1), cache.k, cache.v, cache_seqlens=context.context_lens,
                                       block_table=context.block_tables, softmax_scale=scale,
                                       causal=True).squeeze(1)
