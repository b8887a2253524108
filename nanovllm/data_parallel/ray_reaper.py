"""A local Ray instance ends with the driver that started it, even one killed with SIGKILL.

Ray's own processes notice a dead driver in seconds, but its DashboardAgent and RuntimeEnvAgent, once their
raylet is gone, first try to report that to the GCS (also gone) and wait out a 60-second RPC timeout. The driver
starts this watcher beside the instance (`watch_local_instance`): it reads a pipe whose other end only the driver
holds, and when the pipe closes (the driver ended, however) it gives Ray a moment to stop by itself, then
ends what is left of the processes it was given, each checked by its start time so a reused pid is never hit.

    python -m nanovllm.data_parallel.ray_reaper PID:START_TIME ...
"""
import importlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

GRACE_S = 2.0  # for Ray's own shutdown (ray.shutdown() at a clean exit) before anything is signalled
KILL_AFTER_S = 3.0  # SIGTERM first; what is still there this long after gets SIGKILL


@dataclass
class Reaper:
    """The watcher and the write end of its pipe, open for as long as this process runs."""

    process: subprocess.Popen
    pipe: int


def watch_local_instance(driver_pid: int) -> Reaper | None:
    """Start the watcher over every process the local instance has started under this driver (None when psutil,
    which Ray ships, cannot be imported)."""
    try:
        psutil = _psutil()
    except ImportError:
        return None
    processes = psutil.Process(driver_pid).children(recursive=True)
    targets = [f"{p.pid}:{p.create_time()!r}" for p in processes]
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, False)  # replicas and workers started later must not keep the pipe open
    watcher = subprocess.Popen([sys.executable, "-m", "nanovllm.data_parallel.ray_reaper", *targets],
                               stdin=read_end, start_new_session=True, close_fds=True)
    os.close(read_end)
    return Reaper(watcher, write_end)


def main(targets: list[str]) -> None:
    psutil = _psutil()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the driver's terminal is the driver's to handle
    sys.stdin.buffer.read()  # returns at EOF: the driver is gone
    time.sleep(GRACE_S)
    alive = []
    for target in targets:
        pid, start = target.split(":")
        try:
            process = psutil.Process(int(pid))
            if process.create_time() == float(start):
                process.terminate()
                alive.append(process)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=KILL_AFTER_S)
    for process in still:
        try:
            process.kill()
        except psutil.Error:
            pass


def _psutil():
    importlib.import_module("ray")  # Ray ships its own psutil, which importing it puts on the path
    return importlib.import_module("psutil")


if __name__ == "__main__":
    main(sys.argv[1:])
