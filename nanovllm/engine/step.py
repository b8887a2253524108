from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nanovllm.engine.prompt_logprobs import PromptScores
from nanovllm.engine.sequence import Sequence


@dataclass
class Step:
    """One batch from launch until its sampled tokens are back on the host: created by the engine, filled in by
    the model runner, accounted by the scheduler, and handed back to the engine to complete.

    With async scheduling the engine launches step n+1 before completing step n, so step n's tokens are still on
    the device while n+1 is prepared; a sequence that feeds such a token holds PENDING in its token_ids and the
    runner gathers the real id on the device from `token_ids`.
    """

    seqs: list[Sequence]
    is_prefill: bool
    # per sequence, the tokens [start, end) whose KV this step computes
    spans: list[tuple[int, int]] = field(default_factory=list)
    token_ids: torch.Tensor | None = None  # sampled, on the device, row i for seqs[i] (workers: broadcast)
    host_token_ids: torch.Tensor | None = None  # the same, copied to (pinned) host memory as it completes
    ready: torch.cuda.Event | None = None  # recorded after that copy
    logprobs: list[dict[int, float]] | None = None  # per row: the sampled token's and the top k
    # (source, destination) KV blocks to copy before the forward: a shared partial block about to be written
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (first row, count) runs of a prefill's hidden states to score for prompt_logprobs (every rank), and their
    # scores (rank 0)
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: PromptScores | None = None
    # launched but not sampled yet: a structured-output step's sampler is queued after the step before completes
    # (ModelRunner.finish runs it; where the engine's thread waits for the mask, that wait overlaps the completion)
    sample: Callable[[], None] | None = None
    # structured outputs: reads the mask worker's answer for this step before its tokens are taken
    confirm: Callable[[], None] | None = None

    @classmethod
    def of(cls, seqs: list[Sequence], is_prefill: bool, block_copies: list[tuple[int, int]] | None = None,
           prompt_rows: list[tuple[int, int]] | None = None) -> "Step":
        spans = [(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens) for seq in seqs]
        return cls(seqs, is_prefill, spans, block_copies=block_copies or [], prompt_rows=prompt_rows or [])

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.spans)

    def copy_to_host(self, token_ids: torch.Tensor, logprobs: list[dict[int, float]] | None) -> None:
        """Queue the sampled tokens' copy to the host right behind the sampler, ahead of the next step."""
        self.token_ids, self.logprobs = token_ids, logprobs
        if not token_ids.is_cuda:
            self.host_token_ids = token_ids
            return
        self.host_token_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, device="cpu", pin_memory=True)
        self.host_token_ids.copy_(token_ids, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def result(self) -> list[int]:
        """The sampled token ids, waiting for the device if they are not back yet."""
        if self.confirm is not None:
            confirm, self.confirm = self.confirm, None
            confirm()
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_token_ids.tolist()
