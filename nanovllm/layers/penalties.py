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
from nanovllm.layers import fused
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
        rows, vocab = logits.shape
        device = logits.device
        total = self.token_ids.numel()  # known on the host: no device sync for the sizes below
        row = torch.repeat_interleave(torch.arange(rows, device=device), self.lengths, output_size=total)
        starts = torch.repeat_interleave(self.lengths.cumsum(0) - self.lengths, self.lengths, output_size=total)
        in_prompt = torch.arange(total, device=device) - starts < self.prompt_lengths[row]
        slots = row * vocab + self.token_ids
        # index_add_ adds with atomics (index_put_ with accumulate would sort); masks become 0/1 addends, since
        # selecting by mask would wait for the device to count them
        prompt_counts = torch.zeros(rows * vocab, dtype=torch.int32, device=device)
        prompt_counts.index_add_(0, slots, in_prompt.int())
        counts = torch.zeros(rows * vocab, dtype=torch.int32, device=device)
        counts.index_add_(0, slots, (~in_prompt).int())
        if self.fed_token_ids is not None:
            fed = torch.arange(rows, device=device) * vocab + self.fed_token_ids[:rows].long()
            counts.index_add_(0, fed, torch.ones_like(fed, dtype=torch.int32))
        return apply_penalties(logits.float(), prompt_counts.view(rows, vocab) > 0, counts.view(rows, vocab),
                               self.repetition, self.presence, self.frequency)


@fused
def apply_penalties(logits: torch.Tensor, prompt_seen: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    in_output = counts > 0
    repetition = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(prompt_seen | in_output, penalised, logits)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * in_output


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
