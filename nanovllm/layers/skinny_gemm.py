"""x @ W.T for the few rows of a decode step, split along K so that enough programs stream the weights.

At decode a linear layer has 1-256 rows against thousands of weight rows: reading the weights is the cost,
and an output of 256 x 1024 is only a handful of 128-wide tiles, too few to keep HBM busy. Each program
here takes a BLOCK_N slice of the outputs and one of `split_k` slices of K; the last K slice of a tile to
finish adds up the partial sums (no second launch).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_gemm(x_ptr, w_ptr, y_ptr, part_ptr, counters_ptr, M, N, K, x_stride, y_stride, k_per_split,
                 split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_tile = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(split * k_per_split, (split + 1) * k_per_split, BLOCK_K):
        x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_tile + k, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = y_ptr + rows[:, None] * y_stride + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if split_k == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)
        return
    tile_part = part_ptr + rows[:, None] * N + cols[None, :]
    tl.store(tile_part + split * M * N, acc, mask=mask)
    tl.debug_barrier()
    counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
    if tl.atomic_add(counter, 1, sem="acq_rel") == split_k - 1:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for other in range(0, split_k):
            total += tl.load(tile_part + other * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter, 0)


def default_config(m: int, n: int, k: int) -> dict:
    """Tile sizes and K split for an (m x k) @ (k x n) product; from tests/microbench_gemm.py --sweep."""
    block_n = 64
    split_k = 1
    while split_k < 8 and triton.cdiv(n, block_n) * split_k < 256 and k % (128 * split_k * 2) == 0:
        split_k *= 2
    return dict(block_n=block_n, block_k=128, split_k=split_k, num_stages=4)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, counters: torch.Tensor | None = None,
                out: torch.Tensor | None = None, **config) -> torch.Tensor:
    """x [m, k] @ weight[n, k].T -> [m, n] in x's dtype, float32 accumulation.

    `counters` is int32 scratch of at least cdiv(m, 128) * cdiv(n, block_n) zeros, left at zero."""
    m, k = x.shape
    n = weight.size(0)
    assert x.stride(1) == 1 and weight.is_contiguous() and weight.size(1) == k
    config = {**default_config(m, n, k), **config}
    block_n, block_k, split_k = config["block_n"], config["block_k"], config["split_k"]
    assert k % (block_k * split_k) == 0, (k, block_k, split_k)
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    if counters is None:
        counters = torch.zeros(grid[0] * grid[2], dtype=torch.int32, device=x.device)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else x
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    _skinny_gemm[grid](x, weight, out, part, counters, m, n, k, x.stride(0), out.stride(0), k // split_k, split_k,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                       num_stages=config["num_stages"])
    return out
