from enum import Enum, auto
from itertools import count

from nanovllm.outputs import Logprob
from nanovllm.sampling.grammar import GrammarState
from nanovllm.sampling.rows import PENDING as PENDING  # the engine imports it from here
from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request: its tokens, where its KV lives (block_table) and how much of it is already computed."""

    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams = SamplingParams(),
                 block_size: int = 256) -> None:
        self.seq_id = next(Sequence._ids)
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        # tokens whose KV is already in the cache (prefix-cache hits and finished prefill chunks)
        self.num_cached_tokens = 0
        # tokens the current step computes, starting at num_cached_tokens
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        self.params = sampling_params  # read on rank 0 only; workers never sample
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        # the first of the n samples of one prompt: this one forks its prompt's KV from it (see Scheduler)
        self.prompt_owner: Sequence | None = None
        self.logprobs: list[dict[int, Logprob]] = []  # one entry per generated token, when params.logprobs is set
        # one entry per prompt token after the first, when params.prompt_logprobs is set (engine/prompt_logprobs.py)
        self.prompt_logprobs: list[dict[int, Logprob]] = []
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words, tokenized (sampling/bad_words.py)
        self.grammar: GrammarState | None = None  # params.structured_outputs (sampling/grammar.py)
        self._shipped_token_ids: list[int] = []

    def __len__(self) -> int:
        return self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    @property
    def last_block_num_tokens(self) -> int:
        return self.num_tokens - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    @property
    def scheduled_token_ids(self) -> list[int]:
        if self.token_ids is None:  # a tensor-parallel worker's copy carries only these
            return self._shipped_token_ids
        return self.token_ids[self.num_cached_tokens: self.num_cached_tokens + self.num_scheduled_tokens]

    @property
    def completes_prompt(self) -> bool:
        """True when the scheduled tokens reach the end of the sequence, so the step samples a token for it."""
        return self.num_cached_tokens + self.num_scheduled_tokens == self.num_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.num_tokens += 1

    def truncate(self, num_tokens: int) -> None:
        """Drop tokens past num_tokens: a finished request's slots for steps that were already launched."""
        del self.token_ids[num_tokens:]
        self.num_tokens = len(self.token_ids)

    # Workers need only what the step computes: decode ships one token, not the whole history.
    def __getstate__(self):
        return (self.seq_id, self.block_size, self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
                self.block_table, self.scheduled_token_ids)

    def __setstate__(self, state) -> None:
        (self.seq_id, self.block_size, self.num_tokens, self.num_cached_tokens, self.num_scheduled_tokens,
         self.block_table, self._shipped_token_ids) = state
        self.token_ids = None
