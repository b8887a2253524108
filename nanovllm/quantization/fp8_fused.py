"""The ops before a block-scaled FP8 linear layer, writing its quantized input themselves.

A block-scaled matmul reads e4m3 activations with one float32 scale per row and 128 columns (fp8_linear.py). Made
by a separate kernel (fp8_activation.py), that input costs a launch, a read of the bf16 activations and a write
of the e4m3 ones per matmul (docs/PERFORMANCE.md measures it). Three of a decoder layer's four matmuls
take the output of an op the engine runs anyway (RMSNorm before qkv and gate/up, SiLU-and-mul before down), so
those ops write the e4m3 values and scales directly here, with the arithmetic of the unfused pair: the op's result
rounded to the model dtype first, then quantize_per_group's scale (amax times the float32 reciprocal of 448, 1
for an all-zero group) and division. The attention output before o_proj is still quantized by its own kernel.

`Fp8Input` carries the result to the linear layer, which then skips its own quantization (fp8_linear.py).
quantize_in_producers (below, called by fp8_model.finish_fp8) turns this on per op, only where the consumer is a
block-scaled FP8 layer.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from nanovllm.quantization.e4m3 import FP8, dynamic_scale, saturate_to_e4m3

GROUP = 128  # activation columns per scale: the block-scaled matmul's
ROW_MULTIPLE = 4  # cuBLAS's block-scaled kernel wants the scales' row count a multiple of 4
_GROUP = tl.constexpr(GROUP)


@dataclass(slots=True)
class Fp8Input:
    """A block-scaled FP8 linear layer's input, already quantized: values [padded, cols] e4m3 (rows past `rows`
    zero) and scales [padded, cols / 128] float32, column-major (stride [1, padded])."""

    values: torch.Tensor
    scales: torch.Tensor
    rows: int
    dtype: torch.dtype  # of the activations it stands for: the matmul's output dtype


@triton.jit
def round_to_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still as float32: the cast would do it on the
    GPU, but Triton's CPU interpreter truncates instead, so the CPU tests could not check the kernels' bits."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups(y, out_rows, scale_rows, scale_group_stride, groups, group_mask, fp8):
    # y [GROUPS, 128] float32 (already rounded to the model dtype): one scale per row of it
    amax = tl.max(tl.abs(y), 1)
    scale = dynamic_scale(amax)
    codes = saturate_to_e4m3(tl.math.div_rn(y, scale[:, None]))
    columns = tl.arange(0, _GROUP)
    tl.store(out_rows + groups[:, None] * _GROUP + columns[None, :], codes.to(fp8), mask=group_mask[:, None])
    tl.store(scale_rows + groups * scale_group_stride, scale, mask=group_mask)


@triton.jit
def _rms_norm_quantize_kernel(x_ptr, x_stride, residual_ptr, residual_stride, residual_out_ptr, weight_ptr, out_ptr,
                              scale_ptr, scale_group_stride, rows, eps, COLS: tl.constexpr, GROUPS: tl.constexpr,
                              HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.arange(0, GROUPS)
    group_mask = groups < COLS // _GROUP
    offsets = groups[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    mask = offsets < tl.where(row < rows, COLS, 0)  # rows past the input are padding: zeros, scale 1
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:  # the residual add rounds to bf16, as layernorm.add_rms_norm's does
        residual = tl.load(residual_ptr + row.to(tl.int64) * residual_stride + offsets, mask=mask, other=0.0)
        x = round_to_bf16(x + residual.to(tl.float32))
        tl.store(residual_out_ptr + row.to(tl.int64) * COLS + offsets, x.to(tl.bfloat16), mask=mask)
    inverse_rms = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / COLS + eps)
    weight = tl.load(weight_ptr + offsets, mask=offsets < COLS, other=0.0).to(tl.float32)
    # layernorm.rms_norm: normalised in float32, rounded to bf16, times the weight, rounded again
    y = round_to_bf16(round_to_bf16(x * inverse_rms) * weight)
    _quantize_groups(y, out_ptr + row.to(tl.int64) * COLS, scale_ptr + row, scale_group_stride, groups, group_mask,
                     out_ptr.dtype.element_ty)


@triton.jit
def _silu_and_mul_quantize_kernel(x_ptr, x_stride, out_ptr, scale_ptr, scale_group_stride, rows,
                                  WIDTH: tl.constexpr, GROUPS: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    group_mask = groups < WIDTH // _GROUP
    offsets = groups[:, None] * _GROUP + tl.arange(0, _GROUP)[None, :]
    mask = offsets < tl.where(row < rows, WIDTH, 0)
    x_row = x_ptr + row.to(tl.int64) * x_stride
    gate = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + WIDTH + offsets, mask=mask, other=0.0).to(tl.float32)
    # activation.silu_and_mul's value (float32, one rounding to bf16), then quantized
    y = round_to_bf16(gate * tl.sigmoid(gate) * up)
    _quantize_groups(y, out_ptr + row.to(tl.int64) * WIDTH, scale_ptr + row, scale_group_stride, groups, group_mask,
                     out_ptr.dtype.element_ty)


def _outputs(rows: int, cols: int, like: torch.Tensor) -> Fp8Input:
    padded = -(-rows // ROW_MULTIPLE) * ROW_MULTIPLE
    values = torch.empty(padded, cols, dtype=FP8, device=like.device)
    scales = torch.empty_strided((padded, cols // GROUP), (1, padded), dtype=torch.float32, device=like.device)
    return Fp8Input(values, scales, rows, like.dtype)


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> Fp8Input | tuple[Fp8Input, torch.Tensor]:
    """layernorm.rms_norm(x) (or add_rms_norm(x, residual): then also the new residual) quantized for a block-scaled
    FP8 linear layer, in one kernel. x [rows, cols] with cols a multiple of 128."""
    rows, cols = x.shape
    # bf16 only: the block-scaled matmuls run for bf16 models (fp8_model.finish_fp8)
    assert x.dtype == weight.dtype == torch.bfloat16 and x.stride(1) == 1 and cols % GROUP == 0
    assert weight.is_contiguous()
    result = _outputs(rows, cols, x)
    residual_out = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == torch.bfloat16
    if result.values.size(0):
        _rms_norm_quantize_kernel[(result.values.size(0),)](
            x, x.stride(0), residual if residual is not None else x,
            residual.stride(0) if residual is not None else 0, residual_out if residual is not None else x, weight,
            result.values, result.scales, result.scales.stride(1), rows, eps, COLS=cols,
            GROUPS=triton.next_power_of_2(cols // GROUP), HAS_RESIDUAL=residual is not None,
            num_warps=4 if cols <= 2048 else 8,
        )
    return result if residual is None else (result, residual_out)


def silu_and_mul_quantized(x: torch.Tensor) -> Fp8Input:
    """activation.silu_and_mul(x) for x = [gate | up], quantized for a block-scaled FP8 linear layer, in one kernel."""
    assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % (2 * GROUP) == 0
    rows, width = x.shape[0], x.shape[1] // 2
    result = _outputs(rows, width, x)
    groups = 4  # per program: a small batch still spreads over many programs
    if result.values.size(0):
        _silu_and_mul_quantize_kernel[(result.values.size(0), triton.cdiv(width // GROUP, groups))](
            x, x.stride(0), result.values, result.scales, result.scales.stride(1), rows, WIDTH=width, GROUPS=groups,
        )
    return result


def _block_scaled(layer: nn.Module | None) -> bool:
    fp8 = getattr(layer, "fp8", None)
    return fp8 is not None and fp8.mode == "block" and fp8.kernel_scale is not None


def quantize_in_producers(model: nn.Module, bf16_below_rows: int) -> int:
    """Have the op before each block-scaled FP8 linear layer write that layer's quantized input itself
    (the kernels above): a decoder layer's input norm (for qkv_proj), its post-attention norm (for a dense MLP's
    gate_up_proj) and the MLP's SiLU-and-mul (for down_proj): in these decoders each of those ops feeds only that
    layer, which a MoE layer's post-attention norm (router and experts) does not.
    Returns how many ops were switched: none where batches below `bf16_below_rows` (fp8_linear.BF16_BELOW_ROWS)
    multiply a bf16 copy of the weight, which needs the unquantized input."""
    switched = 0
    if bf16_below_rows > 0:
        return switched
    for layer in model.modules():
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attention is None or not hasattr(layer, "input_layernorm"):
            continue
        for producer, consumer in ((layer.input_layernorm, getattr(attention, "qkv_proj", None)),
                                   (layer.post_attention_layernorm, getattr(mlp, "gate_up_proj", None)),
                                   (getattr(mlp, "act_fn", None), getattr(mlp, "down_proj", None))):
            if producer is not None and hasattr(producer, "fp8_output") and _block_scaled(consumer):
                producer.fp8_output = True
                switched += 1
    return switched
