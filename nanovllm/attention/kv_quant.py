"""FP8 KV cache: keys and values stored as float8 e4m3, each row (one token's one KV head) with its own float32
scale, written with the row. The scale is the row's largest magnitude / 448 (e4m3's largest finite value), so
nothing saturates, no calibration is needed, and any finite input stays finite (docs/fp8_kv_cache.md says why
this granularity and not one static scale per layer).

The torch functions here are the reference the Triton writers and the decode kernel are tested against, and the
CPU backend's own path.
"""
import torch
import triton
import triton.language as tl

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# a row of zeros gets this scale instead of 0, so quantising it divides by something (and gives zeros)
MIN_SCALE = 1e-30


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


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (float8 e4m3 [..., head_dim], float32 scale [...]) with x ~= fp8 * scale.

    Division (not multiplication by a reciprocal) and the clamp are what the Triton writers do too, so the
    results are bit-identical on the GPU."""
    x = x.float()
    amax = x.abs().amax(-1)
    # divided by a tensor: torch on CUDA turns division by a Python scalar into multiplication by its reciprocal,
    # which is not the correctly rounded quotient the kernels compute
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_rows(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_rows (exact up to the quantisation itself), in `dtype`."""
    return (x.float() * scale.unsqueeze(-1)).to(dtype)


def quantize_static(x: torch.Tensor, scale: float) -> torch.Tensor:
    """One scale for a whole layer (vLLM's default, 1.0 without calibration): values past 448 * scale clamp.
    Only for measuring against the per-row scales (benchmarks/fp8_kv_accuracy.py); the engine does not use it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


_FP8_MAX, _MIN_SCALE = tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)  # kernels read constexpr globals only


@triton.jit
def _round_to_e4m3(y):
    """float32 y, |y| <= 448, rounded to the nearest float8 e4m3 value (ties to even), still as float32.

    The cast to float8 would do this itself on the GPU, but Triton's CPU interpreter rounds some values wrongly
    (124.3 to 64), so the tests on CPU could not check the kernels; rounding first makes the cast exact
    everywhere, for a few integer instructions per element in a kernel that is not the bottleneck."""
    bits = y.to(tl.int32, bitcast=True)
    # normal range: keep 3 of float32's 23 mantissa bits, rounding to nearest even (a carry moves the exponent)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    # below 2**-6 e4m3 is subnormal, multiples of 2**-9: adding 1.5 * 2**14 (whose float32 ulp is 2**-9) rounds
    # the magnitude; the sign goes back on as a bit, so -0.0001 becomes -0.0 as torch's cast makes it
    magnitude = (tl.abs(y) + 24576.0) - 24576.0
    sign = y.to(tl.int32, bitcast=True) & -0x80000000
    subnormal = (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


# The Triton side of quantize_rows, for the kernels that write the cache. div_rn: the correctly rounded
# division torch does, not the faster approximate one, so the GPU writes the same bits as the reference.
@triton.jit
def fp8_scale(amax):
    """A row's scale from its largest magnitude (float32)."""
    return tl.maximum(tl.math.div_rn(amax, _FP8_MAX), _MIN_SCALE)


@triton.jit
def to_fp8(x, scale, FP8_DTYPE: tl.constexpr):
    """x [rows, n] (any float dtype) / scale [rows] as float8."""
    y = tl.clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -_FP8_MAX, _FP8_MAX)
    return _round_to_e4m3(y).to(FP8_DTYPE)


@triton.jit
def quantize_heads(x, FP8_DTYPE: tl.constexpr):
    """[heads, head_dim] rows -> (float8 rows, float32 scale per row)."""
    scale = fp8_scale(tl.max(tl.abs(x.to(tl.float32)), 1))
    return to_fp8(x, scale, FP8_DTYPE), scale
