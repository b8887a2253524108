"""run-batch's output file while a run holds it: one writer at a time, records appended one write() each, and a
write that fails (a full disk) reported as what it is. Reading an earlier run's output is io.read_output.

One writer: the file is locked (flock, exclusive, not waiting) from before the model loads to the end of the run.
Two runs on one output would both answer every request, and a later resume would keep both answers; the second
run is refused at once instead. The lock is the output file's own, so it needs no file beside it and goes with the
process, kill -9 included.
"""
import errno
import fcntl
import json
import os
import time
import weakref


class OutputBusy(Exception):
    """Another process holds the output's lock."""


class WriteFailed(Exception):
    """Appending to the output failed (a full disk, a quota, an I/O error). What was written before is whole, and
    a record cut short by the failure is a torn last line, which the next run drops and answers again."""

    def __init__(self, path: str, error: OSError, written: int) -> None:
        why = "the disk is full" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "the write failed"
        super().__init__(f"cannot write to {path}: {why} ({error.strerror or error}); this run wrote {written} "
                         f"records before it")
        self.error = error


def check_writable(path: str) -> None:
    """Raise OSError, naming the problem, where records could not be appended to `path`; creates nothing, so a
    bad path is named before anything is created."""
    if os.path.exists(path):
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path!r} is a directory")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"{path!r} is not writable")
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"the folder {folder!r} of {path!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create {path!r}: the folder {folder!r} is not writable")


class OutputFile:
    """The output opened for appending and locked: OutputBusy, naming the holder's pid where Linux says it, when
    another process has it. Opening creates the file; release() removes it again where this run created it and
    wrote nothing, so a run that cannot start, or that meets a full disk at its first record, leaves no empty
    output behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None  # opened with O_APPEND: every write lands at the end
        self.fd, self.created = _open_locked(path)
        _held.add(self)

    def release(self) -> None:
        """Unlock and close (idempotent)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _held.discard(self)
        try:
            if self.created and os.fstat(fd).st_size == 0 and _names(self.path, fd):
                os.unlink(self.path)  # still locked: no other run has it as its output
        finally:
            os.close(fd)


def _open_locked(path: str) -> tuple[int, bool]:
    for _ in range(100):
        try:
            fd, created = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, created = os.open(path, os.O_WRONLY | os.O_APPEND), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise OutputBusy(f"another run-batch is writing {path}{f' (pid {holder})' if holder else ''}; two runs "
                             f"on one output would answer every request twice: let it finish, or stop it and run "
                             f"this command again to resume") from None
        except OSError:
            os.close(fd)
            raise
        if _names(path, fd):
            return fd, created
        # a run that could not start removed the empty file it had created between our open and our lock: the
        # lock must be on the file the path names now
        os.close(fd)
    raise OSError(f"{path} keeps being removed or replaced while run-batch opens it")


def _names(path: str, fd: int) -> bool:
    """Whether `path` still names the file open as `fd`."""
    try:
        on_disk, opened = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)


def _holder(fd: int) -> int | None:
    """The pid holding a flock on the file open as `fd`, from Linux's /proc/locks; None where it cannot say."""
    opened = os.fstat(fd)
    where = f"{os.major(opened.st_dev):02x}:{os.minor(opened.st_dev):02x}:{opened.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:  # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"; waiters have "->" after "1:"
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where and fields[4] != "0":
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


# The outputs this process holds. A forked process (a data-parallel replica) shares the open file, and with it the
# lock, which it would keep if it outlived the run; its copy of the descriptor is pointed at /dev/null instead.
_held: "weakref.WeakSet[OutputFile]" = weakref.WeakSet()


def _let_go_in_child() -> None:
    for output in list(_held):
        if output.fd is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, output.fd)
            os.close(null)
            output.created = False  # nor may the child remove it
    _held.clear()


os.register_at_fork(after_in_child=_let_go_in_child)


class OutputWriter:
    """Appends records to the held output, one write() per record; fsync when `fsync_every` s have passed. A
    write or fsync that fails is WriteFailed."""

    def __init__(self, output: OutputFile, fsync_every: float = 1.0) -> None:
        self.output = output
        self.written = 0  # records this run wrote whole
        self._fsync_every = fsync_every
        self._last_sync = time.monotonic()

    def write(self, record: dict) -> None:
        # allow_nan=False: a NaN or infinity would make a line that strict JSON readers reject
        line = json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n"
        try:
            data = memoryview(line.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate from the input (JSON's "\\ud800") echoed in an id or message
            data = memoryview((json.dumps(record, allow_nan=False) + "\n").encode("ascii"))  # JSON escapes it
        fd = self.output.fd
        try:
            while data:  # a regular file takes it all at once; the loop only guards against a short write
                data = data[os.write(fd, data):]
            self.written += 1
            if time.monotonic() - self._last_sync >= self._fsync_every:
                os.fsync(fd)
                self._last_sync = time.monotonic()
        except OSError as error:
            raise WriteFailed(self.output.path, error, self.written) from None

    def close(self) -> None:
        """The last fsync; the file itself is the OutputFile's to close."""
        if self.output.fd is not None:
            try:
                os.fsync(self.output.fd)
            except OSError as error:
                raise WriteFailed(self.output.path, error, self.written) from None

    def __enter__(self) -> "OutputWriter":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        try:
            self.close()
        except WriteFailed:
            if exc_type is None:  # otherwise the error already on its way is the news
                raise
