"""A replica's outgoing messages, sent by a thread of their own so that the engine never waits on the transport.

The engine's loop only puts messages on a local queue. The thread takes everything that has accumulated and sends
consecutive results as one message, ("results", [(index, output), ...]): while one message is being pickled and
written, the next batch builds up, so the busier the engine, the fewer messages per result, with no timer to tune.
Other messages ("ready", "error") go on their own, in the order they were put.
"""
import queue
import threading
from collections.abc import Callable

FLUSH_S = 10.0  # after a failure, how long what is queued gets to reach a driver that is not reading
_CLOSE = ("close", None)


class Sender:
    """put() never blocks; close() sends everything put before it. If sending fails (the driver is gone), the next
    put() raises that error, so the replica stops as it would had it sent the message itself."""

    def __init__(self, send: Callable[[tuple], None]) -> None:
        self._send = send
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nanovllm-dp-sender", daemon=True)
        self._thread.start()

    def put(self, message: tuple) -> None:
        """Queue ("result", (index, output)), ("ready", host) or ("error", text) for the driver."""
        if self._failure is not None:
            raise self._failure
        self._queue.put(message)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop the thread: waits for it all unless `timeout` s pass first."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def __enter__(self) -> "Sender":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        # after a failure the driver may be gone or no longer reading: a bounded wait, then the process may end
        self.close(None if exc_type is None else FLUSH_S)

    def _run(self) -> None:
        while True:
            taken = [self._queue.get()]
            while True:
                try:
                    taken.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                for message in batch_results(taken):
                    if message is _CLOSE:
                        return
                    self._send(message)
            except BaseException as error:  # whatever the transport raises ends the sending
                self._failure = error
                return


def batch_results(messages: list[tuple]) -> list[tuple]:
    """The messages in order, each run of consecutive ("result", item) gathered into one ("results", [items])."""
    batched: list[tuple] = []
    for message in messages:
        kind, payload = message
        if kind != "result":
            batched.append(message)
        elif batched and batched[-1][0] == "results":
            batched[-1][1].append(payload)
        else:
            batched.append(("results", [payload]))
    return batched
