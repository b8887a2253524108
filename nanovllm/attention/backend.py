"""The attention backend interface: how a layer's new keys and values reach the paged KV cache, and how its
queries read them back. One backend object serves every layer of a model; it is chosen once at startup."""
import torch
from torch import nn

# the cache's layout and a layer's slice of it live in kv_cache.py, which imports no backend: the arrow runs one way
from nanovllm.attention.kv_cache import KVCacheLayout, LayerKV
from nanovllm.utils.context import Context


class AttentionBackend:
    """Base for the backends in nanovllm.attention: each provides `store`, `prefill` and `decode` (the triton
    backend takes flash_attn's store and prefill and replaces rope_and_store and decode)."""

    name = ""
    uses_cuda = True

    def check_block_size(self, block_size: int) -> None:
        """Raise if the backend cannot page the cache in blocks of this many tokens."""

    def bind(self, num_kv_heads: int, max_num_seqs: int, device: torch.device) -> None:
        """Allocate per-engine scratch once the cache exists (before CUDA-graph capture)."""

    def warm_up(self, layout: KVCacheLayout, num_heads: int, dtype: torch.dtype) -> float:
        """Compile or load, at start-up (after bind, before CUDA-graph capture), any kernel the backend would
        otherwise build at first use, mid-run; num_heads: this rank's query heads. Returns the seconds it took."""
        return 0.0

    def begin_forward(self, context: Context) -> None:
        """Derive, once per forward pass, what every layer's attention reads from the pass's context (the model
        calls it first, so a CUDA graph's capture records it with the layers)."""

    def rope_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       rope: nn.Module, qk_norms: tuple[nn.Module, nn.Module] | None, cache: LayerKV | None,
                       slot_mapping: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head q/k norms (Qwen3) and rotary embedding, then this step's K/V into the cache (cache None:
        the warmup pass, which runs before the cache exists)."""
        if qk_norms is not None:
            q, k = qk_norms[0](q), qk_norms[1](k)
        q, k = rope(positions, q, k)
        if cache is not None:
            self.store(k, v, cache, slot_mapping)
        return q, k

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerKV, slot_mapping: torch.Tensor) -> None:
        """Token i's K/V [tokens, kv_heads, head_dim] into cache slot slot_mapping[i] (-1: skip)."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKV | None, context: Context,
                scale: float) -> torch.Tensor:
        """Causal attention of each sequence's new tokens over its cached prefix and themselves."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, cache: LayerKV, context: Context, scale: float) -> torch.Tensor:
        """One query token per sequence over its first context_lens[i] cached tokens."""
        raise NotImplementedError
