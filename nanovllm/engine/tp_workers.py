"""Tensor-parallel ranks 1..N-1: spawned processes that mirror every call rank 0 makes on its ModelRunner."""
import pickle
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.shared_memory import SharedMemory
from multiprocessing.synchronize import Event

import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config

SHM_SIZE = 1 << 24
STORE_TIMEOUT = timedelta(minutes=5)


class WorkerChannel:
    """Rank 0 -> workers: one pickled [method, *args] in a shared-memory segment, one Event per worker.

    The first 4 bytes hold the message length; a message that does not fit is an error, never a truncation.
    """

    def __init__(self, name: str, create: bool) -> None:
        self.shm = SharedMemory(name=name, create=create, size=SHM_SIZE if create else 0)
        self.owner = create  # rank 0 created the segment and unlinks it

    def send(self, events: list[Event], method: str, *args) -> None:
        data = pickle.dumps([method, *args])
        # rank 0 runs a step ahead of the device: a worker may not have read the last message yet (it clears
        # its event once it has), and overwriting it would lose a step
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while any(event.is_set() for event in events):
            if time.monotonic() > deadline:
                raise RuntimeError(f"a tensor-parallel worker did not read its last message within {STORE_TIMEOUT}")
            time.sleep(0)
        if len(data) + 4 > self.shm.size:
            raise RuntimeError(f"tensor-parallel message of {len(data)} bytes exceeds the {self.shm.size}-byte "
                               f"shared-memory segment")
        self.shm.buf[:4] = len(data).to_bytes(4, "little")
        self.shm.buf[4:4 + len(data)] = data
        for event in events:
            event.set()

    def receive(self, event: Event) -> tuple[str, list]:
        event.wait()
        n = int.from_bytes(self.shm.buf[:4], "little")
        method, *args = pickle.loads(self.shm.buf[4:4 + n])
        event.clear()
        return method, args

    def close(self) -> None:
        self.shm.close()
        if self.owner:
            self.shm.unlink()


def _worker_main(config: Config, rank: int, port: int, shm_name: str, event: Event) -> None:
    from nanovllm.engine.model_runner import ModelRunner

    store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=STORE_TIMEOUT)
    reach = lambda stage: store.set(f"{stage}-{rank}", "1")  # noqa: E731
    reach("started")
    ModelRunner(config, rank, store, shm_name, event, reach)  # returns when rank 0 sends "exit"


class Workers:
    """Spawns ranks 1..N-1 with their own rendezvous store and segment name, so engines never collide."""

    def __init__(self, config: Config) -> None:
        size = config.tensor_parallel_size
        # port 0: the OS picks a free port, and the workers learn it from us
        self.store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                                   timeout=STORE_TIMEOUT)
        self.shm_name = f"nanovllm-{uuid.uuid4().hex[:16]}"
        ctx = mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(1, size)]
        self.processes = [
            ctx.Process(target=_worker_main, args=(config, rank, self.store.port, self.shm_name, event), daemon=True)
            for rank, event in zip(range(1, size), self.events)
        ]
        for process in self.processes:
            process.start()

    def wait_for(self, stage: str) -> None:
        """Wait for every worker to reach `stage` of its start-up; one that dies on the way is an error, not a
        hang (a collective with a dead peer would wait for its whole timeout)."""
        keys = [f"{stage}-{rank}" for rank in range(1, len(self.processes) + 1)]
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not reach {stage!r} within {STORE_TIMEOUT}")
            time.sleep(0.05)

    def any_dead(self) -> bool:
        return any(p.exitcode is not None for p in self.processes)

    def check_alive(self, grace: float = 0.0) -> None:
        """Raise naming every dead worker. `grace` gives a worker whose sockets just closed time to be reaped."""
        for process in self.processes:
            process.join(grace)
        dead = [f"rank {rank} (exit code {p.exitcode})" for rank, p in enumerate(self.processes, 1)
                if p.exitcode is not None]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) died: {', '.join(dead)}")

    def join(self, timeout: float = 30.0) -> None:
        if self.any_dead():  # the others may wait forever in a collective with the dead one
            timeout = 0.0
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():  # stuck in a collective whose peer is gone
                process.kill()
                process.join()


@contextmanager
def deferred_interrupt():
    """Hold Ctrl-C until the block ends. Rank 0 stopped halfway through a forward pass would leave the workers
    waiting in a collective, out of step with every later command; a whole step is short, so it finishes first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
