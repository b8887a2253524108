"""top-k, top-p and min-p as one logit floor per row.

Each filter keeps exactly the tokens whose logit is at or above some value, so the sampler needs one number per
row rather than a filtered copy of the logits (sampling/gumbel_max.py draws above it). The definitions, applied in
this order, each to what the one before left (vLLM's order):

- top-k keeps the tokens at least as likely as the k-th most likely (a tie with the k-th stays in);
- top-p keeps a token when the tokens strictly more likely than it hold less than top_p of the probability
  (tied tokens share the decision, whatever order a sort would give them);
- min-p keeps the tokens at least min_p times as likely as the most likely.

A row with top-k needs only its k largest logits, and those lie in the k chunks of the row with the largest maxima:
so the GPU finds them among k * 128 logits (`largest_logits`), not among the whole vocabulary. A row with top-p and
no top-k has no such bound: its floor comes from a sort of its whole row, the one exact path that costs a sort.
"""
import torch
import triton
import triton.language as tl

CHUNK = 128  # logits per chunk when the k largest are looked for chunk-wise


@triton.jit
def _chunk_maxima(logits_ptr, maxima_ptr, num_chunks, row_stride, CHUNK: tl.constexpr, GROUP: tl.constexpr):
    """maxima[row, c] = the largest logit of chunk c of the row (GROUP chunks a program)."""
    row = tl.program_id(0)
    chunks = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    index = chunks[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + index, mask=chunks[:, None] < num_chunks,
                other=float("-inf"))
    tl.store(maxima_ptr + row * num_chunks + chunks, tl.max(x, 1), mask=chunks < num_chunks)


@triton.jit
def _recount(logits_ptr, floors_ptr, recount_ptr, counts_ptr, vocab, row_stride, BLOCK: tl.constexpr):
    """counts[row] += how many logits of this block of the row are at least floors[row], for marked rows only."""
    row = tl.program_id(0)
    if tl.load(recount_ptr + row) != 0:
        index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + index, mask=index < vocab, other=float("-inf"))
        tl.atomic_add(counts_ptr + row, tl.sum((x.to(tl.float32) >= tl.load(floors_ptr + row)).to(tl.int32), 0))


@triton.jit
def _floors(values_ptr, counts_ptr, temperatures_ptr, top_k_ptr, top_p_ptr, min_p_ptr, floors_ptr, num_values,
            KP: tl.constexpr, HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr):
    """logit_floors' arithmetic on the k largest logits, one program a row (the torch version is 30-odd launches)."""
    row = tl.program_id(0)
    offs = tl.arange(0, KP)
    values = tl.load(values_ptr + row * num_values + offs, mask=offs < num_values, other=float("-inf"))
    temperature = tl.load(temperatures_ptr + row)
    tempered = tl.maximum(temperature, 1e-5)
    largest = tl.max(values, 0)
    floor = tl.full([], float("-inf"), tl.float32)
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + row)
        k = tl.where(top_k > 0, tl.minimum(top_k, num_values), num_values).to(tl.int32)
        kth = tl.sum(tl.where(offs == k - 1, values, 0.0), 0)
        floor = tl.where(top_k > 0, kth, floor)
        if HAS_TOP_P:
            top_p = tl.load(top_p_ptr + row)
            weights = tl.where(offs < k, tl.exp((values - largest) / tempered), 0.0)
            # the mass strictly before each position, as an inclusive sum of the weights shifted by one
            previous = tl.load(values_ptr + row * num_values + offs - 1, mask=(offs >= 1) & (offs - 1 < num_values),
                               other=float("-inf"))
            before = tl.cumsum(tl.where((offs >= 1) & (offs - 1 < k), tl.exp((previous - largest) / tempered), 0.0), 0)
            ties = tl.maximum(tl.load(counts_ptr + row) - k, 0).to(tl.float32)
            total = tl.sum(weights, 0) + ties * tl.exp((kth - largest) / tempered)
            kept = (before < top_p * total) & (offs < k)
            last = tl.maximum(tl.sum(kept.to(tl.int32), 0) - 1, 0)
            top_p_floor = tl.sum(tl.where(offs == last, values, 0.0), 0)
            floor = tl.where((top_k > 0) & (top_p < 1.0), tl.maximum(floor, top_p_floor), floor)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        min_p_floor = largest + tempered * tl.log(tl.maximum(min_p, 1e-30))
        floor = tl.maximum(floor, tl.where(min_p > 0, min_p_floor, float("-inf")))
    tl.store(floors_ptr + row, tl.where(temperature > 0, floor, float("-inf")))


class LargestLogits:
    """The k largest logits of each row, float32 and descending, and how to count a row's logits at or above a
    value among them (ties past the k-th included)."""

    def __init__(self, logits: torch.Tensor, k: int, chunked: bool) -> None:
        rows, vocab = logits.shape
        self.logits, self.k = logits, k
        self.maxima = None
        self.pool = logits  # where every logit at or above the k-th largest is
        if chunked and k > 1 and vocab % CHUNK == 0 and vocab // CHUNK > k:
            num_chunks = vocab // CHUNK
            chunks = logits.view(rows, num_chunks, CHUNK)
            self.maxima = torch.empty(rows, num_chunks, dtype=logits.dtype, device=logits.device)
            group = 16
            _chunk_maxima[(rows, triton.cdiv(num_chunks, group))](logits, self.maxima, num_chunks, logits.stride(0),
                                                                   CHUNK=CHUNK, GROUP=group)
            # every one of the k largest logits is in a chunk whose maximum is among the k largest maxima
            best = self.maxima.topk(k, dim=-1).indices
            self.pool = chunks.gather(1, best.unsqueeze(2).expand(rows, k, CHUNK)).view(rows, k * CHUNK)
        self.values = (self.pool.amax(dim=-1, keepdim=True) if k == 1 else self.pool.topk(k, dim=-1).values).float()

    def count_at_least(self, floors: torch.Tensor) -> torch.Tensor:
        """Per row, how many of its logits are >= floors (each at most the row's k-th largest)."""
        counts = (self.pool >= floors.unsqueeze(1).to(self.pool.dtype)).sum(dim=-1, dtype=torch.int32)
        if self.maxima is None:
            return counts
        # a chunk left out of the pool holds such a logit only when its maximum ties with the pool's smallest
        # maximum: then that row is counted over its whole vocabulary (rare: exact ties of bf16 maxima)
        recount = (self.maxima >= floors.unsqueeze(1).to(self.maxima.dtype)).sum(dim=-1) > self.k
        rows, vocab = self.logits.shape
        whole = torch.zeros_like(counts)
        block = 4096
        _recount[(rows, triton.cdiv(vocab, block))](self.logits, floors.contiguous(), recount.to(torch.int32), whole,
                                                    vocab, self.logits.stride(0), BLOCK=block)
        return torch.where(recount, whole, counts)


def _top_p_floor(values: torch.Tensor, scaled: torch.Tensor, top_p: torch.Tensor,
                 extra_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The floor top-p sets over descending `values` (their tempered `scaled`, -inf past the candidates).
    `extra_weight`: probability mass (relative to the first) of kept tokens that are not among the candidates."""
    weights = (scaled - scaled[:, :1]).exp()
    total = weights.sum(dim=-1)
    if extra_weight is not None:
        total = total + extra_weight
    # the mass strictly before each position (an exclusive sum, so non-decreasing: the kept positions are a prefix)
    before = torch.cat([torch.zeros_like(total).unsqueeze(1), weights.cumsum(dim=-1)[:, :-1]], dim=1)
    kept = (before < top_p.unsqueeze(1) * total.unsqueeze(1)) & torch.isfinite(scaled)
    last = (kept.sum(dim=-1) - 1).clamp_min(0)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


def logit_floors(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None, min_p: torch.Tensor | None, candidates: int,
                 unbounded_top_p: torch.Tensor | None = None, fused: bool | None = None) -> torch.Tensor:
    """Per row, the smallest logit the filters keep (float32, -inf where no filter applies).

    top_k: int64, 0 = off; top_p: float32, 1 = off; min_p: float32, 0 = off (None: off for every row).
    candidates: the largest top_k of the batch (1 when none: min-p needs only the maximum).
    unbounded_top_p: int64 indices of the rows with top-p and no top-k.
    fused: the chunk-wise candidates and one Triton kernel for the arithmetic (default: on a GPU), or torch ops."""
    rows, vocab = logits.shape
    num_candidates = max(1, min(candidates, vocab))
    largest = LargestLogits(logits, num_candidates, chunked=logits.is_cuda if fused is None else fused)
    values = largest.values
    tempered = temperatures.clamp_min(1e-5).unsqueeze(1)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, num_candidates).clamp(max=num_candidates)
        kth = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        # tokens tied with the k-th but past it in the candidates' order are kept by top-k: their mass counts
        at_least_kth = largest.count_at_least(kth) if top_p is not None else None
    if logits.is_cuda if fused is None else fused:
        floors = torch.empty(rows, dtype=torch.float32, device=logits.device)
        _floors[(rows,)](values, at_least_kth if top_k is not None and top_p is not None else floors, temperatures,
                         temperatures if top_k is None else top_k, temperatures if top_p is None else top_p,
                         temperatures if min_p is None else min_p, floors, num_candidates,
                         KP=triton.next_power_of_2(num_candidates), HAS_TOP_K=top_k is not None,
                         HAS_TOP_P=top_p is not None, HAS_MIN_P=min_p is not None)
    else:
        floors = torch.full((rows,), float("-inf"), device=logits.device)
        if top_k is not None:
            floors = torch.where(top_k > 0, kth, floors)
            if top_p is not None:
                in_top_k = torch.arange(num_candidates, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
                scaled = (values / tempered).masked_fill(~in_top_k, float("-inf"))
                kth_weight = ((kth - values[:, 0]) / tempered.squeeze(1)).exp()
                top_p_floor = _top_p_floor(values, scaled, top_p, (at_least_kth - k).clamp_min(0) * kth_weight)
                floors = torch.where((top_k > 0) & (top_p < 1.0), torch.maximum(floors, top_p_floor), floors)
        if min_p is not None:
            # p_i >= min_p * p_max  <=>  x_i >= x_max + T * ln(min_p); min_p = 0 gives -inf
            floors = torch.maximum(floors, values[:, 0] + tempered.squeeze(1) * min_p.log())
        # greedy rows take the argmax, which every floor keeps; a floor there could only be a NaN from T = 0
        floors = torch.where(temperatures > 0, floors, float("-inf"))
    if unbounded_top_p is not None and unbounded_top_p.numel():
        whole = logits.index_select(0, unbounded_top_p).float().sort(dim=-1, descending=True).values
        sub_floors = _top_p_floor(whole, whole / tempered.index_select(0, unbounded_top_p),
                                  top_p.index_select(0, unbounded_top_p))
        floors = floors.index_copy(0, unbounded_top_p,
                                   torch.maximum(floors.index_select(0, unbounded_top_p), sub_floors))
    return floors
