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
    prompt_tokens: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids) of every prompt token
    output_tokens: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids) of every output token known on the host
    fed_token_ids: torch.Tensor | None  # decode: the token each row feeds this step (an output token)

    @classmethod
    def build(cls, seqs: list[Sequence], fed_token_ids: torch.Tensor | None,
              device: torch.device) -> "PenaltyTensors":
        params = [seq.params for seq in seqs]
        prompt_rows, prompt_ids, output_rows, output_ids = [], [], [], []
        for row, seq in enumerate(seqs):
            # decode feeds the last token, possibly still PENDING here: it comes from fed_token_ids instead
            known = len(seq) - (fed_token_ids is not None)
            history = token_history(seq, known)
            prompt_ids.append(history[: seq.num_prompt_tokens])
            output_ids.append(history[seq.num_prompt_tokens:])
            prompt_rows.append(np.full(len(prompt_ids[-1]), row))
            output_rows.append(np.full(len(output_ids[-1]), row))
        as_tensor = lambda values, dtype: to_device(np.array(values, dtype=dtype), device)  # noqa: E731
        flat = lambda parts: to_device(np.concatenate(parts).astype(np.int64), device)  # noqa: E731
        return cls(as_tensor([p.repetition_penalty for p in params], np.float32),
                   as_tensor([p.presence_penalty for p in params], np.float32),
                   as_tensor([p.frequency_penalty for p in params], np.float32),
                   (flat(prompt_rows), flat(prompt_ids)), (flat(output_rows), flat(output_ids)), fed_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.size(0)
        prompt_seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        prompt_seen.index_put_(self.prompt_tokens, torch.ones((), dtype=torch.bool, device=logits.device))
        counts = torch.zeros(logits.shape, dtype=torch.int32, device=logits.device)
        counts.index_put_(self.output_tokens, torch.ones((), dtype=torch.int32, device=logits.device), accumulate=True)
        if self.fed_token_ids is not None:
            fed_rows = torch.arange(rows, device=logits.device)
            counts.index_put_((fed_rows, self.fed_token_ids[:rows].long()),
                              torch.ones((), dtype=torch.int32, device=logits.device), accumulate=True)
        return apply_penalties(logits.float(), prompt_seen, counts, self.repetition, self.presence, self.frequency)


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
