"""FP8 KV cache: keys and values stored as float8 e4m3 with one scale for a layer's keys and one for its values
(per tensor, as vLLM, TensorRT-LLM and FlashInfer keep them): x ~= fp8 * scale. A scale is a plain number fixed
before the cache is first written (quantization/kv_scales.py says where it comes from), so readers fold it into the
softmax scale and the output and multiply nothing per element.

The torch functions here are the reference the Triton writers are tested against, and the CPU backend's own path.
"""
import torch
import triton
import triton.language as tl

from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.quantization.e4m3 import FP8, FP8_MAX, saturate_to_e4m3


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; choose one of {KV_CACHE_DTYPES} "
                         f"('auto': the model's dtype)")


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the cache stores K/V in: the model's for 'auto', float8 e4m3 for 'fp8'/'fp8_e4m3' (which needs
    a GPU of compute capability 8.9 or newer to convert to and from float8 in hardware)."""
    check_kv_cache_dtype(name)
    if name == "auto":
        return model_dtype
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype={name!r} needs a GPU of compute capability 8.9 or newer (Ada, "
                             f"Hopper); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                             f"use kv_cache_dtype='auto'")
    return FP8


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8 e4m3, clamped to +-448: a value past the layer's range saturates instead of becoming
    NaN. The writers multiply by the float32 reciprocal as this does, so the GPU writes the same bits."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize (exact up to the quantisation itself), in `dtype`."""
    return (x.float() * scale).to(dtype)


@triton.jit
def to_fp8(x, inverse_scale, FP8_DTYPE: tl.constexpr):
    """The Triton side of quantize: x (any float dtype) times the layer's 1 / scale (a float32 argument), as
    float8."""
    return saturate_to_e4m3(x.to(tl.float32) * inverse_scale).to(FP8_DTYPE)
