"""An FP8 linear layer's input quantized in one kernel: e4m3 values and their float32 scales (amax / 448 of each
row, or of each 128 columns of a row), written straight into the layout the scaled matmul reads, with the
padding rows that cuBLAS's block-scaled kernel needs already zero: one launch before each FP8 matmul
(fp8_linear.py) where a compiled quantization would add a pad copy and a scale-layout copy.

The arithmetic is quantize_per_row / quantize_per_group's (fp8_linear.py): the scale is amax times the float32
reciprocal of 448, values are divided by it correctly rounded and clamped to +-448, an all-zero group is scaled
by 1, so the kernel writes the same bits as those torch functions, on CPU and on CUDA.
"""
import torch
import triton
import triton.language as tl

from nanovllm.quantization.e4m3 import FP8, dynamic_scale, saturate_to_e4m3


@triton.jit
def _quantize_activations_kernel(x_ptr, x_stride, out_ptr, scale_ptr, scale_row_stride, scale_group_stride, rows,
                                 COLS: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                                 PER_ROW: tl.constexpr):
    row = tl.program_id(0)
    # rows past the input are padding: nothing is loaded (zeros, scale 1)
    readable = tl.where(row < rows, COLS, 0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    out_row = out_ptr + row.to(tl.int64) * COLS
    columns = tl.arange(0, GROUP)
    fp8 = out_ptr.dtype.element_ty
    if PER_ROW:  # one scale for the row: its amax first, then the values
        amax = tl.zeros([GROUP], tl.float32)
        for start in range(0, COLS, GROUP):
            mask = start + columns < readable
            x = tl.load(x_row + start + columns, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = dynamic_scale(tl.max(amax, 0))
        for start in range(0, COLS, GROUP):
            mask = start + columns < readable
            x = tl.load(x_row + start + columns, mask=mask, other=0.0).to(tl.float32)
            y = saturate_to_e4m3(tl.math.div_rn(x, scale))
            tl.store(out_row + start + columns, y.to(fp8), mask=start + columns < COLS)
        tl.store(scale_ptr + row * scale_row_stride, scale)
    else:  # a scale per GROUP columns (COLS is a multiple of GROUP), GROUPS of them per program
        groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offsets = groups[:, None] * GROUP + columns[None, :]
        in_row = groups[:, None] < COLS // GROUP
        x = tl.load(x_row + offsets, mask=in_row & (offsets < readable), other=0.0).to(tl.float32)
        scale = dynamic_scale(tl.max(tl.abs(x), 1))
        y = saturate_to_e4m3(tl.math.div_rn(x, scale[:, None]))
        tl.store(out_row + offsets, y.to(fp8), mask=in_row)
        tl.store(scale_ptr + row * scale_row_stride + groups * scale_group_stride, scale,
                 mask=groups < COLS // GROUP)


def quantize_activations(x: torch.Tensor, group: int | None,
                         row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (rows contiguous) -> (e4m3 [padded, cols], float32 scales), padded = rows rounded up to
    `row_multiple` (the extra rows zero, with scale 1).

    group None: one scale per row, [padded, 1] (torch._scaled_mm's row-wise scale_a). group g: one per g columns,
    [padded, cols / g] with stride [1, padded], the column-major layout of F.scaled_mm's BlockWise1x128."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and (group is None or cols % group == 0)
    padded = -(-rows // row_multiple) * row_multiple
    out = torch.empty(padded, cols, dtype=FP8, device=x.device)
    if group is None:
        scales = torch.empty(padded, 1, dtype=torch.float32, device=x.device)
        strides, block, groups, programs = (1, 0), min(1024, triton.next_power_of_2(cols)), 1, 1
    else:
        scales = torch.empty_strided((padded, cols // group), (1, padded), dtype=torch.float32, device=x.device)
        # a few groups per program, all loaded at once: a small batch still spreads over many programs
        strides, block, groups = scales.stride(), group, 4
        programs = triton.cdiv(cols // group, groups)
    if padded:
        _quantize_activations_kernel[(padded, programs)](x, x.stride(0), out, scales, *strides, rows, COLS=cols,
                                                         GROUP=block, GROUPS=groups, PER_ROW=group is None)
    return out, scales
