"""FP8 KV cache (attention/kv_quant.py): the quantiser, every cache writer and reader, on CPU (Triton kernels in
its interpreter) and on the GPU (gpu marker) against the torch reference."""
import pytest
import torch

from nanovllm.attention import KVCacheLayout, LayerKV
from nanovllm.attention.flash_attn_backend import dequantized_blocks, store_kvcache
from nanovllm.attention.kv_quant import FP8, dequantize_rows, quantize_rows
from nanovllm.attention.paged_decode import paged_decode_attention
from nanovllm.attention.torch_backend import TorchBackend, store_kvcache_torch
from nanovllm.layers.rotary_embedding import KVDestination, RotaryEmbedding, qk_norm_rope
from nanovllm.utils.context import get_context, reset_context, set_context

E4M3_STEP = 2 ** -3  # e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most half a step, relatively


def fp8_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, device: str = "cpu") -> LayerKV:
    zeros = torch.zeros(num_blocks, page, kv_heads, head_dim, device=device).to(FP8)
    return LayerKV(zeros, zeros.clone(), torch.ones(num_blocks, page, kv_heads, device=device),
                   torch.ones(num_blocks, page, kv_heads, device=device))


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def test_quantize_rows_round_trip_within_half_a_step_and_scale_is_row_max():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-6, 6, 64).view(64, 1, 1)
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert torch.equal(scale, x.abs().amax(-1) / 448)  # the largest element maps to 448 exactly
    back = dequantize_rows(q, scale, torch.float32)
    # normal e4m3 values are within half a step relatively; the smallest (subnormal) ones within half of 2**-9
    bound = torch.maximum(x.abs() * E4M3_STEP / 2, scale.unsqueeze(-1) * 2 ** -10)
    assert ((back - x).abs() <= bound * 1.0001).all()
    assert torch.equal(dequantize_rows(*quantize_rows(back), torch.float32), back)  # exactly representable: kept


def test_values_far_out_of_range_stay_finite():
    x = torch.tensor([[3e38, -3e38, 1.0, 0.0], [1e-30, -1e-38, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0],
                      [448.0, 1e4, -65504.0, 2.0]])
    q, scale = quantize_rows(x)
    back = dequantize_rows(q, scale, torch.float32)
    assert back.isfinite().all() and scale.isfinite().all()
    assert back[2].eq(0).all()
    # a row's largest magnitude survives (to float32 rounding of 448 * (amax / 448)), whatever its size
    torch.testing.assert_close(back[[0, 0, 3]][[0, 1, 2], [0, 1, 2]], torch.tensor([3e38, -3e38, -65504.0]))
    # the bf16 path of the CPU engine: huge bf16 activations too
    xb = (torch.randn(8, 2, 32) * 1e37).to(torch.bfloat16)
    assert dequantize_rows(*quantize_rows(xb), torch.bfloat16).isfinite().all()


def test_kv_cache_layout_counts_the_scales():
    bf16 = KVCacheLayout(28, 256, 8, 128, torch.bfloat16)
    fp8 = KVCacheLayout(28, 256, 8, 128, FP8)
    # one byte per element plus four per row of 128: 132 bytes against 256
    assert fp8.block_bytes * 256 == bf16.block_bytes * 132
    (cache, scales), layers = fp8.allocate(3, torch.device("cpu"))
    assert cache.dtype == FP8 and scales.shape == (2, 28, 3, 256, 8) and layers[5].quantized
    assert layers[5].k_scale.data_ptr() == scales[0, 5].data_ptr() and layers[5].k_scale.is_contiguous()


@pytest.mark.parametrize("num_kv_heads,head_dim,dtype", [(2, 32, torch.float32), (3, 24, torch.float32),
                                                         (2, 64, torch.bfloat16)])
def test_store_kvcache_kernel_writes_the_reference_bits(num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 9
    qkv = (torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen) * 5).to(dtype)
    qkv[4, num_kv_heads * head_dim] = 1e4  # one outlier: its row's scale is large, the other rows unaffected
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([5, 0, -1, 63, 17, 18, -1, 40, 1])
    kernel, reference = fp8_cache(4, 16, num_kv_heads, head_dim), fp8_cache(4, 16, num_kv_heads, head_dim)
    store_kvcache(k, v, kernel, slots)
    store_kvcache_torch(k, v, reference, slots)
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(kernel, name), getattr(reference, name)
        assert torch.equal(bits(a) if a.dtype == FP8 else a, bits(b) if b.dtype == FP8 else b), name
    written = reference.k_scale.view(-1, num_kv_heads)
    assert written[63].ne(1).all() and written[2].eq(1).all()  # slot 2 was never written


def test_fused_norm_rope_kernel_writes_the_reference_bits():
    gen = torch.Generator().manual_seed(1)
    head_dim, num_heads, num_kv_heads, page = 128, 6, 3, 16  # 3 KV heads pad to 4: a masked row
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(5, -1, head_dim) for x in (q, k, v))
    cache = fp8_cache(3, page, num_kv_heads, head_dim)
    slots = torch.tensor([17, -1, 0, 47, 5])
    weight = torch.rand(head_dim, generator=gen) + 0.5
    _, fused_k = qk_norm_rope(torch.tensor([3, 0, 9, 40, 1]), q, k, weight, weight, 1e-6,
                              RotaryEmbedding(head_dim, 64, 1e6).cos_sin_cache,
                              KVDestination(v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale))
    reference = fp8_cache(3, page, num_kv_heads, head_dim)
    store_kvcache_torch(fused_k, v, reference, slots)
    assert torch.equal(bits(cache.k), bits(reference.k)) and torch.equal(bits(cache.v), bits(reference.v))
    assert torch.equal(cache.k_scale, reference.k_scale) and torch.equal(cache.v_scale, reference.v_scale)
    assert bits(cache.k).view(-1, num_kv_heads, head_dim)[47].ne(0).any()


def _decode_case(device: str, num_heads: int, num_kv_heads: int, page: int, dtype: torch.dtype):
    """A decode batch over an FP8 cache written from random rows with outliers (as real keys have): a full
    table, a short row, one across a page boundary and a CUDA-graph padding row (context 0)."""
    gen = torch.Generator().manual_seed(0)
    head_dim, width, num_blocks = 128, 12, 60
    rows = torch.randn(2, num_blocks * page, num_kv_heads, head_dim, generator=gen)
    rows[0, :, :, 7] *= 20  # an outlier channel in the keys
    cache = fp8_cache(num_blocks, page, num_kv_heads, head_dim)
    store_kvcache_torch(rows[0], rows[1], cache, torch.arange(num_blocks * page))
    cache = LayerKV(*(x.to(device) for x in (cache.k, cache.v, cache.k_scale, cache.v_scale)))
    q = torch.randn(4, num_heads, head_dim, generator=gen).to(device, dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: 4 * width].view(4, width).int().to(device)
    context_lens = torch.tensor([width * page, 1, page + 5, 0], dtype=torch.int32, device=device)
    return q, cache, block_tables, context_lens


def _reference_decode(q, cache, block_tables, context_lens):
    """Attention over the dequantised cache in float32 (the torch backend's CPU path)."""
    f32 = LayerKV(*(x.float().cpu() for x in (cache.k, cache.v)), cache.k_scale.cpu(), cache.v_scale.cpu())
    set_context(is_prefill=False, slot_mapping=None, context_lens=context_lens[:3].cpu(),
                block_tables=block_tables[:3].cpu())
    try:
        return TorchBackend().decode(q[:3].float().cpu(), f32, get_context(), q.size(-1) ** -0.5)
    finally:
        reset_context()


@pytest.mark.parametrize("num_heads,num_kv_heads,page", [(4, 2, 16), (8, 8, 32)])
def test_decode_kernel_reads_fp8_rows_with_their_scales(num_heads, num_kv_heads, page):
    # a bf16 query, as the engine's: exact in float16, where the kernel takes the dot products; what remains is
    # the float16 rounding of the probabilities (2**-11 relative) and the bf16 output (2**-8)
    q, cache, block_tables, context_lens = _decode_case("cpu", num_heads, num_kv_heads, page, torch.bfloat16)
    expected = _reference_decode(q, cache, block_tables, context_lens)
    for options in ({}, {"block_n": 16, "max_splits": 2}):
        out = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                     k_scale=cache.k_scale, v_scale=cache.v_scale, **options)
        torch.testing.assert_close(out[:3].float(), expected, atol=2e-3, rtol=8e-3)
        assert out[3].eq(0).all()


def test_decode_kernel_with_one_scale_per_layer():
    q, cache, block_tables, context_lens = _decode_case("cpu", 4, 2, 16, torch.bfloat16)
    k_scale, v_scale = torch.tensor([0.03]), torch.tensor([0.02])
    out = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                 k_scale=k_scale, v_scale=v_scale)
    static = LayerKV(cache.k, cache.v, torch.full_like(cache.k_scale, 0.03), torch.full_like(cache.v_scale, 0.02))
    torch.testing.assert_close(out[:3].float(), _reference_decode(q, static, block_tables, context_lens),
                               atol=2e-3, rtol=8e-3)


def test_prefill_over_an_fp8_prefix_matches_the_dequantised_cache():
    """The torch backend reads cached prefixes dequantised; flash-attn's path dequantises the blocks it needs
    into scratch with renumbered tables: both see the same keys."""
    gen = torch.Generator().manual_seed(2)
    page, kv_heads, head_dim = 16, 2, 32
    cache = fp8_cache(8, page, kv_heads, head_dim)
    rows = torch.randn(2, 8 * page, kv_heads, head_dim, generator=gen)
    store_kvcache_torch(rows[0], rows[1], cache, torch.arange(8 * page))
    tables = torch.tensor([[5, 2, 7], [1, 5, 0]], dtype=torch.int32)
    k, v, renumbered = dequantized_blocks(cache, tables, torch.float32)
    assert renumbered.dtype == torch.int32 and k.size(0) == 5  # blocks 0, 1, 2, 5, 7, each once
    for i in range(2):
        expected = dequantize_rows(cache.k[tables[i].long()], cache.k_scale[tables[i].long()], torch.float32)
        assert torch.equal(k[renumbered[i].long()], expected)
        expected = dequantize_rows(cache.v[tables[i].long()], cache.v_scale[tables[i].long()], torch.float32)
        assert torch.equal(v[renumbered[i].long()], expected)
    # the torch backend: a prefill whose first 20 keys are cached, attending over them and 4 new ones
    q, new_k, new_v = torch.randn(4, 4, head_dim), *torch.randn(2, 4, kv_heads, head_dim)
    slots = torch.tensor([2 * page + 4 + i for i in range(4)])  # positions 20..23 sit in the table's block 2
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 24]),
                max_seqlen_q=4, max_seqlen_k=24, slot_mapping=slots, block_tables=torch.tensor([[5, 2]]))
    backend = TorchBackend()
    backend.store(new_k, new_v, cache, slots)
    out = backend.prefill(q, new_k, new_v, cache, get_context(), head_dim ** -0.5)
    reset_context()
    keys = dequantize_rows(cache.k[[5, 2]], cache.k_scale[[5, 2]], torch.float32).flatten(0, 1)[:24]
    values = dequantize_rows(cache.v[[5, 2]], cache.v_scale[[5, 2]], torch.float32).flatten(0, 1)[:24]
    scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(2, 1)) * head_dim ** -0.5
    mask = torch.ones(4, 24, dtype=torch.bool).tril(20)
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1),
                            values.repeat_interleave(2, 1))
    torch.testing.assert_close(out, expected)


# --- on the GPU: the same kernels compiled for the hardware, against the same torch reference --------------

@pytest.mark.gpu
def test_gpu_writers_write_the_reference_bits():
    gen = torch.Generator().manual_seed(3)
    head_dim, num_heads, num_kv_heads, n = 128, 16, 8, 300
    qkv = (torch.randn(n, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 4).cuda().bfloat16()
    qkv[::7] *= 300  # large rows: bf16 values far past 448
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(n, -1, head_dim) for x in (q, k, v))
    slots = torch.randperm(64 * 16, generator=gen)[:n].cuda()
    slots[::11] = -1
    weight = (torch.rand(head_dim, generator=gen) + 0.5).cuda().bfloat16()
    fused = fp8_cache(64, 16, num_kv_heads, head_dim, "cuda")
    _, fused_k = qk_norm_rope(torch.arange(n).cuda(), q, k, weight, weight, 1e-6,
                              RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.cuda(),
                              KVDestination(v, fused.k, fused.v, slots, fused.k_scale, fused.v_scale))
    for source_k, cache in ((fused_k, fused), (k, None)):
        if cache is None:  # the plain store kernel, fed the raw k (views into qkv)
            cache = fp8_cache(64, 16, num_kv_heads, head_dim, "cuda")
            store_kvcache(k, v, cache, slots)
        reference = fp8_cache(64, 16, num_kv_heads, head_dim, "cuda")
        store_kvcache_torch(source_k, v, reference, slots)
        assert torch.equal(cache.k_scale, reference.k_scale) and torch.equal(cache.v_scale, reference.v_scale)
        for ours, theirs in ((cache.k, reference.k), (cache.v, reference.v)):
            # e4m3 codes of one sign are ordered like integers: a rounding difference is one code apart
            steps = (bits(ours).to(torch.int16) - bits(theirs).to(torch.int16)).abs()
            print(f"\n{'fused' if cache is fused else 'store'} writer: {int((steps > 0).sum())} of "
                  f"{steps.numel()} codes differ from torch's cast, at most by {int(steps.max())}")
            assert (steps <= 1).all() and (steps > 0).float().mean() < 1e-3
        assert dequantize_rows(cache.k, cache.k_scale, torch.bfloat16).isfinite().all()


@pytest.mark.gpu
def test_gpu_decode_kernel_matches_the_dequantised_reference():
    q, cache, block_tables, context_lens = _decode_case("cuda", 16, 8, 256, torch.bfloat16)
    expected = _reference_decode(q, cache, block_tables, context_lens).cuda()
    out = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                 k_scale=cache.k_scale, v_scale=cache.v_scale)
    # bf16 query and probabilities (as for a bf16 cache: the fp8 rows widen exactly), float32 sums: within a
    # bf16 rounding of the output's scale
    error = (out[:3].float() - expected).abs().max().item()
    print(f"\nFP8 decode kernel vs float32 reference: max abs error {error:.2e}")
    assert error <= 2 ** -7 * expected.abs().max().item()
    assert out[3].eq(0).all()
