"""The FP8 cache's CUDA decode kernel (attention/paged_decode_fp8.cu) against attention in float32 over the dequantised
cache, on the GPU: every GQA group it serves, both head sizes, pages of 16 and 256 tokens, contexts around tile and
page edges, one slice and many, stale NaN codes past each context, and inside a CUDA graph."""
import pytest
import torch

from nanovllm.attention.paged_decode import paged_decode_attention
from nanovllm.attention.paged_decode_cuda import decode_kernel
from nanovllm.quantization.kv_quant import dequantize, quantize

pytestmark = pytest.mark.gpu

CONTEXTS = [1, 15, 16, 17, 255, 256, 257, 1000, 2500, 0]  # 0: a CUDA-graph padding row
NAN_CODE = 0x7F  # e4m3's NaN


def _case(num_heads: int, num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = -(-max(CONTEXTS) // page)
    num_blocks = len(CONTEXTS) * width + 3
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, device="cuda", generator=gen)
    k[..., 7] *= 20  # an outlier channel, as real keys have
    v = torch.randn(num_blocks, page, num_kv_heads, head_dim, device="cuda", generator=gen)
    k_scale, v_scale = k.abs().max().item() / 200, v.abs().max().item() / 100
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    block_tables = torch.randperm(num_blocks, device="cuda", generator=gen)[: len(CONTEXTS) * width]
    block_tables = block_tables.view(len(CONTEXTS), width).int()
    context_lens = torch.tensor(CONTEXTS, dtype=torch.int32, device="cuda")
    tokens = torch.arange(width * page, device="cuda")
    for row, length in enumerate(CONTEXTS):  # what lies past a context must never reach the output
        past = tokens[tokens >= length]
        blocks, offsets = block_tables[row][past // page].long(), past % page
        k8.view(torch.uint8)[blocks, offsets] = NAN_CODE
        v8.view(torch.uint8)[blocks, offsets] = NAN_CODE
    q = torch.randn(len(CONTEXTS), num_heads, head_dim, device="cuda", generator=gen).to(dtype)
    return q, k8, v8, k_scale, v_scale, block_tables, context_lens


def _reference(q, k8, v8, k_scale, v_scale, block_tables, context_lens) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    page, num_kv_heads = k8.shape[1:3]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for row, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        pages = block_tables[row, : -(-length // page)].long()
        k = dequantize(k8[pages], k_scale, torch.float32).reshape(-1, num_kv_heads, head_dim)[:length]
        v = dequantize(v8[pages], v_scale, torch.float32).reshape(-1, num_kv_heads, head_dim)[:length]
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[row].float(), k) * head_dim ** -0.5
        out[row] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out


def _needs_the_kernel():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the CUDA kernel needs compute capability 8.9+ (e4m3 conversion); older GPUs use Triton's")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page,dtype", [
    (16, 8, 128, 256, torch.bfloat16),   # Qwen3-0.6B
    (32, 8, 128, 256, torch.bfloat16),   # Llama-3.1-8B, Qwen3-8B
    (28, 4, 128, 16, torch.bfloat16),    # Qwen2.5-7B: a group of 7, small pages
    (8, 8, 64, 32, torch.float16),       # no GQA, head size 64, a float16 model
    (64, 8, 128, 256, torch.bfloat16),   # the widest group served
])
def test_gpu_cuda_decode_matches_float32_attention(num_heads, num_kv_heads, head_dim, page, dtype):
    _needs_the_kernel()
    q, k8, v8, k_scale, v_scale, block_tables, context_lens = _case(num_heads, num_kv_heads, head_dim, page, dtype)
    assert decode_kernel(q, num_heads // num_kv_heads) is not None, "the CUDA kernel did not load (see the log)"
    expected = _reference(q, k8, v8, k_scale, v_scale, block_tables, context_lens)
    bound = 2 ** -7 * expected.abs().max().item()  # bf16 output and float16 probabilities, float32 sums
    for max_splits in (None, 1, 16, 32):
        counters = torch.zeros(len(CONTEXTS) * num_kv_heads, dtype=torch.int32, device="cuda")
        out = paged_decode_attention(q, k8, v8, block_tables, context_lens, head_dim ** -0.5, counters,
                                     max_splits=max_splits, k_scale=k_scale, v_scale=v_scale)
        triton = paged_decode_attention(q, k8, v8, block_tables, context_lens, head_dim ** -0.5, counters,
                                        max_splits=max_splits, k_scale=k_scale, v_scale=v_scale, fp8_kernel="triton")
        error = (out.float() - expected).abs().max().item()
        print(f"\n{num_heads}/{num_kv_heads} heads, head {head_dim}, page {page}, max_splits {max_splits}: "
              f"max abs error {error:.2e} (Triton's {(triton.float() - expected).abs().max().item():.2e}, "
              f"bound {bound:.2e})")
        assert out.isfinite().all() and error <= bound
        assert out[-1].eq(0).all() and counters.eq(0).all()
    # the bound can see a wrong value scale
    wrong = paged_decode_attention(q, k8, v8, block_tables, context_lens, head_dim ** -0.5, k_scale=k_scale,
                                   v_scale=v_scale * 1.05)
    assert (wrong.float() - expected).abs().max().item() > bound


def test_gpu_cuda_decode_replays_in_a_cuda_graph():
    _needs_the_kernel()
    q, k8, v8, k_scale, v_scale, block_tables, context_lens = _case(32, 8, 128, 256, torch.bfloat16)
    counters = torch.zeros(len(CONTEXTS) * 8, dtype=torch.int32, device="cuda")

    def call():
        return paged_decode_attention(q, k8, v8, block_tables, context_lens, 128 ** -0.5, counters,
                                      k_scale=k_scale, v_scale=v_scale)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    context_lens //= 2  # the next step's lengths, within what was written
    graph.replay()
    expected = _reference(q, k8, v8, k_scale, v_scale, block_tables, context_lens)
    assert (out.float() - expected).abs().max().item() <= 2 ** -7 * expected.abs().max().item()
    assert out[0].eq(0).all()


def test_gpu_kernel_choice_falls_back_to_triton_where_the_cuda_kernel_does_not_serve():
    _needs_the_kernel()
    q = torch.zeros(2, 32, 128, dtype=torch.bfloat16, device="cuda")
    cache = torch.zeros(4, 16, 8, 144, device="cuda").to(torch.float8_e4m3fn)
    tables = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    assert decode_kernel(q, 4, (cache[..., :128], tables), 64) is not None
    assert decode_kernel(q, 16) is None  # more than 8 query heads per KV head
    assert decode_kernel(q[..., :96].contiguous(), 4) is None
    assert decode_kernel(q.float(), 4) is None
    assert decode_kernel(q[:0], 4) is None
    assert decode_kernel(q, 4, (cache[..., 8:136], tables), 64) is None  # rows not 16-byte aligned
    assert decode_kernel(q, 4, (cache[..., :128], tables.cpu()), 64) is None
    assert decode_kernel(q, 4, (cache[..., :128], tables.long()), 64) is None
    assert decode_kernel(q, 4, (cache[..., :128], tables), 8) is None  # slices not whole 16-token steps
