from collections.abc import Sequence as Rows
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.gumbel_max import gumbel_max_sample
from nanovllm.layers.penalties import PenaltyHistories, PenaltyTensors, has_penalties
from nanovllm.outputs import Logprob
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.device import to_device


@dataclass
class SamplingTensors:
    """Per-row sampling settings on the logits' device. Optional parts are None when no row uses them,
    so the common case (temperature only) skips the sort that top-k/top-p need."""

    temperatures: torch.Tensor
    top_k: torch.Tensor | None = None  # 0 = off
    top_p: torch.Tensor | None = None  # 1 = off
    min_p: torch.Tensor | None = None  # 0 = off
    seeds: list[tuple[int, int]] | None = None  # (row, seed for this row at this step)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked out (min_tokens)
    num_logprobs: int | None = None  # the largest k any row asked for (0: just the sampled token's)
    logprobs_per_row: list[int | None] | None = None  # each row's own k (None: num_logprobs for every row)
    penalties: PenaltyTensors | None = None  # applied to the logits first

    @property
    def temperature_only(self) -> bool:
        return (self.top_k is None and self.top_p is None and self.min_p is None and not self.seeds
                and self.banned is None and self.num_logprobs is None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # on the logits' device: the caller decides when to wait for it
    # per row: the top k then the sampled token (None for a row that asked for none)
    logprobs: list[dict[int, Logprob] | None] | None = None


def gumbel_max_torch(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    # Gumbel-max: argmax(logits / T - log E) with E ~ Exp(1) is a draw from softmax(logits / T). Unlike the
    # softmax-then-divide form it needs no normalisation (which does not move the argmax); temperature 0
    # rows take the plain argmax in the same pass. On the GPU, layers/gumbel_max.py does this in one kernel.
    logits = logits.float()
    log_noise = torch.empty_like(logits).exponential_(1).clamp_min_(1e-10).log()
    temperatures = temperatures.unsqueeze(1)
    scores = torch.where(temperatures == 0, logits, logits / temperatures.clamp_min(1e-5) - log_noise)
    return scores.argmax(dim=-1)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                  min_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf what top-k, then top-p, then min-p remove from already temperature-scaled logits."""
    if top_k is not None or top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if top_k is not None:
            k = torch.where(top_k > 0, top_k, logits.size(-1)).clamp(max=logits.size(-1))
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the more likely ones before it already reach top_p (the first always stays)
            before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(before >= top_p.unsqueeze(1), float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values,
                                    float("-inf"))
    return logits


def samples_with_temperature_only(params: SamplingParams) -> bool:
    """Whether temperature is all the sampler must apply for these params (the fused kernel's case)."""
    return (params.top_k <= 0 and params.top_p == 1.0 and params.min_p == 0.0 and params.min_tokens == 0
            and (params.seed is None or params.temperature == 0) and params.logprobs is None)


def _row_logprobs(k: int | None, top_ids: list[int], top_values: list[float], token: int, value: float,
                  rank: int) -> dict[int, Logprob] | None:
    if k is None:
        return None
    entry = {i: Logprob(v, r) for r, (i, v) in enumerate(zip(top_ids[:k], top_values[:k]), 1)}
    entry[token] = Logprob(value, rank)  # the sampled token last, unless it is one of the top k
    return entry


class Sampler(nn.Module):
    """One token per row: argmax where temperature is 0, else a draw from the filtered, tempered distribution.

    It owns sampling policy: `prepare` turns a batch's requests into SamplingTensors, `forward` samples."""

    def __init__(self, eos_token_ids: Rows[int] = (), device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.generator: torch.Generator | None = None
        self.counters: torch.Tensor | None = None  # scratch for the Triton kernel, which leaves it at zero
        self.penalty_histories = PenaltyHistories(device)

    def prepare(self, seqs: list[Sequence], fed_token_ids: torch.Tensor | None = None) -> SamplingTensors:
        """fed_token_ids: a decode step's input ids on the device (the tokens the penalties count last)."""
        params = [seq.params for seq in seqs]
        as_tensor = lambda values, dtype: to_device(np.array(values, dtype=dtype), self.device)  # noqa: E731
        tensors = SamplingTensors(as_tensor([p.temperature for p in params], np.float32))
        if any(map(has_penalties, params)):
            tensors.penalties = self.penalty_histories.tensors(seqs, fed_token_ids)
        if all(map(samples_with_temperature_only, params)):  # the per-step common case
            return tensors
        if any(p.top_k > 0 for p in params):
            tensors.top_k = as_tensor([max(p.top_k, 0) for p in params], np.int64)
        if any(p.top_p < 1.0 for p in params):
            tensors.top_p = as_tensor([p.top_p for p in params], np.float32)
        if any(p.min_p > 0.0 for p in params):
            tensors.min_p = as_tensor([p.min_p for p in params], np.float32)
        # the step's seed mixes in how many tokens the request has so far, so a replay after preemption matches
        tensors.seeds = [(i, (p.seed * 1_000_003 + seq.num_completion_tokens) % (1 << 63))
                         for i, (p, seq) in enumerate(zip(params, seqs)) if p.seed is not None and p.temperature]
        banned = [(i, t) for i, (p, seq) in enumerate(zip(params, seqs)) if seq.num_completion_tokens < p.min_tokens
                  for t in (*p.stop_token_ids, *self.eos_token_ids)]
        if banned:
            rows, ids = zip(*banned)
            tensors.banned = (as_tensor(rows, np.int64), as_tensor(ids, np.int64))
        tensors.logprobs_per_row = [p.logprobs for p in params]
        wanted = [k for k in tensors.logprobs_per_row if k is not None]
        tensors.num_logprobs = max(wanted) if wanted else None
        return tensors

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        model_logits = logits
        if params.penalties is not None:
            logits = params.penalties.apply(logits)
        if params.temperature_only:  # the common case: one fused kernel
            return SamplerOutput(self._sample_plain(logits, params.temperatures))
        logits = logits.float().clone() if params.banned is not None else logits.float()
        if params.banned is not None:
            logits[params.banned] = float("-inf")
        tokens = self._sample(logits, params)
        logprobs = None
        if params.num_logprobs is not None:
            # logprobs of the model's own distribution, as vLLM reports them by default: before penalties,
            # min_tokens masking, temperature and filters
            all_logprobs = model_logits.float().log_softmax(dim=-1)
            top = all_logprobs.topk(params.num_logprobs, dim=-1)
            chosen = all_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
            chosen_rank = (all_logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
            # the batch computed the largest k any row asked for; each row keeps its own k and its token
            per_row = params.logprobs_per_row or [params.num_logprobs] * logits.size(0)
            logprobs = [_row_logprobs(*row) for row in zip(per_row, top.indices.tolist(), top.values.tolist(),
                                                            tokens.tolist(), chosen.tolist(), chosen_rank.tolist())]
        return SamplerOutput(tokens, logprobs)

    def _sample_plain(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        if not logits.is_cuda:
            return gumbel_max_torch(logits, temperatures)
        if self.counters is None or self.counters.numel() < logits.size(0) or self.counters.device != logits.device:
            self.counters = torch.zeros(max(512, logits.size(0)), dtype=torch.int32, device=logits.device)
        # a fresh stream per step, drawn from torch's generator so torch.manual_seed makes runs repeatable
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        return gumbel_max_sample(logits, temperatures, seed, self.counters)

    def _sample(self, logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
        temperatures = params.temperatures
        scaled = filter_logits(logits / temperatures.clamp_min(1e-5).unsqueeze(1), params.top_k, params.top_p,
                               params.min_p)
        noise = torch.empty_like(scaled).exponential_(1)
        if params.seeds:
            # a seeded row draws from its own stream, so the batch around it cannot change its tokens
            if self.generator is None or self.generator.device != logits.device:
                self.generator = torch.Generator(logits.device)
            for row, seed in params.seeds:
                self.generator.manual_seed(seed)
                noise[row].exponential_(1, generator=self.generator)
        sampled = (scaled - noise.clamp_min_(1e-10).log()).argmax(dim=-1)  # Gumbel-max, as gumbel_max_torch
        greedy = logits.argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
