"""FlashInfer's kernels as the engine calls them, against float32 references, on the GPU (skipped, saying so, where
FlashInfer is not installed).

Decode attention (attention/flashinfer_backend.py, XQA) over 6k-14k-token contexts of a paged cache, FP8 and bf16,
with the engine's per-layer scales, against float32 attention over the same stored cache and over the unquantized
keys and values, beside the triton backend's kernel. XQA's FP8 kernel rounds the query and the probabilities to
e4m3 (the triton kernel keeps them in float16): on random data like this, written out in torch on CPU, that is a
relative RMS error of about 0.04 against the same cache and 1.4x the format's own error against the unquantized
cache. The bars leave room above that and fall far short of what a wrong scale or page gives (order 1).

Block-scaled FP8 matmuls (quantization/fp8_flashinfer.py) at 1-4096 rows for the Qwen3-8B and Llama-3.1-8B layer shapes,
against the same quantization multiplied in float32 (the bar of tests/test_gpu_fp8_weights.py, 1% of the largest
output), and against cuBLAS's error on the same input (mean error at most 1.5x): vLLM saw FlashInfer's kernel lose
accuracy at 32 rows and more on one model, so every row count it may be routed to is checked.
"""
import pytest
import torch

from nanovllm.attention import KVCacheLayout, LayerKV
from nanovllm.attention.paged_decode import paged_decode_attention
from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_flashinfer import flashinfer_block_mm
from nanovllm.quantization.fp8_fused import Fp8Input
from nanovllm.quantization.fp8_linear import quantize_blockwise
from nanovllm.quantization.kv_quant import FP8, dequantize, quantize
from nanovllm.utils.context import Context
from nanovllm.utils.flashinfer import INSTALL, flashinfer_installed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flashinfer_installed(), reason=f"FlashInfer is not installed ({INSTALL})")]
HEAD_DIM, KV_HEADS, BLOCK = 128, 8, 256


def make_backend(rows: int, heads: int, cache_dtype: torch.dtype):
    from nanovllm.attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend()
    backend.bind(KV_HEADS, rows, torch.device("cuda"))
    backend.warm_up(KVCacheLayout(1, BLOCK, KV_HEADS, HEAD_DIM, cache_dtype), heads, torch.bfloat16)
    return backend


def long_context_batch(batch: int, heads: int, fp8_cache: bool, seed: int = 0):
    """bf16 K/V of `batch` sequences of 6k-14k tokens in shuffled blocks, the cache the engine would hold (FP8 with
    its measured-style scales, or bf16), queries, and one CUDA-graph padding row (context 0) at the end."""
    g = torch.Generator("cuda").manual_seed(seed)
    width = -(-14000 // BLOCK)
    num_blocks = batch * width + 4
    k, v = (torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    if fp8_cache:
        scales = (k.abs().max().item() / 200, v.abs().max().item() / 100)
        cache = LayerKV(quantize(k, scales[0]), quantize(v, scales[1]), *scales)
    else:
        cache = LayerKV(k, v)
    lens = torch.randint(6000, 14001, (batch,), generator=g, device="cuda", dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=g, device="cuda")[: batch * width].view(batch, width).int()
    lens = torch.cat([lens, torch.zeros(1, dtype=torch.int32, device="cuda")])
    tables = torch.cat([tables, torch.zeros(1, width, dtype=torch.int32, device="cuda")])
    q = torch.randn(batch + 1, heads, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, (k, v), cache, lens, tables


def float32_attention(q, k, v, lens, tables) -> torch.Tensor:
    """Each sequence's query over its first lens[i] cached tokens, in float32 (k, v: [blocks, BLOCK, H, D])."""
    out = []
    for i, n in enumerate(lens.tolist()):
        keys, values = (c[tables[i, : -(-n // BLOCK)].long()].flatten(0, 1)[:n].float() for c in (k, v))
        group = q.size(1) // keys.size(1)
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        probs = (torch.einsum("hd,nhd->hn", q[i].float(), keys) * HEAD_DIM ** -0.5).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, values))
    return torch.stack(out)


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("heads", [16, 32])  # Qwen3-0.6B's 2 and the 8B models' 4 query heads per KV head
@pytest.mark.parametrize("cache_dtype", ["fp8", "bf16"])
def test_decode_over_long_contexts_against_float32(heads, cache_dtype):
    fp8_cache = cache_dtype == "fp8"
    batch = 12
    q, (k, v), cache, lens, tables = long_context_batch(batch, heads, fp8_cache)
    backend = make_backend(batch + 1, heads, cache.k.dtype)
    context = Context(is_prefill=False, context_lens=lens, block_tables=tables)
    backend.begin_forward(context)
    ours = backend.decode(q, cache, context, HEAD_DIM ** -0.5)
    triton = paged_decode_attention(q, cache.k, cache.v, tables, lens, HEAD_DIM ** -0.5, k_scale=cache.k_scale,
                                    v_scale=cache.v_scale)
    real = slice(0, batch)
    stored = (dequantize(cache.k, cache.k_scale, torch.float32), dequantize(cache.v, cache.v_scale, torch.float32)) \
        if fp8_cache else (k, v)
    same_cache = float32_attention(q[real], *stored, lens[real], tables[real])
    unquantized = float32_attention(q[real], k, v, lens[real], tables[real])
    errors = {name: (relative_rms(out[real], same_cache), relative_rms(out[real], unquantized))
              for name, out in (("flashinfer", ours), ("triton", triton))}
    print(f"\n{cache_dtype} cache, {heads} heads, contexts {lens[real].min().item()}-{lens[real].max().item()}: "
          + ", ".join(f"{name} relative RMS error {a:.4f} against the same cache, {b:.4f} against the unquantized"
                      for name, (a, b) in errors.items()))
    assert torch.isfinite(ours).all()  # the padding row included
    if fp8_cache:
        assert errors["flashinfer"][0] <= 0.06, errors
        assert errors["flashinfer"][1] <= 1.75 * errors["triton"][1], errors
    else:
        assert errors["flashinfer"][0] <= 0.01, errors


def test_decode_replayed_from_a_cuda_graph_reads_the_new_tables():
    """The page table is derived inside the forward pass: a captured graph, replayed over other sequences written
    into the same input tensors, gives what an eager call over them gives, bit for bit."""
    batch, heads = 8, 32
    q, _, cache, lens, tables = long_context_batch(batch, heads, True, seed=1)
    q2, _, _, lens2, tables2 = long_context_batch(batch, heads, True, seed=2)
    backend = make_backend(batch + 1, heads, FP8)
    inputs = [t.clone() for t in (q, lens, tables)]
    context = Context(is_prefill=False, context_lens=inputs[1], block_tables=inputs[2])

    def step() -> torch.Tensor:
        backend.begin_forward(context)
        return backend.decode(inputs[0], cache, context, HEAD_DIM ** -0.5)

    step()  # outside the capture first, as the engine's graphs warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for source, target in zip((q2, lens2, tables2), inputs):
        target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


SHAPES = {"Qwen3-8B qkv": (6144, 4096), "o": (4096, 4096), "Qwen3-8B gate_up": (24576, 4096),
          "Qwen3-8B down": (4096, 12288), "Llama-3.1-8B gate_up": (28672, 4096), "Llama-3.1-8B down": (4096, 14336)}


@pytest.fixture(scope="module", params=list(SHAPES))
def block_weight(request) -> fp8.Fp8Weight:
    out_features, in_features = SHAPES[request.param]
    g = torch.Generator("cuda").manual_seed(out_features + in_features)
    w8, scale = quantize_blockwise(torch.randn(out_features, in_features, generator=g, device="cuda") * 0.02)
    weight = fp8.Fp8Weight(w8, scale, "block", fp8.block_kernel_scale(scale))
    weight.flashinfer_scale = scale.float().contiguous()
    return weight


@pytest.mark.parametrize("rows", [1, 16, 31, 32, 64, 256, 4096])
def test_flashinfer_matmul_against_float32_and_cublas(block_weight, rows):
    assert fp8.fp8_supported(torch.device("cuda"))[1], "FlashInfer's block-scaled kernel is Hopper's"
    g = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, block_weight.weight.size(1), generator=g, device="cuda", dtype=torch.bfloat16)
    ours = flashinfer_block_mm(x, block_weight)
    x8, scales = fp8.quantized_input(x, fp8.BLOCK, 4)
    # the input already quantized (the fused producers' Fp8Input) is the same codes: the same result, bit for bit
    assert torch.equal(flashinfer_block_mm(Fp8Input(x8, scales, rows, x.dtype), block_weight), ours)
    cublas = fp8._scaled_mm_block(x, block_weight)  # no routes on this weight: cuBLAS
    reference = (x8[:rows].float() * scales[:rows].repeat_interleave(fp8.BLOCK, 1)) @ \
        fp8.dequantize_blocks(block_weight.weight, block_weight.scale, torch.float32).t()
    errors = {name: ((y.float() - reference).abs().max().item() / reference.abs().max().item(),
                     (y.float() - reference).abs().mean().item() / reference.abs().mean().item())
              for name, y in (("flashinfer", ours), ("cublas", cublas))}
    print(f"\n{tuple(block_weight.weight.shape)} x {rows} rows: " +
          ", ".join(f"{name} max {a:.2e} mean {b:.2e}" for name, (a, b) in errors.items()))
    assert ours.shape == (rows, block_weight.weight.size(0)) and ours.dtype == torch.bfloat16
    assert errors["flashinfer"][0] <= 0.01, errors
    assert errors["flashinfer"][1] <= 1.5 * errors["cublas"][1], errors
