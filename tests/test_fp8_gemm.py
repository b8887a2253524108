"""The Triton FP8 matmul (nanovllm/layers/fp8_gemm.py) on CPU, in Triton's interpreter: against the float32
product of the dequantized operands, block-wise and row-wise, with its in-kernel input quantization giving the
same bits as quantizing first, and as fp8_linear runs it for decode's row counts."""
import pytest
import torch

from nanovllm.layers import fp8_linear as fp8
from nanovllm.layers.fp8_activation import quantize_activations
from nanovllm.layers.fp8_gemm import TileConfig, fp8_matmul, tile_for
from nanovllm.utils.fp8_checkpoint import quantize_blockwise

SMALL_TILE = TileConfig(16, 32, 4, 2)  # several row and column tiles even at these sizes


def operands(rows: int, out: int, depth: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, depth, generator=g) * torch.logspace(-2, 1, depth)).to(torch.bfloat16)
    weight = torch.randn(out, depth, generator=g) * 0.05
    weight[:, :128] *= 20  # blocks with different scales, so a scale applied to the wrong block shows
    return x, weight


@pytest.mark.parametrize("rows,out,depth", [(1, 200, 256), (5, 384, 512), (33, 130, 384)])
def test_block_mode_matches_the_dequantized_product(rows, out, depth):
    x, weight = operands(rows, out, depth, rows)
    w8, w_scale = quantize_blockwise(weight)
    x8, x_scale = quantize_activations(x, 128)
    y = fp8_matmul(x8, x_scale, w8, w_scale, True, out_dtype=torch.float32, tile=SMALL_TILE)
    reference = (x8.float() * x_scale.repeat_interleave(128, 1)) @ fp8.dequantize_blocks(w8, w_scale, torch.float32).t()
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    # a wrong weight scale layout (transposed blocks) is far off, so the comparison above is not vacuous
    if w_scale.size(0) == w_scale.size(1):
        wrong = fp8_matmul(x8, x_scale, w8, w_scale.t().contiguous(), True, out_dtype=torch.float32, tile=SMALL_TILE)
        assert (wrong - reference).abs().max() > 0.1 * reference.abs().max()


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_in_kernel_quantization_gives_the_same_bits_as_quantizing_first(rows):
    x, weight = operands(rows, 256, 384, 10 + rows)
    x[0, :128] = 0  # an all-zero group: scale 1, as the standalone kernel gives it
    w8, w_scale = quantize_blockwise(weight)
    bias = torch.randn(256).to(torch.bfloat16)
    fused = fp8_matmul(x, None, w8, w_scale, True, bias, tile=SMALL_TILE)
    x8, x_scale = quantize_activations(x, 128)
    separate = fp8_matmul(x8, x_scale, w8, w_scale, True, bias, tile=SMALL_TILE)
    assert fused.dtype == torch.bfloat16 and torch.equal(fused, separate)


def test_channel_mode_matches_the_emulation_and_adds_the_bias():
    x, weight = operands(9, 320, 512, 3)
    w8, w_scale = fp8.quantize_per_channel(weight)
    channel = fp8.Fp8Weight(w8, w_scale, "channel", w_scale.view(1, -1))
    x8, x_scale = quantize_activations(x, None)
    bias = torch.randn(320)
    y = fp8_matmul(x8, x_scale, w8, w_scale, False, bias, out_dtype=torch.float32, tile=SMALL_TILE)
    reference = fp8.emulate_channel(x, channel) + bias
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


@pytest.mark.parametrize("mode", ["block", "channel"])
def test_fp8_linear_takes_the_kernel_for_decode_rows_and_cublas_past_them(mode, monkeypatch):
    x, weight = operands(6, 256, 256, 4)
    if mode == "block":
        w8, w_scale = quantize_blockwise(weight)
        layer = fp8.Fp8Weight(w8, w_scale, "block", fp8.block_kernel_scale(w_scale))
        dense = fp8.dequantize_blocks(w8, w_scale, torch.float32)
        x8, x_scale = fp8.quantize_per_group(x)
        x_dq = x8.float() * x_scale.repeat_interleave(128, 1)
    else:
        w8, w_scale = fp8.quantize_per_channel(weight)
        layer = fp8.Fp8Weight(w8, w_scale, "channel", w_scale.view(1, -1))
        dense = w8.float() * w_scale.unsqueeze(1)
        x8, x_scale = fp8.quantize_per_row(x)
        x_dq = x8.float() * x_scale
    bias = torch.randn(256).to(torch.bfloat16)
    reference = x_dq @ dense.t() + bias.float()
    y = fp8.fp8_linear(x.view(2, 3, 256), layer, bias)
    assert y.shape == (2, 3, 256) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.view(6, 256).float(), reference, rtol=2e-2, atol=2e-2)
    called = []
    monkeypatch.setattr(fp8, "fp8_matmul", lambda *args, **kwargs: called.append(args) or reference)
    fp8.fp8_linear(x, layer, bias)
    assert len(called) == 1
    monkeypatch.setitem(fp8.TRITON_MAX_ROWS, mode, 4)  # 6 rows are past it: cuBLAS (channel runs on CPU too)
    if mode == "channel":
        torch.testing.assert_close(fp8.fp8_linear(x, layer, bias).float(), reference, rtol=2e-2, atol=2e-2)
        assert len(called) == 1


def test_tiles_grow_with_the_rows():
    assert tile_for(1).block_m <= tile_for(64).block_m <= tile_for(256).block_m
    assert tile_for(10_000) == tile_for(256)
