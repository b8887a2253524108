"""benchmarks/steady_probe.py, which the data-parallel benchmark uses to say where a run's steady state went: the CPU
time of a process tree between two snapshots, and nvidia-smi's busy readings within a window."""
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from steady_probe import GpuBusy, SteadyProbe, cpu_between, process_tree_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass"


def snapshots_while(*children: subprocess.Popen) -> tuple[tuple[float, dict], tuple[float, dict]]:
    """Two snapshots of this process's tree 1.5 s apart while `children` run (0.5 s after their start); then they
    are stopped."""
    try:
        time.sleep(0.5)
        first = (time.perf_counter(), process_tree_cpu(os.getpid()))
        time.sleep(1.5)
        return first, (time.perf_counter(), process_tree_cpu(os.getpid()))
    finally:
        for child in children:
            child.kill(), child.wait()


def test_a_busy_child_counts_about_one_core_and_an_idle_one_none():
    busy = subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=3)])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    first, last = snapshots_while(busy, idle)
    assert {busy.pid, idle.pid} <= set(last[1])
    cores = {pid: (last[1][pid][1] - first[1][pid][1]) / (last[0] - first[0]) for pid in (busy.pid, idle.pid)}
    assert cores[busy.pid] > 0.5 and cores[idle.pid] < 0.1, cores
    line = cpu_between(os.getpid(), first, last)
    assert line.startswith("cores busy: run-batch ") and "python" in line, line


def test_a_process_with_threads_shows_its_busiest_thread():
    """A child whose one busy thread spins beside an idle one: the process near one core, its busiest thread
    about the same; a one-thread process shows no thread share."""
    code = ("import threading, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            + BUSY.format(seconds=3))
    child = subprocess.Popen([sys.executable, "-c", code])
    first, last = snapshots_while(child)
    name, _, threads = last[1][child.pid]
    assert len(threads) == 2 and child.pid in threads, threads
    line = cpu_between(os.getpid(), first, last)
    match = re.search(rf"{re.escape(name)} ([\d.]+) \(busiest thread ([\d.]+)\)", line)
    assert match and float(match.group(2)) > 0.5 and float(match.group(1)) - float(match.group(2)) < 0.1, line


def test_gpu_readings_average_per_gpu_within_the_window(tmp_path):
    readings = GpuBusy(str(tmp_path / "smi.csv"))
    assert readings.between(0, 1) == "GPU busy: no nvidia-smi"
    readings.proc = subprocess.Popen(["sleep", "5"])  # stands in for nvidia-smi: only its output is read
    try:
        (tmp_path / "smi.csv").write_text("0, 50\n1, 90\n")
        readings.poll(1.0)
        with open(tmp_path / "smi.csv", "a") as f:
            f.write("0, 70\n1, 9")  # the second line not finished yet: read next time
        readings.poll(2.0)
        assert readings.readings == [(1.0, 0, 50), (1.0, 1, 90), (2.0, 0, 70)]
        assert readings.between(0.5, 2.5) == "GPU busy 0: 60%, 1: 90%"
        assert readings.between(1.5, 2.5) == "GPU busy 0: 70%"
    finally:
        readings.stop()


def test_the_probe_reports_nothing_before_the_steady_state():
    probe = SteadyProbe(os.getpid(), GpuBusy("/nonexistent"))
    probe.sample(1.0, False)
    assert probe.describe() == "steady state: not reached"
