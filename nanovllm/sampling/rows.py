"""What sampling reads of each request in a batch. Declared here, rather than taken from the engine's Sequence
(engine/sequence.py, which has these fields), so sampling imports nothing from the engine above it; and how
per-row settings are laid out for the device."""
from typing import Protocol

import numpy as np

from nanovllm.sampling.grammar import GrammarState
from nanovllm.sampling_params import SamplingParams

# a sampled token the host has not read back yet: with async scheduling a step is prepared while the one before
# it, whose token a request feeds, is still on the device
PENDING = -1


class SamplingRow(Protocol):
    seq_id: int
    params: SamplingParams
    token_ids: list[int]  # the prompt, then the tokens generated so far (the newest may be PENDING)
    num_prompt_tokens: int
    bad_words_token_ids: list[list[int]]  # params.bad_words as token sequences
    grammar: GrammarState | None  # params.structured_outputs, compiled, and its matcher

    def __len__(self) -> int: ...

    @property
    def num_completion_tokens(self) -> int: ...

    @property
    def completion_token_ids(self) -> list[int]: ...


def aligned_rows(rows: list, dtype: type) -> np.ndarray:
    """The rows as one array whose every row starts on a 16-byte boundary: Triton specialises a kernel
    on whether each pointer is 16-byte aligned, so a row that started elsewhere at some batch sizes would compile a
    variant of its own in the middle of a run."""
    per_16_bytes = 16 // np.dtype(dtype).itemsize
    width = len(rows[0])
    array = np.zeros((len(rows), -(-width // per_16_bytes) * per_16_bytes), dtype=dtype)
    array[:, :width] = rows
    return array
