"""Structured outputs, the mask worker's process: the engine's end of it (MaskProcess) and the loop that serves
MaskWorker's messages in it (sampling/mask_worker.py says what the worker does)."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from nanovllm.sampling.grammar import import_xgrammar
from nanovllm.sampling.mask_worker import MaskWorker


class MaskProcess:
    """The engine's end of its mask worker: a Python process of its own (not a multiprocessing child: a user's
    script without a main guard must not run again in it) and a pipe each way."""

    def __init__(self, tokenizer_info: Any, stop_token_ids: list[int]) -> None:
        worker_reads, engine_writes = os.pipe()
        engine_reads, worker_writes = os.pipe()
        # this engine's nanovllm, whatever the worker's working directory holds: its folder is on the path only
        # while the package is imported
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        bootstrap = (f"import sys; sys.path[0] = {root!r}; import nanovllm; sys.path.pop(0); "
                     f"from nanovllm.sampling.mask_process import main; main()")
        try:
            # a session of its own: a Ctrl-C is the engine's to handle, and the worker ends when the engine closes
            # its end of the pipe (or dies)
            self.process = subprocess.Popen([sys.executable, "-c", bootstrap, str(worker_reads), str(worker_writes),
                                             str(os.getpid())], pass_fds=(worker_reads, worker_writes),
                                            start_new_session=True)
        finally:
            os.close(worker_reads)
            os.close(worker_writes)
        self.outgoing = Connection(engine_writes, readable=False)
        self.incoming = Connection(engine_reads, writable=False)
        self.lock = threading.Lock()  # the compiler's hints come from the caller's thread
        self.info_path: str | None = None
        try:  # while the worker imports xgrammar: the tokenizer's tables (megabytes) go through a file, since
            # through the pipe they would hold the engine's thread until the worker has read them
            with tempfile.NamedTemporaryFile("w", prefix="nanovllm-tokenizer-", suffix=".json", delete=False) as file:
                self.info_path = file.name
                file.write(tokenizer_info.serialize_json())
            self.send(self.info_path, stop_token_ids)
        except BaseException:
            self.close()
            raise

    def send(self, method: str, *args: Any) -> None:
        with self.lock, _signals_held():  # a message cut in half would leave the pipe out of step for good
            try:
                self.outgoing.send([method, *args])
            except OSError as error:
                raise self._gone() from error

    def receive(self) -> Any:
        try:
            while not self.incoming.poll(0.05):  # nothing read yet: a Ctrl-C may stop this wait
                if self.process.poll() is not None:
                    raise self._gone()
            with _signals_held():
                return self.incoming.recv()
        except (EOFError, OSError) as error:
            raise self._gone() from error

    def close(self) -> None:
        try:
            self.send("close")
        except RuntimeError:
            pass
        self.outgoing.close()
        self.incoming.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:  # the worker removes it once read; not if it died first
            if self.info_path is not None:
                os.unlink(self.info_path)
        except FileNotFoundError:
            pass

    def _gone(self) -> RuntimeError:
        return RuntimeError(f"the structured-output mask worker exited (code {self.process.poll()})")


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back from this thread until the block ends (a pipe message is sent or read whole)."""
    if threading.current_thread() is not threading.main_thread():  # Python runs handlers in the main thread only
        yield
        return
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def serve(incoming: Connection, outgoing: Connection, engine_pid: int) -> None:
    """The worker's loop: the first message is (the tokenizer tables' file, stop tokens), then MaskWorker's; each
    `fill` is answered with its number and MaskWorker's answer (or the error it raised)."""
    import_xgrammar()  # the slowest part of the start (it imports torch), while the engine writes the tables
    first = incoming.recv()
    if first == ["close"]:  # the engine could not write them
        return
    info_path, stop_token_ids = first
    with open(info_path) as file:
        info_json = file.read()
    os.unlink(info_path)
    worker, shared = MaskWorker(info_json, stop_token_ids, engine_pid), None
    try:
        while True:
            try:
                method, *args = incoming.recv()
            except EOFError:  # the engine closed its end, or died
                return
            if method == "close":
                return
            if method == "attach":
                layout, name, fill_threads = args
                shared = _attach(name)
                worker.attach(layout, shared.buf, fill_threads)
            elif method == "fill":
                try:
                    answer = worker.fill(*args)  # its counter is written, whatever happens
                except Exception:  # noqa: BLE001 - the engine raises it where it reads the answer
                    answer = RuntimeError("structured-output mask worker: " + traceback.format_exc())
                outgoing.send((args[0], answer))
            else:
                getattr(worker, method)(*args)
    finally:
        worker.compiler.close()
        worker.release()
        if shared is not None:
            shared.close()


def _attach(name: str) -> SharedMemory:
    """The engine's segment, which the engine unlinks: not tracked here (this process's tracker would unlink it
    at exit, and warn)."""
    try:
        return SharedMemory(name=name, track=False)  # Python 3.13+
    except TypeError:
        shared = SharedMemory(name=name)
        resource_tracker.unregister(shared._name, "shared_memory")  # type: ignore[attr-defined]
        return shared


def main() -> None:
    """The worker's entry (MaskProcess's command line): READ_FD WRITE_FD ENGINE_PID."""
    serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False),
          int(sys.argv[3]))
