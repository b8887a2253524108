from collections.abc import Sequence as Rows
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.outputs import Logprob
from nanovllm.sampling.bad_words import BadWordsMask, bad_words_mask
from nanovllm.sampling.floors import logit_floors
from nanovllm.sampling.grammar_mask import GrammarMasks
from nanovllm.sampling.gumbel_max import gumbel_max_sample
from nanovllm.sampling.mask_kernel import StepMask
from nanovllm.sampling.penalties import PenaltyHistories, PenaltyTensors, has_penalties
from nanovllm.sampling.rows import SamplingRow, aligned_rows
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.device import to_device


@dataclass
class SamplingTensors:
    """Per-row sampling settings on the logits' device. Optional parts are None when no row uses them, so the
    common case (temperature only) is one kernel over the logits."""

    temperatures: torch.Tensor
    top_k: torch.Tensor | None = None  # int64, 0 = off
    top_p: torch.Tensor | None = None  # 1 = off
    min_p: torch.Tensor | None = None  # 0 = off
    candidates: int = 1  # the largest top_k: how many of each row's largest logits the filters read
    unbounded_top_p: torch.Tensor | None = None  # rows with top-p and no top-k (their floor needs the whole row)
    row_seeds: torch.Tensor | None = None  # int64 per row: its own stream's key at this step, -1 = the step's
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids) masked out (min_tokens)
    num_logprobs: int | None = None  # the largest k any row asked for (0: just the sampled token's)
    logprobs_per_row: list[int | None] | None = None  # each row's own k (None: num_logprobs for every row)
    penalties: PenaltyTensors | None = None  # applied to the logits first
    bad_words: BadWordsMask | None = None  # applied after the penalties (sampling/bad_words.py)
    grammar: StepMask | None = None  # structured outputs: applied before anything else, in place

    @property
    def filtered(self) -> bool:
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def temperature_only(self) -> bool:
        return (not self.filtered and self.row_seeds is None and self.banned is None
                and self.num_logprobs is None)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # on the logits' device: the caller decides when to wait for it
    # per row: the top k then the sampled token (None for a row that asked for none)
    logprobs: list[dict[int, Logprob] | None] | None = None


def gumbel_max_torch(logits: torch.Tensor, temperatures: torch.Tensor, floors: torch.Tensor | None = None,
                     row_seeds: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """sampling/gumbel_max.py's draw in torch ops (the CPU path): argmax(logits / T - log E) with E ~ Exp(1) over the
    logits at or above each row's floor is a draw from their softmax; temperature 0 rows take the plain argmax.
    A row with a seed (row_seeds >= 0) draws its noise from a generator keyed by it alone."""
    logits = logits.float()
    if floors is not None:
        logits = logits.masked_fill(logits < floors.unsqueeze(1), float("-inf"))
    noise = torch.empty_like(logits).exponential_(1, generator=generator)
    if row_seeds is not None:
        for row, key in enumerate(row_seeds.tolist()):
            if key >= 0:
                noise[row].exponential_(1, generator=torch.Generator(logits.device).manual_seed(key))
    temperatures = temperatures.unsqueeze(1)
    scores = torch.where(temperatures == 0, logits,
                         logits / temperatures.clamp_min(1e-5) - noise.clamp_min_(1e-10).log())
    return scores.argmax(dim=-1)


def step_keys(seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """A seeded row's key at each step: a hash (splitmix64's mixer) of the request's seed and how many tokens it has
    generated, so a replay after preemption draws the same noise. Non-negative: -1 marks an unseeded row."""
    z = seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + steps.astype(np.uint64) + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) >> np.uint64(1)).astype(np.int64)


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

    def __init__(self, eos_token_ids: Rows[int] = (), device: torch.device = torch.device("cpu"),
                 seed: int | None = None, max_rows: int = 256) -> None:
        """max_rows: the most rows a step has (the engine's max_num_seqs)."""
        super().__init__()
        # the engine's own stream for rows without a seed: other engines and user code in the process neither
        # draw from it nor reseed it (a host generator: the GPU path draws one key per step from it)
        self.generator = torch.Generator()
        self.reseed(seed)
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = device
        self.counters: torch.Tensor | None = None  # scratch for the Triton kernel, which leaves it at zero
        self.penalty_histories = PenaltyHistories(device)
        self.top_p_by_sort = False  # top-p without top-k by a sort of the row, not the GPU's search (A/B runs)
        self.max_rows = max_rows
        self.grammar_masks: GrammarMasks | None = None  # made at the first constrained step

    def reseed(self, seed: int | None) -> None:
        """Restart the stream: from `seed`, or from fresh entropy when None."""
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def prepare(self, seqs: list[SamplingRow], fed_token_ids: torch.Tensor | None = None) -> SamplingTensors:
        """fed_token_ids: a decode step's input ids on the device (the tokens the penalties count last)."""
        params = [seq.params for seq in seqs]
        as_tensor = lambda values, dtype: to_device(np.array(values, dtype=dtype), self.device)  # noqa: E731
        temperatures = [p.temperature for p in params]
        penalties = self.penalty_histories.tensors(seqs, fed_token_ids) if any(map(has_penalties, params)) else None
        bad_words = bad_words_mask(seqs, fed_token_ids, self.device)
        if all(map(samples_with_temperature_only, params)):  # the per-step common case
            return SamplingTensors(as_tensor(temperatures, np.float32), penalties=penalties, bad_words=bad_words)
        # one transfer for the float settings and one for the integer ones
        floats = as_tensor(aligned_rows([temperatures, [p.top_p for p in params], [p.min_p for p in params]],
                                        np.float32), np.float32)[:, :len(seqs)]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        seeded = [(i, p.seed, seq.num_completion_tokens) for i, (p, seq) in enumerate(zip(params, seqs))
                  if p.seed is not None and p.temperature]
        keys = np.full(len(seqs), -1, dtype=np.int64)
        if seeded:
            rows, seeds, steps = zip(*seeded)
            keys[list(rows)] = step_keys(np.array(seeds, dtype=np.int64), np.array(steps, dtype=np.int64))
        ints = as_tensor(aligned_rows([top_k, keys], np.int64), np.int64)[:, :len(seqs)]
        tensors = SamplingTensors(floats[0], penalties=penalties, bad_words=bad_words,
                                  row_seeds=ints[1] if seeded else None)
        if any(top_k):
            tensors.top_k, tensors.candidates = ints[0], max(top_k)
        if any(p.top_p < 1.0 for p in params):
            tensors.top_p = floats[1]
            unbounded = [i for i, p in enumerate(params) if p.top_p < 1.0 and p.top_k <= 0 and p.temperature]
            tensors.unbounded_top_p = as_tensor(unbounded, np.int64) if unbounded else None
        if any(p.min_p > 0.0 for p in params):
            tensors.min_p = floats[2]
        banned = [(i, t) for i, (p, seq) in enumerate(zip(params, seqs)) if seq.num_completion_tokens < p.min_tokens
                  for t in (*p.stop_token_ids, *self.eos_token_ids)]
        if banned:
            rows, ids = zip(*banned)
            tensors.banned = (as_tensor(rows, np.int64), as_tensor(ids, np.int64))
        tensors.logprobs_per_row = [p.logprobs for p in params]
        wanted = [k for k in tensors.logprobs_per_row if k is not None]
        tensors.num_logprobs = max(wanted) if wanted else None
        return tensors

    def grammar_mask(self, seqs: list[SamplingRow], logits: torch.Tensor) -> int | None:
        """Start the structured-output mask of a step whose forward is launched (sampling/grammar_mask.py): the
        fill's number, or None when no row is constrained; `finish_grammar_mask` it."""
        constrained = next((seq.grammar for seq in seqs if seq.grammar is not None), None)
        if constrained is None:
            return None
        if self.grammar_masks is None:  # the worker started with the engine's first constrained request
            self.grammar_masks = GrammarMasks(constrained.worker.result(), logits.size(1), self.max_rows,
                                              logits.device)
        return self.grammar_masks.start(seqs)

    def finish_grammar_mask(self, fill: int) -> StepMask:
        """The mask of the fill `grammar_mask` started, queued for the sampler (sampling/grammar_mask.py)."""
        return self.grammar_masks.finish(fill)

    def grammar_after_sample(self, seqs: list[SamplingRow], sampled: list[bool], token_ids: torch.Tensor) -> None:
        """A constrained step's sampler is queued: its tokens go to the matchers and their next masks are filled
        ahead, while the engine prepares the next step (sampling/grammar_mask.py)."""
        self.grammar_masks.after_sample(seqs, sampled, token_ids)

    def grammar_confirm(self, fill: int) -> None:
        """Before a constrained step's tokens are taken: the mask worker's answer for it (an error it hit is raised)."""
        self.grammar_masks.confirm(fill)

    def close(self) -> None:
        if self.grammar_masks is not None:
            self.grammar_masks.close()
            self.grammar_masks = None

    def forward(self, logits: torch.Tensor, params: SamplingTensors) -> SamplerOutput:
        if params.grammar is not None:  # so logprobs, as vLLM's, are of the constrained distribution
            params.grammar.apply(logits)
        model_logits = logits
        if params.penalties is not None:
            logits = params.penalties.apply(logits)
        if params.bad_words is not None:  # logprobs are still the model's own (model_logits)
            logits = params.bad_words.apply(logits)
        if params.banned is not None:
            logits = logits.clone() if logits is model_logits else logits
            logits[params.banned] = float("-inf")
        floors = None
        if params.filtered:
            floors = logit_floors(logits, params.temperatures, params.top_k, params.top_p, params.min_p,
                                  params.candidates, params.unbounded_top_p, top_p_by_sort=self.top_p_by_sort)
        tokens = self._draw(logits, params.temperatures, floors, params.row_seeds)
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

    def _draw(self, logits: torch.Tensor, temperatures: torch.Tensor, floors: torch.Tensor | None,
              row_seeds: torch.Tensor | None) -> torch.Tensor:
        if not logits.is_cuda:
            return gumbel_max_torch(logits, temperatures, floors, row_seeds, self.generator)
        if self.counters is None or self.counters.numel() < logits.size(0) or self.counters.device != logits.device:
            self.counters = torch.zeros(max(512, logits.size(0)), dtype=torch.int32, device=logits.device)
        # a fresh stream per step, keyed from the engine's generator so its seed makes runs repeatable
        seed = int(torch.randint(0, 2**31 - 1, (), generator=self.generator).item())
        return gumbel_max_sample(logits, temperatures, seed, self.counters, floors=floors, row_seeds=row_seeds)
