"""The per-row steps of top-p's search for its floor (sampling/top_p_floor.py): where to evaluate F next, and what a
count of F says about the bracket."""
import triton
import triton.language as tl

from nanovllm.sampling import top_p_passes as passes
from nanovllm.sampling.top_p_passes import _above, _key


@triton.jit
def _smallest_key(keys, weights, base, target, lo, hi, SHIFT: tl.constexpr):
    """The smallest int64 k in (lo, hi] with base + sum(weights[keys > k]) < target (hi must be one); lo and hi are
    keys of SHIFT (spanning at most 2**(32 - SHIFT)).

    A fixed number of halvings rather than `while hi - lo > 1`: on the GPU a bisection whose trip count depends on
    the data stalled the program for good on some rows of a random model's logits (never in the interpreter)."""
    for _ in range(33 - SHIFT):
        mid = lo + (hi - lo) // 2
        below = base + tl.sum(tl.where(keys > mid, weights, 0.0), axis=0) < target
        halving = hi - lo > 1
        hi = tl.where(halving & below, mid, hi)
        lo = tl.where(halving & (below == 0), mid, lo)
    return hi


@triton.jit
def _threshold(keys, weights, total, fraction, use_sample, lo, hi, low, high, rounds, PART: tl.constexpr,
               SHIFT: tl.constexpr):
    """Where the sample puts F at `fraction` of the bracket's mass when it can tell, else PART fifths up the
    bracket: of its values in the first rounds, then of its keys. A threshold is the largest value of its key, so
    that the last step's keys agree with it, and at most hi: one above it would count logits the copy leaves out."""
    sampled = _above(_smallest_key(keys, weights, 0.0, total * fraction, _key(lo, 16).to(tl.int64),
                                   _key(hi, 16).to(tl.int64), 16), 16)
    a, b = tl.maximum(lo, low), tl.minimum(hi, high)
    by_value = _above(_key(a + (b - a) * (PART / 5), SHIFT), SHIFT)
    key_lo = tl.maximum(_key(lo, SHIFT), _key(low, SHIFT) - 1).to(tl.int64)
    key_hi = tl.minimum(_key(hi, SHIFT), _key(high, SHIFT)).to(tl.int64)
    by_key = _above(key_lo + (key_hi - key_lo) * PART // 5, SHIFT)
    even = tl.minimum(tl.where(rounds < 4, by_value, by_key), hi)
    usable = use_sample & (fraction > 0.0) & (fraction < 1.0) & (sampled > lo) & (sampled < hi)
    return tl.where(usable, sampled, even)


@triton.jit
def _thresholds(sample, n_sample, top, scale, lo, hi, hi_mass, lo_mass, target, low, high, rounds,
                NS: tl.constexpr, MIN_SAMPLE: tl.constexpr, SHIFT: tl.constexpr):
    """Four thresholds for the bracket (lo, hi], descending: where the sample puts F's crossing of the target,
    give or take one and three of its standard errors (in the first two rounds, when it can tell)."""
    offsets = tl.arange(0, NS)
    s = tl.load(sample + offsets, mask=offsets < n_sample, other=float("-inf"))
    in_bracket = (s > lo) & (s <= hi)
    ws = tl.where(in_bracket, tl.exp2((s - top) * scale), 0.0)
    total = tl.sum(ws, axis=0)
    tau = tl.minimum(tl.maximum((target - hi_mass) / tl.maximum(lo_mass - hi_mass, 1e-30), 0.0), 1.0)
    keys = _key(s, 16)
    # the standard error of the sample's share of the bracket's mass above its crossing
    middle = _smallest_key(keys, ws, 0.0, total * tau, _key(lo, 16).to(tl.int64), _key(hi, 16).to(tl.int64), 16)
    spread = ws * ((keys > middle).to(tl.float32) - tau)
    se = tl.sqrt(tl.sum(spread * spread, axis=0)) / tl.maximum(total, 1e-30)
    use_sample = (tl.sum(in_bracket.to(tl.int32), axis=0) >= MIN_SAMPLE) & (rounds < 2) & (se < 0.2)
    t1 = _threshold(keys, ws, total, tau - 3.0 * se, use_sample, lo, hi, low, high, rounds, 4, SHIFT)
    t2 = _threshold(keys, ws, total, tau - se, use_sample, lo, hi, low, high, rounds, 3, SHIFT)
    t3 = _threshold(keys, ws, total, tau + se, use_sample, lo, hi, low, high, rounds, 2, SHIFT)
    t4 = _threshold(keys, ws, total, tau + 3.0 * se, use_sample, lo, hi, low, high, rounds, 1, SHIFT)
    t1, t2 = tl.maximum(t1, t2), tl.minimum(t1, t2)
    t3, t4 = tl.maximum(t3, t4), tl.minimum(t3, t4)
    t1, t3 = tl.maximum(t1, t3), tl.minimum(t1, t3)
    t2, t4 = tl.maximum(t2, t4), tl.minimum(t2, t4)
    t2, t3 = tl.maximum(t2, t3), tl.minimum(t2, t3)
    return t1, t2, t3, t4


@triton.jit
def _pick(index, v0, v1, v2, v3, v4, v5, v6, v7):
    return tl.where(index == 0, v0, tl.where(index == 1, v1, tl.where(index == 2, v2, tl.where(index == 3, v3, tl.where(
        index == 4, v4, tl.where(index == 5, v5, tl.where(index == 6, v6, v7)))))))


@triton.jit
def _settle(parts, counted, top, hi, t1, t2, t3, t4, lo, target, floor, low, high, C: tl.constexpr):
    """The bracket after a count (the chunk records at `parts`) of the bracket (lo, hi] at t1..t4: the piece above
    the first of the points hi > t1 > ... > t4 > lo > -inf where F reaches the target (top, above them all, has
    F = 0). Returns (flag, lo, hi, F(lo), F(hi), bounds on its values, floor, its count, j: the point's index
    counting top as 0; the count above point p >= 1 is record field C_HI + p - 1)."""
    f_hi = tl.sum(tl.load(parts + passes.F_HI, mask=counted, other=0.0), axis=0)
    m1 = tl.sum(tl.load(parts + passes.F_HI + 1, mask=counted, other=0.0), axis=0)
    m2 = tl.sum(tl.load(parts + passes.F_HI + 2, mask=counted, other=0.0), axis=0)
    m3 = tl.sum(tl.load(parts + passes.F_HI + 3, mask=counted, other=0.0), axis=0)
    m4 = tl.sum(tl.load(parts + passes.F_HI + 4, mask=counted, other=0.0), axis=0)
    m_lo = tl.sum(tl.load(parts + passes.F_HI + 5, mask=counted, other=0.0), axis=0)
    everything = tl.sum(tl.load(parts + passes.F_ALL, mask=counted, other=0.0), axis=0)
    j = tl.where(f_hi >= target, 1, tl.where(m1 >= target, 2, tl.where(m2 >= target, 3, tl.where(
        m3 >= target, 4, tl.where(m4 >= target, 5, tl.where(m_lo >= target, 6, 7))))))
    above_lo = tl.load(parts + passes.C_HI + j - 1, mask=tl.where(j < 7, counted, False), other=0.0)
    above_hi = tl.load(parts + passes.C_HI + tl.maximum(j - 2, 0), mask=tl.where(j > 1, counted, False), other=0.0)
    count = (tl.sum(above_lo, axis=0) - tl.sum(above_hi, axis=0)).to(tl.int32)
    new_hi = _pick(j - 1, top, hi, t1, t2, t3, t4, lo, lo)
    new_hi_mass = _pick(j - 1, 0.0, f_hi, m1, m2, m3, m4, m_lo, m_lo)
    new_lo = _pick(j, top, hi, t1, t2, t3, t4, lo, float("-inf"))
    new_lo_mass = _pick(j, 0.0, f_hi, m1, m2, m3, m4, m_lo, everything)
    # the extremes are those of the bracket counted (when the count kept them): one value there is the floor
    lowest = tl.min(tl.load(parts + passes.LOWEST, mask=counted, other=float("inf")), axis=0)
    highest = tl.max(tl.load(parts + passes.HIGHEST, mask=counted, other=float("-inf")), axis=0)
    bracketed = (j > 1) & (j < 7) & (lowest <= highest)
    single = bracketed & (lowest == highest)
    flag = tl.where(single, passes.DONE, tl.where((j < 7) & (count <= C), passes.GATHER, passes.COUNTING))
    return (flag, new_lo, new_hi, new_lo_mass, new_hi_mass, tl.where(bracketed, lowest, low),
            tl.where(bracketed, highest, high), tl.where(single, tl.maximum(floor, lowest), floor), count, j)


@triton.jit
def _chunk_offsets(parts, counted, j):
    """Where each chunk's logits of the final bracket go among the candidates: after the earlier chunks'."""
    above_lo = tl.load(parts + passes.C_HI + j - 1, mask=counted, other=0.0)
    above_hi = tl.load(parts + passes.C_HI + tl.maximum(j - 2, 0), mask=tl.where(j > 1, counted, False), other=0.0)
    per_chunk = above_lo - above_hi
    tl.store(parts + passes.OFFSET, tl.cumsum(per_chunk, axis=0) - per_chunk, mask=counted)
