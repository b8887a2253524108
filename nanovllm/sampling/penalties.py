"""vLLM's repetition, presence and frequency penalties, applied to a batch's logits on the device.

Repetition divides a positive logit (multiplies a negative one) by the penalty for every token already in the
prompt or the output; presence subtracts its value once for every token in the output, frequency once per
occurrence.

Each request's token history lives on the device, in a row of a table the sampler keeps: the host copies a
request's tokens once (at its prefill, or after its row was given to another request), and every decode step
appends the token it feeds on the device, where it is even before the host has read it back (async scheduling).
So a decode step sends the device a few numbers per row, not the histories.

On the GPU one Triton kernel does a step's whole penalty work (append, count, rewrite the seen logits): a decode
step's host time is on the critical path, and the same work as a chain of ~30 torch ops costs host launches
(docs/PERFORMANCE.md compares the designs).
"""
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter

import numpy as np
import torch
import triton
import triton.language as tl

from nanovllm.sampling.rows import SamplingRow, aligned_rows
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.device import to_device

_seq_id, _params, _num_prompt_tokens = attrgetter("seq_id"), attrgetter("params"), attrgetter("num_prompt_tokens")
_STRENGTHS = tuple(map(attrgetter, ("repetition_penalty", "presence_penalty", "frequency_penalty")))


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


# the strengths' row stride grows with the batch: specialised, a batch whose stride is a multiple of 16 would
# compile a variant of its own in the middle of a run
@triton.jit(do_not_specialize=["strengths_stride"])
def _penalties_kernel(logits_ptr, logits_stride, table_ptr, table_stride, table_rows_ptr, lengths_ptr,
                      prompt_lengths_ptr, strengths_ptr, strengths_stride, fed_ptr, marks_ptr, marks_stride,
                      HAS_FED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    length = tl.load(lengths_ptr + row)
    if length > 0:
        history = table_ptr + tl.load(table_rows_ptr + row) * table_stride
        if HAS_FED:  # this step's fed token joins the row's history before it is counted
            tl.store(history + length - 1, tl.load(fed_ptr + row).to(tl.int32))
            tl.debug_barrier()
        prompt_length = tl.load(prompt_lengths_ptr + row)
        marks = marks_ptr + row * marks_stride  # zero outside this kernel: each use clears what it set
        # pass 1: per token, bit 0 marks it in the prompt and the bits above count it in the output
        for start in range(0, length, BLOCK):
            position = start + tl.arange(0, BLOCK)
            listed = position < length
            token = tl.load(history + position, mask=listed, other=0)
            in_output = position >= prompt_length
            tl.atomic_add(marks + token, 2, mask=listed & in_output)
            tl.atomic_or(marks + token, 1, mask=listed & (position < prompt_length))
        tl.debug_barrier()
        repetition = tl.load(strengths_ptr + row)
        presence = tl.load(strengths_ptr + strengths_stride + row)
        frequency = tl.load(strengths_ptr + 2 * strengths_stride + row)
        logits = logits_ptr + row * logits_stride
        # pass 2: the first listing of each token takes its mark (leaving zero) and rewrites its logit once
        for start in range(0, length, BLOCK):
            position = start + tl.arange(0, BLOCK)
            listed = position < length
            token = tl.load(history + position, mask=listed, other=0)
            mark = tl.atomic_xchg(marks + token, 0, mask=listed)
            first = listed & (mark != 0)
            value = tl.load(logits + token, mask=first, other=0.0)
            value = tl.where(value > 0, value / repetition, value * repetition)
            output_count = (mark >> 1).to(tl.float32)
            value -= tl.where(output_count > 0, presence, 0.0) + frequency * output_count
            tl.store(logits + token, value, mask=first)


@dataclass
class PenaltyTensors:
    strengths: torch.Tensor  # [3, rows] float32: repetition (1 = off), presence, frequency (0 = off)
    lengths: torch.Tensor  # [rows]: how many tokens of the row are valid (0 for a row without penalties)
    prompt_lengths: torch.Tensor  # [rows]: how many of those are its prompt
    table: torch.Tensor  # the histories' table (PenaltyHistories.table) and each row's row in it
    table_rows: torch.Tensor
    width: int  # the longest length
    fed_token_ids: torch.Tensor | None  # decode: appended to each history before counting (by the kernel on GPU)
    histories: "PenaltyHistories"  # holds the kernel's scratch

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Float32 logits with the penalties applied (the caller's tensor is left as it is)."""
        logits = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if not self.histories.use_kernel:
            return self._apply_torch(logits)
        rows, vocab = logits.shape
        marks = self.histories.marks(rows, vocab)
        _penalties_kernel[(rows,)](logits, logits.stride(0), self.table, self.table.stride(0), self.table_rows,
                                   self.lengths, self.prompt_lengths, self.strengths, self.strengths.stride(0),
                                   self.fed_token_ids, marks, marks.stride(0),
                                   HAS_FED=self.fed_token_ids is not None, BLOCK=512)
        return logits

    def _apply_torch(self, logits: torch.Tensor) -> torch.Tensor:
        """The same in torch ops: touches only the logits of tokens a row has seen; repetition and presence are
        written as values computed from the logits before them, so a token listed twice gets the same value twice;
        frequency is added once per listing in the output, which is its definition."""
        if self.fed_token_ids is not None:
            append_at = (self.lengths - 1).clamp_min(0)  # rows without penalties write the spare row
            self.table[self.table_rows, append_at] = self.fed_token_ids[:len(self.lengths)].to(torch.int32)
        histories = self.table[self.table_rows, :self.width].long()
        rows, vocab = logits.shape
        device = logits.device
        position = torch.arange(self.width, device=device)
        valid = position < self.lengths.unsqueeze(1)
        listed_in_output = (valid & (position >= self.prompt_lengths.unsqueeze(1))).flatten()
        # past a row's length, listings point at one spare logit after the batch's, which is dropped at the end
        spare = rows * vocab
        row_base = torch.arange(rows, device=device).unsqueeze(1) * vocab
        slots = torch.where(valid, row_base + histories, spare).flatten()
        flat = torch.cat([logits.flatten(), logits.new_zeros(1)])
        # a token of the prompt may be in the output too: whether it is, for each listing, from a byte per logit
        output_marks = torch.zeros(spare + 1, dtype=torch.int8, device=device)
        output_marks.scatter_reduce_(0, slots, listed_in_output.to(torch.int8), reduce="amax")
        in_output = output_marks[slots].bool()
        repetition, presence, frequency = (s.unsqueeze(1).expand(rows, position.numel()).flatten()
                                           for s in self.strengths)
        seen = flat[slots]
        seen = torch.where(seen > 0, seen / repetition, seen * repetition)
        # every listing of a token writes the same value, so duplicates agree
        flat[slots] = seen - torch.where(in_output, presence, 0.0)
        # frequency counts the output's listings only
        flat.index_add_(0, slots, -torch.where(listed_in_output, frequency, 0.0))
        return flat[:spare].view(rows, vocab)


class PenaltyHistories:
    """The device table of token histories, one row per request with penalties, reassigned as requests come and
    go. The host remembers which request owns each row and how many of its tokens the row holds."""

    def __init__(self, device: torch.device, use_kernel: bool | None = None) -> None:
        self.device = device
        self.use_kernel = device.type == "cuda" if use_kernel is None else use_kernel
        self._marks = torch.zeros(0, 0, dtype=torch.int32, device=device)
        self.table = torch.zeros(0, 0, dtype=torch.int32, device=device)  # its last row catches unused writes
        self.row_of: dict[int, int] = {}  # seq_id -> its row
        self.owner: list[int | None] = []  # row -> seq_id
        self.filled: dict[int, int] = {}  # seq_id -> tokens its row holds

    def tensors(self, seqs: list[SamplingRow], fed_token_ids: torch.Tensor | None) -> PenaltyTensors:
        """fed_token_ids: a decode step's input ids on the device; each is appended to its row's history."""
        # every decode step runs this on the host, ahead of the device: per-row work is C-level maps, not Python
        decode = fed_token_ids is not None
        ids = list(map(_seq_id, seqs))
        params = list(map(_params, seqs))
        penalised = np.fromiter(map(has_penalties, params), bool, len(seqs))
        # decode feeds the last token, possibly still PENDING on the host: it is appended from the device
        known = np.fromiter(map(len, seqs), np.int64, len(seqs)) - decode
        if decode:
            filled = np.fromiter(map(self.filled.get, ids, repeat(-1)), np.int64, len(seqs))
            stale = np.flatnonzero(penalised & (filled != known)).tolist()
        else:
            stale = np.flatnonzero(penalised).tolist()
        if stale:
            # a row whose owner is not in this step can be taken: the owner copies its history again if it returns
            in_step = set(ids)
            takeable = [row for row, owner in enumerate(self.owner) if owner is None or owner not in in_step]
            takeable.reverse()
            for i in stale:
                self._assign_row(ids[i], takeable)
        self._fit(len(self.owner) + 1, int(known.max()) + 1)
        spare_row = self.table.size(0) - 1
        rows = np.fromiter(map(self.row_of.get, ids, repeat(spare_row)), np.int64, len(seqs))
        rows[~penalised] = spare_row
        if stale:
            self._copy_histories([seqs[i] for i in stale], known[stale].tolist(), rows[stale])
        lengths = (known + decode) * penalised
        self.filled.update(zip(compress(ids, penalised), lengths[penalised].tolist()))
        prompt_lengths = np.fromiter(map(_num_prompt_tokens, seqs), np.int64, len(seqs))
        meta = to_device(aligned_rows([rows, lengths, prompt_lengths], np.int64), self.device)[:, :len(seqs)]
        table_rows, length, prompt_length = meta
        strengths = to_device(aligned_rows([np.fromiter(map(setting, params), np.float32, len(seqs))
                                            for setting in _STRENGTHS], np.float32), self.device)[:, :len(seqs)]
        return PenaltyTensors(strengths, length, prompt_length, self.table, table_rows, int(lengths.max()),
                              fed_token_ids, self)

    def marks(self, rows: int, vocab: int) -> torch.Tensor:
        """The kernel's scratch: [rows, vocab] int32, zero between uses (each use clears what it set)."""
        if self._marks.size(0) < rows or self._marks.size(1) != vocab:
            self._marks = torch.zeros(max(rows, 2 * self._marks.size(0)), vocab, dtype=torch.int32,
                                      device=self.device)
        return self._marks

    def _assign_row(self, seq_id: int, takeable: list[int]) -> None:
        if seq_id in self.row_of:
            return
        if takeable:
            free = takeable.pop()
        else:
            free = len(self.owner)
            self.owner.append(None)
        if self.owner[free] is not None:
            del self.row_of[self.owner[free]], self.filled[self.owner[free]]
        self.owner[free] = seq_id
        self.row_of[seq_id] = free

    def _fit(self, rows: int, width: int) -> None:
        """Grow the table (keeping its contents) to at least `rows` rows (the owned ones and the spare) of `width`
        tokens."""
        old_rows, old_width = self.table.shape
        if rows <= old_rows and width <= old_width:
            return
        # each dimension doubles only when it must grow; the width stays a multiple of 16, so that the kernel's row
        # stride is always the same kind of integer to Triton
        rows = old_rows if rows <= old_rows else max(rows, 2 * old_rows)
        width = old_width if width <= old_width else -(-max(width, 2 * old_width) // 16) * 16
        table = torch.zeros(rows, width, dtype=torch.int32, device=self.device)
        if old_rows:  # owned rows keep their index; the old spare row holds nothing of value
            table[:old_rows - 1, :old_width] = self.table[:old_rows - 1]
        self.table = table

    def _copy_histories(self, seqs: list[SamplingRow], lengths: list[int], rows: np.ndarray) -> None:
        tokens = np.concatenate([np.asarray(seq.token_ids[:n], dtype=np.int32) for seq, n in zip(seqs, lengths)])
        starts = np.repeat(rows.astype(np.int64) * self.table.size(1), lengths)
        offsets = np.arange(len(tokens)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        flat_index = to_device(starts + offsets, self.device)
        self.table.view(-1)[flat_index] = to_device(tokens, self.device)
        for seq, n in zip(seqs, lengths):
            self.filled[seq.seq_id] = n
