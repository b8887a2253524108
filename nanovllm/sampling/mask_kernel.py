"""Structured outputs: a step's token bitmask applied to its logits on the device, in one launch.

xgrammar's own kernel takes one bitmask row per logits row, so the engine first gathered each row's mask from
where it was filled (a row filled ahead sits at its place in the step before) into a batch-ordered buffer: an
index upload, an index_select, an index_copy and the apply, each a launch and some Python on the engine's
thread, at every constrained step. Here each logits row reads its mask from its source row directly.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.sampling.grammar import import_xgrammar

BLOCK = 4096  # vocabulary ids per program: 128 words of the bitmask


@triton.jit
def _mask_rows(logits_ptr, bitmask_ptr, rows_ptr, sources_ptr, vocab_size, logits_stride, bitmask_stride,
               INDEXED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if INDEXED:
        row = tl.load(rows_ptr + i).to(tl.int64)
        source = tl.load(sources_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
        source = i.to(tl.int64)
    inside = ids < vocab_size
    words = tl.load(bitmask_ptr + source * bitmask_stride + ids // 32, mask=inside, other=0)
    refused = ((words >> (ids % 32)) & 1) == 0  # bit 31 of an int32 is its sign: >> keeps it, & 1 reads it
    tl.store(logits_ptr + row * logits_stride + ids, float("-inf"), mask=inside & refused)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int, rows: torch.Tensor | None = None,
                sources: torch.Tensor | None = None) -> None:
    """Set to -inf, in place, each logits row's ids its bitmask row refuses. rows / sources: logits row i of
    `rows` takes bitmask row sources[i] (other rows are left alone); without them row i takes bitmask row i, for
    every row of `logits`. Ids at or past vocab_size are left alone."""
    count = logits.size(0) if rows is None else rows.numel()
    if count == 0:
        return
    grid = (count, triton.cdiv(vocab_size, BLOCK))
    _mask_rows[grid](logits, bitmask, rows, sources, vocab_size, logits.stride(0), bitmask.stride(0),
                     INDEXED=rows is not None, BLOCK=BLOCK)


@dataclass
class StepMask:
    """A step's bitmask for its constrained rows, already queued for the device."""

    bitmask: torch.Tensor  # int32 rows of masks: row i for logits row i, or the rows `sources` names
    rows: torch.Tensor | list[int] | None  # the logits rows to mask (None: all of them)
    vocab_size: int
    sources: torch.Tensor | None = None  # on the device: the bitmask row of each of `rows`

    def apply(self, logits: torch.Tensor) -> None:
        """Masked tokens' logits to -inf, in place."""
        if logits.is_cuda:
            mask_logits(logits, self.bitmask, self.vocab_size, self.rows, self.sources)
        else:
            import_xgrammar().apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size,
                                                          indices=self.rows)
