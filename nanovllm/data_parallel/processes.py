"""Backend "mp": replicas as processes of this host, each on its own group of GPUs (or on CPU).

Replicas are forked where the caller asks for it and it is safe: on Linux, from a process that runs no other Python
thread, in which the CUDA driver has not been initialised (the driver counts GPUs through NVML only), and where a
forked child can run torch's intra-op thread pool (intra_op_pool_hangs). A forked
replica starts with everything the driver imported, while a spawned one first imports torch, transformers and
nanovllm again, seconds on the path to its first request. Elsewhere they are spawned.

Each replica has its own pipe. The driver closes its copy of the replica's end, and a forked replica closes its
copies of the driver's ends, so a replica that dies, even mid-message, reads as end-of-file once what it sent
before dying has been read: no wait on a dead process (nor, in a replica, on a dead driver). A
thread in the replica moves incoming work into a local queue as it arrives, and another sends its results
(sender.py), so neither the driver's sends nor the engine wait on the pipe (nor two full pipes on each other).
"""
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import connection, get_all_start_methods, get_context, resource_tracker
from multiprocessing.process import BaseProcess

from nanovllm.data_parallel.replica import STOP
from nanovllm.data_parallel.replica_process import INTERRUPTS, STOP_SIGNAL, check_devices, replica_main

__all__ = ["INTERRUPTS", "JOIN_S", "STOP_SIGNAL", "ProcessReplicas", "check_devices", "visible_gpus", "why_not_fork"]

JOIN_S = 30.0  # how long a replica gets to release its engine before it is killed
FORK_PROBE_S = 2.0  # a forked child's parallel region takes ~15 ms where the pool survives the fork (none hangs less)
CUDA_ERROR_NOT_INITIALIZED = 3  # the CUDA driver's answer to a call before cuInit


def visible_gpus() -> int:
    """How many GPUs this process sees, counted through NVML where it can be, as torch.cuda.device_count() does
    first: the CUDA runtime's count (torch.cuda.is_available()) initialises the CUDA driver, which takes time
    before any replica starts, for nothing the driver uses, and after which a forked process cannot use CUDA. A
    GPU that NVML lists and CUDA cannot use stops its replica with a message naming it (check_devices)."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    by_nvml = getattr(torch.cuda, "_device_count_nvml", None)  # private to torch: its absence is handled
    count = by_nvml() if by_nvml is not None else -1
    return count if count >= 0 else torch.cuda.device_count()


def cuda_driver_initialised() -> bool:
    """Whether anything (torch, Triton, a caller) has initialised the CUDA driver in this process, after which a
    forked child cannot use CUDA. The driver library answers without initialising anything: cuDeviceGetCount
    returns CUDA_ERROR_NOT_INITIALIZED until cuInit has run (any other answer counts as initialised)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no CUDA driver on this machine: nothing to initialise
        return False
    count = ctypes.c_int()
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def device_groups(replicas: int, tp: int, count: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES for each replica: consecutive groups of `tp` of this process's `count` visible GPUs;
    None for every replica where there is no GPU (CPU replicas)."""
    if count == 0:
        return [None] * replicas
    if replicas * tp > count:
        raise ValueError(f"data_parallel_size={replicas} x tensor_parallel_size={tp} needs {replicas * tp} GPUs "
                         f"but {count} are visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = visible.split(",") if visible else [str(i) for i in range(count)]
    return [",".join(names[r * tp:(r + 1) * tp]) for r in range(replicas)]


def start_with_devices(process: BaseProcess, devices: str | None) -> None:
    """Start a spawned process with CUDA_VISIBLE_DEVICES=devices in its environment from its first instruction:
    set inside the process it would come after the imports that unpickling its target runs, and torch counts the
    GPUs once."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices
    try:
        process.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def start_method(fork: bool) -> str:
    """"fork" where asked for and safe here (Linux, no other Python thread that could hold a lock the replica
    needs, the CUDA driver not initialised in this process), else "spawn"."""
    return "spawn" if not fork or why_not_fork() else "fork"


def why_not_fork() -> str:
    """Why a fork would not be safe in this process now ("" where it is), for the start-up line."""
    if not sys.platform.startswith("linux") or "fork" not in get_all_start_methods():
        return f"no safe fork on {sys.platform}"
    if threading.active_count() != 1:
        return f"{threading.active_count() - 1} other thread(s) running: {[t.name for t in threading.enumerate()][:4]}"
    if cuda_driver_initialised():
        return "the CUDA driver is initialised in this process"
    return ""


def intra_op_pool_hangs(threads: int) -> str:
    """Why a child forked now could not run torch's intra-op thread pool at `threads` threads ("" where it could).
    GNU OpenMP's pool is not fork-safe: once it has run here (the caller's own multi-threaded torch work, writing a
    random checkpoint), a forked child's first parallel region waits forever for pool threads it does not have, at
    0 s of CPU and deaf to signals. Nothing in the process says whether the pool has run (its threads are nameless
    natives, beside BLAS's own), so a child is forked to try a parallel region, and given FORK_PROBE_S."""
    if threads <= 1 or "torch" not in sys.modules:  # one thread runs no pool; without torch nothing has run it
        return ""
    import torch

    began = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: only the probe, then out without any of the parent's clean-up
        try:
            torch.set_num_threads(threads)
            torch.ones(threads * 65536).add_(1)  # more than one grain (32,768 elements) per thread: it runs parallel
        finally:
            os._exit(0)
    while time.monotonic() - began < FORK_PROBE_S:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return ""
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return (f"torch's intra-op thread pool has run in this process, and a forked child running it at {threads} "
            f"threads did not finish in {FORK_PROBE_S:g} s")


@contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and STOP_SIGNAL held back (blocked, not lost) in this thread while inside, the previous mask restored
    after; a process started inside inherits the block, forked or spawned (the mask survives the exec). Replicas
    start that way and lift it once their imports are done (_take_interrupts): an interrupt that lands in a fork's
    after-fork hooks or inside torch's import can leave a process unable to exit (the driver then waits JOIN_S to
    kill it), while one held back arrives where the replica leaves cleanly."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: nothing to hold
        yield
        return
    # a mask holds only this thread: the kernel hands a process-directed signal (kill, Ctrl-C) to any thread that
    # does not block it, and Python then raises in the main thread all the same. So the main thread also records
    # what arrives meanwhile and raises it again once the hold ends
    held: list[int] = []
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for number in INTERRUPTS:
            if signal.getsignal(number) not in (signal.SIG_IGN, None):
                handlers[number] = signal.signal(number, lambda number, frame: held.append(number))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a signal pending here is recorded too
        for number, handler in handlers.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(held):
            signal.raise_signal(number)


class ProcessReplicas:
    """Starts the replica processes, all at once, and carries messages to and from them. fork: the caller allows
    forking them where it is safe (see the module's docstring)."""

    def __init__(self, replicas: int, engine_class: type | str, model: str, options: dict,
                 fork: bool = False) -> None:
        before = why_not_fork() if fork else ""
        devices = device_groups(replicas, options.get("tensor_parallel_size", 1), visible_gpus())
        # why replicas are spawned although a fork was allowed, for the start-up line ("" when forked or not asked)
        after = why_not_fork() if fork else ""
        self.spawn_reason = (before or f"{after} (by counting the GPUs)") if after else ""
        threads = None
        if devices[0] is None and "OMP_NUM_THREADS" not in os.environ:
            threads = max(1, (os.cpu_count() or 1) // replicas)
        if fork and not after:  # a forked replica runs torch at `threads`, else at the driver's own setting
            import torch

            self.spawn_reason = after = intra_op_pool_hangs(threads or torch.get_num_threads())
        self.start_method = "fork" if fork and not after else "spawn"
        ctx = get_context(self.start_method)
        self.conns: list[connection.Connection] = []
        self.processes = []
        self.ended: set[int] = set()  # replicas whose pipe reached end-of-file
        self.reported: set[int] = set()  # ... and that lost() has named
        if self.start_method == "spawn":
            # the first spawn starts multiprocessing's resource tracker, which unblocks SIGINT and SIGTERM in this
            # thread as it does: started first, it leaves the hold below whole for every replica
            resource_tracker.ensure_running()
        # interrupts held over the whole launch: each replica inherits the hold and lifts it after its imports, and
        # one that reaches the driver meanwhile arrives as the hold ends, with every started replica recorded here
        try:
            with interrupts_held():
                for r, group in enumerate(devices):
                    self._start(ctx, r, group, engine_class, model, options, threads)
        except BaseException:  # a replica failed to start, or an interrupt came: the others would wait forever
            for process in self.processes:
                process.kill()
            raise
        self.names = [f"replica {r} ({self.start_method}ed pid {p.pid}{f', GPUs {g}' if g else ', CPU'})"
                      for r, (p, g) in enumerate(zip(self.processes, devices))]

    def _start(self, ctx, r: int, group: str | None, engine_class: type | str, model: str, options: dict,
               threads: int | None) -> None:
        parent, child = ctx.Pipe()
        # not a daemon: daemonic processes may not start the engine's own tensor-parallel workers
        # a forked replica inherits the driver's ends of its own pipe and of the ones before it: it closes them
        drivers_ends = [*self.conns, parent] if self.start_method == "fork" else []
        process = ctx.Process(target=replica_main, name=f"nanovllm-dp-{r}",
                              args=(child, engine_class, model, options, group, threads, time.time(), drivers_ends,
                                    os.getpid()))
        start_with_devices(process, group)
        child.close()  # so that the replica's death is end-of-file here
        self.conns.append(parent)
        self.processes.append(process)

    def send(self, r: int, items: list) -> None:
        try:
            self.conns[r].send(items)
        except OSError:  # it died; its end-of-file tells the driver
            pass

    def receive(self, timeout: float) -> list[tuple[int, tuple]]:
        """(replica, message) for every message that is here within `timeout` s."""
        live = {self.conns[r]: r for r in range(len(self.conns)) if r not in self.ended}
        messages = []
        for conn in connection.wait(list(live), timeout):
            r = live[conn]
            try:
                while conn.poll():
                    messages.append((r, conn.recv()))
            except (EOFError, OSError):
                self.ended.add(r)
        return messages

    def lost(self) -> dict[int, str]:
        """Replicas gone since the last call, with why (exit code or signal)."""
        gone = {}
        for r in sorted(self.ended - self.reported):
            self.reported.add(r)
            process = self.processes[r]
            process.join(timeout=5)
            code = process.exitcode
            gone[r] = (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else
                       f"exited with code {code}" if code is not None else "closed its pipe")
        return gone

    def kill(self, r: int) -> None:
        if self.processes[r].is_alive():
            self.processes[r].kill()
        self.ended.add(r)

    def close(self, clean: bool) -> None:
        """Stop every replica: STOP after a clean run; otherwise STOP_SIGNAL (their Ctrl-C), so engines abort and
        free their workers and shared memory; a replica that does not go within JOIN_S s is killed."""
        for r, process in enumerate(self.processes):
            if process.is_alive():
                if clean:
                    self.send(r, [STOP])
                else:
                    os.kill(process.pid, STOP_SIGNAL)
        for process in self.processes:
            process.join(timeout=JOIN_S)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        for conn in self.conns:
            conn.close()
