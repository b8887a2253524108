"""Top-p's floor for rows without top-k, found without sorting the row.

The floor is the smallest logit v whose strictly larger logits hold less than top_p of the row's probability
(layers/sampling_floors.py gives the definition); every logit at or above it is kept. With F(t) the probability mass
of the logits above t, the floor lies in any bracket (lo, hi] with F(lo) >= top_p > F(hi); one pass over the row
evaluates F at a few values. The passes run chunk by chunk, many programs a row (layers/top_p_passes.py); between
them one program a row decides:

1. scan: the row's maximum and total mass, a strided sample of its logits, and the largest logit at each position of
   a thread's tile. Those largest logits bound F from below, which on a peaked row puts lo close under the floor.
   plan: four thresholds inside the bracket where the sample puts F's crossing of top_p, give or take one and three
   of the sample's standard errors.
2. count: F and a count at lo and at the thresholds. decide: the new bracket is the piece where F crosses top_p.
   Mostly that piece fits CANDIDATES logits. Otherwise a second count (thresholds from the sample again), then the
   deciding program runs rounds over the row itself: even splits of the bracket's values, then of its keys, which
   shrink it fivefold a round and so end the loop; a bracket holding one distinct value is the floor (many tied
   logits need not fit).
3. gather: the bracket's logits to a buffer. finish: bisect their order-preserving integer keys for the smallest
   one whose strictly larger logits, plus F(hi), hold less than top_p -- an actual logit, ties deciding together.

Masses are float32 sums of exp2((x - max) * log2(e) / T) in a fixed order; the last step sums the bracket's logits
onto F(hi) in another, so a token whose mass before it is within float32 rounding of top_p may fall either side (the
float64 definition agrees otherwise). Every order is fixed, so the same logits give the same floor.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.sampling import top_p_passes as passes
from nanovllm.sampling.top_p_passes import _above, _count_chunk, _key, _row, _value
from nanovllm.sampling.top_p_search import _chunk_offsets, _settle, _smallest_key, _thresholds

SAMPLE = 4096  # logits per row sampled to place the thresholds
CANDIDATES = 8192  # logits per row the last step bisects over, in registers
MAX_CHUNKS = 32  # programs per row in a pass


@triton.jit
def _plan(rows_ptr, temperatures_ptr, top_p_ptr, scratch_ptr, vocab, ROW: tl.constexpr, STATE_AT: tl.constexpr,
          PART_AT: tl.constexpr, GROUPS_AT: tl.constexpr, NS: tl.constexpr, STRIDE: tl.constexpr,
          CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, TILE_R: tl.constexpr, MIN_SAMPLE: tl.constexpr,
          SHIFT: tl.constexpr):
    row, scratch, scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    top_p = tl.load(top_p_ptr + row)
    chunks = tl.arange(0, MAX_CHUNKS)
    scanned = chunks < (vocab + CHUNK - 1) // CHUNK
    parts = scratch + PART_AT + chunks * passes.PARTS
    maxima = tl.load(parts, mask=scanned, other=float("-inf"))
    top = tl.max(maxima, axis=0)
    running = (top > float("-inf")) & (top_p < 1.0)
    top = tl.where(running, top, 0.0)  # keeps the arithmetic finite for a row that needs no floor
    total = tl.sum(tl.load(parts + 1, mask=scanned, other=0.0) * tl.exp2((maxima - top) * scale), axis=0)
    # F(t) >= the mass of the thread rows' maxima above t: lo is a value where those alone exceed top_p (with a
    # margin for rounding; the count checks F(lo) anyway)
    groups = tl.load(scratch + GROUPS_AT + chunks[:, None] * TILE_R + tl.arange(0, TILE_R)[None, :],
                     mask=scanned[:, None], other=float("-inf"))
    groups = tl.reshape(groups, [MAX_CHUNKS * TILE_R])
    bottom = tl.full([], float("-inf"), tl.float32)
    k = _smallest_key(_key(groups, 16), tl.exp2((groups - top) * scale), 0.0, top_p * total * 1.0001,
                      _key(bottom, 16).to(tl.int64), _key(top, 16).to(tl.int64), 16)
    lo = _above(k - 1, 16)
    low = tl.where(running, tl.min(tl.load(parts + 2, mask=scanned, other=float("inf")), axis=0), 0.0)
    t1, t2, t3, t4 = _thresholds(scratch, (vocab + STRIDE - 1) // STRIDE, top, scale, lo, top, 0.0, total,
                                 top_p * total, low, top, 0, NS, MIN_SAMPLE, SHIFT)
    state = scratch + STATE_AT
    tl.store(state + passes.FLAG, tl.where(running, passes.COUNTING, passes.DONE).to(tl.float32))
    tl.store(state + passes.TOP, top)
    tl.store(state + passes.LO, lo)
    tl.store(state + passes.HI, top)
    tl.store(state + passes.HI_MASS, 0.0)
    tl.store(state + passes.LO_MASS, total)  # an estimate until counted
    tl.store(state + passes.LOW, low)
    tl.store(state + passes.HIGH, top)
    tl.store(state + passes.T1, t1)
    tl.store(state + passes.T1 + 1, t2)
    tl.store(state + passes.T1 + 2, t3)
    tl.store(state + passes.T1 + 3, t4)
    tl.store(state + passes.ROUNDS, 0.0)


@triton.jit
def _decide(logits_ptr, row_stride, rows_ptr, temperatures_ptr, top_p_ptr, floors_ptr, scratch_ptr, vocab,
            ROW: tl.constexpr, STATE_AT: tl.constexpr, PART_AT: tl.constexpr, NS: tl.constexpr,
            STRIDE: tl.constexpr, C: tl.constexpr, CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
            TILE_R: tl.constexpr, TILE_C: tl.constexpr, MIN_SAMPLE: tl.constexpr, SHIFT: tl.constexpr,
            FIRST: tl.constexpr, LAST: tl.constexpr, MAX_ROUNDS: tl.constexpr):
    """Settles a count of every row still counting. FIRST: the count's total mass sets the target. Rows it leaves
    undecided get the next count's thresholds, or, LAST, more rounds here, over the whole row."""
    row, scratch, scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    state = scratch + STATE_AT
    if tl.load(state + passes.FLAG).to(tl.int32) == passes.COUNTING:
        top, lo, hi = tl.load(state + passes.TOP), tl.load(state + passes.LO), tl.load(state + passes.HI)
        hi_mass, lo_mass = tl.load(state + passes.HI_MASS), tl.load(state + passes.LO_MASS)
        low, high = tl.load(state + passes.LOW), tl.load(state + passes.HIGH)
        t1, t2 = tl.load(state + passes.T1), tl.load(state + passes.T1 + 1)
        t3, t4 = tl.load(state + passes.T1 + 2), tl.load(state + passes.T1 + 3)
        parts = scratch + PART_AT + tl.arange(0, MAX_CHUNKS) * passes.PARTS
        n_chunks = (vocab + CHUNK - 1) // CHUNK
        counted = tl.arange(0, MAX_CHUNKS) < n_chunks
        if FIRST:
            everything = tl.sum(tl.load(parts + passes.F_ALL, mask=counted, other=0.0), axis=0)
            target = tl.load(top_p_ptr + row) * everything
        else:
            target = tl.load(state + passes.TARGET)
        floor = tl.load(floors_ptr + row)
        rounds = tl.load(state + passes.ROUNDS).to(tl.int32) + 1
        flag, lo, hi, lo_mass, hi_mass, low, high, floor, count, j = _settle(
            parts, counted, top, hi, t1, t2, t3, t4, lo, target, floor, low, high, C)
        n_sample = (vocab + STRIDE - 1) // STRIDE
        if LAST:
            logits = logits_ptr + row * row_stride
            while (flag == passes.COUNTING) & (rounds < MAX_ROUNDS):
                tl.debug_barrier()  # every thread has read the records this round rewrites
                t1, t2, t3, t4 = _thresholds(scratch, n_sample, top, scale, lo, hi, hi_mass, lo_mass, target, low,
                                             high, rounds, NS, MIN_SAMPLE, SHIFT)
                for chunk in range(0, n_chunks):
                    _count_chunk(logits, vocab, scratch + PART_AT + chunk * passes.PARTS, chunk * CHUNK, top, scale,
                                 hi, t1, t2, t3, t4, lo, CHUNK, TILE_R, TILE_C, HAS_HI=True, EXTREMES=True)
                tl.debug_barrier()
                flag, lo, hi, lo_mass, hi_mass, low, high, floor, count, j = _settle(
                    parts, counted, top, hi, t1, t2, t3, t4, lo, target, floor, low, high, C)
                rounds += 1
            # out of reach (even splits of the keys end the loop sooner); were it not, the logits above hi are kept
            floor = tl.where(flag == passes.COUNTING, tl.maximum(floor, hi), floor)
            flag = tl.where(flag == passes.COUNTING, passes.DONE, flag)
        elif flag == passes.COUNTING:
            t1, t2, t3, t4 = _thresholds(scratch, n_sample, top, scale, lo, hi, hi_mass, lo_mass, target, low, high,
                                         rounds, NS, MIN_SAMPLE, SHIFT)
            tl.store(state + passes.T1, t1)
            tl.store(state + passes.T1 + 1, t2)
            tl.store(state + passes.T1 + 2, t3)
            tl.store(state + passes.T1 + 3, t4)
        tl.store(floors_ptr + row, floor)
        if flag == passes.GATHER:
            _chunk_offsets(parts, counted, j)
        tl.store(state + passes.FLAG, flag.to(tl.float32))
        tl.store(state + passes.LO, lo)
        tl.store(state + passes.HI, hi)
        tl.store(state + passes.HI_MASS, hi_mass)
        tl.store(state + passes.LO_MASS, lo_mass)
        tl.store(state + passes.LOW, low)
        tl.store(state + passes.HIGH, high)
        tl.store(state + passes.TARGET, target)
        tl.store(state + passes.COUNT, count.to(tl.float32))
        tl.store(state + passes.ROUNDS, rounds.to(tl.float32))


@triton.jit
def _finish(rows_ptr, temperatures_ptr, floors_ptr, scratch_ptr, ROW: tl.constexpr, CANDIDATES_AT: tl.constexpr,
            STATE_AT: tl.constexpr, C: tl.constexpr, SHIFT: tl.constexpr):
    row, scratch, scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    state = scratch + STATE_AT
    if tl.load(state + passes.FLAG).to(tl.int32) == passes.GATHER:
        lo, hi, hi_mass = tl.load(state + passes.LO), tl.load(state + passes.HI), tl.load(state + passes.HI_MASS)
        offsets = tl.arange(0, C)
        x = tl.load(scratch + CANDIDATES_AT + offsets, mask=offsets < tl.load(state + passes.COUNT).to(tl.int32),
                    other=float("-inf"))
        inside = (x > lo) & (x <= hi)
        keys = _key(x, SHIFT)
        k = _smallest_key(keys, tl.where(inside, tl.exp2((x - tl.load(state + passes.TOP)) * scale), 0.0), hi_mass,
                          tl.load(state + passes.TARGET), _key(lo, SHIFT).to(tl.int64), _key(hi, SHIFT).to(tl.int64),
                          SHIFT)
        # an actual logit; a value just above lo only when rounding put the crossing below every candidate
        snapped = tl.min(tl.where(inside & (keys >= k), x, float("inf")), axis=0)
        floor = tl.where(snapped < float("inf"), snapped, _value(k.to(tl.int32) << SHIFT))
        tl.store(floors_ptr + row, tl.maximum(tl.load(floors_ptr + row), floor))


@dataclass(frozen=True)
class ScratchLayout:
    """Offsets (float32) in a row's scratch: sample, candidates, state, chunk records, thread-row maxima."""

    sample: int
    candidates: int
    tile_rows: int

    @property
    def state_at(self) -> int:
        return self.sample + self.candidates

    @property
    def part_at(self) -> int:
        return self.state_at + passes.STATE.value

    @property
    def groups_at(self) -> int:
        return self.part_at + MAX_CHUNKS * passes.PARTS.value

    @property
    def row(self) -> int:
        return self.groups_at + MAX_CHUNKS * self.tile_rows


def top_p_floors(logits: torch.Tensor, rows: torch.Tensor, temperatures: torch.Tensor, top_p: torch.Tensor,
                 floors: torch.Tensor, sample: int = SAMPLE, candidates: int = CANDIDATES, tile_rows: int = 256,
                 num_warps: int = 4, row_warps: int = 16) -> torch.Tensor:
    """Raise floors[r] to top-p's floor for each row r in `rows` (int64; rows with temperature > 0), in place.

    logits [rows, vocab] (bf16 or float32, each row contiguous); temperatures, top_p and floors float32 per row of
    `logits`. num_warps: per program of a pass (tile_rows rows of 16 bytes a tile); row_warps: per program of a
    row's decisions. Returns the scratch (a row per entry of `rows`), whose state tells how each row went."""
    vocab = logits.size(1)
    assert logits.stride(1) == 1 and rows.dtype == torch.int64 and floors.dtype == torch.float32
    assert floors.is_contiguous() and temperatures.dtype == top_p.dtype == torch.float32
    for name, value in (("sample", sample), ("candidates", candidates), ("tile_rows", tile_rows)):
        assert value > 0 and value & (value - 1) == 0, f"{name}={value} must be a power of two"
    layout = ScratchLayout(sample, candidates, tile_rows)
    scratch = torch.empty(rows.numel(), layout.row, dtype=torch.float32, device=logits.device)
    if rows.numel() == 0:
        return scratch
    # a thread reads 16 bytes of a row at a time and sums them itself; rows that do not start on 16 bytes get one
    # logit a thread row (the compiler would otherwise spread each row's 16 bytes over threads)
    tile_cols = 16 // logits.element_size()
    if logits.stride(0) % tile_cols or vocab % tile_cols:
        tile_cols = 1
    tile = tile_rows * tile_cols
    chunk = tile * triton.cdiv(triton.cdiv(vocab, MAX_CHUNKS), tile)
    by_chunk, by_row = (rows.numel(), triton.cdiv(vocab, chunk)), (rows.numel(),)
    stride = tile_cols * triton.cdiv(vocab, tile_cols * sample)
    shift = 16 if logits.dtype == torch.bfloat16 else 0  # a bf16 logit's low 16 bits are zero
    tiles = dict(ROW=layout.row, CHUNK=chunk, TILE_R=tile_rows, TILE_C=tile_cols)
    at = dict(STATE_AT=layout.state_at, PART_AT=layout.part_at)
    search = dict(NS=sample, STRIDE=stride, MAX_CHUNKS=MAX_CHUNKS, MIN_SAMPLE=16, SHIFT=shift)
    head = (logits, logits.stride(0), rows, temperatures)
    passes._scan[by_chunk](*head, scratch, vocab, PART_AT=layout.part_at, GROUPS_AT=layout.groups_at, STRIDE=stride,
                           **tiles, num_warps=num_warps)
    _plan[by_row](rows, temperatures, top_p, scratch, vocab, GROUPS_AT=layout.groups_at, ROW=layout.row,
                  CHUNK=chunk, TILE_R=tile_rows, **at, **search, num_warps=row_warps)
    # two counts over every chunk, then more rounds row by row for rows still undecided (rare)
    for first in (True, False):
        passes._count[by_chunk](*head, scratch, vocab, **at, HAS_HI=not first, **tiles, num_warps=num_warps)
        _decide[by_row](*head[:3], temperatures, top_p, floors, scratch, vocab, C=candidates, FIRST=first,
                        LAST=not first, MAX_ROUNDS=64, **tiles, **at, **search, num_warps=row_warps)
    passes._gather[by_chunk](*head, scratch, vocab, CANDIDATES_AT=sample, **at, **tiles, num_warps=num_warps)
    _finish[by_row](rows, temperatures, floors, scratch, ROW=layout.row, CANDIDATES_AT=sample,
                    STATE_AT=layout.state_at, C=candidates, SHIFT=shift, num_warps=row_warps)
    return scratch
