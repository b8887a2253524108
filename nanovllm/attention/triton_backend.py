import torch
from torch import nn

from nanovllm.attention.flash_attn_backend import FlashAttnBackend
from nanovllm.attention.kv_cache import LayerKV
from nanovllm.attention.paged_decode import paged_decode_attention
from nanovllm.attention.qk_norm_rope import KVDestination, qk_norm_rope
from nanovllm.utils.context import Context


class TritonBackend(FlashAttnBackend):
    """flash-attn prefill, with the KV write fused into the (q/k-norm +) RoPE kernel (one launch per layer fewer)
    and our split-context decode kernel, the fastest backend on the GPU (docs/PERFORMANCE.md compares it with
    flash-attn 2's paged decode)."""

    name = "triton"

    def bind(self, num_kv_heads: int, max_num_seqs: int, device: torch.device) -> None:
        # layers run one after another and the decode kernel leaves its counters at zero: one buffer serves all
        self.split_counters = torch.zeros(max_num_seqs * num_kv_heads, dtype=torch.int32, device=device)

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope: nn.Module, qk_norms: tuple[nn.Module, nn.Module] | None, cache: LayerKV | None,
                       slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # one kernel: Qwen3's q/k norms (if any), RoPE and the KV write
        destination = None if cache is None else KVDestination(v, cache.k, cache.v, slot_mapping, cache.k_scale,
                                                                  cache.v_scale)
        if qk_norms is None:  # Llama, Qwen2
            return qk_norm_rope(positions, q, k, None, None, 0.0, rope.cos_sin_cache, destination)
        q_norm, k_norm = qk_norms
        return qk_norm_rope(positions, q, k, q_norm.weight, k_norm.weight, q_norm.eps, rope.cos_sin_cache,
                            destination)

    def decode(self, q: torch.Tensor, cache: LayerKV, context: Context, scale: float) -> torch.Tensor:
        return paged_decode_attention(q, cache.k, cache.v, context.block_tables, context.context_lens, scale,
                                      self.split_counters, k_scale=cache.k_scale, v_scale=cache.v_scale)
