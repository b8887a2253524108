import torch
import torch.nn.functional as F

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.kv_cache import LayerKV
from nanovllm.quantization.kv_quant import dequantize, quantize
from nanovllm.utils.context import Context


def store_kvcache_torch(k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping != -1
    slots = slot_mapping[keep]
    if not cache.quantized:
        cache.k.view(-1, *k.shape[1:])[slots] = k[keep]
        cache.v.view(-1, *v.shape[1:])[slots] = v[keep]
        return
    cache.k.view(-1, *k.shape[1:])[slots] = quantize(k[keep], cache.k_scale)
    cache.v.view(-1, *v.shape[1:])[slots] = quantize(v[keep], cache.v_scale)


def cached_rows(cache: LayerKV, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `blocks` in order, [len(blocks) * block_size, kv_heads, head_dim], in `dtype`."""
    if not cache.quantized:
        return cache.k[blocks].flatten(0, 1), cache.v[blocks].flatten(0, 1)
    return (dequantize(cache.k[blocks], cache.k_scale, dtype).flatten(0, 1),
            dequantize(cache.v[blocks], cache.v_scale, dtype).flatten(0, 1))


class TorchBackend(AttentionBackend):
    """Plain torch over the same paged cache, one sequence at a time: the CPU path that CI checks against
    transformers, and the reference the GPU kernels are tested against."""

    name = "torch"
    uses_cuda = False

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        store_kvcache_torch(k, v, cache, slot_mapping)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None, context: Context,
                scale: float) -> torch.Tensor:
        cu_q, cu_k = context.cu_seqlens_q.tolist(), context.cu_seqlens_k.tolist()
        spans = [(cu_q[i], cu_q[i + 1], cu_k[i + 1] - cu_k[i]) for i in range(len(cu_q) - 1)]
        return self._attend_spans(q, k, v, cache, context.block_tables, spans, scale)

    def decode(self, q: torch.Tensor, cache: LayerKV, context: Context, scale: float) -> torch.Tensor:
        spans = [(i, i + 1, n) for i, n in enumerate(context.context_lens.tolist())]
        return self._attend_spans(q, None, None, cache, context.block_tables, spans, scale)

    @staticmethod
    def _attend_spans(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cache: LayerKV | None,
                      block_tables: torch.Tensor | None, spans: list[tuple[int, int, int]],
                      scale: float) -> torch.Tensor:
        """spans: (first query row, end query row, number of keys) per sequence. With block tables the keys come
        from the paged cache (a cached prefix, or decode); without, from this step's own k and v."""
        out = torch.empty_like(q)
        for i, (q_start, q_end, k_len) in enumerate(spans):
            if block_tables is not None:
                keys, values = cached_rows(cache, block_tables[i][:-(-k_len // cache.k.size(1))], q.dtype)
                keys, values = keys[:k_len], values[:k_len]
            else:
                keys, values = k[q_start:q_end], v[q_start:q_end]
            out[q_start:q_end] = _causal_attention(q[q_start:q_end], keys, values, scale)
        return out


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    q_len, k_len = q.size(0), k.size(0)
    # query i sits at absolute position k_len - q_len + i and sees keys up to there
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=q.size(1) != k.size(1))
    return out.transpose(0, 1)
