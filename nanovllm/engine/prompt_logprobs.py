"""SamplingParams.prompt_logprobs: each prompt token's log-probability given the tokens before it, with the top k
there, as vLLM reports them (RequestOutput.prompt_logprobs).

Kept off the hot path: a prefill scores only each sequence's last token (ParallelLMHead), so a step that holds
requests asking for these scores their prompt rows once more, here, in slices that bound the [rows, vocab] logits.
A prompt prefilled in chunks is scored chunk by chunk, in order. A cached prefix is never computed, so such a
request takes no prefix-cache hits (BlockManager.allocate), as vLLM's does.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import Logprob
from nanovllm.utils.context import reset_context

SLICE_ROWS = 256  # rows scored at once: a whole 16k-token chunk at a 152k vocabulary would need 10 GB of logits


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Whether a prefill of seq must score its prompt: only in the first pass over the prompt of a request's first
    sample (its other samples report the first one's; a recompute after preemption has its scores already)."""
    return seq.params.prompt_logprobs is not None and seq.prompt_owner is None and seq.num_completion_tokens == 0


def _spans(seqs: list[Sequence]) -> list[tuple[Sequence, int, int, int]]:
    """(seq, its first row in the step's hidden states, first position, count) for each sequence to score. The
    hidden state at position p predicts the prompt token at p + 1; the last prompt token's predicts the output."""
    spans, offset = [], 0
    for seq in seqs:
        start = seq.num_cached_tokens
        if wants_prompt_logprobs(seq):
            count = min(start + seq.num_scheduled_tokens, seq.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append((seq, offset, start, count))
        offset += seq.num_scheduled_tokens
    return spans


def prompt_rows(seqs: list[Sequence], is_prefill: bool) -> list[tuple[int, int]]:
    """The rows of a step's hidden states to score, as (first row, count) runs: computed on rank 0 as the step is
    made, and shipped to tensor-parallel workers, which take part in the LM head's vocabulary gather."""
    if not is_prefill:
        return []
    return [(first, count) for _, first, _, count in _spans(seqs)]


@dataclass
class PromptScores:
    """One step's prompt logprobs, on the device until the step completes (rank 0)."""

    spans: list[tuple[Sequence, int, int, int]]  # as _spans: whose rows these are
    token_logprobs: torch.Tensor  # [rows]: of the prompt token each row predicts
    token_ranks: torch.Tensor  # [rows]: 1 + how many tokens are more likely
    top_ids: torch.Tensor  # [rows, the largest k asked]
    top_logprobs: torch.Tensor
    ready: torch.cuda.Event | None = None  # recorded after the copies to the host (GPU)

    def copy_to_host(self) -> None:
        """Queue the copies to (pinned) host memory behind the scoring, as Step.copy_to_host does for tokens: read
        back with a plain .tolist() when the step completes, they would wait for the step launched after it too."""
        if not self.token_logprobs.is_cuda:
            return
        for name in ("token_logprobs", "token_ranks", "top_ids", "top_logprobs"):
            tensor = getattr(self, name)
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            setattr(self, name, host.copy_(tensor, non_blocking=True))
        self.ready = torch.cuda.Event()
        self.ready.record()

    def attach(self) -> None:
        """Append each row's entry to its sequence's prompt_logprobs: the prompt token first, then the top k."""
        if self.ready is not None:
            self.ready.synchronize()
        token_logprobs, token_ranks = self.token_logprobs.tolist(), self.token_ranks.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        row = 0
        for seq, _, position, count in self.spans:
            k = seq.params.prompt_logprobs
            for p in range(position, position + count):
                entry = {seq.token_ids[p + 1]: Logprob(token_logprobs[row], token_ranks[row])}
                for rank, (token, logprob) in enumerate(zip(top_ids[row][:k], top_logprobs[row][:k]), 1):
                    entry.setdefault(token, Logprob(logprob, rank))
                seq.prompt_logprobs.append(entry)
                row += 1


def score_prompts(model: nn.Module, hidden_states: torch.Tensor, seqs: list[Sequence], rows: list[tuple[int, int]],
                  rank: int) -> PromptScores | None:
    """Score the given rows of a prefill's hidden states on every rank (the LM head gathers the vocabulary on
    rank 0); rank 0 gets their PromptScores, the others None. Called after the step's own logits."""
    reset_context()  # outside a prefill context the LM head scores every row it is given, not each sequence's last
    index = torch.cat([torch.arange(first, first + count) for first, count in rows]).to(hidden_states.device)
    if rank == 0:  # the same spans the rows were made from: nothing has changed since
        spans = _spans(seqs)
        targets = torch.tensor([seq.token_ids[p + 1] for seq, _, position, count in spans
                                for p in range(position, position + count)], device=hidden_states.device)
        k = max(seq.params.prompt_logprobs for seq, *_ in spans)
    parts = []
    for first in range(0, len(index), SLICE_ROWS):
        logits = model.compute_logits(hidden_states[index[first: first + SLICE_ROWS]])
        if logits is None:  # a worker: its part of the vocabulary went to rank 0
            continue
        logprobs = logits.float().log_softmax(dim=-1)
        token = logprobs.gather(1, targets[first: first + SLICE_ROWS].unsqueeze(1))
        top = logprobs.topk(k, dim=-1)
        parts.append((token.squeeze(1), (logprobs > token).sum(dim=1) + 1, top.indices, top.values))
    if rank != 0:
        return None
    scores = PromptScores(spans, *(torch.cat(column) for column in zip(*parts)))
    scores.copy_to_host()
    return scores
