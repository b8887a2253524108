"""SamplingParams.bad_words, as vLLM bans them: each word is a token sequence (tokenized with and without a leading
space), and its last token is masked whenever the tokens before it are the newest generated ones; a one-token
word is always masked. Only generated tokens count, not the prompt.

The mask is applied to the logits before the sampler sees them, on the device. With async scheduling the newest
token of a decoding request is often still on the device (PENDING on the host): a ban that hinges on it is
decided there, against the token the step feeds, so no step waits for the host.
"""
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nanovllm.sampling.rows import PENDING, SamplingRow
from nanovllm.utils.device import to_device


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> list[list[int]]:
    """The token sequences of `words`: each word as written (leading spaces stripped) and, when that spelling is
    other tokens of the same count (a word-start token, for BPE vocabularies), with one leading space."""
    sequences = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:  # nothing the model could generate (a tokenizer that drops these characters)
            continue
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


@dataclass
class BadWordsMask:
    """(row, token) pairs to mask in one step's logits; a pair with `after` >= 0 only if the token the step feeds
    for that row (the newest output token, maybe still PENDING on the host) equals it."""

    rows: torch.Tensor
    token_ids: torch.Tensor
    after: torch.Tensor
    fed_token_ids: torch.Tensor | None  # a decode step's input ids, on the device (None for a prefill)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits with the bans, as a new tensor (the caller's may still be reported as logprobs)."""
        banned = self.after < 0
        if self.fed_token_ids is not None:  # a prefill's tokens were all known on the host
            banned |= self.fed_token_ids[self.rows] == self.after
        # added rather than assigned, so a pair listed twice (once banned, once not) is banned, without a sync
        penalty = torch.zeros(banned.shape, dtype=logits.dtype, device=logits.device).masked_fill(banned, -torch.inf)
        return logits.index_put((self.rows, self.token_ids), penalty, accumulate=True)


def bad_words_mask(seqs: list[SamplingRow], fed_token_ids: torch.Tensor | None,
                   device: torch.device) -> BadWordsMask | None:
    """The bans of one step (rows in the order of seqs), or None when it has none (no request has bad words)."""
    if not any(seq.bad_words_token_ids for seq in seqs):  # every step asks: the common answer comes first
        return None
    pairs = []
    for row, seq in enumerate(seqs):
        output = seq.completion_token_ids
        for word in seq.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix:
                pairs.append((row, word[-1], -1))
            elif len(prefix) <= len(output) and output[len(output) - len(prefix):-1] == prefix[:-1]:
                newest = output[-1]  # only the newest output token can be PENDING: one step is in flight
                if newest == PENDING:
                    pairs.append((row, word[-1], prefix[-1]))
                elif newest == prefix[-1]:
                    pairs.append((row, word[-1], -1))
    if not pairs:
        return None
    rows, token_ids, after = to_device(np.array(pairs, dtype=np.int64).T.copy(), device)
    return BadWordsMask(rows, token_ids, after, fed_token_ids)
