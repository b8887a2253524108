"""The float8 e4m3 format every FP8 tensor here is stored in (e4m3fn: no infinity, so a value past the largest
must be clamped; the cast would make it NaN): the dtype, its largest value, and rounding to it in Triton kernels."""
import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A dynamic scale is amax times this float32 reciprocal, not amax / FP8_MAX: torch on CUDA turns a division by a
# Python number into that multiplication while the CPU divides, so written out, CPU, CUDA and the kernels all
# compute the same scales, and the same e4m3 codes.
FP8_MAX_RECIPROCAL = 1.0 / FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)  # kernels read constexpr globals only
_FP8_MAX_RECIPROCAL = tl.constexpr(FP8_MAX_RECIPROCAL)


@triton.jit
def round_to_e4m3(y):
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


@triton.jit
def saturate_to_e4m3(y):
    """float32 y clamped to +-448 and rounded to the nearest e4m3 value, still as float32: ready to cast."""
    return round_to_e4m3(tl.clamp(y, -_FP8_MAX, _FP8_MAX))


@triton.jit
def dynamic_scale(amax):
    """The scale of a group whose largest magnitude is amax: amax / 448 (as the reciprocal's product), 1 for an
    all-zero group."""
    return tl.where(amax > 0, amax * _FP8_MAX_RECIPROCAL, 1.0)
