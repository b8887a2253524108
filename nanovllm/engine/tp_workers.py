"""Tensor-parallel ranks 1..N-1: spawned processes that mirror every step rank 0 launches on its ModelRunner."""
import gc
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.synchronize import Event

import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm.config import Config
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.shm_channel import WorkerChannel
from nanovllm.engine.spawn_guard import death_hint
from nanovllm.engine.step import Step

STORE_TIMEOUT = timedelta(minutes=5)


def _worker_main(config: Config, rank: int, store_path: str, shm_name: str, event: Event) -> None:
    store = dist.FileStore(store_path)
    store.set_timeout(STORE_TIMEOUT)
    reach = lambda stage: store.set(f"{stage}-{rank}", "1")  # noqa: E731
    reach("started")
    runner = ModelRunner(config, rank, store, reach)
    store.wait([shm_name])  # rank 0 creates the segment once its own runner is ready
    channel = WorkerChannel(shm_name, create=False)
    previous: Step | None = None  # its tokens (broadcast from rank 0) feed the next decode's PENDING rows
    try:
        while True:
            method, args = channel.receive(event)
            if method == "exit":
                runner.exit()
                break
            seqs, is_prefill, block_copies, prompt_rows = args  # "launch"
            previous = runner.launch(Step.of(seqs, is_prefill, block_copies, prompt_rows), previous)
    finally:
        channel.close()


class Workers:
    """Spawns ranks 1..N-1 with their own rendezvous store and segment name, so engines never collide.

    The store is a file in a directory only this user can read (a TCP store would listen on every interface,
    unauthenticated)."""

    def __init__(self, config: Config) -> None:
        size = config.tensor_parallel_size
        self.store_dir = tempfile.mkdtemp(prefix="nanovllm-store-")  # mode 0700
        self.store_path = os.path.join(self.store_dir, "store")
        self.store = dist.FileStore(self.store_path)
        self.store.set_timeout(STORE_TIMEOUT)
        self.shm_name = f"nanovllm-{uuid.uuid4().hex[:16]}"
        self.channel: WorkerChannel | None = None
        ctx = mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(1, size)]
        self.processes = [
            ctx.Process(target=_worker_main, args=(config, rank, self.store_path, self.shm_name, event), daemon=True)
            for rank, event in zip(range(1, size), self.events)
        ]
        for process in self.processes:
            process.start()
        self.pids = [process.pid for process in self.processes]

    def open_channel(self) -> None:
        """Called once rank 0's runner is built: workers attach to the segment only after it exists."""
        self.channel = WorkerChannel(self.shm_name, create=True)
        self.store.set(self.shm_name, "ready")

    def send(self, method: str, *args) -> None:
        self.channel.send(self.events, method, *args, check_alive=self.check_alive)

    def launch(self, step: Step) -> None:
        self.send("launch", step.seqs, step.is_prefill, step.block_copies, step.prompt_rows)

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
        dead = [rank for rank, p in enumerate(self.processes, 1) if p.exitcode is not None]
        if dead:
            started = all(self.store.check([f"started-{rank}"]) for rank in dead)
            named = ", ".join(f"rank {rank} (exit code {self.processes[rank - 1].exitcode})" for rank in dead)
            raise RuntimeError(f"tensor-parallel worker(s) died: {named}{death_hint(started)}")

    def join(self, timeout: float = 30.0) -> None:
        if self.any_dead():  # the others may wait forever in a collective with the dead one
            timeout = 0.0
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():  # stuck in a collective whose peer is gone
                process.kill()
                process.join()

    def tell_exit(self) -> None:
        # signalling a killed worker's Event can block forever, so the dead are not told
        if self.channel is not None and not self.any_dead():
            self.send("exit")

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the workers to stop and release what they shared: the segment, and the events' named
        semaphores (in /dev/shm until their last Python object is collected, so they are dropped here even if
        the engine object lives on)."""
        self.join(timeout)
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.processes, self.events = [], []
        self.store = None
        shutil.rmtree(self.store_dir, ignore_errors=True)
        gc.collect()


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


@contextmanager
def interrupts_deferred_in_exit():
    """Hold SIGINT and SIGTERM, where Python handles them, until the block ends, then hand the first to its handler.
    A second interrupt in an engine's exit (a data-parallel replica stopped twice, Ctrl-C pressed twice) would cut
    its clean-up short and leave the workers' rendezvous folder and shared memory behind; the exit is bounded (the
    workers get 30 s), so the interrupt waits for it. A signal left to its default action is not held."""
    if threading.current_thread() is not threading.main_thread():  # handlers can be set only there
        yield
        return
    caught: list[tuple[int, object]] = []
    held = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    held = {signum: handler for signum, handler in held.items() if callable(handler)}
    for signum in held:
        signal.signal(signum, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
    if caught:
        held[caught[0][0]](*caught[0])
