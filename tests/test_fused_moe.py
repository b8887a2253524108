"""The fused MoE path (grouping by expert, two grouped Triton matmuls) against the plain per-expert loop.

On CPU the kernels run in Triton's interpreter (float32); the bf16 case, the tile configurations the engine picks
and a CUDA-graph replay need the GPU."""
import pytest
import torch

from nanovllm.layers.fused_moe import TileConfig, align_by_expert, experts_torch, experts_triton, route, tile_config


def problem(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, device: str,
            dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(device, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device, dtype)
    weights, ids = route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("block_m", [16, 32])
def test_pairs_grouped_by_expert_and_padded(block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    sorted_pairs, tile_experts = align_by_expert(ids, 6, block_m)
    num_pairs = ids.numel()
    assert sorted_pairs.numel() % block_m == 0 and tile_experts.numel() == sorted_pairs.numel() // block_m
    seen = []
    for tile, expert in enumerate(tile_experts.tolist()):
        pairs = sorted_pairs[tile * block_m:(tile + 1) * block_m].tolist()
        real = [p for p in pairs if p < num_pairs]
        if expert == 6:  # past the last group
            assert not real
            continue
        assert all(ids.flatten()[p] == expert for p in real) and real
        seen += real
    assert sorted(seen) == list(range(num_pairs))  # every pair exactly once
    assert tile_experts.tolist()[:3] == [0, 1, 3]  # ascending, experts without pairs get no tile


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 8, 2), (37, 6, 3), (64, 16, 4)])
def test_triton_path_matches_the_loop_in_float32(num_tokens, num_experts, top_k):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w13, w2, weights, ids = problem(num_tokens, num_experts, top_k, 64, 48, device, torch.float32)
    # a small tile configuration: the interpreter is slow, and N=96, K=48 leave partial tiles on both sides
    config = TileConfig(16, 32, 32, 4, 2)
    torch.testing.assert_close(experts_triton(x, w13, w2, weights, ids, config),
                               experts_torch(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_default_tile_configs_in_float32():
    configs = set()
    for num_tokens in (1, 64, 128, 256):  # 1 to 128 pairs per expert: each of tile_config's choices
        x, w13, w2, weights, ids = problem(num_tokens, 4, 2, 256, 128, "cpu", torch.float32, seed=num_tokens)
        configs.add(tile_config(ids.numel(), 4))
        torch.testing.assert_close(experts_triton(x, w13, w2, weights, ids),
                                   experts_torch(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)
    assert len(configs) == 4, configs


def test_no_tokens():
    x, w13, w2, weights, ids = problem(0, 4, 2, 32, 16, "cpu", torch.float32)
    assert experts_triton(x, w13, w2, weights, ids).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 2000, 4096])
def test_bf16_on_the_gpu_matches_the_loop(num_tokens):
    """Qwen3-30B-A3B's expert shapes at TP=2 (128 experts, 8 per token), with the engine's tile choice."""
    x, w13, w2, weights, ids = problem(num_tokens, 128, 8, 2048, 384, "cuda", torch.bfloat16)
    print(f"\n{num_tokens} tokens: {tile_config(ids.numel(), 128)}")
    fused = experts_triton(x, w13, w2, weights, ids).float()
    loop = experts_torch(x, w13, w2, weights, ids).float()
    # both round to bf16 at different places (the loop after each expert, the kernel after each projection)
    error = (fused - loop).abs()
    assert error.max() <= 0.02 * loop.abs().max(), (error.max(), loop.abs().max())
    assert error.mean() <= 0.01 * loop.abs().mean()


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_routing():
    x, w13, w2, weights, ids = problem(16, 128, 8, 2048, 384, "cuda", torch.bfloat16)
    logits = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)

    def step():
        w, i = route(logits, 8, True)
        out.copy_(experts_triton(x, w13, w2, w, i))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    logits.copy_(torch.randn_like(logits))  # other experts than at capture
    x.copy_(torch.randn_like(x))
    graph.replay()
    w, i = route(logits, 8, True)
    torch.testing.assert_close(out.float(), experts_triton(x, w13, w2, w, i).float(), rtol=0, atol=0)
