"""Rank 0 -> tensor-parallel workers: one pickled [method, *args] at a time in a shared-memory segment."""
import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

SHM_SIZE = 1 << 24
SEND_TIMEOUT = timedelta(minutes=5)


class WorkerChannel:
    """Rank 0 -> workers: one pickled [method, *args] in a shared-memory segment, one Event per worker.

    The first 4 bytes hold the message length; a message that does not fit is an error, never a truncation.
    """

    def __init__(self, name: str, create: bool) -> None:
        self.shm = SharedMemory(name=name, create=create, size=SHM_SIZE if create else 0)
        self.owner = create  # rank 0 created the segment and unlinks it

    def send(self, events: list[Event], method: str, *args, check_alive: Callable[[], None] = lambda: None) -> None:
        """`check_alive` raises if a worker has died: a dead worker never reads, so it is asked while waiting."""
        data = pickle.dumps([method, *args])
        # rank 0 runs a step ahead of the device: a worker may not have read the last message yet (it clears
        # its event once it has), and overwriting it would lose a step
        deadline = time.monotonic() + SEND_TIMEOUT.total_seconds()
        next_check = time.monotonic() + 0.1
        while any(event.is_set() for event in events):
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"a tensor-parallel worker did not read its last message within {SEND_TIMEOUT}")
            if now > next_check:
                check_alive()
                next_check = now + 0.1
            time.sleep(0)
        if len(data) + 4 > self.shm.size:
            raise RuntimeError(f"tensor-parallel message of {len(data)} bytes exceeds the {self.shm.size}-byte "
                               f"shared-memory segment")
        self.shm.buf[:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:4 + len(data)] = data
        for event in events:
            event.set()

    def receive(self, event: Event) -> tuple[str, list]:
        parent = os.getppid()
        while not event.wait(timeout=1.0):
            if os.getppid() != parent:  # rank 0 died without telling us: do not outlive it holding a GPU
                raise SystemExit("tensor-parallel worker: rank 0 is gone")
        n = int.from_bytes(self.shm.buf[:4], "little")
        method, *args = pickle.loads(self.shm.buf[4:4 + n])
        event.clear()
        return method, args

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()
