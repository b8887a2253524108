"""vLLM's repetition, presence and frequency penalties, applied to a batch's logits on the device.

Repetition divides a positive logit (multiplies a negative one) by the penalty for every token already in the
prompt or the output; presence subtracts its value once for every token in the output, frequency once per
occurrence. A step may feed a token that is still on the device (async scheduling), so that token is counted
from the step's input ids there, never read back.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.device import to_device


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


@dataclass
class PenaltyTensors:
    repetition: torch.Tensor  # [rows] float32, 1 = off
    presence: torch.Tensor  # [rows], 0 = off
    frequency: torch.Tensor  # [rows], 0 = off
    token_ids: torch.Tensor  # every row's tokens known on the host, row after row
    lengths: torch.Tensor  # [rows]: how many of them are each row's
    prompt_lengths: torch.Tensor  # [rows]: how many of those are its prompt
    fed_token_ids: torch.Tensor | None  # decode: the token each row feeds this step (an output token)

    @classmethod
    def build(cls, seqs: list[Sequence], fed_token_ids: torch.Tensor | None,
              device: torch.device) -> "PenaltyTensors":
        """Host work is a copy of each row's tokens: the rest is computed on the device (this runs every step)."""
        params = [seq.params for seq in seqs]
        # decode feeds the last token, possibly still PENDING here: it comes from fed_token_ids instead
        histories = [token_history(seq, len(seq) - (fed_token_ids is not None)) for seq in seqs]
        as_tensor = lambda values, dtype: to_device(np.array(values, dtype=dtype), device)  # noqa: E731
        return cls(as_tensor([p.repetition_penalty for p in params], np.float32),
                   as_tensor([p.presence_penalty for p in params], np.float32),
                   as_tensor([p.frequency_penalty for p in params], np.float32),
                   to_device(np.concatenate(histories), device), as_tensor(list(map(len, histories)), np.int64),
                   as_tensor([seq.num_prompt_tokens for seq in seqs], np.int64), fed_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Touches only the logits of tokens a row has seen: repetition and presence are written as values
        computed from the logits before them, so a token listed twice gets the same value twice; frequency is
        added once per listing in the output, which is its definition."""
        rows, vocab = logits.shape
        device = logits.device
        total = self.token_ids.numel()  # known on the host: no device sync for the sizes below
        row = torch.repeat_interleave(torch.arange(rows, device=device), self.lengths, output_size=total)
        starts = torch.repeat_interleave(self.lengths.cumsum(0) - self.lengths, self.lengths, output_size=total)
        listed_in_output = torch.arange(total, device=device) - starts >= self.prompt_lengths[row]
        slots = row * vocab + self.token_ids
        if self.fed_token_ids is not None:
            fed_rows = torch.arange(rows, device=device)
            slots = torch.cat([slots, fed_rows * vocab + self.fed_token_ids[:rows].long()])
            row = torch.cat([row, fed_rows])
            listed_in_output = torch.cat([listed_in_output, torch.ones(rows, dtype=torch.bool, device=device)])
        flat = logits.float().flatten()
        if flat.data_ptr() == logits.data_ptr():
            flat = flat.clone()  # float32 logits: the caller's tensor stays as the model produced it
        # a token of the prompt may be in the output too: whether it is, for each listing, from a byte per logit
        output_marks = torch.zeros(rows * vocab, dtype=torch.int8, device=device)
        output_marks.scatter_reduce_(0, slots, listed_in_output.to(torch.int8), reduce="amax")
        in_output = output_marks[slots].bool()
        seen = flat[slots]
        repetition = self.repetition[row]
        seen = torch.where(seen > 0, seen / repetition, seen * repetition)
        # every listing of a token writes the same value, so duplicates agree
        flat[slots] = seen - torch.where(in_output, self.presence[row], 0.0)
        # frequency counts the output's listings only
        flat.index_add_(0, slots, -torch.where(listed_in_output, self.frequency[row], 0.0))
        return flat.view(rows, vocab)


def token_history(seq: Sequence, length: int) -> np.ndarray:
    """seq.token_ids[:length] as int64, kept in a buffer on the sequence that grows with it, so a step copies
    only the tokens added since the last one rather than converting the whole list."""
    buffer, filled = seq.penalty_history or (np.empty(max(64, 2 * length), np.int64), 0)
    filled = min(filled, length)  # a request truncated at a stop keeps no stale tail
    if length > len(buffer):
        buffer = np.concatenate([buffer[:filled], np.empty(2 * length - filled, np.int64)])
    buffer[filled:length] = seq.token_ids[filled:length]
    seq.penalty_history = (buffer, length)
    return buffer[:length]
