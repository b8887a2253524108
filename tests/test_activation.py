import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.activation import silu_and_mul_kernel


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, -1)
    return (F.silu(gate) * up).to(x.dtype)


@pytest.mark.parametrize("width", [1000, 3072])  # 1000: a masked last column block
def test_silu_and_mul_kernel_matches_torch(width):
    gen = torch.Generator().manual_seed(0)
    # a view with a longer row stride than its width, as a slice of a wider buffer would be
    x = (torch.randn(5, 2 * width + 8, generator=gen) * 4)[:, : 2 * width]
    out = silu_and_mul_kernel(x)
    assert out.shape == (5, width) and out.is_contiguous()
    torch.testing.assert_close(out, reference(x), atol=1e-5, rtol=1e-5)
    assert silu_and_mul_kernel(x[:0]).shape == (0, width)


@pytest.mark.gpu
def test_silu_and_mul_kernel_in_bf16_on_gpu():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 2 * 3072, generator=gen) * 4).to("cuda", torch.bfloat16)
    out, expected = silu_and_mul_kernel(x).float(), reference(x).float()
    # one rounding of the float32 result in both; the sigmoid's exp may differ in the last float32 bit
    assert ((out - expected).abs() <= 2 ** -7 * expected.abs()).all()
    assert (out == expected).float().mean() > 0.99
