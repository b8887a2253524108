"""One data-parallel replica: an engine fed from an inbox, its results handed to a sender as they finish.

The same loop runs in a spawned process (backend "mp") and in a Ray actor (backend "ray"); only the transport
around it differs. The driver sends lists of items: work (Work), DRAIN (no more work for now: finish what you
hold) and STOP. The replica's messages are ("ready", (its host, its StartupTimes)), ("results", [(index, output or
exception), ...])
with whatever finished while the previous message was being sent (sender.py), and ("error", text), sent after
every result that finished before it and the last message of a replica that goes away. A replica told STOP
exits only once every result is sent.
"""
import queue
import socket
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from importlib import import_module
from typing import NamedTuple

from nanovllm.engine.startup import StartupTimes
from nanovllm.sampling_params import SamplingParams

from .sender import Sender

DRAIN, STOP = "drain", "stop"


class Work(NamedTuple):
    index: int  # the request's index in the driver's input
    prompt: object
    params: SamplingParams


def engine_named(engine_class: type | str) -> type:
    """The engine class itself, or one named "module:name" (imported here): a driver that has not imported the
    engine yet can still ask for it, since pickling a class for a spawned process imports its module."""
    if not isinstance(engine_class, str):
        return engine_class
    module, _, name = engine_class.partition(":")
    return getattr(import_module(module), name)


def serve(make_engine: Callable[[], object], inbox: queue.Queue, send: Callable[[tuple], None],
          requested_at: float | None = None) -> None:
    """Load the engine, then run sessions until STOP, sending through `send` from a thread of its own (sender.py).
    A session is one iter_generate over work pulled from the inbox as the engine has room, ended by DRAIN, so
    that work the driver hands out later (a dead peer's requests) starts a new session rather than needing the
    end of the input to be known in advance. requested_at: when the driver asked for this replica (time.time()),
    so that its start-up times include getting here (the process's start and imports)."""
    with Sender(send) as sender:  # leaving it sends what is queued: results first, an error last
        _serve(make_engine, inbox, sender.put, requested_at)


def _serve(make_engine: Callable[[], object], inbox: queue.Queue, send: Callable[[tuple], None],
           requested_at: float | None) -> None:
    startup = StartupTimes(time.time() if requested_at is None else requested_at)
    if requested_at is not None:
        startup.lap("start and imports")
    try:
        engine = make_engine()
    except BaseException as error:
        _tell(send, "the engine failed to start", error)
        raise
    startup.extend(getattr(engine, "startup", None))  # an engine that times its own start-up (LLM does)
    startup.set_ready()
    send(("ready", (socket.gethostname(), startup)))
    with engine:
        while (item := inbox.get()) != STOP:
            if item != DRAIN and not _session(engine, item, inbox, send):
                break


def _session(engine, first: Work, inbox: queue.Queue, send: Callable[[tuple], None]) -> bool:
    """Run work until DRAIN (True) or STOP (False); the engine pulls the next item whenever it has room."""
    index_of: dict[int, int] = {}  # the engine's own index (its pull order) -> the driver's index
    params: deque[SamplingParams] = deque()
    stopped, pulled = False, 0

    def prompts() -> Iterator[object]:
        nonlocal stopped, pulled
        item = first
        while isinstance(item, Work):
            index_of[pulled] = item.index
            pulled += 1
            params.append(item.params)
            yield item.prompt
            # blocks the engine only when the driver has fallen a whole slack (max_num_seqs items) behind
            item = inbox.get()
        stopped = item == STOP

    def params_in_step() -> Iterator[SamplingParams]:
        while True:
            yield params.popleft()

    try:
        for local, output in engine.iter_generate(prompts(), params_in_step(), errors="yield"):
            send(("result", (index_of.pop(local), output)))
    except BaseException as error:
        _tell(send, "generation failed", error)
        raise
    return not stopped


def describe_error(error: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(error), error)).strip()


def _tell(send: Callable[[tuple], None], what: str, error: BaseException) -> None:
    """Send the driver ("error", what and why). Not for an interrupt: the replica was stopped, and how it ends says
    by what (a process ends by the signal, replica_process.py)."""
    if isinstance(error, KeyboardInterrupt):
        return
    try:
        send(("error", f"{what}: {describe_error(error)}"))
    except Exception:  # the driver is gone too: nobody left to tell
        pass
