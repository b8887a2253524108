"""FlashInfer's place in the engine, on CPU and without FlashInfer: which attention backend is chosen, the error
when FlashInfer is asked for but absent, how the flashinfer backend pages our cache for XQA (against XQA's
documented contract, written out in torch), and which FP8 matmul each batch size runs. The kernels themselves are
tested on the GPU (tests/test_gpu_flashinfer.py)."""
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import nanovllm.attention as attention
from nanovllm.attention import KVCacheLayout, LayerKV, default_backend, make_attention_backend
from nanovllm.attention import flashinfer_backend as fib
from nanovllm.attention.torch_backend import TorchBackend
from nanovllm.engine.config_checks import checked_config
from nanovllm.quantization import fp8_flashinfer
from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_fused import Fp8Input
from nanovllm.quantization.fp8_routes import (
    CUBLAS,
    FLASHINFER,
    MEASURED_ROUTES,
    ROUTES_ENV,
    describe_routes,
    kernel_for,
    parse_routes,
    routed_rows,
)
from nanovllm.quantization.kv_quant import FP8, quantize
from nanovllm.utils.context import Context
from nanovllm.utils.flashinfer import INSTALL, flashinfer_installed, require_flashinfer


@pytest.fixture
def no_flashinfer(monkeypatch):
    """`import flashinfer` fails, as where the extra is not installed."""
    for name in ("flashinfer", "flashinfer.decode", "flashinfer.gemm"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_default_backend_per_device_cache_and_switch(monkeypatch, hopper):
    installed = {"yes": True}
    monkeypatch.setattr(attention, "flashinfer_installed", lambda: installed["yes"])
    assert default_backend(False, True) == "torch"
    monkeypatch.setattr(attention, "FLASHINFER_FOR_FP8_KV_ON_HOPPER", False)
    assert default_backend(True, True) == "triton"  # the switch off: triton, FlashInfer or not
    monkeypatch.setattr(attention, "FLASHINFER_FOR_FP8_KV_ON_HOPPER", True)
    assert default_backend(True, True) == "flashinfer"
    assert default_backend(True, False) == "triton"  # a bf16 cache stays on triton
    installed["yes"] = False
    assert default_backend(True, True) == "triton"
    installed["yes"] = True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert default_backend(True, True) == "triton"  # Ada: no Hopper FP8 XQA kernel


def test_asking_for_flashinfer_without_it_names_the_extra(no_flashinfer):
    assert not flashinfer_installed()
    with pytest.raises(ImportError, match=r"attention_backend='flashinfer' needs FlashInfer .*" + '"' +
                       r"\.\[cuda,flashinfer\]" + '"'):
        make_attention_backend("flashinfer", use_cuda=True)
    with pytest.raises(ImportError, match="pip install"):
        require_flashinfer("FP8 matmul routes", "gemm")
    assert INSTALL == 'pip install -e ".[cuda,flashinfer]"'
    # without a GPU the device is what is wrong, and it is said first
    with pytest.raises(ValueError, match="attention_backend='flashinfer' does not run with no CUDA device"):
        make_attention_backend("flashinfer", use_cuda=False)


def test_asking_for_flashinfer_with_an_fp8_cache_warns_that_it_is_less_exact(tiny_model, caplog):
    with caplog.at_level("WARNING", logger="nanovllm.engine.config_checks"):
        checked_config(tiny_model, attention_backend="flashinfer")  # a bf16 cache: XQA's generic kernel, exact
        checked_config(tiny_model, kv_cache_dtype="fp8")  # the default backend: nothing rounded beyond the cache
        assert not caplog.records
        checked_config(tiny_model, attention_backend="flashinfer", kv_cache_dtype="fp8")
    [record] = caplog.records
    assert "rounds the query and the softmax probabilities to e4m3" in record.getMessage()


def test_paged_tables_map_each_block_to_its_128_token_pages():
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([300, 17, 0], dtype=torch.int32)
    pages, seq_lens = fib.paged_tables(tables, lens, 2, torch.arange(2, dtype=torch.int32))
    assert pages.tolist() == [[6, 7, 14, 15, 0, 1], [10, 11, 0, 1, 0, 1], [0, 1, 0, 1, 0, 1]]
    assert seq_lens.tolist() == [300, 17, 1] and pages.dtype == seq_lens.dtype == torch.int32
    # token t of a sequence: page pages[t // 128], row t % 128 of the cache seen as pages is slot t of its block
    cache = torch.arange(8 * 256, dtype=torch.float32).view(8, 256, 1, 1)
    paged = cache.view(-1, fib.PAGE, 1, 1)
    for t in (0, 127, 128, 255, 256, 299):
        assert paged[pages[0, t // 128], t % 128].item() == cache[tables[0, t // 256], t % 256].item()


def xqa_contract(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, bmm1_scale=1.0,
                 bmm2_scale=1.0, out=None):
    """flashinfer.decode.xqa_batch_decode_with_kv_cache as its documentation states it, for NHD pages: row i
    attends to its first seq_lens[i] tokens, softmax(q . k * bmm1_scale) . v * bmm2_scale over the cache's
    values as stored."""
    k_cache, v_cache = kv_cache
    page = k_cache.size(1)
    assert block_tables.dtype == torch.int32 and max_seq_len == block_tables.size(1) * page
    assert workspace_buffer.numel() >= fib.SEMAPHORE_BYTES and query.is_contiguous()
    for i in range(query.size(0)):
        n = int(seq_lens[i])
        used = block_tables[i, : -(-n // page)].long()
        k, v = (c[used].flatten(0, 1)[:n].float() for c in (k_cache, v_cache))
        group = query.size(1) // k.size(1)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        probs = (torch.einsum("hd,nhd->hn", query[i].float(), k) * bmm1_scale).softmax(-1)
        out[i] = torch.einsum("hn,nhd->hd", probs, v) * bmm2_scale
    return out


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_flashinfer_decode_folds_scales_and_pages_as_xqa_expects(monkeypatch, dtype):
    calls = []

    def xqa(*args, **kwargs):
        calls.append(args[3])
        return xqa_contract(*args, **kwargs)

    fake = SimpleNamespace(xqa_batch_decode_with_kv_cache=xqa)
    monkeypatch.setattr(fib, "require_flashinfer", lambda what, submodule="": fake)
    kv_heads, heads, head_dim, blocks = 2, 4, 16, 6
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(blocks, 256, kv_heads, head_dim, generator=g) * 3 for _ in range(2))
    scales = (k.abs().max().item() / 200, v.abs().max().item() / 100) if dtype == FP8 else (1.0, 1.0)
    cache = LayerKV(quantize(k, scales[0]), quantize(v, scales[1]), *scales) if dtype == FP8 else LayerKV(k, v)
    backend = make_attention_backend("flashinfer", use_cuda=True)
    backend.bind(kv_heads, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        backend.warm_up(KVCacheLayout(1, 256, kv_heads, head_dim, cache.k.dtype), heads, torch.float32)
    assert backend.warm_up(KVCacheLayout(1, 256, kv_heads, head_dim, cache.k.dtype), heads, torch.bfloat16) >= 0
    assert calls[-1].tolist() == [[0, 1]]  # the warm-up: one block, two pages
    q = torch.randn(3, heads, head_dim, generator=g)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3], [0, 0, 0]], dtype=torch.int32)
    context = Context(is_prefill=False, context_lens=torch.tensor([300, 700, 0], dtype=torch.int32),
                      block_tables=tables)
    backend.begin_forward(context)
    ours = backend.decode(q, cache, context, head_dim ** -0.5)
    reference = TorchBackend().decode(q[:2], cache, Context(is_prefill=False, context_lens=context.context_lens[:2],
                                                            block_tables=tables[:2]), head_dim ** -0.5)
    torch.testing.assert_close(ours[:2], reference, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours[2]).all()  # the padding row read one token of block 0
    backend.begin_forward(Context(is_prefill=True))
    assert backend.pages is None  # a prefill pass derives nothing


def test_routes_parse_and_pick_a_kernel_per_row_count():
    routes = parse_routes("31:flashinfer, 64:cublas,256:flashinfer")
    assert routes == ((31, FLASHINFER), (64, CUBLAS), (256, FLASHINFER))
    assert [kernel_for(n, routes) for n in (1, 31, 32, 64, 65, 256, 257, 8192)] == \
        [FLASHINFER, FLASHINFER, CUBLAS, CUBLAS, FLASHINFER, FLASHINFER, CUBLAS, CUBLAS]
    assert kernel_for(1, ()) == CUBLAS
    assert routed_rows(routes, FLASHINFER, 100) == list(range(1, 32)) + list(range(65, 101))
    assert describe_routes(((31, FLASHINFER),)) == "1-31 rows: flashinfer, 32+ rows: cublas"
    for bad, error in (("31", "'31' is not max_rows:kernel"), ("31:cutlass", "'31:cutlass' is not"),
                       ("x:cublas", "'x:cublas' is not"), ("0:flashinfer", "positive and increasing"),
                       ("64:flashinfer,31:cublas", "positive and increasing")):
        with pytest.raises(ValueError, match=error):
            parse_routes(bad)


def block_weight(out_features: int, in_features: int, routes=()) -> fp8.Fp8Weight:
    blocks = (-(-out_features // 128), -(-in_features // 128))
    weight = fp8.Fp8Weight(torch.zeros(out_features, in_features, dtype=FP8), torch.ones(blocks), "block",
                           torch.ones(1), routes=routes)
    weight.flashinfer_scale = weight.scale if routes else None
    return weight


def test_fp8_linear_sends_each_batch_size_to_its_kernel(monkeypatch):
    ran = []
    monkeypatch.setattr(fp8, "flashinfer_block_mm", lambda x, w: (ran.append(FLASHINFER), torch.zeros(1))[1])
    monkeypatch.setattr(fp8.F, "scaled_mm", lambda *a, **k: (ran.append(CUBLAS), torch.zeros(a[0].size(0), 256))[1])
    routed = block_weight(256, 256, ((31, FLASHINFER),))
    for rows in (1, 16, 31, 32, 64, 4096):
        fp8._scaled_mm_block(torch.randn(rows, 256, dtype=torch.bfloat16), routed)
    quantized = Fp8Input(torch.zeros(20, 256, dtype=FP8), torch.ones(20, 2), 17, torch.bfloat16)
    fp8._scaled_mm_block(quantized, routed)
    fp8._scaled_mm_block(quantized, block_weight(256, 256))  # no routes: cuBLAS
    assert ran == [FLASHINFER] * 3 + [CUBLAS] * 3 + [FLASHINFER, CUBLAS]


class FakeModel(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Module() for _ in shapes)
        for layer, shape in zip(self.layers, shapes):
            layer.fp8 = block_weight(*shape)


def test_prepare_compiles_every_routed_row_count_of_every_shape_that_fits(monkeypatch, hopper):
    ran = []
    monkeypatch.setattr(fp8_flashinfer, "flashinfer_installed", lambda: True)
    monkeypatch.setattr(fp8_flashinfer, "require_flashinfer", lambda *a: None)
    monkeypatch.setattr(fp8_flashinfer, "flashinfer_block_mm", lambda x, w: ran.append((tuple(w.weight.shape), len(x))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    # two layers of one shape, one whose output (200) is not a multiple of 64, one whose input (200) is not of 128
    model = FakeModel([(256, 512), (256, 512), (200, 256), (384, 200), (128, 128)])
    monkeypatch.setenv(ROUTES_ENV, "")
    assert fp8_flashinfer.prepare_flashinfer_gemm(model, 64) is None  # no route names FlashInfer
    monkeypatch.setenv(ROUTES_ENV, "4:flashinfer,8:cublas,10:flashinfer")
    assert fp8_flashinfer.prepare_flashinfer_gemm(model, 64) >= 0
    assert ran == [(shape, n) for shape in ((256, 512), (128, 128)) for n in (1, 2, 3, 4, 9, 10)]
    assert [bool(layer.fp8.routes) for layer in model.layers] == [True, True, False, False, True]
    assert model.layers[0].fp8.flashinfer_scale.dtype == torch.float32


def test_routes_to_flashinfer_without_it(monkeypatch, hopper, no_flashinfer):
    model = FakeModel([(256, 512)])
    monkeypatch.setattr(fp8_flashinfer, "active_routes", lambda: ((31, FLASHINFER),))
    assert fp8_flashinfer.prepare_flashinfer_gemm(model, 64) is None  # the code's table: cuBLAS keeps every batch
    assert not model.layers[0].fp8.routes
    monkeypatch.setenv(ROUTES_ENV, "31:flashinfer")  # asked for explicitly: an error naming the extra
    with pytest.raises(ImportError, match=r"\.\[cuda,flashinfer\]"):
        fp8_flashinfer.prepare_flashinfer_gemm(model, 64)


def test_a_flashinfer_that_cannot_build_leaves_the_built_in_routes_on_cublas(monkeypatch, hopper):
    """FlashInfer installed but its kernels failing to compile (no nvcc, a broken JIT): the built-in table only
    prefers it for speed, so every layer goes back to cuBLAS with a warning; routes asked for by name fail."""
    def broken(x, w):
        raise RuntimeError("nvcc not found")

    monkeypatch.setattr(fp8_flashinfer, "flashinfer_installed", lambda: True)
    monkeypatch.setattr(fp8_flashinfer, "require_flashinfer", lambda *a: None)
    monkeypatch.setattr(fp8_flashinfer, "flashinfer_block_mm", broken)
    monkeypatch.setattr(fp8_flashinfer, "active_routes", lambda: ((128, FLASHINFER),))
    monkeypatch.delenv(ROUTES_ENV, raising=False)
    model = FakeModel([(256, 512), (128, 128)])
    assert fp8_flashinfer.prepare_flashinfer_gemm(model, 64) is None
    assert [(layer.fp8.routes, layer.fp8.flashinfer_scale) for layer in model.layers] == [((), None), ((), None)]
    monkeypatch.setenv(ROUTES_ENV, "128:flashinfer")
    with pytest.raises(RuntimeError, match="nvcc not found"):
        fp8_flashinfer.prepare_flashinfer_gemm(model, 64)
    assert not any(layer.fp8.routes for layer in model.layers)


def test_the_ab_benchmark_defaults_to_the_built_in_routes():
    """benchmarks/flashinfer_ab.py's --routes default is the engine's own table, so its A/B measures what ships."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "flashinfer_ab.py")
    spec = importlib.util.spec_from_file_location("flashinfer_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert parse_routes(module.BUILT_IN_ROUTES) == MEASURED_ROUTES
