"""top-k, top-p and min-p as one logit floor per row.

Each filter keeps exactly the tokens whose logit is at or above some value, so the sampler needs one number per
row rather than a filtered copy of the logits (layers/gumbel_max.py draws above it). The definitions, applied in
this order, each to what the one before left (vLLM's order):

- top-k keeps the tokens at least as likely as the k-th most likely (a tie with the k-th stays in);
- top-p keeps a token when the tokens strictly more likely than it hold less than top_p of the probability
  (tied tokens share the decision, whatever order a sort would give them);
- min-p keeps the tokens at least min_p times as likely as the most likely.

A row with top-k needs only its k largest logits (`topk`, no sort of the vocabulary). A row with top-p and no top-k
has no such bound: its floor comes from a sort of its whole row, the one exact path that costs a sort.
"""
import torch


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
                 unbounded_top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the smallest logit the filters keep (float32, -inf where no filter applies).

    top_k: int64, 0 = off; top_p: float32, 1 = off; min_p: float32, 0 = off (None: off for every row).
    candidates: the largest top_k of the batch (1 when none: min-p needs only the maximum).
    unbounded_top_p: int64 indices of the rows with top-p and no top-k."""
    rows, vocab = logits.shape
    num_candidates = max(1, min(candidates, vocab))
    values = logits.topk(num_candidates, dim=-1).values.float()  # descending
    tempered = temperatures.clamp_min(1e-5).unsqueeze(1)
    floors = torch.full((rows,), float("-inf"), device=logits.device)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, num_candidates).clamp(max=num_candidates)
        kth = values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        floors = torch.where(top_k > 0, kth, floors)
        if top_p is not None:
            in_top_k = torch.arange(num_candidates, device=logits.device).unsqueeze(0) < k.unsqueeze(1)
            scaled = (values / tempered).masked_fill(~in_top_k, float("-inf"))
            # tokens tied with the k-th but past it in topk's order are kept by top-k: their mass counts
            tied_beyond = ((logits >= kth.unsqueeze(1).to(logits.dtype)).sum(dim=-1) - k).clamp_min(0)
            kth_weight = ((kth - values[:, 0]) / tempered.squeeze(1)).exp()
            bounded = (top_k > 0) & (top_p < 1.0)
            floors = torch.where(bounded, torch.maximum(floors, _top_p_floor(values, scaled, top_p,
                                                                             tied_beyond * kth_weight)), floors)
    if unbounded_top_p is not None and unbounded_top_p.numel():
        whole = logits.index_select(0, unbounded_top_p).float().sort(dim=-1, descending=True).values
        sub_floors = _top_p_floor(whole, whole / tempered.index_select(0, unbounded_top_p),
                                  top_p.index_select(0, unbounded_top_p))
        floors = floors.index_copy(0, unbounded_top_p,
                                   torch.maximum(floors.index_select(0, unbounded_top_p), sub_floors))
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  x_i >= x_max + T * ln(min_p); min_p = 0 gives -inf
        floors = torch.maximum(floors, values[:, 0] + tempered.squeeze(1) * min_p.log())
    # greedy rows take the argmax, which every floor keeps; a floor there could only be a NaN from T = 0
    return torch.where(temperatures > 0, floors, float("-inf"))
