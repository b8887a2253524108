import pytest
import torch

from nanovllm.attention.qk_norm_rope import KVDestination, qk_norm_rope
from nanovllm.layers.rotary_embedding import RotaryEmbedding, _rotate


def eager_reference(positions, x, weight, eps, cos_sin_cache):
    """RMSNorm then RoPE in plain torch ops, rounding to the model dtype after each step as the modules do.

    (On CUDA the modules' compiled versions may keep the float32 intermediate instead; this does not.)
    """
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(normed, cos, sin)


# Triton's CPU interpreter rounds float32 -> bfloat16 toward zero (the GPU rounds to nearest), so the bf16
# case can only be checked on the GPU
@pytest.mark.parametrize("dtype,device", [(torch.float32, "cpu"),
                                          pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3)])  # 6 and 3 pad to 8 and 4: masked rows
def test_fused_kernel_matches_norm_then_rope(dtype, device, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(0)
    head_dim, num_tokens, eps = 128, 7, 1e-6
    q_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype)
    k_weight = (torch.rand(head_dim, generator=gen) + 0.5).to(device, dtype)
    cos_sin_cache = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(device)
    # q and k as views into one packed qkv row, as the model produces them
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(device, dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 5, 100, 2047, 4095, 17], device=device)

    fused_q, fused_k = qk_norm_rope(positions, q, k, q_weight, k_weight, eps, cos_sin_cache)

    assert fused_q.dtype == dtype and fused_q.is_contiguous() and fused_q.shape == q.shape
    for fused, x, weight in ((fused_q, q, q_weight), (fused_k, k, k_weight)):
        expected = eager_reference(positions, x, weight, eps, cos_sin_cache).float()
        error = (fused.float() - expected).abs()
        if dtype == torch.float32:  # only the order of the sum of squares differs
            assert error.max() <= 1e-5, error.max()
        else:  # rsqrt may differ in the last float32 bit and flip a rounding; almost all elements are identical
            assert (error <= 2 ** -6 * expected.abs() + 2 ** -8).all(), error.max()
            assert (error == 0).float().mean() >= 0.95, (error == 0).float().mean()
    assert (fused_q.float() - q.float()).abs().max() > 0.1  # it did transform something


def test_single_token_views_with_any_row_stride():
    # a one-row view may report a row stride other than the packed row's; only row 0 is read then
    head_dim = 128
    qkv = torch.randn(1, 4 * head_dim)
    q, k = qkv[:, : 2 * head_dim].view(1, 2, head_dim), qkv[:, 2 * head_dim: 3 * head_dim].view(1, 1, head_dim)
    cos_sin_cache = RotaryEmbedding(head_dim, 16, 1e6).cos_sin_cache
    ones = torch.ones(head_dim)
    fused_q, fused_k = qk_norm_rope(torch.tensor([3]), q, k, ones, ones, 1e-6, cos_sin_cache)
    torch.testing.assert_close(fused_k, eager_reference(torch.tensor([3]), k, ones, 1e-6, cos_sin_cache))


def test_keys_and_values_go_into_the_cache_slots():
    gen = torch.Generator().manual_seed(1)
    head_dim, num_heads, num_kv_heads, page = 128, 4, 2, 16
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(5, -1, head_dim) for x in (q, k, v))
    k_cache = torch.full((3, page, num_kv_heads, head_dim), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)
    slots = torch.tensor([17, -1, 0, 47, 5])  # -1: a padding row, written nowhere
    cos_sin_cache = RotaryEmbedding(head_dim, 64, 1e6).cos_sin_cache
    weight = torch.rand(head_dim, generator=gen) + 0.5
    positions = torch.tensor([3, 0, 9, 40, 1])

    _, fused_k = qk_norm_rope(positions, q, k, weight, weight, 1e-6, cos_sin_cache,
                              KVDestination(v, k_cache, v_cache, slots))

    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    written = [17, 0, 47, 5]
    assert torch.equal(flat_k[written], fused_k[[0, 2, 3, 4]])
    assert torch.equal(flat_v[written], v[[0, 2, 3, 4]])
    untouched = [i for i in range(flat_k.size(0)) if i not in written]
    assert (flat_k[untouched] == 7.0).all() and (flat_v[untouched] == 7.0).all()


def test_rope_only_without_norm_weights_matches_rotary_embedding():
    """Llama and Qwen2 have no q/k norms: the kernel only rotates (and writes the cache)."""
    gen = torch.Generator().manual_seed(2)
    head_dim, num_heads, num_kv_heads = 64, 6, 2
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(5, -1, head_dim) for x in (q, k, v))
    rope = RotaryEmbedding(head_dim, 128, 5e5, dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=16))
    positions = torch.tensor([0, 3, 127, 64, 9])
    k_cache, v_cache = torch.zeros(2, 16, num_kv_heads, head_dim), torch.zeros(2, 16, num_kv_heads, head_dim)
    slots = torch.tensor([0, 1, 2, 31, -1])
    fused_q, fused_k = qk_norm_rope(positions, q, k, None, None, 0.0, rope.cos_sin_cache,
                                    KVDestination(v, k_cache, v_cache, slots))
    expected_q, expected_k = rope(positions, q, k)
    torch.testing.assert_close(fused_q, expected_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(fused_k, expected_k, rtol=0, atol=1e-5)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[[0, 1, 2, 31]], fused_k[:4])
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_dim)[[0, 1, 2, 31]], v[:4])


def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from nanovllm.layers.rotary_embedding import rope_parameters

    config = LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64, max_position_embeddings=131072,
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192))
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    params = rope_parameters(config)
    rope = RotaryEmbedding(64, 4096, params["rope_theta"], params)
    positions = torch.arange(4096, dtype=torch.float)
    freqs = torch.outer(positions, inv_freq)
    torch.testing.assert_close(rope.cos_sin_cache, torch.cat((freqs.cos(), freqs.sin()), dim=-1), rtol=0, atol=0)
    plain = RotaryEmbedding(64, 4096, params["rope_theta"])
    assert not torch.equal(rope.cos_sin_cache, plain.cos_sin_cache)  # the scaling changed something
