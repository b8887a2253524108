"""FP8 KV cache (quantization/kv_quant.py, kv_scales.py): the quantiser, the per-layer scales, every cache writer and
reader, on CPU (Triton kernels in its interpreter) and on the GPU (gpu marker) against the torch reference."""
import numpy as np
import pytest
import torch

from nanovllm.attention import KVCacheLayout, LayerKV
from nanovllm.attention.flash_attn_backend import dequantized_blocks, store_kvcache
from nanovllm.attention.paged_decode import cuda_max_splits, default_max_splits, paged_decode_attention
from nanovllm.attention.qk_norm_rope import KVDestination, qk_norm_rope
from nanovllm.attention.torch_backend import TorchBackend, store_kvcache_torch
from nanovllm.engine.model_inputs import InputBuilder
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.quantization.kv_quant import FP8, FP8_MAX, dequantize, quantize
from nanovllm.quantization.kv_scales import checkpoint_kv_scales, kv_scale_name, measured_kv_scales
from nanovllm.utils.context import get_context, reset_context, set_context

E4M3_STEP = 2 ** -3  # e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most half a step, relatively
K_SCALE, V_SCALE = 0.037, 0.011  # not powers of two: the reciprocal's rounding is part of what is checked


def fp8_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, device: str = "cpu",
              scales: tuple[float, float] = (K_SCALE, V_SCALE)) -> LayerKV:
    zeros = torch.zeros(num_blocks, page, kv_heads, head_dim, device=device).to(FP8)
    return LayerKV(zeros, zeros.clone(), *scales)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def test_the_cuda_decode_kernels_slice_counts_are_the_measured_ones():
    """docs/fp8_kv_cache.md's slice table (8 KV heads): the CUDA kernel's picks, and where they leave the Triton
    kernel's rule (more, shorter slices below 256 sequences; the same 4 from 2,048 sequence-head pairs on)."""
    picks = {batch: cuda_max_splits(batch, 8) for batch in (1, 4, 8, 16, 32, 64, 128, 255, 256, 512, 4096)}
    assert picks == {1: 32, 4: 32, 8: 32, 16: 32, 32: 16, 64: 8, 128: 8, 255: 8, 256: 4, 512: 4, 4096: 4}
    assert [default_max_splits(batch, 8) for batch in (4, 32, 128, 256)] == [16, 8, 4, 4]
    assert cuda_max_splits(64, 4) == 16 and cuda_max_splits(512, 2) == 8  # pairs, not sequences, count


def test_quantize_round_trip_within_half_a_step_and_saturates_past_the_range():
    gen = torch.Generator().manual_seed(0)
    scale = 0.01
    x = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 0.5, 64).view(64, 1, 1)
    q = quantize(x, scale)
    assert q.dtype == FP8
    back = dequantize(q, scale, torch.float32)
    inside = x.abs() <= FP8_MAX * scale
    # normal e4m3 values are within half a step relatively; the smallest (subnormal) ones within half of 2**-9
    bound = torch.maximum(x.abs() * E4M3_STEP / 2, torch.full_like(x, scale * 2 ** -10))
    assert ((back - x).abs() <= bound * 1.0001)[inside].all()
    assert not inside.all()  # some values are past 448 x scale: they saturate, keeping their sign
    assert torch.equal(back[~inside], torch.sign(x[~inside]) * dequantize(quantize(torch.tensor(448.0), 1.0),
                                                                         scale, torch.float32))
    assert torch.equal(dequantize(quantize(back, scale), scale, torch.float32), back)  # representable: kept


def test_values_far_out_of_range_stay_finite():
    x = torch.tensor([3e38, -3e38, 1.0, 0.0, 1e-30, -1e-38, 65504.0, float("-inf")])
    back = dequantize(quantize(x, 0.5), 0.5, torch.float32)
    assert back.isfinite().all()
    assert back.tolist()[:4] == [224.0, -224.0, 1.0, 0.0] and back[-1] == -224.0
    xb = (torch.randn(8, 2, 32) * 1e37).to(torch.bfloat16)
    assert dequantize(quantize(xb, 1e-3), 1e-3, torch.bfloat16).isfinite().all()


def test_kv_cache_layout_is_half_of_bf16_and_layers_carry_their_scales():
    bf16 = KVCacheLayout(28, 256, 8, 128, torch.bfloat16)
    fp8 = KVCacheLayout(28, 256, 8, 128, FP8)
    assert 2 * fp8.block_bytes == bf16.block_bytes
    scales = [(0.01 * (i + 1), 0.001 * (i + 1)) for i in range(28)]
    cache, layers = fp8.allocate(3, torch.device("cpu"), scales)
    assert cache.dtype == FP8 and cache.shape == (2, 28, 3, 256, 8, 128) and layers[5].quantized
    assert (layers[5].k_scale, layers[5].v_scale) == scales[5] and layers[5].k.data_ptr() == cache[0, 5].data_ptr()
    _, plain = bf16.allocate(3, torch.device("cpu"))
    assert not plain[0].quantized and (plain[0].k_scale, plain[0].v_scale) == (1.0, 1.0)


def test_checkpoint_kv_scale_names_and_checks():
    assert kv_scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_name("model.layers.12.self_attn.attn.v_scale") == (12, "v")
    assert kv_scale_name("model.layers.0.self_attn.k_proj.output_scale") == (0, "k")
    assert kv_scale_name("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert kv_scale_name("model.layers.0.self_attn.k_proj.weight_scale") is None
    assert kv_scale_name("model.layers.0.self_attn.k_proj.weight") is None
    assert checkpoint_kv_scales({}, 2) is None
    two_layers = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                  "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
                  "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16)}
    assert checkpoint_kv_scales(two_layers, 2) == [(0.5, 0.25), (2.0, 2.0)]
    with pytest.raises(ValueError, match=r"not both scales of layer\(s\) \[2\] of 3"):
        checkpoint_kv_scales(two_layers, 3)
    for bad in (torch.tensor(0.0), torch.tensor(float("nan")), torch.tensor([0.1, 0.2])):
        with pytest.raises(ValueError, match="'model.layers.0.self_attn.k_scale' must be one positive finite"):
            checkpoint_kv_scales({**two_layers, "model.layers.0.self_attn.k_scale": bad}, 2)


def test_measured_scales_keep_headroom_and_refuse_overflow():
    # the largest key maps to 200 of e4m3's 448, the largest value to 100 (vLLM's headroom)
    assert measured_kv_scales([(20.0, 3.0), (0.0, 0.0)]) == [(0.1, 0.03), (1e-8, 1e-8)]
    with pytest.raises(ValueError, match="layer 1's keys or values overflowed"):
        measured_kv_scales([(1.0, 1.0), (float("nan"), 1.0)])


@pytest.mark.parametrize("num_kv_heads,head_dim,dtype", [(2, 32, torch.float32), (3, 24, torch.float32),
                                                         (2, 64, torch.bfloat16)])
def test_store_kvcache_kernel_writes_the_reference_bits(num_kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens = 9
    qkv = (torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen) * 5).to(dtype)
    qkv[4, num_kv_heads * head_dim] = 1e4  # past 448 x the key scale: saturates
    qkv[5, 2 * num_kv_heads * head_dim] = 1e-4  # subnormal in e4m3
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([5, 0, -1, 63, 17, 18, -1, 40, 1])
    kernel, reference = fp8_cache(4, 16, num_kv_heads, head_dim), fp8_cache(4, 16, num_kv_heads, head_dim)
    store_kvcache(k, v, kernel, slots)
    store_kvcache_torch(k, v, reference, slots)
    assert torch.equal(bits(kernel.k), bits(reference.k)) and torch.equal(bits(kernel.v), bits(reference.v))
    assert bits(reference.k).view(-1, num_kv_heads * head_dim)[17].ne(0).any()
    assert bits(reference.k).view(-1, num_kv_heads * head_dim)[2].eq(0).all()  # slot 2 was never written


def test_fused_norm_rope_kernel_writes_the_reference_bits():
    gen = torch.Generator().manual_seed(1)
    head_dim, num_heads, num_kv_heads, page = 128, 6, 3, 16  # 3 KV heads pad to 4: a masked row
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(5, -1, head_dim) for x in (q, k, v))
    cache = fp8_cache(3, page, num_kv_heads, head_dim, scales=(0.004, 0.02))  # some keys saturate
    slots = torch.tensor([17, -1, 0, 47, 5])
    weight = torch.rand(head_dim, generator=gen) + 0.5
    _, fused_k = qk_norm_rope(torch.tensor([3, 0, 9, 40, 1]), q, k, weight, weight, 1e-6,
                              RotaryEmbedding(head_dim, 64, 1e6).cos_sin_cache,
                              KVDestination(v, cache.k, cache.v, slots, cache.k_scale, cache.v_scale))
    reference = fp8_cache(3, page, num_kv_heads, head_dim, scales=(0.004, 0.02))
    store_kvcache_torch(fused_k, v, reference, slots)
    assert torch.equal(bits(cache.k), bits(reference.k)) and torch.equal(bits(cache.v), bits(reference.v))
    assert bits(cache.k).view(-1, num_kv_heads, head_dim)[47].ne(0).any()
    assert (bits(cache.k) & 0x7F).eq(0x7E).any()  # 448: saturated codes were written too


def _decode_case(device: str, num_heads: int, num_kv_heads: int, page: int, dtype: torch.dtype):
    """A decode batch over an FP8 cache written from random rows with an outlier key channel (as real keys
    have): a full table, a short row, one across a page boundary and a CUDA-graph padding row (context 0)."""
    gen = torch.Generator().manual_seed(0)
    head_dim, width, num_blocks = 128, 12, 60
    rows = torch.randn(2, num_blocks * page, num_kv_heads, head_dim, generator=gen)
    rows[0, :, :, 7] *= 20
    scales = (rows[0].abs().max().item() / 200, rows[1].abs().max().item() / 100)
    cache = fp8_cache(num_blocks, page, num_kv_heads, head_dim, scales=scales)
    store_kvcache_torch(rows[0], rows[1], cache, torch.arange(num_blocks * page))
    cache = LayerKV(cache.k.to(device), cache.v.to(device), *scales)
    q = torch.randn(4, num_heads, head_dim, generator=gen).to(device, dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: 4 * width].view(4, width).int().to(device)
    context_lens = torch.tensor([width * page, 1, page + 5, 0], dtype=torch.int32, device=device)
    return q, cache, block_tables, context_lens


def _reference_decode(q, cache, block_tables, context_lens):
    """Attention over the dequantised cache in float32 (the torch backend's CPU path)."""
    f32 = LayerKV(cache.k.cpu(), cache.v.cpu(), cache.k_scale, cache.v_scale)
    set_context(is_prefill=False, slot_mapping=None, context_lens=context_lens[:3].cpu(),
                block_tables=block_tables[:3].cpu())
    try:
        return TorchBackend().decode(q[:3].float().cpu(), f32, get_context(), q.size(-1) ** -0.5)
    finally:
        reset_context()


@pytest.mark.slow
@pytest.mark.parametrize("num_heads,num_kv_heads,page", [(4, 2, 16), (8, 8, 32)])
def test_decode_kernel_folds_the_layer_scales(num_heads, num_kv_heads, page):
    # a bf16 query, as the engine's: exact in float16, where the kernel takes the dot products; what remains is
    # the float16 rounding of the probabilities (2**-11 relative) and the bf16 output (2**-8)
    q, cache, block_tables, context_lens = _decode_case("cpu", num_heads, num_kv_heads, page, torch.bfloat16)
    expected = _reference_decode(q, cache, block_tables, context_lens)
    for options in ({}, {"block_n": 16, "max_splits": 2}):
        out = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                     k_scale=cache.k_scale, v_scale=cache.v_scale, **options)
        torch.testing.assert_close(out[:3].float(), expected, atol=2e-3, rtol=8e-3)
        assert out[3].eq(0).all()
    # a wrong scale is not within that tolerance: the test can see one
    wrong = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                   k_scale=cache.k_scale, v_scale=cache.v_scale * 1.05)
    assert not torch.allclose(wrong[:3].float(), expected, atol=2e-3, rtol=8e-3)


def test_prefill_tables_name_each_used_block_once_without_the_device():
    builder = InputBuilder(16, 8, torch.device("cpu"), quantized_cache=True)
    seqs = []
    for blocks, cached in (([5, 2, 7], 20), ([9, 5], 16)):
        seq = Sequence(list(range(blocks.__len__() * 16 - 3)), block_size=16)
        seq.block_table, seq.num_cached_tokens = blocks, cached
        seq.num_scheduled_tokens = len(seq) - cached
        seqs.append(seq)
    builder.prefill(seqs)
    context = get_context()
    reset_context()
    assert context.used_blocks.tolist() == [2, 5, 7, 9]
    renumbered = context.used_block_tables.numpy()
    assert context.used_block_tables.dtype == torch.int32
    assert np.array_equal(context.used_blocks[renumbered[0]], [5, 2, 7])
    assert np.array_equal(context.used_blocks[renumbered[1, :2]], [9, 5])
    assert context.block_tables.tolist() == [[5, 2, 7], [9, 5, 0]]


def test_prefill_over_an_fp8_prefix_matches_the_dequantised_cache():
    """The torch backend reads cached prefixes dequantised; flash-attn's path dequantises the blocks it needs
    into scratch with renumbered tables: both see the same keys."""
    gen = torch.Generator().manual_seed(2)
    page, kv_heads, head_dim = 16, 2, 32
    cache = fp8_cache(8, page, kv_heads, head_dim)
    rows = torch.randn(2, 8 * page, kv_heads, head_dim, generator=gen)
    store_kvcache_torch(rows[0], rows[1], cache, torch.arange(8 * page))
    used, tables = torch.tensor([1, 2, 5, 7]), torch.tensor([[2, 1, 3], [0, 2, 0]], dtype=torch.int32)
    set_context(used_blocks=used, used_block_tables=tables)
    k, v = dequantized_blocks(cache, get_context(), torch.float32)
    reset_context()
    assert k.shape == (4, page, kv_heads, head_dim) and k.dtype == v.dtype == torch.float32
    assert torch.equal(k[tables[0].long()], dequantize(cache.k[[5, 2, 7]], K_SCALE, torch.float32))
    assert torch.equal(v[tables[1, :2].long()], dequantize(cache.v[[1, 5]], V_SCALE, torch.float32))
    # the torch backend: a prefill whose first 20 keys are cached, attending over them and 4 new ones
    q, new_k, new_v = torch.randn(4, 4, head_dim), *torch.randn(2, 4, kv_heads, head_dim)
    slots = torch.tensor([2 * page + 4 + i for i in range(4)])  # positions 20..23 sit in the table's block 2
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 4]), cu_seqlens_k=torch.tensor([0, 24]),
                max_seqlen_q=4, max_seqlen_k=24, slot_mapping=slots, block_tables=torch.tensor([[5, 2]]))
    backend = TorchBackend()
    backend.store(new_k, new_v, cache, slots)
    out = backend.prefill(q, new_k, new_v, cache, get_context(), head_dim ** -0.5)
    reset_context()
    keys = dequantize(cache.k[[5, 2]], K_SCALE, torch.float32).flatten(0, 1)[:24]
    values = dequantize(cache.v[[5, 2]], V_SCALE, torch.float32).flatten(0, 1)[:24]
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
    qkv[::7] *= 300  # large rows: past the layer's range, they saturate
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
        for ours, theirs in ((cache.k, reference.k), (cache.v, reference.v)):
            differ = int((bits(ours) != bits(theirs)).sum())
            print(f"\n{'fused' if cache is fused else 'store'} writer: {differ} of {ours.numel()} codes differ "
                  f"from torch's")
            assert differ == 0
        assert dequantize(cache.k, cache.k_scale, torch.bfloat16).isfinite().all()


@pytest.mark.gpu
def test_gpu_dequantized_blocks_are_the_reference_bits():
    # bf16 on the GPU (Triton's interpreter rounds float32 to bf16 by truncation, so CPU checks float32 only)
    gen = torch.Generator().manual_seed(4)
    cache = fp8_cache(40, 256, 8, 128, "cuda")
    rows = torch.randn(2, 40 * 256, 8, 128, generator=gen).cuda()
    store_kvcache_torch(rows[0], rows[1], cache, torch.arange(40 * 256, device="cuda"))
    used = torch.tensor([3, 17, 0, 39], device="cuda")
    set_context(used_blocks=used)
    try:
        k, v = dequantized_blocks(cache, get_context(), torch.bfloat16)
    finally:
        reset_context()
    assert torch.equal(k, dequantize(cache.k[used], K_SCALE, torch.bfloat16))
    assert torch.equal(v, dequantize(cache.v[used], V_SCALE, torch.bfloat16))


@pytest.mark.gpu
def test_gpu_decode_kernel_matches_the_dequantised_reference():
    q, cache, block_tables, context_lens = _decode_case("cuda", 16, 8, 256, torch.bfloat16)
    expected = _reference_decode(q, cache, block_tables, context_lens).cuda()
    out = paged_decode_attention(q, cache.k, cache.v, block_tables, context_lens, q.size(-1) ** -0.5,
                                 k_scale=cache.k_scale, v_scale=cache.v_scale)
    # bf16 query and probabilities (the fp8 rows widen exactly), float32 sums: within a bf16 rounding of the
    # output's scale
    error = (out[:3].float() - expected).abs().max().item()
    print(f"\nFP8 decode kernel vs float32 reference: max abs error {error:.2e}")
    assert error <= 2 ** -7 * expected.abs().max().item()
    assert out[3].eq(0).all()
