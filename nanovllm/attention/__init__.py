"""Attention backends: how keys and values reach the paged KV cache and how queries read them.

- `flash_attn`: the q/k-norm + RoPE kernel, then Triton store_kvcache; flash-attn varlen prefill,
  flash_attn_with_kvcache decode (the reference engine's path).
- `triton`: flash-attn prefill, KV write fused into q/k-norm + RoPE, our split-context decode kernel (fastest).
- `flashinfer`: the triton backend with FlashInfer's XQA decode (the optional `flashinfer` extra; Hopper's FP8
  kernel for an FP8 cache).
- `torch`: plain torch over the same cache (CPU).
"""
import torch

from nanovllm.attention.backend import AttentionBackend
from nanovllm.attention.kv_cache import KVCacheLayout, LayerKV
from nanovllm.config import ATTENTION_BACKENDS as BACKEND_NAMES
from nanovllm.utils.flashinfer import flashinfer_installed

# The default backend's one switch: True makes `flashinfer` the default on Hopper (sm_90) with an FP8 KV cache
# where FlashInfer is installed. Off: XQA's FP8 decode is faster end to end but rounds the query and the softmax
# probabilities to e4m3: at 6k-14k contexts it lands on the float32 argmax clearly less often than the triton
# kernel (tests/test_gpu_flashinfer_engine.py), and on peaked logits it fails the FP8 cache's acceptance bars
# (tests/test_gpu_fp8_kv.py); figures in docs/flashinfer.md.
FLASHINFER_FOR_FP8_KV_ON_HOPPER = False

__all__ = ["AttentionBackend", "BACKEND_NAMES", "KVCacheLayout", "LayerKV", "default_backend",
           "make_attention_backend"]


def default_backend(use_cuda: bool, fp8_kv_cache: bool = False) -> str:
    """The fastest backend for the device and cache: torch on CPU; on CUDA triton, or flashinfer where
    FLASHINFER_FOR_FP8_KV_ON_HOPPER says it wins (an FP8 cache on sm_90, FlashInfer installed)."""
    if not use_cuda:
        return "torch"
    if (FLASHINFER_FOR_FP8_KV_ON_HOPPER and fp8_kv_cache and torch.cuda.get_device_capability()[0] == 9
            and flashinfer_installed()):
        return "flashinfer"
    return "triton"


def _backend_class(name: str) -> type[AttentionBackend]:
    if name == "torch":
        from nanovllm.attention.torch_backend import TorchBackend
        return TorchBackend
    if name == "flash_attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend
        return FlashAttnBackend
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonBackend
        return TritonBackend
    if name == "flashinfer":
        from nanovllm.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend
    raise ValueError(f"attention_backend={name!r} is unknown; choose one of {BACKEND_NAMES} or None (fastest)")


def make_attention_backend(name: str | None, use_cuda: bool, fp8_kv_cache: bool = False) -> AttentionBackend:
    """The backend called `name`, or (None) default_backend's choice for the device and cache."""
    name = name or default_backend(use_cuda, fp8_kv_cache)
    backend_class = _backend_class(name)
    if backend_class.uses_cuda != use_cuda:
        device = "a CUDA device" if use_cuda else "no CUDA device"
        raise ValueError(f"attention_backend={name!r} does not run with {device} here; "
                         f"use {'triton, flash_attn or flashinfer' if use_cuda else 'torch'} (or None)")
    return backend_class()
