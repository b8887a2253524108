"""A Triton FP8 matmul for the batch sizes of decode: y = x W^T with e4m3 operands and float32 scales.

cuBLAS's scaled matmuls (torch._scaled_mm, F.scaled_mm) are tuned for large row counts. At the 16-256 rows of a
decode step a layer is bound by reading its weight, and there they fall well short of half of bf16's time. This
kernel tiles the output thinly (few rows, 32-128 columns per program) so even a 16-row batch spreads over every
SM, walks K in steps of 128 (the scale group), and applies the scales in float32 as it accumulates:

- block: activations scaled per row and 128 columns, the weight per 128x128 block (published FP8 checkpoints);
  each K step's product is multiplied by its row and block scales before it is added.
- channel: one scale per activation row and per weight row (quantization="fp8"); applied once at the end.

With QUANTIZE_INPUT (block mode) the kernel reads the bf16 activations and quantizes each 128-column group
itself, with the arithmetic of fp8_activation.py (so the same e4m3 codes and scales): at decode's row counts the
activations are a few kilobytes, and redoing their quantization in every column tile costs less than a kernel
launch and a round trip through memory. At prefill's row counts it would not, and cuBLAS takes over anyway.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.attention.kv_quant import round_to_e4m3

GROUP = 128  # the K step: one activation scale group, one weight scale block
_FP8_MAX = tl.constexpr(448.0)
_FP8_MAX_RECIPROCAL = tl.constexpr(1.0 / 448.0)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, rows, cols, depth,
    x_stride, xs_row_stride, xs_group_stride, w_stride, ws_row_stride, out_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_MODE: tl.constexpr, QUANTIZE_INPUT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # column tiles vary fastest: neighbouring programs share the activation rows and stream different weights
    column_tiles = tl.cdiv(cols, BLOCK_N)
    m = (tl.program_id(0) // column_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = (tl.program_id(0) % column_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, GROUP)
    row_mask, col_mask = m < rows, n < cols
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride + k[None, :]
    # the weight tile is read as [GROUP, BLOCK_N] (K-major, as the tensor cores take the second operand)
    w_cols = w_ptr + n.to(tl.int64)[None, :] * w_stride + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(0, tl.cdiv(depth, GROUP)):
        in_depth = step * GROUP + k < depth
        x = tl.load(x_rows + step * GROUP, mask=row_mask[:, None] & in_depth[None, :], other=0.0)
        w = tl.load(w_cols + step * GROUP, mask=in_depth[:, None] & col_mask[None, :], other=0.0)
        if QUANTIZE_INPUT:  # fp8_activation.py's arithmetic, per row of this 128-column group
            x = x.to(tl.float32)
            amax = tl.max(tl.abs(x), 1)
            x_scale = tl.where(amax > 0, amax * _FP8_MAX_RECIPROCAL, 1.0)
            x = round_to_e4m3(tl.clamp(tl.math.div_rn(x, x_scale[:, None]), -_FP8_MAX, _FP8_MAX))
            x = x.to(w.dtype)
        product = tl.dot(x, w)
        if BLOCK_MODE:
            if not QUANTIZE_INPUT:
                x_scale = tl.load(x_scale_ptr + m * xs_row_stride + step * xs_group_stride, mask=row_mask, other=1.0)
            w_scale = tl.load(w_scale_ptr + (n // GROUP) * ws_row_stride + step, mask=col_mask, other=1.0)
            acc += product * x_scale[:, None] * w_scale[None, :]
        else:
            acc += product
    if not BLOCK_MODE:
        x_scale = tl.load(x_scale_ptr + m * xs_row_stride, mask=row_mask, other=1.0)
        w_scale = tl.load(w_scale_ptr + n, mask=col_mask, other=1.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m.to(tl.int64)[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# (most rows, tile) from benchmarks/microbench_fp8_gemm.py --sweep on an H200; past the last row count the engine
# uses cuBLAS (fp8_linear.TRITON_MAX_ROWS)
TUNED: list[tuple[int, TileConfig]] = [
    (16, TileConfig(16, 64, 4, 4)),
    (64, TileConfig(32, 64, 4, 4)),
    (256, TileConfig(64, 128, 4, 3)),
]


def tile_for(rows: int) -> TileConfig:
    return next((tile for most, tile in TUNED if rows <= most), TUNED[-1][1])


def fp8_matmul(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
               block_mode: bool, bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
               tile: TileConfig | None = None) -> torch.Tensor:
    """x [rows, in]: e4m3 with x_scale ([rows, in/128] block, [rows, 1] channel; any strides), or, in block mode
    with x_scale None, the unquantized activations (quantized in the kernel). weight [out, in] e4m3 with
    weight_scale [ceil(out/128), ceil(in/128)] (block, row-major) or [out] (channel). Returns [rows, out]."""
    rows, depth = x.shape
    cols = weight.size(0)
    assert weight.size(1) == depth and x.stride(1) == 1 and weight.stride(1) == 1
    quantize_input = x_scale is None
    assert not quantize_input or block_mode, "the kernel quantizes its input only in block mode"
    if block_mode:
        assert depth % GROUP == 0 and weight_scale.stride(1) == 1
    tile = tile or tile_for(rows)
    out = torch.empty(rows, cols, dtype=out_dtype, device=x.device)
    scale_strides = (0, 0) if quantize_input else (x_scale.stride(0), x_scale.stride(1))
    grid = (triton.cdiv(rows, tile.block_m) * triton.cdiv(cols, tile.block_n),)
    _fp8_matmul_kernel[grid](
        x, x if quantize_input else x_scale, weight, weight_scale, bias if bias is not None else out, out,
        rows, cols, depth, x.stride(0), *scale_strides, weight.stride(0),
        weight_scale.stride(0) if block_mode else 0, out.stride(0),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_MODE=block_mode, QUANTIZE_INPUT=quantize_input,
        HAS_BIAS=bias is not None, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return out
