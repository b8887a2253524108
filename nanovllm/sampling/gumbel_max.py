"""Sampling in one pass over the logits: the Gumbel-max draw argmax(logits / T - log E), E ~ Exp(1).

The compiled torch version was bound by the random numbers, not by memory: one Philox evaluation per logit.
Here each Philox evaluation feeds four logits (`tl.rand4x`), and the vocabulary is cut into chunks so that a
small batch still fills the GPU; the last chunk of a row to finish picks the row's winner.

Two per-row options keep every sampling setting on this one pass:
- a floor: logits below it are out of the draw. top-k, top-p and min-p all keep exactly the tokens at or above
  some logit (sampling/floors.py finds it), and a Gumbel-max draw over the kept tokens is a draw from
  their renormalised softmax.
- a seed: the row's noise is then keyed by (seed, vocabulary id) alone, so the batch around it, its row and the
  CUDA graph size cannot change its token; unseeded rows share the step's seed, keyed by row.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _log2(x, HARDWARE_LOG: tl.constexpr):
    if HARDWARE_LOG:  # the bare lg2.approx instruction (GPU only): Gumbel noise needs no more precision
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _keep_best(row_logits, index, u, vocab, temperature, scale, floor, best, best_index, HARDWARE_LOG: tl.constexpr,
               HAS_FLOOR: tl.constexpr):
    x = tl.load(row_logits + index, mask=index < vocab, other=float("-inf")).to(tl.float32)
    if HAS_FLOOR:
        x = tl.where(x >= floor, x, float("-inf"))
    if temperature > 0:
        # in base 2: log2(E) = log2(-log2 u) + log2(ln 2), and a constant does not move the argmax
        x = x * scale - _log2(-_log2(u, HARDWARE_LOG), HARDWARE_LOG)  # u == 0 gives -inf: never chosen
    # a lane sees increasing indices, so "strictly greater" keeps the first of equal scores, as torch.argmax
    better = x > best
    return tl.where(better, x, best), tl.where(better, index, best_index)


@triton.jit(do_not_specialize=["seed"])  # a fresh seed every step: one variant for all of them
def _gumbel_max(logits_ptr, temperatures_ptr, floors_ptr, row_seeds_ptr, out_ptr, part_score_ptr, part_index_ptr,
                counters_ptr, seed, vocab, row_stride, num_chunks, CHUNK: tl.constexpr, QUARTER: tl.constexpr,
                MAX_CHUNKS: tl.constexpr, HARDWARE_LOG: tl.constexpr, HAS_FLOOR: tl.constexpr,
                HAS_ROW_SEEDS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    scale = 1.4426950408889634 / tl.maximum(temperature, 1e-5)  # log2(e) / T
    floor = tl.load(floors_ptr + row) if HAS_FLOOR else float("-inf")
    # one Philox counter per four logits, unique per (row, position) within a call; a seeded row's own key
    # makes its counters depend on the position alone
    counter_base = row * (num_chunks * CHUNK // 4)
    if HAS_ROW_SEEDS:
        row_seed = tl.load(row_seeds_ptr + row)
        key = tl.where(row_seed >= 0, row_seed, seed)
        counter_base = tl.where(row_seed >= 0, 0, counter_base)
    else:
        key = seed
    lane = tl.arange(0, QUARTER)
    best = tl.full([QUARTER], float("-inf"), tl.float32)
    best_index = tl.zeros([QUARTER], tl.int32)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    for first in range(chunk * CHUNK, chunk * CHUNK + CHUNK, 4 * QUARTER):
        u0, u1, u2, u3 = tl.rand4x(key, counter_base + first // 4 + lane)
        index = first + lane
        best, best_index = _keep_best(row_logits, index, u0, vocab, temperature, scale, floor, best, best_index,
                                      HARDWARE_LOG, HAS_FLOOR)
        best, best_index = _keep_best(row_logits, index + QUARTER, u1, vocab, temperature, scale, floor, best,
                                      best_index, HARDWARE_LOG, HAS_FLOOR)
        best, best_index = _keep_best(row_logits, index + 2 * QUARTER, u2, vocab, temperature, scale, floor,
                                      best, best_index, HARDWARE_LOG, HAS_FLOOR)
        best, best_index = _keep_best(row_logits, index + 3 * QUARTER, u3, vocab, temperature, scale, floor,
                                      best, best_index, HARDWARE_LOG, HAS_FLOOR)
    top = tl.max(best, 0)
    top_index = tl.min(tl.where(best == top, best_index, vocab), 0)
    tl.store(part_score_ptr + row * num_chunks + chunk, top)
    tl.store(part_index_ptr + row * num_chunks + chunk, top_index)
    # the last chunk of the row to finish merges (same ticket scheme as the decode attention kernel)
    tl.debug_barrier()
    counter = counters_ptr + row
    if tl.atomic_add(counter, 1, sem="acq_rel") == num_chunks - 1:
        chunks = tl.arange(0, MAX_CHUNKS)
        valid = chunks < num_chunks
        scores = tl.load(part_score_ptr + row * num_chunks + chunks, mask=valid, other=float("-inf"),
                         cache_modifier=".cg")
        indices = tl.load(part_index_ptr + row * num_chunks + chunks, mask=valid, other=vocab, cache_modifier=".cg")
        winner = tl.max(scores, 0)
        tl.store(out_ptr + row, tl.min(tl.where(scores == winner, indices, vocab), 0).to(tl.int64))
        tl.atomic_xchg(counter, 0)


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
                      counters: torch.Tensor | None = None, chunk: int = 4096, floors: torch.Tensor | None = None,
                      row_seeds: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row of `logits` [rows, vocab]: a draw from softmax(logits / T) over the logits at or above
    the row's floor, argmax where T is 0.

    `seed` picks the step's random stream; `row_seeds` (int64, -1: the step's stream) give a row a stream of its
    own; `floors` (float32, -inf: none) bound the draw from below; `counters` is int32 scratch of at least `rows`
    zeros that the kernel leaves at zero (pass one buffer for every call to save a memset)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temperatures.dtype == torch.float32
    assert 0 <= seed < 2**31
    if counters is None:
        counters = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    assert counters.numel() >= rows and counters.dtype == torch.int32
    assert floors is None or (floors.dtype == torch.float32 and floors.numel() >= rows)
    assert row_seeds is None or (row_seeds.dtype == torch.int64 and row_seeds.numel() >= rows)
    num_chunks = triton.cdiv(vocab, chunk)
    part_score = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    part_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    quarter = 256
    assert chunk % (4 * quarter) == 0
    _gumbel_max[(rows, num_chunks)](logits, temperatures, temperatures if floors is None else floors,
                                    out if row_seeds is None else row_seeds, out, part_score, part_index, counters,
                                    seed, vocab, logits.stride(0), num_chunks, CHUNK=chunk, QUARTER=quarter,
                                    MAX_CHUNKS=triton.next_power_of_2(num_chunks),
                                    HARDWARE_LOG=logits.is_cuda, HAS_FLOOR=floors is not None,
                                    HAS_ROW_SEEDS=row_seeds is not None, num_warps=4)
    return out
