import pytest
import torch
import torch.nn.functional as F

from nanovllm.attention import LayerKV, make_attention_backend
from nanovllm.attention.flash_attn_backend import FlashAttnBackend, store_kvcache
from nanovllm.attention.paged_decode import paged_decode_attention
from nanovllm.attention.torch_backend import TorchBackend, store_kvcache_torch
from nanovllm.attention.triton_backend import TritonBackend
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.rotary_embedding import RotaryEmbedding
from nanovllm.utils.context import get_context, reset_context, set_context

BS, H, KV_H, D = 16, 4, 2, 32


@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 32), (3, 24)])  # 72 is not a power of two: masked lanes
def test_store_kvcache_kernel_matches_torch(num_kv_heads, head_dim):
    torch.manual_seed(0)
    num_tokens, num_slots = 9, 64
    # K/V as views into a packed qkv row, the way the model hands them over (non-contiguous rows)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim)
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([5, 0, -1, 63, 17, 18, -1, 40, 1])
    caches = [torch.zeros(num_slots // BS, BS, num_kv_heads, head_dim) for _ in range(4)]
    store_kvcache(k, v, LayerKV(caches[0], caches[1]), slots)
    store_kvcache_torch(k, v, LayerKV(caches[2], caches[3]), slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, num_kv_heads, head_dim)[63].equal(k[3])
    assert caches[0].abs().sum() > 0


def dense_causal(q, k, v, scale):
    """Reference: full attention of the last q.size(0) positions over all keys."""
    k = k.repeat_interleave(H // KV_H, dim=1)
    v = v.repeat_interleave(H // KV_H, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    offset = k.size(0) - q.size(0)
    mask = torch.ones(q.size(0), k.size(0), dtype=torch.bool).tril(offset)
    return torch.einsum("hqk,khd->qhd", F.softmax(scores.masked_fill(~mask, float("-inf")), -1), v)


def attend(backend, cache, q, k, v):
    """What a layer does after RoPE: this step's K/V into the cache, then prefill or decode attention."""
    context = get_context()
    backend.store(k, v, cache, context.slot_mapping)
    if context.is_prefill:
        return backend.prefill(q, k, v, cache, context, D ** -0.5)
    return backend.decode(q, cache, context, D ** -0.5)


def test_paged_prefill_with_cached_prefix_and_decode_match_dense():
    torch.manual_seed(0)
    backend, cache = TorchBackend(), LayerKV(*torch.zeros(2, 8, BS, KV_H, D))
    lengths = [40, 21]  # the first sequence has two cached blocks
    tables = [[5, 2, 7], [1, 6]]
    keys = [torch.randn(n, KV_H, D) for n in lengths]
    values = [torch.randn(n, KV_H, D) for n in lengths]
    queries = [torch.randn(n, H, D) for n in lengths]

    def slots(table, start, end):
        return [table[p // BS] * BS + p % BS for p in range(start, end)]

    # the cached prefix is already in its blocks
    store_kvcache_torch(keys[0][:32], values[0][:32], cache, torch.tensor(slots(tables[0], 0, 32)))
    q = torch.cat([queries[0][32:], queries[1]])
    k = torch.cat([keys[0][32:], keys[1]])
    v = torch.cat([values[0][32:], values[1]])
    set_context(is_prefill=True, cu_seqlens_q=torch.tensor([0, 8, 29]), cu_seqlens_k=torch.tensor([0, 40, 61]),
                max_seqlen_q=21, max_seqlen_k=40,
                slot_mapping=torch.tensor(slots(tables[0], 32, 40) + slots(tables[1], 0, 21)),
                block_tables=torch.tensor([[5, 2, 7], [1, 6, 0]]))
    out = attend(backend, cache, q, k, v)
    reset_context()
    expected = torch.cat([dense_causal(queries[0][32:], keys[0], values[0], D ** -0.5),
                          dense_causal(queries[1], keys[1], values[1], D ** -0.5)])
    torch.testing.assert_close(out, expected)

    # decode one more token for each
    new_q, new_k, new_v = torch.randn(2, H, D), torch.randn(2, KV_H, D), torch.randn(2, KV_H, D)
    set_context(is_prefill=False, slot_mapping=torch.tensor([slots(tables[0], 40, 41)[0], slots(tables[1], 21, 22)[0]]),
                context_lens=torch.tensor([41, 22]), block_tables=torch.tensor([[5, 2, 7], [1, 6, 0]]))
    out = attend(backend, cache, new_q, new_k, new_v)
    reset_context()
    for i in range(2):
        expected = dense_causal(new_q[i:i + 1], torch.cat([keys[i], new_k[i:i + 1]]),
                                torch.cat([values[i], new_v[i:i + 1]]), D ** -0.5)
        torch.testing.assert_close(out[i:i + 1], expected)


def _decode_case(device: str, dtype: torch.dtype, num_heads: int, num_kv_heads: int, page: int):
    """A decode batch over scattered pages: one full-width table, one short, one padding row (context 0)."""
    gen = torch.Generator().manual_seed(0)
    # head_dim 128: a size every flash-attn build (the GPU reference) computes, trimmed builds included
    head_dim, width, num_blocks = 128, 12, 60  # 12 pages: the long row spans several slices
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(4, num_heads, head_dim, generator=gen).to(device, dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: 4 * width].view(4, width).int().to(device)
    context_lens = torch.tensor([width * page, 1, page + 5, 0], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, context_lens


@pytest.mark.parametrize("num_heads,num_kv_heads,page", [(4, 2, 16), (6, 2, 32), (8, 8, 16)])
def test_triton_decode_kernel_matches_torch_paged_attention(num_heads, num_kv_heads, page):
    q, k_cache, v_cache, block_tables, context_lens = _decode_case("cpu", torch.float32, num_heads, num_kv_heads, page)
    scale = q.size(-1) ** -0.5
    set_context(is_prefill=False, slot_mapping=None, context_lens=context_lens[:3], block_tables=block_tables[:3])
    expected = TorchBackend().decode(q[:3], LayerKV(k_cache, v_cache), get_context(), scale)
    reset_context()
    # the default (many one-chunk slices) and few long slices (the online softmax runs over many chunks)
    counters = torch.zeros(4 * num_kv_heads, dtype=torch.int32)
    for options in ({}, {"block_n": 16, "max_splits": 2}):
        out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, counters, **options)
        torch.testing.assert_close(out[:3], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[3], torch.zeros_like(out[3]))  # CUDA-graph padding rows stay finite
        assert not counters.any()  # left ready for the next call


@pytest.mark.gpu
def test_triton_decode_kernel_matches_flash_attn_on_gpu():
    from flash_attn import flash_attn_with_kvcache

    q, k_cache, v_cache, block_tables, context_lens = _decode_case("cuda", torch.bfloat16, 16, 8, 256)
    scale = q.size(-1) ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)[:3]
    expected = flash_attn_with_kvcache(q[:3].unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens[:3],
                                       block_table=block_tables[:3], softmax_scale=scale, causal=True).squeeze(1)
    # both accumulate in float32 and round once to bf16; only the order of the sums differs
    assert (out.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()


@pytest.mark.gpu
def test_varlen_attention_is_flash_attn_varlen_func_bit_for_bit():
    """The prefill's attention gives flash_attn_varlen_func's result bit for bit, packed (several sequences, K and
    V strided views of one projection, as the model hands them over) and paged (a cached prefix): the same kernel,
    called through flash-attn's extension where its version allows."""
    import flash_attn
    from flash_attn import flash_attn_varlen_func

    from nanovllm.attention.flash_attn_backend import EXTENSION_SIGNATURE, _extension_varlen_fwd, varlen_attention

    torch.manual_seed(0)
    lengths, cached, block, scale = [5, 300, 77], [0, 256, 0], 256, 128 ** -0.5
    new = [n - c for n, c in zip(lengths, cached)]
    cu = lambda sizes: torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                    device="cuda")
    tokens = sum(lengths)
    qkv = torch.randn(tokens, (8 + 2 + 2) * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (part.view(tokens, -1, 128) for part in qkv.split([8 * 128, 2 * 128, 2 * 128], dim=1))
    args = (cu(lengths), cu(lengths), max(lengths), max(lengths))
    packed = varlen_attention(q, k, v, *args, scale, None)
    assert torch.equal(packed, flash_attn_varlen_func(q, k, v, *args, softmax_scale=scale, causal=True))
    q = q[:sum(new)].contiguous()
    k_cache, v_cache = (torch.randn(6, block, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    block_table = torch.tensor([[0, 5], [3, 1], [2, 4]], dtype=torch.int32, device="cuda")
    args = (cu(new), cu(lengths), max(new), max(lengths))
    paged = varlen_attention(q, k_cache, v_cache, *args, scale, block_table)
    assert torch.equal(paged, flash_attn_varlen_func(q, k_cache, v_cache, *args, softmax_scale=scale, causal=True,
                                                     block_table=block_table))
    assert packed.abs().sum() > 0 and paged.abs().sum() > 0
    first, after = EXTENSION_SIGNATURE
    version = tuple(int(part) for part in flash_attn.__version__.split(".")[:2])
    assert (_extension_varlen_fwd() is not None) == (first <= version < after), flash_attn.__version__


@pytest.mark.parametrize("qk_norm", [True, False])
def test_backends_write_the_same_cache_and_rotate_the_same_way(qk_norm):
    """The Triton backend's fused q/k-norm + RoPE + KV write equals the plain path (norms, RoPE, then a store);
    the flash_attn backend's (the same norm + RoPE kernel, then its own store) equals the Triton backend's bit for
    bit."""
    torch.manual_seed(0)
    num_tokens, head_dim = 6, 64
    q, k, v = torch.randn(num_tokens, H, head_dim), torch.randn(num_tokens, KV_H, head_dim), torch.randn(
        num_tokens, KV_H, head_dim)
    positions = torch.tensor([0, 1, 2, 40, 41, 7])
    slots = torch.tensor([3, 4, -1, 60, 61, 17])
    rope = RotaryEmbedding(head_dim, 128, 10000.0)
    norms = (RMSNorm(head_dim), RMSNorm(head_dim))
    for norm in norms:
        norm.weight.data.uniform_(0.5, 1.5)
    results = []
    for backend in (TorchBackend(), TritonBackend(), FlashAttnBackend()):
        cache = LayerKV(torch.zeros(4, BS, KV_H, head_dim), torch.zeros(4, BS, KV_H, head_dim))
        results.append((*backend.rope_and_store(positions, q, k, v, rope, norms if qk_norm else None, cache, slots),
                        cache))
    (q0, k0, c0), (q1, k1, c1), (q2, k2, c2) = results
    torch.testing.assert_close(q1, q0)
    torch.testing.assert_close(k1, k0)
    torch.testing.assert_close(c1.k, c0.k)
    assert torch.equal(c1.v, c0.v) and c0.k.view(-1, KV_H, head_dim)[60].abs().sum() > 0
    assert torch.equal(q2, q1) and torch.equal(k2, k1) and torch.equal(c2.k, c1.k) and torch.equal(c2.v, c1.v)


def test_backend_choice_is_checked():
    assert make_attention_backend(None, use_cuda=False).name == "torch"
    assert make_attention_backend(None, use_cuda=True).name == "triton"
    with pytest.raises(ValueError, match="attention_backend='flash_attn' does not run with no CUDA device"):
        make_attention_backend("flash_attn", use_cuda=False)
    with pytest.raises(ValueError, match="unknown"):
        make_attention_backend("xformers", use_cuda=True)
