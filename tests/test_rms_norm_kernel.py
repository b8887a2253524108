"""The CUDA path's RMSNorm (nanovllm/layers/layernorm.py: one Triton program per row, with or without the residual
add) against the eager functions the CPU runs and transformers' arithmetic follows: on CPU in Triton's interpreter,
and compiled on the GPU."""
import subprocess
import sys

import pytest
import torch

from nanovllm.layers.layernorm import add_rms_norm, rms_norm, rms_norm_kernel


def inputs(rows: int, cols: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, cols)).to(dtype).to(device)


def assert_like(ours: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal but for a rare last bit: the kernel adds the squares up in another order than torch's mean."""
    assert ours.dtype == expected.dtype and ours.shape == expected.shape
    ours, expected = ours.cpu().float(), expected.float()
    same = (ours == expected).float().mean().item()
    assert same > 0.995, same
    # a last-bit difference is at most one bf16 step (2**-7 relative), which bounds fp16's (2**-10) too
    assert ((ours - expected).abs() <= expected.abs() * 2 ** -7 + 1e-6).all()


def check(rows: int, cols: int, dtype: torch.dtype, residual: bool, device: str, weight_dtype=None) -> None:
    x = inputs(rows, cols, dtype, rows + cols, device)
    weight = (1 + 0.1 * torch.randn(cols, generator=torch.Generator().manual_seed(7))).to(weight_dtype or dtype)
    weight = weight.to(device)
    if residual:
        res = inputs(rows, cols, dtype, 1000 + rows, device)
        out, residual_out = rms_norm_kernel(x, weight, 1e-6, res)
        normed, expected_residual = add_rms_norm(x.cpu(), res.cpu(), weight.cpu(), 1e-6)
        assert residual_out.dtype == x.dtype  # the residual stays in the model dtype, whatever the weight's
        assert torch.equal(residual_out.cpu(), expected_residual)  # one rounding of an exact float32 sum
    else:
        out, normed = rms_norm_kernel(x, weight, 1e-6), rms_norm(x.cpu(), weight.cpu(), 1e-6)
    assert_like(out, normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("rows,cols", [(1, 512), (7, 1024), (3, 160)])  # 160: a masked tail of the block
def test_the_kernel_is_the_eager_norm(rows, cols, dtype, residual):
    check(rows, cols, dtype, residual, "cpu")


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_a_float32_weight_gives_a_float32_result_as_torch_promotes(residual):
    check(4, 256, torch.bfloat16, residual, "cpu", weight_dtype=torch.float32)


def test_a_residual_laid_out_unlike_x_and_an_all_zero_row():
    # the residual a slice of a wider buffer (its own row stride); a zero row normalises through eps alone
    x = inputs(5, 256, torch.bfloat16, 11)
    x[2] = 0
    wide = inputs(5, 3 * 256, torch.bfloat16, 12)
    residual = wide[:, 256:512]
    residual[2] = 0
    weight = (1 + 0.1 * torch.randn(256, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    out, residual_out = rms_norm_kernel(x, weight, 1e-6, residual)
    normed, expected_residual = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual_out, expected_residual)
    assert_like(out, normed)
    assert torch.equal(out[2], torch.zeros(256, dtype=torch.bfloat16))
    # eps keeps a zero row finite; without it the row would be 0 * inf
    assert torch.isfinite(rms_norm_kernel(x[2:3], weight, 1e-6)).all()


def test_strided_and_per_head_inputs():
    # a slice of a wider buffer (q out of a packed qkv) and a [tokens, heads, head_dim] per-head norm
    wide = inputs(6, 3 * 128, torch.bfloat16, 3)
    weight = torch.ones(128, dtype=torch.bfloat16)
    sliced = wide[:, 128:256]
    assert torch.equal(rms_norm_kernel(sliced, weight, 1e-6), rms_norm_kernel(sliced.contiguous(), weight, 1e-6))
    heads = wide.view(6, 3, 128)
    out = rms_norm_kernel(heads, weight, 1e-6)
    assert out.shape == (6, 3, 128)
    assert_like(out, rms_norm(heads, weight, 1e-6))
    assert rms_norm_kernel(wide[:0, :128], weight, 1e-6).shape == (0, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 37, 512])
def test_the_compiled_kernel_on_the_gpu(rows):
    for residual in (False, True):
        check(rows, 4096, torch.bfloat16, residual, "cuda")
        check(rows, 1024, torch.bfloat16, residual, "cuda")


ENGINE_WITHOUT_THE_COMPILER = r'''
import importlib.abc, sys, traceback


class NameWhoImportsTheCompiler(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch._dynamo":
            frames = [f.filename for f in traceback.extract_stack()[:-1] if not f.filename.startswith("<")]
            print("TorchDynamo imported by:", frames[-1])
        return None


sys.meta_path.insert(0, NameWhoImportsTheCompiler())
import flash_attn.flash_attn_interface as interface

public_varlen_calls = []  # flash_attn_varlen_func's route: its custom op imports TorchDynamo at the first call
real_apply = interface.FlashAttnVarlenFunc.apply
interface.FlashAttnVarlenFunc.apply = lambda *args, **kwargs: (public_varlen_calls.append(1),
                                                                real_apply(*args, **kwargs))[1]
from nanovllm import LLM, SamplingParams
from nanovllm.attention.flash_attn_backend import _extension_varlen_fwd
llm = LLM(sys.argv[1], attention_backend=sys.argv[2], max_model_len=1024)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.6), use_tqdm=False)
frames = 0
if "torch._dynamo" in sys.modules:
    from torch._dynamo.utils import counters
    frames = counters["frames"]["total"]
print("frames compiled:", frames)
print("extension route:", _extension_varlen_fwd() is not None, "public varlen calls:", len(public_varlen_calls))
'''


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_an_engine_starts_and_generates_without_compiling(backend, small_model):
    """Importing torch's compiler cost each engine process a second or more of start-up; the default backends
    need none of it, and no frame is ever handed to it: the layers' kernels are Triton's, and the prefill calls
    flash-attn's extension itself rather than through its custom op, whose wrapper imports TorchDynamo at the
    first call. Some transformers versions import it in their own tokenizer modules, which is not ours to avoid."""
    result = subprocess.run([sys.executable, "-c", ENGINE_WITHOUT_THE_COMPILER, small_model, backend],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "frames compiled: 0" in result.stdout, result.stdout + result.stderr[-3000:]
    importers = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("TorchDynamo")]
    # some transformers versions' tokenizer modules import it themselves (5.17 does, 5.24 does not)
    assert all("/transformers/" in importer for importer in importers), result.stdout
    # where transformers imported it first, the hook above cannot see the prefill's route: count that route's calls
    assert "extension route: False" in result.stdout or "public varlen calls: 0" in result.stdout, result.stdout
