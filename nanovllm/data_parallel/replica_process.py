"""A replica process of backend "mp", from its own side: how it starts, how it stops, and how it outlives no driver.

Its stop never depends on the process it came from. A forked replica starts with the driver's signal handlers (a
caller's own SIGINT handler among them, which may just return), so it installs its own before anything else: the
first SIGINT or STOP_SIGNAL raises KeyboardInterrupt, where the engine aborts and frees its workers and shared
memory; any later one finds that stop under way and is only noted, so it cannot cut the clean-up short. Once its
engine is released, a replica stopped by a signal ends by that signal (exit status -SIGTERM), so that whoever
reads its status, the driver included, sees what stopped it rather than a clean exit.

A thread watches the driver: when the replica's parent is no longer the driver, the replica stops itself as the
driver would have (STOP_SIGNAL), and one still there ORPHAN_S later kills itself. That holds even where its main
thread is stuck in native code, deaf to signals (a fork taken inside a running OpenMP pool waits forever).
"""
import os
import queue
import signal
import sys
import threading
import time
from multiprocessing import connection, current_process

from nanovllm.data_parallel.replica import STOP, describe_error, engine_named, serve

# how the driver stops a replica at once (after a failure): the replica takes it as its Ctrl-C. Not SIGINT itself:
# a driver started as a shell script's background job ignores SIGINT, and so would every replica it starts
STOP_SIGNAL = signal.SIGTERM
INTERRUPTS = {signal.SIGINT, STOP_SIGNAL}
WATCH_S = 0.5  # how often a replica looks for its driver
ORPHAN_S = 5.0  # how long a replica whose driver is gone gets to stop cleanly before it kills itself

_stopped_by: list[int] = []  # the interrupts this replica received, in order


def check_devices(devices: str | None, name: str) -> None:
    """A replica given GPUs that this machine does not have stops with their names, before any engine work."""
    if devices is None:
        return
    import torch

    wanted = len(devices.split(","))
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < wanted:
        raise RuntimeError(f"{name}: CUDA_VISIBLE_DEVICES={devices} names {wanted} GPU(s) but {found} can be "
                           f"used: check the GPUs of this machine and the data/tensor parallel sizes")


def _on_interrupt(signum: int, frame) -> None:
    _stopped_by.append(signum)
    if len(_stopped_by) == 1:
        raise KeyboardInterrupt


def _on_stop(signum: int, frame) -> None:
    """STOP_SIGNAL: the replica's Ctrl-C. Where the engine holds Ctrl-C past a tensor-parallel step (its handler is
    in place of ours for the step), the stop waits with it."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not _on_interrupt:
        _stopped_by.append(signum)
        handler(signal.SIGINT, frame)
    else:
        _on_interrupt(signum, frame)


def _install_handlers() -> None:
    signal.signal(STOP_SIGNAL, _on_stop)
    # a SIGINT the shell set to be ignored (a background job's) stays ignored; any other handler is replaced
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_interrupt)


def _lift_hold() -> None:
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, INTERRUPTS)


def _watch_driver(driver: int) -> None:
    while os.getppid() == driver:  # re-parented (to init or a subreaper) once the driver is gone
        time.sleep(WATCH_S)
    os.kill(os.getpid(), STOP_SIGNAL)
    time.sleep(ORPHAN_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _end_by_signal(signum: int) -> None:
    """Die of `signum`, as its default action would have it, now that the engine is released."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    time.sleep(5)  # the signal is delivered meanwhile; should it not be, the exit below still ends the process
    os._exit(128 + signum)


def replica_main(conn: connection.Connection, engine_class: type | str, model: str, options: dict,
                 devices: str | None, threads: int | None, requested_at: float,
                 drivers_ends: list[connection.Connection], driver: int) -> None:
    """A replica process's target. Interrupts are held back from its start (ProcessReplicas) until its imports are
    done: one that lands in a fork's after-fork hooks or inside torch's import can leave a process unable to exit."""
    _install_handlers()
    threading.Thread(target=_watch_driver, args=(driver,), name="nanovllm-dp-watch", daemon=True).start()
    for end in drivers_ends:  # a forked replica's copies of the driver's pipe ends (see processes.py)
        end.close()
    inbox: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            while True:
                for item in conn.recv():
                    inbox.put(item)
        except (EOFError, OSError):  # the driver is gone: finish up and exit
            inbox.put(STOP)

    try:  # the driver may stop a replica at any point of its start-up, imports included
        try:
            check_devices(devices, current_process().name)
            if threads is not None:  # CPU replicas share the cores rather than each taking all of them
                import torch

                torch.set_num_threads(threads)
            engine = engine_named(engine_class)
        except Exception as error:
            # told while interrupts are still held: a stop pending since the imports must not hide why they failed
            try:
                conn.send(("error", f"the engine failed to start: {describe_error(error)}"))
            except OSError:
                pass
            raise
        finally:
            _lift_hold()
        threading.Thread(target=read, name="nanovllm-dp-reader", daemon=True).start()
        serve(lambda: engine(model, **options), inbox, conn.send, requested_at)
    except BrokenPipeError:  # the driver left: not worth a traceback
        pass
    except KeyboardInterrupt:  # stopped, and the engine released: end as the signal that stopped us
        _end_by_signal(_stopped_by[0] if _stopped_by else signal.SIGINT)
