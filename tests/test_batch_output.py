"""run-batch's output while a run holds it (nanovllm/batch/output.py): one writer at a time, and a full disk said as
such, with the run resumable."""
import errno
import os
import subprocess
import sys
import warnings

import pytest
from test_run_batch import ENGINE, by_id, records, request, write_lines

from nanovllm import cli as command_line
from nanovllm.batch import output as batch_output

LINES = [request(f"r{i}", {"prompt": [3 + i, 7, 9], "max_tokens": 2, "temperature": 0}) for i in range(5)]
HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); " \
       "time.sleep(60)"


def test_a_second_writer_is_refused_by_name_before_the_model_loads(tiny_model, tmp_path, capsys):
    inp, out = write_lines(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    out.write_bytes(b"")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "1\n"  # it holds the lock, as a run-batch writing there does
        # no such model: the refusal comes before any attempt to load one
        code = command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", str(tmp_path / "no-model")])
        err = capsys.readouterr().err
        assert code == 1, err
        assert f"another run-batch is writing {out} (pid {holder.pid}); two runs on one output would answer every " \
               f"request twice" in err
        assert "cannot start the engine" not in err and out.read_bytes() == b""
    finally:
        holder.kill()
        holder.communicate()
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    assert sorted(by_id(out)) == [f"r{i}" for i in range(5)]


def test_a_forked_process_does_not_keep_the_lock(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"")  # there before the run: kept when it ends
    output = batch_output.OutputFile(str(path))
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    with warnings.catch_warnings():  # the test process has threads; the child only waits and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:
        os.write(ready_write, b"r")  # past the fork (and its handlers)
        os.read(read, 1)  # alive, sharing the parent's open files, until the parent says
        os._exit(0)
    try:
        assert os.read(ready_read, 1) == b"r"
        output.release()
        again = batch_output.OutputFile(str(path))  # the child's copy of the descriptor holds no lock
        again.release()
        assert path.exists()
    finally:
        os.write(write, b"x")
        os.waitpid(child, 0)
        for fd in (read, write, ready_read, ready_write):
            os.close(fd)


class FullDisk:
    """os.write that fails with ENOSPC once `room` records have been written, as a full disk does."""

    def __init__(self, room: int) -> None:
        self.room, self.write = room, os.write

    def __call__(self, fd: int, data) -> int:
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= 1
        return self.write(fd, data)


@pytest.mark.parametrize("room", [2, 0])
def test_a_full_disk_is_said_and_the_same_command_resumes(tiny_model, tmp_path, capsys, monkeypatch, room):
    inp, out = write_lines(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"
    argv = ["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]
    monkeypatch.setattr(batch_output.os, "write", FullDisk(room))
    assert command_line.main(argv) == 1
    err = capsys.readouterr().err
    assert f"cannot write to {out}: the disk is full (No space left on device); this run wrote {room} records " \
           f"before it; free some space (or fix the error) and run the same command again to resume" in err
    assert "Traceback" not in err
    if room == 0:
        assert not out.exists()  # nothing could be written: no empty output left behind
    else:
        assert len(records(out)) == room
    monkeypatch.undo()
    assert command_line.main(argv) == 0
    assert f"{5 - room} succeeded, 0 failed, {room} skipped" in capsys.readouterr().err
    assert sorted(by_id(out)) == [f"r{i}" for i in range(5)]


def test_a_failing_fsync_is_said_too(tiny_model, tmp_path, capsys, monkeypatch):
    # a full disk can show only at fsync, where the file system allocates late
    inp, out = write_lines(tmp_path / "in.jsonl", LINES), tmp_path / "out.jsonl"

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", fsync)
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 1
    err = capsys.readouterr().err
    assert f"cannot write to {out}: the disk is full (No space left on device); this run wrote " in err
    assert "Traceback" not in err and len(records(out)) == 5  # written whole; only their fsync failed
