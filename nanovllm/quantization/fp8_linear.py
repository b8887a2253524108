"""FP8 (e4m3) linear weights: the quantization arithmetic and the matmul that uses it.

Two weight layouts exist (docs/fp8_weights.md):
- "channel": one float32 scale per output row, computed at load from a bf16 checkpoint (quantization="fp8");
  activations get one scale per token. On the GPU this is torch._scaled_mm's row-wise mode.
- "block": the published FP8 checkpoints' layout, one scale per 128x128 weight block; activations get one scale
  per token and 128 input columns. On the GPU this is torch.nn.functional.scaled_mm's BlockWise1x128 x
  BlockWise128x128 mode (Hopper). Where every block of a row of blocks has the same scale the layout is folded to
  "channel" at load, which is exact.
Activation scales are dynamic (amax / 448 of what is multiplied), as the checkpoints' activation_scheme says.

On CPU, and wherever the GPU lacks FP8 matmuls, "channel" weights run a plain emulation (quantize, dequantize,
multiply in float32) and "block" weights are dequantized at load instead (nanovllm/quantization/fp8_model.py).
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanovllm.quantization.e4m3 import FP8, FP8_MAX, FP8_MAX_RECIPROCAL
from nanovllm.quantization.fp8_activation import quantize_activations
from nanovllm.quantization.fp8_flashinfer import flashinfer_block_mm
from nanovllm.quantization.fp8_fused import Fp8Input
from nanovllm.quantization.fp8_routes import FLASHINFER, Routes, kernel_for

BLOCK = 128  # the published checkpoints' weight_block_size, and the activation group of the block-wise matmul
# Rows (tokens) below which a layer multiplies a bf16 copy of its weight instead: 0 keeps FP8 for every batch.
# A copy costs the memory FP8 saves, so raise this only where the device measurement
# (`benchmarks/microbench.py fp8-gemm`) shows FP8 losing at small batches.
BF16_BELOW_ROWS = 0
# Hopper's fast accumulation (row-wise matmuls only) is less exact over long reductions; the microbenchmark shows
# what it would gain.
FAST_ACCUM = False
# FP8 matmuls run wherever the GPU has them; NANOVLLM_FP8_SCALED_MM=0 turns them off (block weights are then
# dequantized at load, channel weights emulated), to compare or to work around a driver.
SCALED_MM_ON_GPU = os.environ.get("NANOVLLM_FP8_SCALED_MM", "1") != "0"


def _scaling_type(*names: str):
    # torch.nn.functional.ScalingType's members were renamed between releases (Blockwise_1x128 -> BlockWise1x128)
    kind = getattr(F, "ScalingType", None)
    return next((getattr(kind, name) for name in names if hasattr(kind, name)), None)


ACT_1x128 = _scaling_type("BlockWise1x128", "Blockwise_1x128")
WEIGHT_128x128 = _scaling_type("BlockWise128x128", "Blockwise_128x128")


@dataclass(slots=True)
class Fp8Weight:
    """A linear layer's FP8 weight, ready to multiply: weight [out, in] e4m3 and its scales.

    channel: scale [out] float32. block: scale [ceil(out/128), ceil(in/128)] float32, the weight being
    weight * scale block by block (the checkpoints' weight_scale_inv). On the GPU `kernel_scale` holds the scale in
    the layout the scaled matmul wants; `dense` is the bf16 copy used below BF16_BELOW_ROWS, if any. A block-scaled
    weight that FlashInfer's kernel runs for some batch sizes (fp8_routes.py) has `routes` and `flashinfer_scale`
    (the block scales as float32, contiguous), set at start-up by fp8_flashinfer.prepare_flashinfer_gemm."""

    weight: torch.Tensor
    scale: torch.Tensor
    mode: str  # "channel" or "block"
    kernel_scale: torch.Tensor | None = None  # None: no FP8 matmul on this device, emulate
    dense: torch.Tensor | None = None
    routes: Routes = ()
    flashinfer_scale: torch.Tensor | None = None


def fp8_supported(device: torch.device) -> tuple[bool, bool]:
    """(row-wise, block-wise) scaled matmuls on this device: FP8 tensor cores from Ada (8.9); block scales: Hopper."""
    if device.type != "cuda" or not SCALED_MM_ON_GPU:
        return False, False
    capability = torch.cuda.get_device_capability(device)
    return capability >= (8, 9), capability[0] == 9 and hasattr(F, "scaled_mm") and WEIGHT_128x128 is not None


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # the clamp keeps values that round past 448 finite: e4m3fn has no infinity, a cast would give NaN
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (e4m3 rows, float32 scale [rows, 1]) with x ~ rows * scale; an all-zero row gets scale 1."""
    return quantize_per_group(x, x.size(-1))  # one group of the whole row


def quantize_per_group(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] -> (e4m3, float32 scale [rows, cols / group]): one scale per `group` columns of a row."""
    rows, cols = x.shape
    grouped = x.float().view(rows, cols // group, group)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * FP8_MAX_RECIPROCAL, torch.ones_like(amax))
    return _to_fp8(grouped, scale).view(rows, cols), scale.squeeze(-1)


def quantize_blockwise(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] -> (e4m3 weight, float32 weight_scale_inv [ceil(out/block), ceil(in/block)])."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block, dtype=torch.float32,
                         device=weight.device)
    padded[:rows, :cols] = weight.float()
    row_blocks, col_blocks = padded.size(0) // block, padded.size(1) // block
    # each block as one row of block*block values, so one per-row quantization gives one scale per block
    tiles = padded.view(row_blocks, block, col_blocks, block).permute(0, 2, 1, 3).reshape(-1, block * block)
    w8, scale = quantize_per_group(tiles, block * block)
    w8 = w8.view(row_blocks, col_blocks, block, block).permute(0, 2, 1, 3).reshape(padded.shape)
    return w8[:rows, :cols].contiguous(), scale.view(row_blocks, col_blocks).contiguous()



def expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """Block scales [ceil(out/bo), ceil(in/bi)] -> one scale per element of an [out, in] weight (edge blocks cut)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """A block-scaled e4m3 weight as `dtype`: weight * scale_inv of its block, multiplied in float32."""
    return (weight.float() * expand_blocks(scale.float(), tuple(weight.shape), block)).to(dtype)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [out, in] -> (e4m3 weight, float32 scale [out]): one scale per output row (quantization='fp8')."""
    w8, scale = quantize_per_row(weight)
    return w8, scale.squeeze(1)


def fold_to_channel(scale: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Per-row scales [rows] equal to block scales, where every block of each row of blocks shares one scale.

    Only then is the row-wise matmul exact for a block-scaled weight; otherwise None."""
    if not bool((scale == scale[:, :1]).all()):
        return None
    return scale[:, 0].repeat_interleave(BLOCK)[:rows].float().contiguous()


def emulate_channel(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """What the row-wise FP8 matmul computes, in plain torch: both sides quantized, dequantized, float32 product."""
    x8, x_scale = quantize_per_row(x)
    return (x8.float() * x_scale) @ (weight.weight.float() * weight.scale.unsqueeze(1)).t()


def quantized_input(x: torch.Tensor, group: int | None, row_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's input as the scaled matmul takes it: e4m3 rows padded to `row_multiple` (zero rows, scale
    1) and float32 scales per row ([padded, 1]) or per `group` columns (column-major [padded, cols / group]). One
    Triton kernel on CUDA (fp8_activation.py); the torch functions elsewhere (CPU, and meta tensors in tests)."""
    if x.is_cuda:
        return quantize_activations(x.contiguous(), group, row_multiple)
    if x.size(0) % row_multiple:
        x = F.pad(x, (0, 0, 0, -x.size(0) % row_multiple))
    if group is None:
        return quantize_per_row(x)
    x8, scale = quantize_per_group(x, group)
    # column-major [rows, groups] with stride [1, rows], built explicitly: .t().contiguous().t() keeps a
    # row-major stride when there is one row
    return x8, torch.empty_strided(scale.shape, (1, scale.size(0)), dtype=torch.float32,
                                   device=scale.device).copy_(scale)


def _scaled_mm_channel(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    x8, x_scale = quantized_input(x, None)
    return torch._scaled_mm(x8, weight.weight.t(), scale_a=x_scale, scale_b=weight.kernel_scale, out_dtype=x.dtype,
                            use_fast_accum=FAST_ACCUM)


def _scaled_mm_block(x: torch.Tensor | Fp8Input, weight: Fp8Weight) -> torch.Tensor:
    if weight.routes and kernel_for(x.rows if isinstance(x, Fp8Input) else x.size(0), weight.routes) == FLASHINFER:
        return flashinfer_block_mm(x, weight)
    if isinstance(x, Fp8Input):  # quantized by the op that made it (fp8_fused.py)
        rows, x8, x_scale = x.rows, x.values, x.scales
    else:
        # cuBLAS's block-scaled kernel wants the activation scales' token count a multiple of 4 (padding rows'
        # outputs are dropped below) and reads them column-major
        rows, (x8, x_scale) = x.size(0), quantized_input(x, BLOCK, 4)
    # no fast accumulation: the block-scaled kernels apply the scales per 128-deep K step themselves
    y = F.scaled_mm(x8, weight.weight.t(), x_scale, ACT_1x128, weight.kernel_scale, WEIGHT_128x128,
                    output_dtype=x.dtype)
    return y[:rows]


def block_kernel_scale(scale: torch.Tensor) -> torch.Tensor:
    """Block scales [out/128, in/128] in the layout BlockWise128x128 reads: [round_up(in/128, 4), out/128] with
    stride [1, round_up(in/128, 4)], i.e. padded rows of the row-major scale, seen transposed."""
    out_blocks, in_blocks = scale.shape
    padded = torch.ones(out_blocks, -(-in_blocks // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :in_blocks] = scale
    return padded.t()


def fp8_linear(x: torch.Tensor | Fp8Input, weight: Fp8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """y = x W^T (+ bias) for an FP8 weight; x is [..., in] in the model dtype and y comes back in it, or x is an
    Fp8Input for a block-scaled weight (then y is [rows, out])."""
    if isinstance(x, Fp8Input):
        assert weight.mode == "block" and weight.kernel_scale is not None
        y = _scaled_mm_block(x, weight)
        return y if bias is None else y + bias
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if weight.dense is not None and x.size(0) < BF16_BELOW_ROWS:
        y = F.linear(x, weight.dense)
    elif weight.kernel_scale is None:
        assert weight.mode == "channel", "block-scaled weights are dequantized at load where no kernel runs them"
        y = emulate_channel(x, weight).to(x.dtype)
    elif weight.mode == "channel":
        y = _scaled_mm_channel(x, weight)
    else:
        y = _scaled_mm_block(x, weight)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], y.size(-1))
