"""Attention backends: how keys and values reach the paged KV cache and how queries read them.

- `flash_attn`: the q/k-norm + RoPE kernel, then Triton store_kvcache; flash-attn varlen prefill,
  flash_attn_with_kvcache decode (the reference engine's path).
- `triton`: flash-attn prefill, KV write fused into q/k-norm + RoPE, our split-context decode kernel (fastest).
- `torch`: plain torch over the same cache (CPU).
"""
from nanovllm.attention.backend import AttentionBackend, LayerKV
from nanovllm.attention.kv_cache import KVCacheLayout
from nanovllm.config import ATTENTION_BACKENDS as BACKEND_NAMES

__all__ = ["AttentionBackend", "BACKEND_NAMES", "KVCacheLayout", "LayerKV", "make_attention_backend"]


def make_attention_backend(name: str | None, use_cuda: bool) -> AttentionBackend:
    """The backend called `name`, or (None) the fastest for the device: triton on CUDA, torch on CPU."""
    if name is None:
        name = "triton" if use_cuda else "torch"
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend
        backend = TorchBackend()
    elif name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        backend = FlashAttnBackend()
    elif name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend
        backend = TritonBackend()
    else:
        raise ValueError(f"attention_backend={name!r} is unknown; choose one of {BACKEND_NAMES} or None (fastest)")
    if backend.uses_cuda != use_cuda:
        device = "a CUDA device" if use_cuda else "no CUDA device"
        raise ValueError(f"attention_backend={name!r} does not run with {device} here; "
                         f"use {'triton or flash_attn' if use_cuda else 'torch'} (or None)")
    return backend
