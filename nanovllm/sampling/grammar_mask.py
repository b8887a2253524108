"""Structured outputs, sampling: one step's token mask for its constrained rows.

The model runner launches a step's forward first, then calls `GrammarMasks.start`: with async scheduling a
constrained row's newest token may still be on the device (PENDING), so a worker thread waits for the step before
(which finished before this step's forward began), lets each matcher take its new tokens, and fills the rows'
bitmasks (xgrammar, many threads, GIL released) into pinned memory, while the device runs the forward and the
engine's thread completes the step before. Then `finish` queues the copy to the device, and the sampler applies
the mask to the logits before anything else (`StepMask.apply`, xgrammar's kernel). A step without constrained
rows never comes here."""
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nanovllm.sampling.grammar import GrammarState, import_xgrammar
from nanovllm.sampling.rows import PENDING, SamplingRow
from nanovllm.utils.device import allowed_cpu_cores

logger = logging.getLogger(__name__)
# xgrammar's threads for one step's rows; the engine's own thread keeps a core
FILL_THREADS = max(1, min(16, allowed_cpu_cores() - 1))


@dataclass
class StepMask:
    """A step's bitmask for its constrained rows, already queued for the device."""

    bitmask: torch.Tensor  # int32, one row per logits row when `rows` is given, else one per constrained row
    rows: torch.Tensor | list[int] | None  # the logits rows to mask (None: all of them)
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> None:
        """Masked tokens' logits to -inf, in place."""
        import_xgrammar().apply_token_bitmask_inplace(logits, self.bitmask, vocab_size=self.vocab_size,
                                                      indices=self.rows)


class GrammarMasks:
    """Bitmask buffers for batches of up to `max_rows` rows over a vocabulary of `vocab_size` (the logits' width):
    two pinned host buffers used in turn (one may still be copying while the next step fills the other) and their
    device copies. `stop_token_ids`: what a row whose matcher refused a token may still sample."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, stop_token_ids: list[int]) -> None:
        self.xgr = import_xgrammar()
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        width = -(-vocab_size // 32)
        pinned = device.type == "cuda"
        self.host = [torch.zeros(max_rows, width, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.device_rows = torch.zeros(max_rows, width, dtype=torch.int32, device=device) if pinned else None
        self.device_full = torch.zeros(max_rows, width, dtype=torch.int32, device=device) if pinned else None
        self.filler = self.xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        # one thread, so steps' fills keep their order and a matcher is never used by two at once
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-mask")
        self.stop_only = torch.zeros(width, dtype=torch.int32)
        for token in stop_token_ids:
            self.stop_only[token // 32] |= _bit(token % 32)

    def start(self, seqs: list[SamplingRow], pending_tokens: Callable[[], dict[int, int]]) -> Future | None:
        """Begin a step's mask for the constrained rows among `seqs` (None when there are none): the matchers take
        their new tokens and fill the rows' bitmasks in a thread, while the caller goes on. pending_tokens(): the
        tokens of the step in flight by seq_id, asked only if a constrained row feeds one. `finish` the result."""
        # what each row generated since the last step, read now: the engine appends to the lists meanwhile
        work = [(row, seq.grammar, seq.completion_token_ids[seq.grammar.num_accepted:], seq.seq_id)
                for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not work:
            return None
        turn, self.turn = self.turn, self.turn ^ 1
        return self.worker.submit(self._fill, work, len(seqs), turn, pending_tokens)

    def finish(self, filled: Future) -> StepMask:
        """The mask `start` filled, queued for the device (on the caller's stream)."""
        rows, batch, turn = filled.result()
        host = self.host[turn]
        if self.device_rows is None:  # CPU: the logits are on the host too
            if rows == list(range(batch)):
                return StepMask(host[:len(rows)], None, self.vocab_size)
            return StepMask(_scatter(host, rows, batch), rows, self.vocab_size)
        compact = self.device_rows[:len(rows)]
        compact.copy_(host[:len(rows)], non_blocking=True)
        event = self.copied[turn] = torch.cuda.Event()
        event.record()
        if rows == list(range(batch)):
            return StepMask(compact, None, self.vocab_size)
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        self.device_full.index_copy_(0, index, compact)
        return StepMask(self.device_full[:batch], index, self.vocab_size)

    @torch.inference_mode()  # the buffers were made in the runner's inference mode; this thread has its own
    def _fill(self, work: list[tuple[int, GrammarState, list[int], int]], batch: int, turn: int,
              pending_tokens: Callable[[], dict[int, int]]) -> tuple[list[int], int, int]:
        states = [state for _, state, _, _ in work]
        self._accept(work, pending_tokens)
        host = self.host[turn]
        if self.copied[turn] is not None:  # this buffer's last copy to the device must be done
            self.copied[turn].synchronize()
        # a row whose request ended in the step in flight (its matcher took the stop token) is still in this
        # step, launched before the host knew: its token will be dropped, so any mask does
        live = [j for j, state in enumerate(states) if not state.rejected and not state.matcher.is_terminated()]
        self.filler.batch_fill_next_token_bitmask([states[j].matcher for j in live], host, live)
        for j in sorted(set(range(len(states))) - set(live)):
            host[j] = self.stop_only
        return [row for row, _, _, _ in work], batch, turn

    def _accept(self, work: list[tuple[int, GrammarState, list[int], int]],
                pending_tokens: Callable[[], dict[int, int]]) -> None:
        """Each matcher takes the tokens its request generated since the last step."""
        pending = None
        single, single_tokens = [], []  # (seq_id, state) and its one new token
        for _, state, new, seq_id in work:
            state.start(self.xgr)
            if new and new[-1] == PENDING:
                pending = pending_tokens() if pending is None else pending
                new[-1] = pending[seq_id]
            state.num_accepted += len(new)
            if state.rejected or not new:
                continue
            if len(new) == 1:  # the usual decode step: one call for all of them
                single.append((seq_id, state))
                single_tokens.append(new[0])
            elif not all(state.matcher.accept_token(token) for token in new):
                self._reject(seq_id, state)
        if single:
            accepted = self.xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for _, s in single],
                                                                       single_tokens)
            for (seq_id, state), ok in zip(single, accepted):
                if not ok:
                    self._reject(seq_id, state)

    @staticmethod
    def _reject(seq_id: int, state: GrammarState) -> None:
        logger.warning("constrained request %d sampled a token its grammar refuses (were all the allowed tokens "
                       "banned by bad_words?): it may only end now", seq_id)
        state.rejected = True


def _bit(position: int) -> int:
    # bit 31 of an int32 is its sign
    return (1 << position) - (1 << 32 if position == 31 else 0)


def _scatter(compact: torch.Tensor, rows: list[int], batch: int) -> torch.Tensor:
    full = torch.zeros(batch, compact.size(1), dtype=torch.int32)
    full[rows] = compact[:len(rows)]
    return full
