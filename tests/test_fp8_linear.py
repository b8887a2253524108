"""The FP8 arithmetic of nanovllm/quantization/fp8_linear.py on CPU, and the argument layouts of its GPU calls: the
row-wise torch._scaled_mm runs on CPU too; the block-wise call is checked on meta tensors, against torch's own
shape and stride checks for that kernel."""
import pytest
import torch
import torch.nn.functional as F

from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.e4m3 import FP8, FP8_MAX
from nanovllm.quantization.fp8_linear import quantize_blockwise


def test_blockwise_quantization_round_trips_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 200, generator=g)
    weight[:128, :128] *= 50  # one loud block must not coarsen its neighbours
    w8, scale = quantize_blockwise(weight)
    assert w8.dtype == FP8 and list(scale.shape) == [3, 2]
    back = fp8.dequantize_blocks(w8, scale, torch.float32)
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of a value, or 2^-10 of its block's scale for subnormals
    error = (back - weight).abs()
    bound = weight.abs() / 16 + fp8.expand_blocks(scale, (300, 200)) / 2**10
    assert (error <= bound * (1 + 1e-6)).all()
    assert scale[0, 0] > 20 * scale[1:, 1:].max()  # the loud block has its own scale


def test_fold_to_channel_only_when_exact():
    w8 = torch.randn(256, 256).to(FP8)
    uniform = torch.tensor([[0.5, 0.5], [2.0, 2.0]])
    folded = fp8.fold_to_channel(uniform, 256)
    torch.testing.assert_close(w8.float() * folded.unsqueeze(1), fp8.dequantize_blocks(w8, uniform, torch.float32),
                               rtol=0, atol=0)
    assert fp8.fold_to_channel(torch.tensor([[0.5, 0.25], [2.0, 2.0]]), 256) is None


def test_rowwise_scaled_mm_call_matches_the_emulation():
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(384, 512, generator=g), torch.randn(5, 512, generator=g)
    w8, scale = fp8.quantize_per_channel(weight)
    channel = fp8.Fp8Weight(w8, scale, "channel", scale.view(1, -1))
    # float32 sums of 512 products in two orders (the thread count changes torch's): 1e-4, not bit equality
    torch.testing.assert_close(fp8._scaled_mm_channel(x, channel), fp8.emulate_channel(x, channel),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 5, 128, 300])
@pytest.mark.parametrize("cols", [384, 512, 4096])
def test_blockwise_call_layouts_pass_torch_checks(rows, cols):
    weight = torch.randn(256, cols)
    w8, scale = quantize_blockwise(weight)
    kernel_scale = fp8.block_kernel_scale(scale)
    assert kernel_scale.shape[1] == 2 and kernel_scale.stride(0) == 1
    torch.testing.assert_close(kernel_scale.t()[:, :cols // 128], scale, rtol=0, atol=0)
    block = fp8.Fp8Weight(w8.to("meta"), scale.to("meta"), "block", kernel_scale.to("meta"))
    y = fp8._scaled_mm_block(torch.empty(rows, cols, device="meta", dtype=torch.bfloat16), block)
    assert list(y.shape) == [rows, 256] and y.dtype == torch.bfloat16
    # and a wrong layout is refused, so the check above is not vacuous
    wrong = fp8.Fp8Weight(block.weight, block.scale, "block", scale.to("meta"))
    with pytest.raises(RuntimeError):
        fp8._scaled_mm_block(torch.empty(rows, cols, device="meta", dtype=torch.bfloat16), wrong)


def test_group_quantization_scales_each_128_columns():
    x = torch.ones(2, 256)
    x[0, 128:] = 100
    x8, scale = fp8.quantize_per_group(x)
    torch.testing.assert_close(scale, torch.tensor([[1, 100], [1, 1]]) / FP8_MAX)
    assert (x8.float() == FP8_MAX).all()
    assert hasattr(F, "scaled_mm")  # the block-wise GPU path's entry point exists in this torch


@pytest.mark.parametrize("rows,cols,group,multiple", [(5, 512, 128, 4), (4, 384, 128, 4), (3, 300, None, 1),
                                                      (6, 2048, None, 4), (1, 128, 128, 4)])
def test_fused_activation_quantization_writes_the_reference_bits(rows, cols, group, multiple):
    from nanovllm.quantization.fp8_activation import quantize_activations

    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 2, cols)).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero group (or, per row, a partly zero row)
    x[-1, -1] = 3e4  # one loud value: its group's (or row's) scale is large
    x8, scales = quantize_activations(x, group, multiple)
    padded = -(-rows // multiple) * multiple
    reference, reference_scales = fp8.quantize_per_row(x) if group is None else fp8.quantize_per_group(x, group)
    assert x8.shape == (padded, cols) and x8.dtype == FP8
    assert torch.equal(x8[:rows].view(torch.uint8), reference.view(torch.uint8))
    assert torch.equal(scales[:rows].reshape(reference_scales.shape), reference_scales)
    assert x8[rows:].float().eq(0).all() and scales[rows:].eq(1).all()  # padding rows
    if group is not None:  # column-major, as BlockWise1x128 reads the activation scales
        assert scales.stride() == (1, padded)


def test_quantization_at_load_uses_blocks_only_where_they_tile_each_part():
    from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
    from nanovllm.quantization.fp8_model import _blocks_fit, _quantize_blockwise_in_slabs
    from nanovllm.utils.parallel import TensorParallelGroup

    one = TensorParallelGroup(rank=0, size=1)
    with torch.device("meta"):
        aligned = QKVParallelLinear(256, 128, 2, 1, one)  # q 256 rows, k and v 128 each
        split_block = QKVParallelLinear(256, 64, 4, 1, one)  # k and v of 64 rows would share a block
        row_parallel = RowParallelLinear(384, 256, one)
    assert _blocks_fit(aligned) and not _blocks_fit(split_block) and _blocks_fit(row_parallel)
    weight = torch.randn(2 * 1024 + 256, 384)  # slabs of 1,024 rows, the last one shorter
    slabs, whole = _quantize_blockwise_in_slabs(weight), quantize_blockwise(weight)
    assert torch.equal(slabs[0].view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(slabs[1], whole[1])
