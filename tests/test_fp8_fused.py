"""The norm and activation kernels that write a block-scaled FP8 linear layer's quantized input
(nanovllm/quantization/fp8_fused.py), on CPU in Triton's interpreter and compiled on the GPU: against the unfused pair
(the op, then quantize_per_group), the padding rows and scale layout the matmul reads, and which ops the engine
switches."""
import pytest
import torch
from transformers import AutoConfig

from nanovllm.layers.layernorm import add_rms_norm, rms_norm
from nanovllm.models import model_class
from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.e4m3 import FP8
from nanovllm.quantization.fp8_fused import Fp8Input, quantize_in_producers, rms_norm_quantized, silu_and_mul_quantized
from nanovllm.utils.parallel import TensorParallelGroup
from nanovllm.utils.random_checkpoint import model_config


def activations(rows: int, cols: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, cols)).to(torch.bfloat16).to(device)


def assert_quantized_like(result: Fp8Input, reference: torch.Tensor, rows: int, exact: bool) -> None:
    """`result` holds quantize_per_group(reference) for its rows, zero padding rows with scale 1 after them, and the
    scales column-major."""
    codes, scales = fp8.quantize_per_group(reference)
    padded = -(-rows // 4) * 4
    assert result.values.shape == (padded, reference.size(1)) and result.rows == rows
    assert result.scales.shape == (padded, reference.size(1) // 128) and result.scales.stride() == (1, padded)
    ours = result.values[:rows].view(torch.uint8)
    if exact:
        assert torch.equal(ours, codes.view(torch.uint8)) and torch.equal(result.scales[:rows], scales)
    else:  # the norm's sum of squares is added up in another order than torch's: a rare last-bit difference
        same = (ours == codes.view(torch.uint8)).float().mean().item()
        assert same > 0.999, same
        torch.testing.assert_close(result.scales[:rows], scales, rtol=2**-7, atol=0)
        dequantized = result.values[:rows].float() * result.scales[:rows].repeat_interleave(128, 1)
        expected = codes.float() * scales.repeat_interleave(128, 1)
        assert ((dequantized - expected).abs() <= expected.abs() / 8 + 1e-6).all()  # within one e4m3 step
    assert result.values[rows:].float().eq(0).all() and result.scales[rows:].eq(1).all()


def check_rms_norm(rows: int, cols: int, residual: bool, device: str) -> None:
    x = activations(rows, cols, rows, device)
    x[0, :128] = 0  # with the residual too: an all-zero input group still normalises to something
    weight = (1 + 0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16).to(device)
    # the reference runs eagerly on CPU: on CUDA layernorm's functions are compiled, and the compiler keeps the
    # normalised value in float32 where the eager code (and transformers') rounds it to bf16 before the weight
    if residual:
        res = activations(rows, cols, 100 + rows, device)
        result, residual_out = rms_norm_quantized(x, weight, 1e-6, res)
        normed, expected_residual = add_rms_norm(x.cpu(), res.cpu(), weight.cpu(), 1e-6)
        assert torch.equal(residual_out.cpu(), expected_residual)
    else:
        result, normed = rms_norm_quantized(x, weight, 1e-6), rms_norm(x.cpu(), weight.cpu(), 1e-6)
    assert result.dtype == torch.bfloat16
    assert_quantized_like(Fp8Input(result.values.cpu(), result.scales.cpu(), result.rows, result.dtype), normed,
                          rows, exact=False)


def check_silu_and_mul(rows: int, width: int, device: str, exact: bool) -> None:
    x = activations(rows, 2 * width, width, device)
    x[-1, width:width + 128] = 0  # an all-zero up group: scale 1
    gate, up = x.float().chunk(2, -1)
    # activation.silu_and_mul_kernel's arithmetic (float32, one rounding)
    assert_quantized_like(silu_and_mul_quantized(x), (gate * torch.sigmoid(gate) * up).to(torch.bfloat16), rows,
                          exact=exact)


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_writes_the_quantized_norm(rows, residual):
    check_rms_norm(rows, 512, residual, "cpu")


@pytest.mark.parametrize("rows,width", [(1, 256), (6, 640), (9, 1536)])
def test_silu_and_mul_writes_the_quantized_product(rows, width):
    check_silu_and_mul(rows, width, "cpu", exact=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 256])
def test_the_compiled_kernels_on_the_gpu(rows):
    """Qwen3-8B's widths; the GPU's sigmoid may differ from torch's in the last float32 bit, which can move a
    bf16 rounding, so SiLU-and-mul is held to the same bar as the norm there."""
    for residual in (False, True):
        check_rms_norm(rows, 4096, residual, "cuda")
    check_silu_and_mul(rows, 12288, "cuda", exact=False)


def test_a_block_scaled_layer_takes_the_quantized_input_as_is():
    # meta tensors: torch's own shape and layout checks of the block-scaled call, no FP8 matmul needed
    weight = fp8.Fp8Weight(torch.empty(256, 512, dtype=FP8, device="meta"),
                           torch.empty(2, 4, device="meta"), "block",
                           fp8.block_kernel_scale(torch.ones(2, 4)).to("meta"))
    x = Fp8Input(torch.empty(8, 512, dtype=FP8, device="meta"),
                 torch.empty_strided((8, 4), (1, 8), device="meta"), 5, torch.bfloat16)
    y = fp8.fp8_linear(x, weight, torch.empty(256, device="meta", dtype=torch.bfloat16))
    assert y.shape == (5, 256) and y.dtype == torch.bfloat16
    with pytest.raises(AssertionError):  # a row-wise weight cannot take block-scaled input
        fp8.fp8_linear(x, fp8.Fp8Weight(weight.weight, torch.empty(256, device="meta"), "channel",
                                        torch.empty(1, 256, device="meta")), None)


@pytest.mark.parametrize("shape,expected", [("Qwen3-8B", 3), ("Qwen3-30B-A3B", 1)])
def test_the_ops_before_block_scaled_layers_are_switched(shape, expected):
    """Per decoder layer: the input norm (qkv), the post-attention norm and SiLU-and-mul of a dense MLP; a MoE
    layer's post-attention norm feeds the router and the bf16 experts, so it stays as it is."""
    overrides = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=128, vocab_size=512, moe_intermediate_size=128, num_experts=4,
                     num_experts_per_tok=2)
    config = AutoConfig.for_model(**model_config(shape, **overrides))
    with torch.device("meta"):
        model = model_class(config)(config, TensorParallelGroup(rank=0, size=1))
    assert quantize_in_producers(model, 0) == 0  # nothing is FP8 yet
    for module in model.modules():
        if hasattr(module, "fp8") and hasattr(module, "weight") and module.weight.dim() == 2:
            module.fp8 = fp8.Fp8Weight(module.weight, torch.empty(1, 1), "block", torch.empty(1, 1))
    assert quantize_in_producers(model, 0) == expected * 2
    switched = [m for m in model.modules() if getattr(m, "fp8_output", False)]
    for module in switched:
        module.fp8_output = False
    assert quantize_in_producers(model, 64) == 0  # small batches multiply bf16 copies: unquantized input
    assert not any(getattr(m, "fp8_output", False) for m in model.modules())
    assert quantize_in_producers(model, 0) == expected * 2
    layer = model.model.layers[0]
    assert layer.input_layernorm.fp8_output and not model.model.norm.fp8_output
    assert layer.post_attention_layernorm.fp8_output == (expected == 3)
