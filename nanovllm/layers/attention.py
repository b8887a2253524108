import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from nanovllm.layers.paged_decode import paged_decode_attention
from nanovllm.layers.rotary_embedding import KVDestination
from nanovllm.utils.context import Context, get_context


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


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V rows [num_tokens, kv_heads, head_dim] into cache slot slot_mapping[i] (-1 = skip)."""
    num_tokens, num_heads, head_dim = key.shape
    D = num_heads * head_dim
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key.stride(1) == head_dim and value.stride(1) == head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.numel() == num_tokens
    _store_kvcache_kernel[(num_tokens,)](
        key, key.stride(0), value, value.stride(0), k_cache, v_cache, slot_mapping, D, triton.next_power_of_2(D)
    )


def store_kvcache_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping != -1
    slots = slot_mapping[keep]
    k_cache.view(-1, *key.shape[1:])[slots] = key[keep]
    v_cache.view(-1, *value.shape[1:])[slots] = value[keep]


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache: flash-attn prefill and a Triton decode kernel on
    CUDA, plain torch elsewhere."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.k_cache = self.v_cache = torch.tensor([])
        self.split_counters: torch.Tensor | None = None  # decode kernel scratch, shared by all layers

    def kv_destination(self, v: torch.Tensor) -> KVDestination | None:
        """For a kernel that writes this step's K/V into the cache itself (None before the cache exists)."""
        if self.k_cache.numel() == 0:
            return None
        return KVDestination(v, self.k_cache, self.v_cache, get_context().slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_stored: bool = False) -> torch.Tensor:
        """`kv_stored`: the caller has already written k and v into the cache (see `kv_destination`)."""
        context = get_context()
        has_cache = self.k_cache.numel() > 0 and not kv_stored  # the warmup pass runs before the cache exists
        if q.is_cuda:
            if has_cache:
                store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
            return self._cuda_attention(q, k, v, context)
        if has_cache:
            store_kvcache_torch(k, v, self.k_cache, self.v_cache, context.slot_mapping)
        return self._torch_attention(q, k, v, context)

    def _cuda_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: Context) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        if context.is_prefill:
            if context.block_tables is not None:  # a cached prefix: read all keys from the paged cache
                k, v = self.k_cache, self.v_cache
            return flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=context.cu_seqlens_q, cu_seqlens_k=context.cu_seqlens_k,
                max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
                softmax_scale=self.scale, causal=True, block_table=context.block_tables,
            )
        # decode: our split-context Triton kernel, 10-30% faster than flash-attn 2's paged kernel on an H200
        # (tests/microbench_decode_attention.py; docs/PERFORMANCE.md)
        return paged_decode_attention(q, self.k_cache, self.v_cache, context.block_tables, context.context_lens,
                                      self.scale, self.split_counters)

    def _torch_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: Context) -> torch.Tensor:
        """The same paged-cache semantics as the flash-attn calls, one sequence at a time."""
        if context.is_prefill:
            cu_q, cu_k = context.cu_seqlens_q.tolist(), context.cu_seqlens_k.tolist()
            spans = [(cu_q[i], cu_q[i + 1], cu_k[i + 1] - cu_k[i]) for i in range(len(cu_q) - 1)]
        else:
            spans = [(i, i + 1, n) for i, n in enumerate(context.context_lens.tolist())]
        out = torch.empty_like(q)
        for i, (q_start, q_end, k_len) in enumerate(spans):
            if context.block_tables is not None:
                blocks = context.block_tables[i]
                keys = self.k_cache[blocks].flatten(0, 1)[:k_len]
                values = self.v_cache[blocks].flatten(0, 1)[:k_len]
            else:
                keys, values = k[q_start:q_end], v[q_start:q_end]
            out[q_start:q_end] = self._attend(q[q_start:q_end], keys, values)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_len, k_len = q.size(0), k.size(0)
        # query i sits at absolute position k_len - q_len + i and sees keys up to there
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(0, 1)
