import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.quantization.fp8_fused import rms_norm_quantized, round_to_bf16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) * weight


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the residual add rounds to the model dtype, as transformers' does
    x = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(x, weight, eps), x


@triton.jit
def _round_to(x, BF16: tl.constexpr, FP16: tl.constexpr):
    """float32 x rounded to the model dtype, kept as float32 (bf16 by bits: the CPU interpreter's cast truncates)."""
    if BF16:
        return round_to_bf16(x)
    if FP16:
        return x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, residual_ptr, residual_stride, residual_out_ptr, weight_ptr, out_ptr, eps,
                     COLS: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BF16: tl.constexpr,
                     FP16: tl.constexpr, OUT_BF16: tl.constexpr, OUT_FP16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < COLS
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + residual, BF16, FP16)
        tl.store(residual_out_ptr + row * COLS + cols, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
    inverse_rms = tl.rsqrt(tl.sum(x * x, 0) / COLS + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # rms_norm's roundings: normalised in float32, rounded to x's dtype, times the weight, rounded to the result's
    y = _round_to(_round_to(x * inverse_rms, BF16, FP16) * weight, OUT_BF16, OUT_FP16)
    tl.store(out_ptr + row * COLS + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, cols] without a copy where its rows are evenly strided (a slice of a wider tensor is)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm (or add_rms_norm with `residual`) in one Triton program per row, with their roundings.

    The CUDA path: torch.compile made the same fused kernel, but importing and running its compiler cost every
    engine process seconds of start-up (docs/data_parallel.md)."""
    rows = _as_rows(x)
    cols = rows.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    residual_rows = _as_rows(residual) if residual is not None else rows
    residual_out = torch.empty_like(rows) if residual is not None else out
    block = triton.next_power_of_2(cols)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, rows.stride(0), residual_rows, residual_rows.stride(0), residual_out, weight, out, eps,
            COLS=cols, BLOCK=block, HAS_RESIDUAL=residual is not None, BF16=x.dtype == torch.bfloat16,
            FP16=x.dtype == torch.float16, OUT_BF16=out_dtype == torch.bfloat16,
            OUT_FP16=out_dtype == torch.float16, num_warps=min(16, max(1, block // 256)))
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), residual_out.view(x.shape)


class RMSNorm(nn.Module):
    # set by quantize_in_producers (quantization/fp8_fused.py) where the consumer is a block-scaled FP8 linear
    # layer: the output is then its quantized input, on CUDA
    fp8_output = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            if self.fp8_output:
                return rms_norm_quantized(x, self.weight, self.eps, residual)
            return rms_norm_kernel(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
