"""Mixture-of-experts compute: each token's hidden state through its top-k experts' SwiGLU MLPs, weighted.

On the GPU a fused Triton path: the (token, expert) pairs are grouped by expert, each group padded to the tile
height, and two grouped matmuls run over all experts at once (gate/up, then down with the routing weights
applied), so every expert's weights are read once per call whatever the batch. Every step has a fixed shape, with
no host synchronisation, so it runs inside CUDA graphs. On CPU a plain loop over the experts in use.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanovllm.layers.activation import silu_and_mul


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each token and their weights (float32): softmax over all experts, the k largest,
    renormalised to sum to 1 when the model says so (norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The reference: expert by expert in ascending order, as transformers sums them (it syncs with the host)."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for expert in ids.unique().tolist():
        token, slot = torch.where(ids == expert)
        y = F.linear(silu_and_mul(F.linear(x[token], w13[expert])), w2[expert])
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # pairs per tile: each expert's group is padded to a multiple of it
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(num_pairs: int, num_experts: int) -> TileConfig:
    """Few pairs per expert (decode): short tiles, the weights streamed by many programs; many (prefill): tall
    tiles that reuse each weight tile over more rows. The sweep is `benchmarks/microbench.py moe --sweep`."""
    if num_pairs <= 4 * num_experts:
        return TileConfig(16, 64, 128, 4, 4)
    if num_pairs <= 32 * num_experts:
        return TileConfig(32, 64, 128, 4, 3)
    if num_pairs < 128 * num_experts:
        return TileConfig(64, 128, 64, 8, 3)
    return TileConfig(128, 128, 64, 8, 3)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs, numbered token * top_k + slot, grouped by expert with each group padded to a
    multiple of block_m; padding holds the number of pairs (an id past the last). Also the expert of each
    block_m-row tile, num_experts for tiles past the last group. Sizes depend only on the number of pairs."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    # at most one partly filled tile per expert in use, and no more experts in use than pairs
    capacity = min(num_pairs * block_m, triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m)
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=ids.device)
    sorted_pairs[(ends - padded)[expert] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, capacity, block_m, device=ids.device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    return sorted_pairs, tile_experts


@triton.jit
def _grouped_matmul(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_pairs_ptr, tile_experts_ptr, num_pairs, num_experts,
                    N, K, a_stride, b_stride_expert, b_stride_n, c_stride,
                    A_ROW_DIVISOR: tl.constexpr, MUL_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[pair // A_ROW_DIVISOR] @ B[expert]^T (x routing weight) for one tile of one expert's pairs."""
    num_n = tl.cdiv(N, BLOCK_N)
    tile, n_block = tl.program_id(0) // num_n, tl.program_id(0) % num_n
    expert = tl.load(tile_experts_ptr + tile).to(tl.int64)
    if expert >= num_experts:  # past the last group: a fixed grid has more tiles than the routing fills
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // A_ROW_DIVISOR).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + rows[:, None] * a_stride + ks[None, :]
    b_tile = b_ptr + expert * b_stride_expert + cols[None, :].to(tl.int64) * b_stride_n + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_tile + k, mask=valid[:, None] & (ks[None, :] < K - k), other=0.0)
        b = tl.load(b_tile + k, mask=(ks[:, None] < K - k) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = c_ptr + pairs[:, None].to(tl.int64) * c_stride + cols[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))


def _grouped(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
             sorted_pairs: torch.Tensor, tile_experts: torch.Tensor, row_divisor: int, config: TileConfig) -> None:
    num_n = triton.cdiv(b.size(1), config.block_n)
    _grouped_matmul[(tile_experts.numel() * num_n,)](
        a, b, c, c if weights is None else weights, sorted_pairs, tile_experts, c.size(0), b.size(0), b.size(1),
        b.size(2), a.stride(0), b.stride(0), b.stride(1), c.stride(0), A_ROW_DIVISOR=row_divisor,
        MUL_WEIGHTS=weights is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   config: TileConfig | None = None) -> torch.Tensor:
    """x [tokens, hidden] through experts w13 [experts, 2 x inter, hidden] (gate rows, then up rows) and
    w2 [experts, hidden, inter]; weights/ids [tokens, top_k] from route()."""
    num_tokens, top_k = ids.shape
    num_pairs, num_experts = num_tokens * top_k, w13.size(0)
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    config = config or tile_config(num_pairs, num_experts)
    sorted_pairs, tile_experts = align_by_expert(ids, num_experts, config.block_m)
    gate_up = torch.empty(num_pairs, w13.size(1), dtype=x.dtype, device=x.device)
    _grouped(x, w13, gate_up, None, sorted_pairs, tile_experts, top_k, config)
    down = torch.empty(num_pairs, w2.size(1), dtype=x.dtype, device=x.device)
    _grouped(silu_and_mul(gate_up), w2, down, weights.flatten().float(), sorted_pairs, tile_experts, 1, config)
    return down.view(num_tokens, top_k, -1).sum(dim=1)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return experts_triton(x, w13, w2, weights, ids)
    return experts_torch(x, w13, w2, weights, ids)
