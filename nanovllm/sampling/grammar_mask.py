"""Structured outputs, sampling: one step's token mask for its constrained rows, as the engine's side of the mask
worker (sampling/mask_worker.py, a process that keeps the matchers and fills the masks into shared memory).

As soon as a step's sampler is queued (`after_sample`) the worker is told which rows to take tokens for, and the
device writes the tokens into the shared memory behind the sampler: the worker takes them into the matchers and
fills the rows' next masks ahead, into rows the engine knows (row j of a buffer: the j-th row sent). The next
step's `start`, after its forward is launched, places each constrained row's mask (where it was filled ahead, or
a new row to fill) and asks the worker to fill what is missing. `finish` queues, on the device, a wait for the
worker's counter (sampling/host_wait.py), the copy of those rows and the sampler's apply (StepMask,
sampling/mask_kernel.py): the engine goes on at once, and reads the worker's answer (`confirm`) only when that
step's tokens are read back. Without a stream wait (the CPU) `finish` reads the answer itself. A step without
constrained rows never comes here."""
import logging
import os
import select
import threading
import weakref
from collections import deque
from multiprocessing.shared_memory import SharedMemory

import torch

from nanovllm.sampling.grammar import GrammarState
from nanovllm.sampling.grammar_fill import FILL_THREADS
from nanovllm.sampling.host_wait import HostCounterWait
from nanovllm.sampling.mask_kernel import StepMask
from nanovllm.sampling.mask_process import MaskProcess
from nanovllm.sampling.mask_worker import COPY_DONE, MASK_READY, TOKENS_LANDED, SharedLayout, StepWork
from nanovllm.sampling.rows import SamplingRow

logger = logging.getLogger(__name__)
# how far past the last fill asked for a released counter reads (the device compares it cyclically over 32 bits):
# waits queued while the engine had not yet noticed the worker was gone go on too
RELEASE_MARGIN = 1 << 30


class GrammarMasks:
    """The shared memory of `worker` (SharedLayout: two bitmask buffers used in turn, a step's tokens, three
    counters) for batches of up to `max_rows` rows over a vocabulary of `vocab_size` (the logits' width), and its
    copy on the device. Each constrained request is a `slot` in the worker from its first step on, dropped with its
    GrammarState."""

    def __init__(self, worker: MaskProcess, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.worker, self.vocab_size, self.max_rows, self.device = worker, vocab_size, max_rows, device
        self.layout = layout = SharedLayout(max_rows, -(-vocab_size // 32))
        self.shared = SharedMemory(create=True, size=layout.nbytes)
        self.registered = False
        try:
            self._set_up(layout, device)
        except BaseException:
            _release(self.shared, self.registered, self.host[0].data_ptr() if self.registered else 0)
            raise
        self._finalizer = weakref.finalize(self, _release, self.shared, self.registered,
                                           self.host[0].data_ptr() if self.registered else 0)
        worker.send("attach", layout, self.shared.name, FILL_THREADS)
        self.wait = HostCounterWait.load(self.host[0].data_ptr() + layout.counters_at + 8 * MASK_READY) \
            if self.registered else None
        self.turn = 0  # the buffer the next step's start fills
        self.generation = 0  # steps whose tokens were sent
        self.ahead: list[dict[int, int]] = [{}, {}]  # per buffer: slot -> row, of the last fill ahead into it
        self.ahead_generation = [0, 0]
        self.copies = 0  # copies to the device queued
        self.last_copy = [0, 0]  # per buffer: the last copy that read it
        self.fills = 0  # fills asked for
        self.answered = 0  # fills whose answer was read: each answer names its fill, so one never read is passed
        # the step started: (turn, rows in the step, constrained rows, their source rows, rows copied per buffer)
        self.started: tuple[int, int, list[int], list[int], list[int]] | None = None
        self.next_slot = 1
        self.dropped: deque[int] = deque()  # slots of GrammarStates gone (appended by their finalizers)
        self.closed = False
        if self.wait is not None and hasattr(worker, "process"):  # a worker that dies must not leave a wait
            threading.Thread(target=_release_when_gone, args=(worker.process.pid, weakref.ref(self)), daemon=True,
                             name="nanovllm-mask-watch").start()

    def _set_up(self, layout: SharedLayout, device: torch.device) -> None:
        rows, tokens, counters = layout.views(self.shared.buf)
        self.host = [torch.from_numpy(rows[:layout.span]), torch.from_numpy(rows[layout.span:])]
        self.tokens, self.counters = torch.from_numpy(tokens), torch.from_numpy(counters)
        self.counter_values = counters  # the host's own writes (numpy: torch refuses in-place writes to a tensor
        # made in inference mode, outside it)
        self.all_rows = torch.from_numpy(rows)  # both buffers, for sources (which index both)
        self.device_rows = self.marks = None
        if device.type == "cuda":  # pinned in place, so the copies to and from the device run beside the host
            mapped = 2  # cudaHostRegisterMapped: the device's stream waits read the counter in place
            status = torch.cuda.cudart().cudaHostRegister(self.host[0].data_ptr(), layout.nbytes, mapped)
            if int(status) != 0:
                raise RuntimeError(f"could not pin the structured-output mask memory ({layout.nbytes} bytes): "
                                   f"cudaHostRegister returned {status}")
            self.registered = True
            self.device_rows = torch.zeros(2 * layout.span, layout.width, dtype=torch.int32, device=device)
            self.marks = torch.zeros(2, dtype=torch.int64, device=device)  # the counters' values, device side

    def start(self, seqs: list[SamplingRow]) -> int | None:
        """Ask the worker for a step's mask, for the constrained rows among `seqs` (None when there are none), while
        the caller goes on; `finish` the fill number it returns."""
        span, turn = self.layout.span, self.turn
        work, new, refill = StepWork(), [], len(self.ahead[turn])
        counts = [0, 0]  # per buffer: its rows [0, count) hold this step's masks
        # the newer of the two fills ahead first: a row sampled in the last step has it in `turn`
        newer, older = (turn, turn ^ 1) if self.ahead_generation[turn] >= self.ahead_generation[turn ^ 1] else \
            (turn ^ 1, turn)
        for row, seq in enumerate(seqs):
            state = seq.grammar
            if state is None:
                continue
            if state.slot is None:
                new.append(self._register(state))
            for buffer in (newer, older):
                position = self.ahead[buffer].get(state.slot)
                if position is not None:
                    generation, source = self.ahead_generation[buffer], buffer * span + position
                    break
            else:
                generation, source, refill = -1, turn * span + refill, refill + 1
            counts[source // span] = max(counts[source // span], source % span + 1)
            work.rows.append(row)
            work.slots.append(state.slot)
            work.lengths.append(seq.num_completion_tokens)
            work.sources.append(source)
            work.generations.append(generation)
        if not work.rows:
            return None
        if len(seqs) > self.max_rows:
            raise RuntimeError(f"a step of {len(seqs)} rows exceeds the structured-output mask's {self.max_rows}")
        if self.dropped:
            self._send("drop", [self.dropped.popleft() for _ in range(len(self.dropped))])
        if new:
            self._send("add", new)
        self.turn = turn ^ 1
        self.fills += 1
        # the copies queued so far, as they are now (finish counts this step's own in)
        self._send("fill", self.fills, work, len(seqs), tuple(self.last_copy))
        self.started = (turn, len(seqs), work.rows, work.sources, counts)
        return self.fills

    def finish(self, number: int) -> StepMask:
        """The mask `start` asked for (fill `number`), queued for the device (on the caller's stream) behind a
        wait for the worker to have written it; on the host, once the worker has."""
        turn, batch, rows, sources, counts = self.started
        if self.wait is None:
            self.confirm(number)
        else:
            self.wait.until(number)
        span = self.layout.span
        in_place = rows == list(range(batch)) and sources == list(range(turn * span, turn * span + batch))
        if self.device_rows is None:  # CPU: the logits are on the host too
            if in_place:
                return StepMask(self.host[turn][:batch], None, self.vocab_size)
            full = torch.zeros(batch, self.layout.width, dtype=torch.int32)
            full[rows] = self.all_rows[sources]
            return StepMask(full, rows, self.vocab_size)
        self.copies += 1
        for buffer, count in enumerate(counts):
            if count:
                first = buffer * span
                self.device_rows[first:first + count].copy_(self.host[buffer][:count], non_blocking=True)
        self._mark(COPY_DONE, self.copies)  # the worker may write those rows again once the device has read them
        for buffer, count in enumerate(counts):  # after the mark: no fill may wait for a copy never marked
            if count:
                self.last_copy[buffer] = self.copies
        if in_place:
            return StepMask(self.device_rows[turn * span:turn * span + batch], None, self.vocab_size)
        index = torch.tensor([rows, sources], dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)
        return StepMask(self.device_rows, index[0], self.vocab_size, index[1])

    def confirm(self, number: int) -> None:
        """Read the worker's answers up to fill `number`'s (before a token sampled under that mask is taken):
        the error it raised, if any, is raised here. A worker gone releases the device's waits first."""
        while self.answered < number:
            try:
                self.answered, answer = self.worker.receive()
            except RuntimeError:  # the worker is gone (a Ctrl-C here leaves the waits to a worker that is not)
                self._release_waits()
                raise
            if isinstance(answer, BaseException):
                if self.answered == number:
                    raise answer
                continue  # the answer to a step that never sampled (an exception or Ctrl-C before it)
            for error in answer:
                logger.error("filling structured-output masks ahead failed (the next step filled them):\n%s", error)

    def after_sample(self, seqs: list[SamplingRow], sampled: list[bool], token_ids: torch.Tensor) -> None:
        """A step's sampler is queued: its constrained rows whose token is kept (sampled: not a prefill chunk short
        of its prompt's end) take their tokens in the worker, which fills their next masks ahead into the buffer
        the next step's `start` takes. On the device the tokens and their counter go to the shared memory behind
        the sampler, and the worker waits for them there."""
        rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None and sampled[row]]
        if not rows:
            return
        self.generation += 1
        tokens = None
        if self.registered:
            self.tokens[:len(seqs)].copy_(token_ids, non_blocking=True)
            self._mark(TOKENS_LANDED, self.generation)
        else:
            tokens = token_ids.tolist()
        slots = [seqs[row].grammar.slot for row in rows]
        self.note_ahead(self.turn, slots, self.generation)
        self._send("ahead", rows, slots, self.turn, self.generation, tokens, self.last_copy[self.turn])

    def note_ahead(self, buffer: int, slots: list[int], generation: int) -> None:
        """The fill ahead of `generation` puts slot slots[j]'s mask at row j of `buffer`."""
        self.ahead[buffer] = {slot: j for j, slot in enumerate(slots)}
        self.ahead_generation[buffer] = generation

    def close(self) -> None:
        """Free the shared memory (the worker is the compiler's to stop)."""
        self._release_waits()
        self.closed = True
        if self.registered:
            torch.cuda.synchronize()  # no copy may still read or write it
        self._finalizer()

    def _release_waits(self) -> None:
        """Let every device wait go on (the worker is gone, or the engine closes; the tokens then sampled are not
        taken: the engine raises first)."""
        self.counter_values[MASK_READY] = self.fills + RELEASE_MARGIN

    def _send(self, method: str, *args: object) -> None:
        try:
            self.worker.send(method, *args)
        except RuntimeError:  # the worker is gone: the wait of a step already queued must not hang the device
            self._release_waits()
            raise

    def _register(self, state: GrammarState) -> tuple:
        state.slot, self.next_slot = self.next_slot, self.next_slot + 1
        weakref.finalize(state, self.dropped.append, state.slot)
        return state.slot, state.spec

    def _mark(self, counter: int, value: int) -> None:
        """The device writes `value` to the shared counter once the work queued before it is done."""
        self.marks[counter].fill_(value)
        self.counters[counter:counter + 1].copy_(self.marks[counter:counter + 1], non_blocking=True)


def _release_when_gone(pid: int, masks: weakref.ref) -> None:
    """A thread's: once the worker's process has exited, every device wait goes on (the engine may be blocked on
    the device, as a step's logprobs are read in its sampling, and would never reach a call that notices)."""
    try:
        descriptor = os.pidfd_open(pid)  # Linux 5.3+; elsewhere the engine's next message to the worker releases
    except (AttributeError, OSError):
        return
    try:
        select.select([descriptor], [], [])
    finally:
        os.close(descriptor)
    owner = masks()
    if owner is not None and not owner.closed:
        owner._release_waits()


def _release(shared: SharedMemory, registered: bool, pointer: int) -> None:
    if registered:
        torch.cuda.cudart().cudaHostUnregister(pointer)
    try:
        shared.close()
    except BufferError:  # a view still points into it: unlinked anyway, freed with the last view
        pass
    shared.unlink()
