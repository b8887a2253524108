"""Structured outputs, the mask worker: a process of its own that keeps every constrained request's xgrammar
matcher, takes each step's sampled tokens into them and fills their next bitmasks into memory it shares with the
engine (sampling/grammar_mask.py is the engine's side, and says when each message is sent).

At 512 rows, a step's xgrammar calls and the Python around them take about 3 ms on the path from one step's
tokens to the next step's sampler. In a thread of the engine's process, that Python held the engine's GIL while
the engine launched the next step (0.8 ms longer per step) and waited for it. Here none of it does. Messages come
through a pipe, in order, each `[method, *args]` of MaskWorker; only `fill` is answered (with the errors of the
`ahead`s before it, which nothing waits for).

Shared memory: two bitmask buffers of 2 x max_rows rows each (one may still be copying to the device while the
next step fills the other), a step's sampled tokens (written by the device) and three counters: two the device
writes behind its work (the last step whose tokens have landed, the last copy of the buffers to the device that is
done) and one this worker writes (the last fill whose rows are all written, which the device waits for before it
copies them).
"""
import os
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from nanovllm.sampling.grammar import GrammarCompiler, import_xgrammar
from nanovllm.sampling.grammar_fill import FILL_THREADS, Constraint, MaskFiller
from nanovllm.sampling_params import StructuredOutputsParams

TOKENS_LANDED, COPY_DONE, MASK_READY = 0, 1, 2  # the counters
WAIT_LIMIT_S = 120.0
# A fill ahead of many rows is split in two, a thread each: xgrammar's accept holds the GIL but its fill lets go
# of it, so one half's fill runs beside the other half's accept (2,048 rows on 2 cores: a fill of each half in a
# thread of its own took 31 ms, against 55 ms for all of them in one).
AHEAD_SHARDS, SHARD_ROWS = 2, 64


@dataclass(frozen=True)
class SharedLayout:
    """Where the worker's shared memory holds what: `max_rows` rows a step at most, bitmask rows `width` words."""

    max_rows: int
    width: int

    @property
    def span(self) -> int:  # rows per buffer: a step's rows filled ahead, then the next step's own
        return 2 * self.max_rows

    @property
    def nbytes(self) -> int:
        return 2 * self.span * self.width * 4 + self.max_rows * 8 + 3 * 8

    @property
    def counters_at(self) -> int:
        """Byte offset of the counters."""
        return 2 * self.span * self.width * 4 + self.max_rows * 8

    def views(self, buffer: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bitmask rows of both buffers, [2 * span, width] int32; tokens, int64; counters, int64)."""
        rows = np.ndarray((2 * self.span, self.width), np.int32, buffer)
        offset = rows.nbytes
        tokens = np.ndarray((self.max_rows,), np.int64, buffer, offset)
        counters = np.ndarray((3,), np.int64, buffer, offset + tokens.nbytes)
        return rows, tokens, counters


@dataclass
class StepWork:
    """A step's constrained rows, as columns (the engine's `start` makes it): each row's place in the step, its
    request, its tokens sampled so far, the source row its mask is placed at and the generation of the fill
    ahead that put it there (-1: none)."""

    rows: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    generations: list[int] = field(default_factory=list)


class MaskWorker:
    """The matchers and the fills, in the worker process (`serve`; tests drive one in their own). Its compiler
    builds what the engine's compiled (xgrammar's compiled grammars do not cross processes cheaply)."""

    def __init__(self, tokenizer_info_json: str, stop_token_ids: list[int], engine_pid: int | None = None) -> None:
        """engine_pid: the engine's process (its death ends a wait for the device); None: this one."""
        self.engine_pid = os.getppid() if engine_pid is None else engine_pid
        self.xgr = import_xgrammar()
        info = self.xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
        self.compiler = GrammarCompiler(None, info.vocab_size, stop_token_ids, tokenizer_info=info)
        self.stop_token_ids = stop_token_ids
        self.grammars: dict[int, Future] = {}  # by slot: its compiled grammar
        self.constraints: dict[int, Constraint] = {}
        self.filler: MaskFiller | None = None
        self.sampled_under = np.full(0, -1)  # by row of the last filled step: the mask row it is sampled under
        self.errors: list[str] = []  # of fills ahead, sent with the next fill's answer

    def attach(self, layout: SharedLayout, shared: memoryview, fill_threads: int = FILL_THREADS) -> None:
        """The engine's shared memory (its first constrained step makes it)."""
        self.layout = layout
        self.rows, self.tokens, self.counters = layout.views(shared)
        self.fillers = [MaskFiller(self.xgr, self.rows, self.stop_token_ids, fill_threads)
                        for _ in range(AHEAD_SHARDS)]
        self.filler = self.fillers[0]
        self.shards = ThreadPoolExecutor(AHEAD_SHARDS - 1, thread_name_prefix="nanovllm-mask-shard")

    def release(self) -> None:
        """Let go of the shared memory's views (it cannot be closed while numpy arrays point into it)."""
        if self.filler is not None:
            self.shards.shutdown()
        self.filler = self.fillers = self.rows = self.tokens = self.counters = None

    def compile(self, spec: StructuredOutputsParams) -> None:
        """Start compiling a spec the engine just took (so it is ready here when its request first runs)."""
        self.compiler.submit(spec)

    def add(self, new: list[tuple[int, StructuredOutputsParams]]) -> None:
        """Requests the engine runs for the first time: (slot, spec) each. One message's requests of one spec
        share its object (pickle keeps them one), so its key is made once."""
        by_object: dict[int, Future] = {}
        for slot, spec in new:
            if id(spec) not in by_object:
                by_object[id(spec)] = self.compiler.submit(spec)
            self.grammars[slot] = by_object[id(spec)]

    def drop(self, slots: list[int]) -> None:
        for slot in slots:
            self.grammars.pop(slot, None)
            self.constraints.pop(slot, None)

    def constraint(self, slot: int) -> Constraint:
        found = self.constraints.get(slot)
        if found is None:
            matcher = self.xgr.GrammarMatcher(self.grammars[slot].result())
            found = self.constraints[slot] = Constraint(matcher, getattr(matcher, "_handle", None),
                                                        frozenset(matcher.stop_token_ids))
        return found

    def ahead(self, rows: list[int], slots: list[int], turn: int, generation: int, tokens: list[int] | None,
              copy_done: int) -> None:
        """A step's sampled rows (rows: their places in the step; slots: their requests): take their tokens (None:
        once the device has written them here) into the matchers and fill their next masks into rows 0, 1, ... of
        buffer `turn`, for the next step. copy_done: the last copy to the device that read that buffer."""
        try:
            self.wait(TOKENS_LANDED, generation if tokens is None else 0)
            self.wait(COPY_DONE, copy_done)
            new = self.tokens[rows].tolist() if tokens is None else [tokens[row] for row in rows]
            known = self.constraints.get  # a method call per row costs as much as xgrammar's accept of its token
            constraints = [known(slot) or self.constraint(slot) for slot in slots]
            for constraint, token in zip(constraints, new):
                constraint.tokens.append(token)
            under = self.sampled_under[rows] if len(self.sampled_under) > rows[-1] else None
            allowed = self.filler.allowed(new, under)  # read before this fill overwrites any of those rows
            count, first_row = len(slots), turn * self.layout.span
            split = count // 2 if count >= SHARD_ROWS else count
            halves = [self.shards.submit(self._take_and_fill, self.fillers[1], constraints, new, allowed, generation,
                                         split, count, first_row)] if split < count else []
            try:
                try:
                    self._take_and_fill(self.filler, constraints, new, allowed, generation, 0, split, first_row)
                finally:
                    for half in halves:  # both are done before anything else reads or writes those rows
                        half.result()
            except BaseException:  # rows half written: no mark may name them
                for constraint in constraints:
                    constraint.filled = None
                raise
        except Exception:  # noqa: BLE001 - nothing waits for a fill ahead: the next fill says what failed
            self.errors.append(traceback.format_exc())

    @staticmethod
    def _take_and_fill(filler: MaskFiller, constraints: list[Constraint], tokens: list[int],
                       allowed: list[bool] | None, generation: int, first: int, end: int, first_row: int) -> None:
        """Rows [first, end) of a fill ahead: their matchers take their tokens, then their next masks are filled."""
        filler.take(constraints[first:end], tokens[first:end], None if allowed is None else allowed[first:end],
                    (first_row + first, generation))
        filler.fill(constraints[first:end], range(first_row + first, first_row + end))

    def fill(self, number: int, work: StepWork, batch: int, copy_done: tuple[int, int]) -> list[str]:
        """A step's constrained rows: the engine has placed each row's mask at its source row (of either buffer),
        where a fill ahead of that generation put it (generation -1: a row to fill there now). Rows whose mask is
        not there as expected (new, behind, or a fill ahead failed) are filled there now; then the counter the
        device waits on says fill `number` is done, whatever happened. copy_done: per buffer, the last copy to the
        device that read it. Returns the errors of the fills ahead before it."""
        try:
            refill, at, known = [], [], self.constraints.get
            for slot, length, source, generation in zip(work.slots, work.lengths, work.sources, work.generations):
                constraint = known(slot) or self.constraint(slot)
                if length != constraint.num_accepted:
                    self.catch_up(constraint, length)
                elif constraint.filled == (source, generation, length):
                    continue
                refill.append(constraint)
                at.append(source)
            for buffer in {source // self.layout.span for source in at}:  # those rows may still be copying
                self.wait(COPY_DONE, copy_done[buffer])
            if refill:
                self.filler.fill(refill, at)
            self.sampled_under = np.full(batch, -1)
            self.sampled_under[work.rows] = work.sources
            errors, self.errors = self.errors, []
            return errors
        finally:
            self.counters[MASK_READY] = number

    def catch_up(self, constraint: Constraint, length: int) -> None:
        """A matcher not at its row's `length` tokens: behind (a fill ahead failed: it takes the tokens it missed
        one by one). A row shorter than the tokens taken, or longer than the tokens sent here, never comes in a
        healthy run: that row may only end."""
        if length < constraint.num_accepted or length > len(constraint.tokens):
            constraint.terminated = True
            return
        if not (constraint.rejected or constraint.terminated):
            if not all(constraint.matcher.accept_token(t) for t in constraint.tokens[constraint.num_accepted:length]):
                self.filler.reject(constraint)
            constraint.terminated = constraint.matcher.is_terminated()
        constraint.num_accepted = length

    def wait(self, counter: int, value: int) -> None:
        """Until the device has written `value` (or more) to a counter: a spin, then short sleeps. Every value
        waited for is already queued on the device, so a long wait means a device that stopped (an error, after
        WAIT_LIMIT_S) or an engine that died (the worker ends)."""
        start = time.perf_counter()
        while self.counters[counter] < value:
            waited = time.perf_counter() - start
            if waited > 0.002:
                time.sleep(0.0001)
                if waited > 1.0 and os.getppid() != self.engine_pid:
                    raise SystemExit("nanovllm mask worker: the engine is gone")
                if waited > WAIT_LIMIT_S:
                    raise RuntimeError(f"the device did not write the structured-output mask's counter {counter} "
                                       f"(waiting for {value}, at {self.counters[counter]}) within {WAIT_LIMIT_S} s")
