"""What run-batch does before it imports the engine: the checks of its two files (a bad path or a duplicate
custom_id fails in a second, before any work), what is left to do, and the replicas launched at once where that
gains (data_parallel/launch.py): Ray actors, whose start overlaps the driver's own imports, and processes that
could not be forked here (they are spawned, and import everything themselves anyway). Processes that can be forked
are forked later, by DataParallel after the driver's imports, so they start with those done. Nothing here imports
the engine or transformers (counting GPUs imports torch)."""
import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanovllm.batch import io as batch_io
from nanovllm.batch.flags import engine_options
from nanovllm.batch.io import Done
from nanovllm.batch.output import OutputBusy, OutputFile, check_writable
from nanovllm.data_parallel.processes import visible_gpus, why_not_fork

if TYPE_CHECKING:
    from nanovllm.data_parallel.launch import LaunchedReplicas


@dataclass
class BatchStart:
    began: float  # time.perf_counter() at the start of the command's work
    done: Done  # what the output file holds already
    skipped: int  # requests answered by an earlier run
    todo: int  # requests left to answer
    output: OutputFile  # held (locked) for the whole run: release() it at the end
    launched: "LaunchedReplicas | None" = None  # where replicas were launched before the engine's import


def check_files(args: argparse.Namespace) -> BatchStart | int:
    """The input and output checked and read (the exit code where they fail, having said why)."""
    began = time.perf_counter()
    if same_file(args.input_file, args.output_file):  # results appended to the requests would read as done
        return fail(f"the output file {args.output_file!r} is the input file {args.input_file!r} (the same file "
                    f"on disk); give -o a path of its own", code=2)
    try:
        scan = batch_io.scan_input(args.input_file)
    except OSError as error:
        return fail(f"cannot read the input: {error}")
    if not scan.total:  # before the model: an empty input is more likely a mistake than a job
        say(f"warning: {args.input_file} holds no requests (it is empty or blank); nothing to do")
    if scan.duplicates:  # before any work or output: a resumed run could not tell such requests apart
        named = "; ".join(f"{cid!r} on lines {', '.join(map(str, lines))}" for cid, lines in scan.duplicates.items())
        return fail(f"duplicate custom_id(s) in {args.input_file}: {named}")
    try:  # before the model: a bad path, or another run writing the output, fails in a second
        check_writable(args.output_file)  # names a bad path before anything is created
        output = OutputFile(args.output_file)
    except OutputBusy as error:
        return fail(str(error))
    except OSError as error:
        return fail(f"cannot resume from or write the output: {error}")
    try:  # under the lock: no other run appends while the answered ids are read
        done = batch_io.read_output(args.output_file)
    except (OSError, ValueError) as error:
        output.release()
        return fail(f"cannot resume from or write the output: {error}")
    skipped = scan.ids.count_in(done.ids) + sum(line in done.lines for line in scan.id_less_lines)
    return BatchStart(began, done, skipped, scan.total - skipped, output)


def start(args: argparse.Namespace) -> BatchStart | int:
    """check_files, then, with work to do and replicas to start, the replicas launched: Ray actors, or processes
    where no fork is safe here. Processes forked after the driver's imports skip their own, which ran beside the
    driver's and took as long (one host of 2 GPUs: each replica's first request about 1 s sooner, docs/
    data_parallel.md), so those are left to DataParallel."""
    started = check_files(args)
    if isinstance(started, int) or not started.todo or serial(args) or args.data_parallel_size < 1:
        return started
    if args.data_parallel_backend == "mp":
        visible_gpus()  # where NVML cannot count them, CUDA's count initialises the driver: then no fork is safe
        if not why_not_fork():
            return started
    from nanovllm.data_parallel.launch import launch_replicas

    try:
        started.launched = launch_replicas(args.model, args.data_parallel_size, args.data_parallel_backend,
                                           engine_options(args))
    except (OSError, ValueError, ImportError) as error:  # more replicas than GPUs, Ray not installed
        started.output.release()
        return fail(f"cannot start the engine: {type(error).__name__}: {error}")
    return started


def serial(args: argparse.Namespace) -> bool:
    """One engine in this process: no replica processes or actors to start."""
    return args.data_parallel_size == 1 and args.data_parallel_backend == "mp"


def same_file(a: str, b: str) -> bool:
    """Whether two paths name one file, however spelled: relative or absolute, through a symlink, or a hard link
    (samefile compares device and inode). A path that does not exist yet is no existing file."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing (or unreadable): then they cannot be one existing file
        return False


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the command runs, SIGTERM (kill, a job scheduler's stop, docker stop) does what Ctrl-C does: the
    results so far are on disk, the engine and its replicas are stopped, and the message says how to resume. The
    previous handler is back afterwards, so a caller's process (a test, a benchmark) keeps its own."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        handler = signal.getsignal(signal.SIGINT)  # one that holds Ctrl-C past a step holds this stop as well
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def say(message: str) -> None:
    print(f"nanovllm run-batch: {message}", file=sys.stderr)


def fail(message: str, code: int = 1) -> int:
    say(message)
    return code
