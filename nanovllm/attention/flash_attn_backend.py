import torch
import triton
import triton.language as tl

from nanovllm.attention.backend import AttentionBackend, LayerKV
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


def store_kvcache(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    """Token i's K/V rows [tokens, kv_heads, head_dim] into cache slot slot_mapping[i] (-1 = skip), one program
    per token. k and v may be views into the packed qkv row."""
    num_tokens, num_heads, head_dim = k.shape
    D = num_heads * head_dim
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k.stride(1) == head_dim and v.stride(1) == head_dim
    assert cache.k.is_contiguous() and cache.v.is_contiguous() and slot_mapping.numel() == num_tokens
    _store_kvcache_kernel[(num_tokens,)](
        k, k.stride(0), v, v.stride(0), cache.k, cache.v, slot_mapping, D, triton.next_power_of_2(D)
    )


class FlashAttnBackend(AttentionBackend):
    """The reference nano-vllm's path: Triton store_kvcache, flash-attn varlen prefill (paged when a prefix is cached)
    and flash-attn's paged decode (flash_attn_with_kvcache)."""

    name = "flash_attn"

    def check_block_size(self, block_size: int) -> None:
        if block_size % 256 != 0:
            raise ValueError(f"kvcache_block_size={block_size}: flash-attn's paged KV needs a multiple of 256")

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        store_kvcache(k, v, cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None, context: Context,
                scale: float) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        if context.block_tables is not None:  # a cached prefix: read all keys from the paged cache
            k, v = cache.k, cache.v
        return flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
            max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
            softmax_scale=scale, causal=True, block_table=context.block_tables,
        )

    def decode(self, q: torch.Tensor, cache: LayerKV, context: Context, scale: float) -> torch.Tensor:
        from flash_attn import flash_attn_with_kvcache

        return flash_attn_with_kvcache(q.unsqueeze(1), cache.k, cache.v, cache_seqlens=context.context_lens,
                                       block_table=context.block_tables, softmax_scale=scale,
                                       causal=True).squeeze(1)
