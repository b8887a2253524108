"""The passes over the logits behind sampling/top_p_floor.py. Each program reads one chunk of one row, so many
programs share a row and the logits stream at the memory's bandwidth; the per-row decisions between the passes are
top_p_floor.py's.

- `_scan`: each chunk's maximum, its mass (relative to that maximum), its minimum, the largest logit each thread row
  of the tile saw, and the row's sample (every STRIDE-th logit).
- `_count_chunk` (the `_count` kernel, and top_p_floor.py's rounds after the first): the mass and count above the
  bracket's ends and its four thresholds, the total mass, and the bracket's smallest and largest logits.
- `_gather`: the logits of the final bracket, copied to the row's candidates at offsets fixed per chunk, so their
  order (and every sum over them) is the same from run to run.

A row's scratch (float32) holds, from ScratchLayout's offsets: the sample, the candidates, the row's STATE fields,
one PARTS-float record per chunk, and the scan's thread-row maxima.
"""
import triton
import triton.language as tl

PARTS: tl.constexpr = tl.constexpr(16)
# a chunk's record after a count: masses above hi, t1..t4, lo and in all; counts above hi, t1..t4, lo; the bracket's
# extremes; where the chunk's logits go among the candidates. After the scan: maximum, mass, minimum.
F_HI: tl.constexpr = tl.constexpr(0)
F_ALL: tl.constexpr = tl.constexpr(6)
C_HI: tl.constexpr = tl.constexpr(7)
LOWEST: tl.constexpr = tl.constexpr(13)
HIGHEST: tl.constexpr = tl.constexpr(14)
OFFSET: tl.constexpr = tl.constexpr(15)
# the row's state: its FLAG; the maximum; top_p times the total mass; the bracket (lo, hi], F(hi) (exact) and F(lo)
# (exact once counted); bounds on the bracket's values; the four thresholds of the first count (T1..T1 + 3); the
# final bracket's count; the rounds it took
FLAG: tl.constexpr = tl.constexpr(0)
TOP: tl.constexpr = tl.constexpr(1)
TARGET: tl.constexpr = tl.constexpr(2)
LO: tl.constexpr = tl.constexpr(3)
HI: tl.constexpr = tl.constexpr(4)
HI_MASS: tl.constexpr = tl.constexpr(5)
LO_MASS: tl.constexpr = tl.constexpr(6)
LOW: tl.constexpr = tl.constexpr(7)
HIGH: tl.constexpr = tl.constexpr(8)
T1: tl.constexpr = tl.constexpr(9)
COUNT: tl.constexpr = tl.constexpr(14)
ROUNDS: tl.constexpr = tl.constexpr(15)
STATE: tl.constexpr = tl.constexpr(16)
COUNTING: tl.constexpr = tl.constexpr(0)  # values of FLAG
DONE: tl.constexpr = tl.constexpr(1)
GATHER: tl.constexpr = tl.constexpr(2)


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """An int32 ordered as the float32 x (-0.0 as 0.0), without its low SHIFT bits."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) >> SHIFT


@triton.jit
def _value(full_key):
    bits = full_key.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _above(key, SHIFT: tl.constexpr):
    """The largest float32 with this key: x > _above(k) exactly when _key(x) > k."""
    return _value((key.to(tl.int32) << SHIFT) | ((1 << SHIFT) - 1))


@triton.jit
def _row(program, rows_ptr, temperatures_ptr, scratch_ptr, ROW: tl.constexpr):
    row = tl.load(rows_ptr + program)
    scale = 1.4426950408889634 / tl.maximum(tl.load(temperatures_ptr + row), 1e-5)  # log2(e) / T
    return row, scratch_ptr + program.to(tl.int64) * ROW, scale


@triton.jit
def _tile(start, logits, vocab, TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """TILE_R rows of TILE_C adjacent logits from `start` (-inf past the vocabulary), as float32."""
    rows_in_tile = start + tl.arange(0, TILE_R) * TILE_C
    index = rows_in_tile[:, None] + tl.arange(0, TILE_C)[None, :]
    return tl.load(logits + index, mask=index < vocab, other=float("-inf")).to(tl.float32), rows_in_tile


@triton.jit
def _scan(logits_ptr, row_stride, rows_ptr, temperatures_ptr, scratch_ptr, vocab, ROW: tl.constexpr,
          PART_AT: tl.constexpr, GROUPS_AT: tl.constexpr, STRIDE: tl.constexpr, CHUNK: tl.constexpr,
          TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    chunk = tl.program_id(1)
    row, scratch, scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    logits = logits_ptr + row * row_stride
    peak = tl.full([TILE_R], float("-inf"), tl.float32)
    mass = tl.zeros([TILE_R], tl.float32)  # relative to peak, per thread row
    least = tl.full([TILE_R], float("inf"), tl.float32)
    columns = tl.arange(0, TILE_C)[None, :]
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, TILE_R * TILE_C):
        x, first = _tile(start, logits, vocab, TILE_R, TILE_C)
        new_peak = tl.maximum(peak, tl.max(x, axis=1))
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        mass = mass * tl.exp2((peak - shift) * scale) + tl.sum(tl.exp2((x - shift[:, None]) * scale), axis=1)
        peak = new_peak
        least = tl.minimum(least, tl.min(tl.where(x > float("-inf"), x, float("inf")), axis=1))
        # the sample: the first logit of every STRIDE / TILE_C-th thread row (a 1-D store, not a scatter)
        tl.store(scratch + first // STRIDE, tl.max(tl.where(columns == 0, x, float("-inf")), axis=1),
                 mask=(first % STRIDE == 0) & (first < vocab))
    top = tl.max(peak, axis=0)
    part = scratch + PART_AT + chunk * PARTS
    tl.store(part, top)
    tl.store(part + 1, tl.sum(mass * tl.exp2((peak - tl.where(top == float("-inf"), 0.0, top)) * scale), axis=0))
    tl.store(part + 2, tl.min(least, axis=0))
    tl.store(scratch + GROUPS_AT + chunk * TILE_R + tl.arange(0, TILE_R), peak)


@triton.jit
def _tally(x, w, t, mass, count):
    # a 1.0-or-0.0 mask: the mass is then a fused multiply-add, and counts in float32 are exact (a chunk has fewer
    # than 2**24 logits) and cheaper than integer ones
    above = tl.where(x > t, 1.0, 0.0)
    return mass + tl.sum(w * above, axis=1), count + tl.sum(above, axis=1)


@triton.jit
def _count_chunk(logits, vocab, part, start, top, scale, hi, t1, t2, t3, t4, lo, CHUNK: tl.constexpr,
                 TILE_R: tl.constexpr, TILE_C: tl.constexpr, HAS_HI: tl.constexpr, EXTREMES: tl.constexpr):
    """Writes the chunk's record of a count (HAS_HI: count above hi too, else nothing is: hi is the maximum)."""
    zero = tl.zeros([TILE_R], tl.float32)
    f_hi, f1, f2, f3, f4, f_lo, f_all = zero, zero, zero, zero, zero, zero, zero
    c_hi, c1, c2, c3, c4, c_lo = zero, zero, zero, zero, zero, zero
    lowest = tl.full([TILE_R], float("inf"), tl.float32)
    highest = tl.full([TILE_R], float("-inf"), tl.float32)
    for tile_start in range(start, start + CHUNK, TILE_R * TILE_C):
        x, unused_rows = _tile(tile_start, logits, vocab, TILE_R, TILE_C)
        w = tl.exp2((x - top) * scale)
        if HAS_HI:
            f_hi, c_hi = _tally(x, w, hi, f_hi, c_hi)
        f1, c1 = _tally(x, w, t1, f1, c1)
        f2, c2 = _tally(x, w, t2, f2, c2)
        f3, c3 = _tally(x, w, t3, f3, c3)
        f4, c4 = _tally(x, w, t4, f4, c4)
        f_lo, c_lo = _tally(x, w, lo, f_lo, c_lo)
        f_all += tl.sum(w, axis=1)
        if EXTREMES:
            inside = (x > lo) & (x <= hi)
            lowest = tl.minimum(lowest, tl.min(tl.where(inside, x, float("inf")), axis=1))
            highest = tl.maximum(highest, tl.max(tl.where(inside, x, float("-inf")), axis=1))
    tl.store(part + F_HI, tl.sum(f_hi, axis=0))
    tl.store(part + F_HI + 1, tl.sum(f1, axis=0))
    tl.store(part + F_HI + 2, tl.sum(f2, axis=0))
    tl.store(part + F_HI + 3, tl.sum(f3, axis=0))
    tl.store(part + F_HI + 4, tl.sum(f4, axis=0))
    tl.store(part + F_HI + 5, tl.sum(f_lo, axis=0))
    tl.store(part + F_ALL, tl.sum(f_all, axis=0))
    tl.store(part + C_HI, tl.sum(c_hi, axis=0))
    tl.store(part + C_HI + 1, tl.sum(c1, axis=0))
    tl.store(part + C_HI + 2, tl.sum(c2, axis=0))
    tl.store(part + C_HI + 3, tl.sum(c3, axis=0))
    tl.store(part + C_HI + 4, tl.sum(c4, axis=0))
    tl.store(part + C_HI + 5, tl.sum(c_lo, axis=0))
    tl.store(part + LOWEST, tl.min(lowest, axis=0))
    tl.store(part + HIGHEST, tl.max(highest, axis=0))


@triton.jit
def _count(logits_ptr, row_stride, rows_ptr, temperatures_ptr, scratch_ptr, vocab, ROW: tl.constexpr,
           STATE_AT: tl.constexpr, PART_AT: tl.constexpr, CHUNK: tl.constexpr, TILE_R: tl.constexpr,
           TILE_C: tl.constexpr, HAS_HI: tl.constexpr):
    """A count of every row still counting, chunk by chunk (not HAS_HI: the first, whose hi is the maximum)."""
    chunk = tl.program_id(1)
    row, scratch, scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    state = scratch + STATE_AT
    if tl.load(state + FLAG) == COUNTING:
        _count_chunk(logits_ptr + row * row_stride, vocab, scratch + PART_AT + chunk * PARTS, chunk * CHUNK,
                     tl.load(state + TOP), scale, tl.load(state + HI), tl.load(state + T1), tl.load(state + T1 + 1),
                     tl.load(state + T1 + 2), tl.load(state + T1 + 3), tl.load(state + LO), CHUNK, TILE_R, TILE_C,
                     HAS_HI, EXTREMES=HAS_HI)


@triton.jit
def _gather(logits_ptr, row_stride, rows_ptr, temperatures_ptr, scratch_ptr, vocab, ROW: tl.constexpr,
            CANDIDATES_AT: tl.constexpr, STATE_AT: tl.constexpr, PART_AT: tl.constexpr, CHUNK: tl.constexpr,
            TILE_R: tl.constexpr, TILE_C: tl.constexpr):
    """Copies the logits in (lo, hi] of every row that has its bracket to its candidates, this chunk's from its
    OFFSET on, in the row's order."""
    chunk = tl.program_id(1)
    row, scratch, unused_scale = _row(tl.program_id(0), rows_ptr, temperatures_ptr, scratch_ptr, ROW)
    state = scratch + STATE_AT
    if tl.load(state + FLAG) == GATHER:
        lo, hi = tl.load(state + LO), tl.load(state + HI)
        logits = logits_ptr + row * row_stride
        copied = tl.load(scratch + PART_AT + chunk * PARTS + OFFSET).to(tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, TILE_R * TILE_C):
            x, unused_rows = _tile(start, logits, vocab, TILE_R, TILE_C)
            chosen = ((x > lo) & (x <= hi)).to(tl.int32)
            per_row = tl.sum(chosen, axis=1)
            position = copied + (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(chosen, axis=1) - 1
            tl.store(scratch + CANDIDATES_AT + position, x, mask=chosen != 0)
            copied += tl.sum(per_row, axis=0)
