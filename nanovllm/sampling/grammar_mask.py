"""Structured outputs, sampling: one step's token mask for its constrained rows.

A worker thread keeps the matchers: as soon as a step's sampler is queued (`GrammarMasks.after_sample`) it waits
for the step's tokens, lets each matcher take its new one, and fills the rows' next bitmasks (xgrammar, many
threads, GIL released) into pinned memory, while the engine's thread completes the step before and schedules and
launches the next. That step's `start`, after its forward is launched, fills only rows not filled ahead (new
requests; with async scheduling a row's newest token may still be PENDING on the host, taken from the step in
flight), then `finish` queues the copy to the device, and the sampler applies the mask to the logits before
anything else (`StepMask.apply`, xgrammar's kernel). A step without constrained rows never comes here."""
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nanovllm.sampling.grammar import GrammarState, import_xgrammar
from nanovllm.sampling.rows import PENDING, SamplingRow
from nanovllm.utils.device import allowed_cpu_cores

logger = logging.getLogger(__name__)
# xgrammar's threads for one step's rows; the engine's own thread keeps a core
FILL_THREADS = max(1, min(16, allowed_cpu_cores() - 1))
TAIL = 8  # newest tokens of each row read at a step's start: a row's matcher is never further behind


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
    device copies. `stop_token_ids`: what a row whose matcher refused a token may still sample.

    Each step's sampled tokens are taken as soon as the sampler is queued (`after_sample`): the worker waits for
    them, and fills every constrained row's next mask into the buffer the next step uses, while the engine
    schedules and launches that step. `start` then only fills what that did not (new requests, a row whose tokens
    it missed), after the rows already filled; a row that sat out the step before (a prefill of other requests)
    takes its mask from the other buffer, where it was filled ahead."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, stop_token_ids: list[int],
                 generation: int = 0) -> None:
        """generation: where the count of fills ahead starts (past a replaced GrammarMasks', whose marks on the
        matchers must not match this one's)."""
        self.xgr = import_xgrammar()
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        width = -(-vocab_size // 32)
        pinned = device.type == "cuda"
        # twice the rows: a step's rows filled ahead, then the next step's own (at most a batch each)
        self.host = [torch.zeros(2 * max_rows, width, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.ahead = [(0, 0), (0, 0)]  # per buffer: (generation, rows) of the last fill ahead into it
        self.generation = generation
        self.device_rows = torch.zeros(4 * max_rows, width, dtype=torch.int32, device=device) if pinned else None
        self.device_full = torch.zeros(max_rows, width, dtype=torch.int32, device=device) if pinned else None
        self.filler = self.xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self.core = _accept_binding(self.xgr)
        self.sampled_under: dict[int, int] = {}
        self.host_views = [host.numpy() for host in self.host]  # the same memory, read without torch calls
        # one thread, so steps' fills keep their order and a matcher is never used by two at once
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-mask")
        self.stop_only = np.zeros(width, dtype=np.int32)
        for token in stop_token_ids:
            self.stop_only[token // 32] |= _bit(token % 32)

    def after_sample(self, seqs: list[SamplingRow], sampled: list[bool], tokens: Callable[[], list[int]]) -> None:
        """A step's sampler is queued: take its tokens (tokens(): by row, waiting for them) into the matchers of its
        constrained rows whose token is kept (sampled: not a prefill chunk short of its prompt's end), and fill
        their next masks ahead, into the buffer the next step's `start` takes."""
        under, self.sampled_under = self.sampled_under, {}
        work = [(row, seq.grammar, seq.seq_id, under.get(row)) for row, (seq, kept) in enumerate(zip(seqs, sampled))
                if seq.grammar is not None and kept]
        if work:
            self.generation += 1
            self.worker.submit(self._fill_ahead, work, self.turn, self.generation, tokens).add_done_callback(_logged)

    def start(self, seqs: list[SamplingRow], pending_tokens: Callable[[], dict[int, int]]) -> Future | None:
        """Begin a step's mask for the constrained rows among `seqs` (None when there are none), in the worker,
        while the caller goes on. pending_tokens(): the tokens of the step in flight by seq_id, asked only if a
        constrained row feeds one its matcher has not taken. `finish` the result."""
        # each row's length and newest tokens, read now: the engine appends to the lists meanwhile
        work = [(row, seq.grammar, seq.num_completion_tokens, seq.token_ids[-TAIL:], seq)
                for row, seq in enumerate(seqs) if seq.grammar is not None]
        if not work:
            return None
        turn, self.turn = self.turn, self.turn ^ 1
        return self.worker.submit(self._fill, work, len(seqs), turn, pending_tokens)

    def finish(self, filled: Future) -> StepMask:
        """The mask `start` filled, queued for the device (on the caller's stream)."""
        rows, sources, used, batch, turn = filled.result()
        span = self.host[0].size(0)  # sources index both host buffers, the second after the first
        self.sampled_under = dict(zip(rows, sources))  # for after_sample: the mask each row is sampled under
        in_place = rows == list(range(batch)) and sources == list(range(turn * span, turn * span + batch))
        if self.device_rows is None:  # CPU: the logits are on the host too
            if in_place:
                return StepMask(self.host[turn][:batch], None, self.vocab_size)
            full = torch.zeros(batch, self.host[0].size(1), dtype=torch.int32)
            for buffer, host in enumerate(self.host):
                picked = [(row, source - buffer * span) for row, source in zip(rows, sources)
                          if source // span == buffer]
                if picked:
                    to, source = zip(*picked)
                    full[list(to)] = host[list(source)]
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
        self.device_full.index_copy_(0, index[0], self.device_rows.index_select(0, index[1]))
        return StepMask(self.device_full[:batch], index[0], self.vocab_size)

    def close(self) -> None:
        """Wait for the worker's last fill and stop it (before another GrammarMasks takes over the matchers)."""
        self.worker.shutdown(wait=True)

    @torch.inference_mode()  # the buffers were made in the runner's inference mode; this thread has its own
    def _fill_ahead(self, work: list[tuple[int, GrammarState, int, int | None]], turn: int, generation: int,
                    tokens: Callable[[], list[int]]) -> None:
        if self.copied[turn] is not None:  # this buffer's last copy to the device must be done
            self.copied[turn].synchronize()
        sampled = tokens()
        states = [state for _, state, _, _ in work]
        new = [sampled[row] for row, _, _, _ in work]
        # read before this fill overwrites any of them (a row that sat out a step had its mask in this buffer)
        allowed = self._allowed(new, [source for _, _, _, source in work])
        self._take(states, new, [seq_id for _, _, seq_id, _ in work], allowed)
        self._fill_rows(turn, states, 0)
        for j, state in enumerate(states):
            state.filled = (turn, generation, j, state.num_accepted)
        self.ahead[turn] = (generation, len(work))

    @torch.inference_mode()
    def _fill(self, work: list[tuple[int, GrammarState, int, list[int], SamplingRow]], batch: int, turn: int,
              pending_tokens: Callable[[], dict[int, int]]) -> tuple[list[int], list[int], list[int], int, int]:
        pending, single, several = None, [], []
        for _, state, length, tail, seq in work:
            missing = length - state.num_accepted
            if missing <= 0:
                continue
            # the newest tokens are in the snapshot; older ones (never, in practice) are past any change
            new = tail[-missing:] if missing <= len(tail) else seq.completion_token_ids[state.num_accepted:length]
            if new[-1] == PENDING:
                pending = pending_tokens() if pending is None else pending
                new[-1] = pending[seq.seq_id]
            if missing == 1:
                single.append((state, new[0], seq.seq_id))
            else:
                several.append((state, new, seq.seq_id))
        if single:
            states, tokens, seq_ids = map(list, zip(*single))
            self._take(states, tokens, seq_ids)
        self._take_several(several)
        # a row's mask filled ahead may be in either buffer: one that sat out the last step (a prefill of other
        # requests) has it in the buffer before
        span, other = self.host[turn].size(0), turn ^ 1
        (generation, used), (other_generation, other_used) = self.ahead[turn], self.ahead[other]
        if used + len(work) > span:  # cannot happen with batches of max_rows; stay correct
            generation, used = -1, 0
            self.ahead[turn] = (0, 0)
        sources, refill, from_other = [], [], False
        for _, state, _, _, _ in work:
            done = state.filled
            if done is not None and done[3] == state.num_accepted:
                if done[:2] == (turn, generation):
                    sources.append(turn * span + done[2])
                    continue
                if done[:2] == (other, other_generation):
                    sources.append(other * span + done[2])
                    from_other = True
                    continue
            sources.append(turn * span + used + len(refill))
            refill.append(state)
        if refill and self.copied[turn] is not None:  # the rows past those filled ahead may still be copying
            self.copied[turn].synchronize()
        self._fill_rows(turn, refill, used)
        counts = [0, 0]
        counts[turn], counts[other] = used + len(refill), other_used if from_other else 0
        return [row for row, *_ in work], sources, counts, batch, turn

    def _fill_rows(self, turn: int, states: list[GrammarState], first: int) -> None:
        """Rows first, first + 1, ... of host buffer `turn`: each state's next mask."""
        if not states:  # no call at all: each call into xgrammar or torch lets go of the GIL
            return
        for state in states:
            if state.matcher is None:
                state.start(self.xgr)
        # a row whose request ended in the step in flight (its matcher took the stop token) is still in this
        # step, launched before the host knew: its token will be dropped, so any mask does
        live = [j for j, state in enumerate(states) if not (state.rejected or state.terminated)]
        if live:
            self.filler.batch_fill_next_token_bitmask([states[j].matcher for j in live], self.host[turn],
                                                      [first + j for j in live])
        if len(live) < len(states):
            for j in sorted(set(range(len(states))) - set(live)):
                self.host_views[turn][first + j] = self.stop_only

    def _take(self, states: list[GrammarState], tokens: list[int], seq_ids: list[int],
              allowed: list[bool] | None = None) -> None:
        """Each matcher takes its one new token (seq_ids: for the log), in one call. allowed: whether the mask each
        token was sampled under allowed it, when known, which is xgrammar's verdict too (the mask is the set of
        tokens the matcher accepts); then the verdicts are not read back from xgrammar, which costs one GIL
        release per row: beside the engine's thread, milliseconds per step."""
        if not states:
            return
        for state in states:
            if state.matcher is None:
                state.start(self.xgr)
        open_rows = [j for j, state in enumerate(states) if not (state.rejected or state.terminated)]
        if allowed is None:
            verdicts = self.xgr.BatchGrammarMatcher.batch_accept_token([states[j].matcher for j in open_rows],
                                                                       [tokens[j] for j in open_rows])
        else:
            verdicts = [allowed[j] for j in open_rows]
            taken = [j for j in open_rows if allowed[j]]
            self._accept_unread([states[j].matcher for j in taken], [tokens[j] for j in taken])
        # counted once taken: if xgrammar raised, the next start takes the tokens again (through the public call)
        for state in states:
            state.num_accepted += 1
        for j, ok in zip(open_rows, verdicts):
            if not ok:
                self._reject(seq_ids[j], states[j])
            elif tokens[j] in states[j].stop_token_ids:
                states[j].terminated = states[j].matcher.is_terminated()

    def _accept_unread(self, matchers: list, tokens: list[int]) -> None:
        """xgrammar's batch accept without reading its answers back (its public call reads them one by one)."""
        if self.core is None:
            self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        elif matchers:
            self.core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)

    def _allowed(self, tokens: list[int], sources: list[int | None]) -> list[bool] | None:
        """Whether each token is in the host mask row `sources` names (None: not known for every row). Plain
        Python over numpy views: a torch call lets go of the GIL, which beside the engine's thread costs more
        than this loop."""
        if not tokens or None in sources:
            return None
        span = self.host[0].size(0)
        return [bool(int(self.host_views[source // span][source % span, token >> 5]) >> (token & 31) & 1)
                for token, source in zip(tokens, sources)]

    def _take_several(self, work: list[tuple[GrammarState, list[int], int]]) -> None:
        """Matchers more than one token behind (a row that missed a step's fill) take theirs one by one."""
        for state, new, seq_id in work:
            state.start(self.xgr)
            if not (state.rejected or state.terminated):
                if not all(state.matcher.accept_token(token) for token in new):
                    self._reject(seq_id, state)
                state.terminated = state.matcher.is_terminated()
            state.num_accepted += len(new)

    @staticmethod
    def _reject(seq_id: int, state: GrammarState) -> None:
        logger.warning("constrained request %d sampled a token its grammar refuses (were all the allowed tokens "
                       "banned by bad_words?): it may only end now", seq_id)
        state.rejected = True


def _logged(done: Future) -> None:
    # nothing waits for a fill ahead: its failure would go unseen (the next start fills those rows itself)
    if done.exception() is not None:
        logger.error("filling structured-output masks ahead failed", exc_info=done.exception())


def _accept_binding(xgr: Any) -> Any:
    """xgrammar's binding under its public batch accept (whose answers _take knows already), if it takes the call
    _accept_unread makes; else None, and the public call is used."""
    core = getattr(getattr(xgr, "base", None), "_core", None)
    try:
        core.BatchGrammarMatcher.batch_accept_token([], [], False)
    except Exception:  # noqa: BLE001 - another xgrammar version: any failure means "use the public call"
        return None
    return core


def _bit(position: int) -> int:
    # bit 31 of an int32 is its sign
    return (1 << position) - (1 << 32 if position == 31 else 0)
