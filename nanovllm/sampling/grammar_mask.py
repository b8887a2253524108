"""Structured outputs, sampling: one step's token mask for its constrained rows.

A worker thread keeps the matchers: as soon as a step's sampler is queued (`GrammarMasks.after_sample`) it waits
for the step's tokens, lets each matcher take its new one, and fills the rows' next bitmasks (xgrammar, a few
threads, GIL released) into pinned memory, while the engine's thread completes the step before and schedules and
launches the next. That step's `start`, after its forward is launched, fills only rows not filled ahead (new
requests; with async scheduling a row's newest token may still be PENDING on the host, taken from the step in
flight), then `finish` queues the copy to the device, and the sampler applies the mask to the logits before
anything else (`StepMask.apply`, sampling/mask_kernel.py). A step without constrained rows never comes here."""
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from nanovllm.sampling.grammar import GrammarState, accept_binding, fill_binding, import_xgrammar
from nanovllm.sampling.mask_kernel import StepMask
from nanovllm.sampling.rows import PENDING, SamplingRow
from nanovllm.utils.device import allowed_cpu_cores

logger = logging.getLogger(__name__)
# xgrammar's threads for one step's fill. It starts them anew at every call, so more is not faster: at 512 rows
# on a 16-core host, 4 fill in 1.6 ms, 15 in 2.7 ms, 1 in 2.5 ms. The engine's own thread keeps a core.
FILL_THREADS = max(1, min(4, allowed_cpu_cores() - 1))


class GrammarMasks:
    """Bitmask buffers for batches of up to `max_rows` rows over a vocabulary of `vocab_size` (the logits' width):
    two pinned host buffers used in turn (one may still be copying while the next step fills the other) and their
    device copies. `stop_token_ids`: what a row whose matcher refused a token may still sample.

    Each step's sampled tokens are taken as soon as the sampler is queued (`after_sample`): the worker waits for
    them, and fills every constrained row's next mask into the buffer the next step uses, while the engine
    schedules and launches that step. `start` then only fills what that did not (new requests, a row whose tokens
    it missed); a row that sat out the step before (a prefill of others) takes its mask from the other buffer.
    Every row passes here at every step, beside the engine's thread: one loop per phase, xgrammar's bindings called
    with cached handles (at 512 rows, per-row Python costs as much as xgrammar's own work)."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, stop_token_ids: list[int],
                 generation: int = 0) -> None:
        """generation: where the count of fills ahead starts (past a replaced GrammarMasks', whose marks on the
        matchers must not match this one's)."""
        self.xgr = import_xgrammar()
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        width = -(-vocab_size // 32)
        pinned = device.type == "cuda"
        # twice the rows per buffer: a step's rows filled ahead, then the next step's own (at most a batch each)
        both = torch.zeros(2, 2 * max_rows, width, dtype=torch.int32, pin_memory=pinned)
        self.host = list(both)
        self.host_rows = both.view(-1, width).numpy()  # both buffers' rows, read and written without torch calls
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.ahead = [(0, 0), (0, 0)]  # per buffer: (generation, rows) of the last fill ahead into it
        self.generation = generation
        self.device_rows = torch.zeros(4 * max_rows, width, dtype=torch.int32, device=device) if pinned else None
        self.filler = self.xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self.core = accept_binding(self.xgr)
        self.fill_binding = fill_binding(self.filler, both[0])
        self.sampled_under = np.full(0, -1)  # by row of the last finished step: the host row of its mask
        # one thread, so steps' fills keep their order and a matcher is never used by two at once
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-mask")
        self.stop_only = np.zeros(width, dtype=np.int32)
        for token in stop_token_ids:
            self.stop_only[token // 32] |= _bit(token % 32)

    def after_sample(self, seqs: list[SamplingRow], sampled: list[bool], tokens: Callable[[], list[int]]) -> None:
        """A step's sampler is queued: take its tokens (tokens(): by row, waiting for them) into the matchers of its
        constrained rows whose token is kept (sampled: not a prefill chunk short of its prompt's end), and fill
        their next masks ahead, into the buffer the next step's `start` takes."""
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None and sampled[row]]
        if rows:
            self.generation += 1
            states = [seqs[row].grammar for row in rows]
            self.worker.submit(self._fill_ahead, rows, states, seqs, self.sampled_under, self.turn,
                               self.generation, tokens).add_done_callback(_logged)

    def start(self, seqs: list[SamplingRow], pending_tokens: Callable[[], dict[int, int]]) -> Future | None:
        """Begin a step's mask for the constrained rows among `seqs` (None when there are none), in the worker,
        while the caller goes on. pending_tokens(): the tokens of the step in flight by seq_id, asked only if a
        constrained row feeds one its matcher has not taken. `finish` the result."""
        # each row's length, read now: the engine appends to the lists meanwhile
        work = [(row, seq.grammar, seq.num_completion_tokens, seq) for row, seq in enumerate(seqs)
                if seq.grammar is not None]
        if not work:
            return None
        turn, self.turn = self.turn, self.turn ^ 1
        return self.worker.submit(self._fill, work, len(seqs), turn, pending_tokens)

    def finish(self, filled: Future) -> StepMask:
        """The mask `start` filled, queued for the device (on the caller's stream)."""
        rows, sources, used, batch, turn = filled.result()
        span = self.host[0].size(0)  # sources index both host buffers, the second after the first
        self.sampled_under = np.full(batch, -1)  # for after_sample: the mask each row is sampled under
        self.sampled_under[rows] = sources
        in_place = rows == list(range(batch)) and sources == list(range(turn * span, turn * span + batch))
        if self.device_rows is None:  # CPU: the logits are on the host too
            if in_place:
                return StepMask(self.host[turn][:batch], None, self.vocab_size)
            full = torch.zeros(batch, self.host[0].size(1), dtype=torch.int32)
            full[rows] = torch.from_numpy(self.host_rows[sources])
            return StepMask(full, rows, self.vocab_size)
        event = torch.cuda.Event()
        for buffer, count in enumerate(used):
            if count:
                first = buffer * span
                self.device_rows[first:first + count].copy_(self.host[buffer][:count], non_blocking=True)
                self.copied[buffer] = event
        event.record()
        if in_place:
            return StepMask(self.device_rows[turn * span:turn * span + batch], None, self.vocab_size)
        index = torch.tensor([rows, sources], dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        return StepMask(self.device_rows, index[0], self.vocab_size, index[1])

    def close(self) -> None:
        """Wait for the worker's last fill and stop it (before another GrammarMasks takes over the matchers)."""
        self.worker.shutdown(wait=True)

    @torch.inference_mode()  # the buffers were made in the runner's inference mode; this thread has its own
    def _fill_ahead(self, rows: list[int], states: list[GrammarState], seqs: list[SamplingRow], under: np.ndarray,
                    turn: int, generation: int, tokens: Callable[[], list[int]]) -> None:
        if self.copied[turn] is not None:  # this buffer's last copy to the device must be done
            self.copied[turn].synchronize()
        sampled = tokens()
        new = [sampled[row] for row in rows]
        # read before this fill overwrites any of them (a row that sat out a step had its mask in this buffer)
        allowed = self._allowed(new, under[rows] if len(under) > rows[-1] else None)
        # marked before the fill, but no mark counts until ahead[turn] names it (a fill that fails wrote some rows)
        self.ahead[turn] = (-1, 0)
        self._take(states, new, lambda j: seqs[rows[j]].seq_id, allowed, (turn, generation))
        self._fill_rows(turn, states, 0)
        self.ahead[turn] = (generation, len(states))

    @torch.inference_mode()
    def _fill(self, work: list[tuple[int, GrammarState, int, SamplingRow]], batch: int, turn: int,
              pending_tokens: Callable[[], dict[int, int]]) -> tuple[list[int], list[int], list[int], int, int]:
        # a row's mask filled ahead may be in either buffer: one that sat out the last step (a prefill of other
        # requests) has it in the buffer before
        span, other = self.host[turn].size(0), turn ^ 1
        (generation, used), (other_generation, other_used) = self.ahead[turn], self.ahead[other]
        if used + len(work) > span:  # cannot happen with batches of max_rows; stay correct
            generation, used = -1, 0
            self.ahead[turn] = (0, 0)
        here, there = (turn, generation), (other, other_generation)
        sources, refill, behind, from_other = [], [], [], False
        for j, (_, state, length, _) in enumerate(work):
            done = state.filled
            if length > state.num_accepted:  # tokens the matcher has not taken (a fill ahead failed)
                behind.append(j)
                sources.append(-1)
            elif done is not None and done[3] == state.num_accepted and done[:2] in (here, there):
                sources.append(done[0] * span + done[2])
                from_other = from_other or done[0] == other
            else:
                sources.append(turn * span + used + len(refill))
                refill.append(state)
        if behind:
            self._take_behind([work[j] for j in behind], pending_tokens)
            for j in behind:
                sources[j] = turn * span + used + len(refill)
                refill.append(work[j][1])
        if refill and self.copied[turn] is not None:  # the rows past those filled ahead may still be copying
            self.copied[turn].synchronize()
        self._fill_rows(turn, refill, used)
        counts = [0, 0]
        counts[turn], counts[other] = used + len(refill), other_used if from_other else 0
        return [row for row, *_ in work], sources, counts, batch, turn

    def _fill_rows(self, turn: int, states: list[GrammarState], first: int) -> None:
        """Rows first, first + 1, ... of host buffer `turn`: each state's next mask."""
        handles, indices, stop_rows = [], [], []
        for j, state in enumerate(states, first):
            if state.matcher is None:
                state.start(self.xgr)
            # a row whose request ended in the step in flight (its matcher took the stop token) is still in this
            # step, launched before the host knew: its token will be dropped, so any mask does
            if state.rejected or state.terminated:
                stop_rows.append(j)
            else:
                handles.append(state.handle if self.fill_binding else state.matcher)
                indices.append(j)
        if handles:  # no call at all otherwise: each call into xgrammar or torch lets go of the GIL
            (self.fill_binding or self.filler.batch_fill_next_token_bitmask)(handles, self.host[turn], indices, False)
        if stop_rows:
            self.host_rows[[turn * self.host[0].size(0) + j for j in stop_rows]] = self.stop_only

    def _take(self, states: list[GrammarState], tokens: list[int], seq_id: Callable[[int], int],
              allowed: list[bool] | None = None, mark: tuple[int, int] | None = None) -> None:
        """Each matcher takes its one new token (seq_id(j): row j's, for the log). allowed: whether the mask each
        token was sampled under allowed it, when known: xgrammar's verdict too (a mask is the set of tokens its
        matcher accepts), not read back then (xgrammar's public call does, one GIL release per row). mark:
        (buffer, generation) of the fill ahead that follows, noted on each state with its row."""
        if allowed is None or self.core is None:
            allowed = self._accept_public(states, tokens)
            handles = None
        else:
            handles, taken = [], []
        stops, counted = [], 0
        try:
            for j, (state, token, ok) in enumerate(zip(states, tokens, allowed)):
                if state.matcher is None:
                    state.start(self.xgr)
                if state.rejected or state.terminated:
                    pass
                elif not ok:
                    self._reject(seq_id(j), state)
                else:
                    if handles is not None:
                        handles.append(state.handle)
                        taken.append(token)
                    if token in state.stop_token_ids:
                        stops.append(state)
                state.num_accepted += 1
                counted = j + 1
                if mark is not None:
                    state.filled = (*mark, j, state.num_accepted)
            if handles:
                self.core.BatchGrammarMatcher.batch_accept_token(handles, taken, False)
        except BaseException:  # the next start takes the tokens again
            for state in states[:counted]:
                state.num_accepted -= 1
                state.filled = None
            raise
        for state in stops:
            state.terminated = state.matcher.is_terminated()

    def _accept_public(self, states: list[GrammarState], tokens: list[int]) -> list[bool]:
        """xgrammar's public batch accept of the open rows' tokens; each row's verdict (an ended row's: True)."""
        for state in states:
            state.start(self.xgr)
        open_rows = [j for j, state in enumerate(states) if not (state.rejected or state.terminated)]
        answers = self.xgr.BatchGrammarMatcher.batch_accept_token([states[j].matcher for j in open_rows],
                                                                  [tokens[j] for j in open_rows])
        verdicts = [True] * len(states)
        for j, ok in zip(open_rows, answers):
            verdicts[j] = ok
        return verdicts

    def _allowed(self, tokens: list[int], sources: np.ndarray | None) -> list[bool] | None:
        """Whether each token is in the host mask row `sources` names (None: not known for every row). numpy on
        the buffers' view: a torch call lets go of the GIL, which beside the engine's thread costs more."""
        if sources is None or (sources < 0).any():
            return None
        ids = np.asarray(tokens)
        return ((self.host_rows[sources, ids >> 5] >> (ids & 31)) & 1).astype(bool).tolist()

    def _take_behind(self, work: list[tuple[int, GrammarState, int, SamplingRow]],
                     pending_tokens: Callable[[], dict[int, int]]) -> None:
        """Matchers behind their rows' tokens take them, one by one (never in a healthy run: every step's tokens
        are taken by its fill ahead)."""
        pending = None
        for _, state, length, seq in work:
            new = seq.completion_token_ids[state.num_accepted:length]
            if len(new) < length - state.num_accepted:  # its request ended meanwhile (the engine cut the slots of
                state.terminated = True  # steps launched after its end): this row's token is dropped
                continue
            if new[-1] == PENDING:
                pending = pending_tokens() if pending is None else pending
                new[-1] = pending[seq.seq_id]
            state.start(self.xgr)
            if not (state.rejected or state.terminated):
                if not all(state.matcher.accept_token(token) for token in new):
                    self._reject(seq.seq_id, state)
                state.terminated = state.matcher.is_terminated()
            state.num_accepted = length

    @staticmethod
    def _reject(seq_id: int, state: GrammarState) -> None:
        logger.warning("constrained request %d sampled a token its grammar refuses (were all the allowed tokens "
                       "banned by bad_words?): it may only end now", seq_id)
        state.rejected = True


def _logged(done: Future) -> None:
    # nothing waits for a fill ahead: its failure would go unseen (the next start fills those rows itself)
    if done.exception() is not None:
        logger.error("filling structured-output masks ahead failed", exc_info=done.exception())


def _bit(position: int) -> int:
    # bit 31 of an int32 is its sign
    return (1 << position) - (1 << 32 if position == 31 else 0)
