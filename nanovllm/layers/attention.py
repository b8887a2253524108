import torch
from torch import nn

from nanovllm.attention import AttentionBackend, LayerKV
from nanovllm.utils.context import get_context


class Attention(nn.Module):
    """One layer's paged attention: rotary embedding (and Qwen3's q/k norms), this step's K/V into the cache, then
    prefill or decode attention, all through the engine's attention backend."""

    def __init__(self, scale: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.scale = scale
        self.backend = backend
        self.cache: LayerKV | None = None  # set by the model runner once the KV cache is allocated
        # [largest |key|, largest |value|] seen, while the start-up pass measures an FP8 cache's scales
        self.kv_amax: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: nn.Module,
                qk_norms: tuple[nn.Module, nn.Module] | None = None) -> torch.Tensor:
        """q [tokens, heads, head_dim], k and v [tokens, kv_heads, head_dim] (views into the packed qkv row)."""
        context = get_context()
        q, k = self.backend.rope_and_store(positions, q, k, v, rope, qk_norms, self.cache, context.slot_mapping)
        if self.kv_amax is not None:
            seen = torch.stack((k.abs().amax(), v.abs().amax())).float()
            self.kv_amax = torch.maximum(self.kv_amax, seen)
        if context.is_prefill:
            return self.backend.prefill(q, k, v, self.cache, context, self.scale)
        return self.backend.decode(q, self.cache, context, self.scale)
