import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from nanovllm.quantization.fp8_fused import silu_and_mul_quantized


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul_kernel(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension, in float32 with one rounding at the end.

    One Triton program per (row, column block): torch.compile's version indexed with the dynamic row width and
    ran far below memory bandwidth on long prefills."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](x, out, x.stride(0), out.stride(0), width,
                                                               BLOCK=block, num_warps=4)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return silu_and_mul_kernel(x)
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up, with gate and up packed side by side in the last dimension."""

    # set by quantize_in_producers (quantization/fp8_fused.py) where down_proj is a block-scaled FP8 linear layer:
    # the output is then its quantized input, on CUDA
    fp8_output = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_output and x.is_cuda:
            return silu_and_mul_quantized(x)
        return silu_and_mul(x)
