"""Where a run-batch process's steady state spends the host and the GPUs (data_parallel_gpu.py): the CPU time of the
process and of each process below it (its replicas, and their workers), and each GPU's busy share as nvidia-smi
reports it, between two moments of the run. Linux only (/proc); without nvidia-smi the GPU part says so.

A replica that uses about one core over the steady state is bound by its own host loop; GPUs well under 100% busy
then wait on the host. A driver near one core is the shared bottleneck."""
import os
import shutil
import subprocess
from dataclasses import dataclass, field

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float, str] | None:
    """(parent pid, CPU seconds, command name) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    name, rest = text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()
    # after the name: state, ppid, ..., utime and stime are fields 14 and 15 of the whole line (11 and 12 here)
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / TICKS, name


def _thread_cpu(pid: int) -> dict[int, float]:
    """tid -> CPU seconds so far of each live thread of `pid` (empty if it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    threads = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        threads[int(tid)] = (int(rest[11]) + int(rest[12])) / TICKS
    return threads


def process_tree_cpu(root: int) -> dict[int, tuple[str, float, dict[int, float]]]:
    """pid -> (command name, CPU seconds so far, each thread's CPU seconds so far) for `root` and every live process
    below it."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            stats[int(entry)] = stat
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats and pid not in tree:
            tree[pid] = (stats[pid][2], stats[pid][1], _thread_cpu(pid))
            frontier.extend(child for child, (parent, _, _) in stats.items() if parent == pid)
    return tree


@dataclass
class GpuBusy:
    """nvidia-smi's utilization.gpu for every GPU, twice a second, each reading stamped when it is read."""

    path: str
    readings: list[tuple[float, int, int]] = field(default_factory=list)  # (time, GPU index, % busy)
    proc: subprocess.Popen | None = None
    _offset: int = 0

    def start(self) -> "GpuBusy":
        if shutil.which("nvidia-smi"):
            with open(self.path, "w") as out:
                self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                                              "--format=csv,noheader,nounits", "-lms", "500"], stdout=out,
                                             stderr=subprocess.DEVNULL)
        return self

    def poll(self, now: float) -> None:
        if self.proc is None:
            return
        with open(self.path) as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[:text.rfind("\n") + 1]
        self._offset += len(complete)
        for line in complete.splitlines():
            index, busy = (part.strip() for part in line.split(","))
            if index.isdigit() and busy.isdigit():
                self.readings.append((now, int(index), int(busy)))

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()

    def between(self, start: float, end: float) -> str:
        if self.proc is None:
            return "GPU busy: no nvidia-smi"
        per_gpu: dict[int, list[int]] = {}
        for t, index, busy in self.readings:
            if start <= t <= end:
                per_gpu.setdefault(index, []).append(busy)
        if not per_gpu:
            return "GPU busy: no reading in the window"
        return "GPU busy " + ", ".join(f"{i}: {sum(v) / len(v):.0f}%" for i, v in sorted(per_gpu.items()))


def cpu_between(root: int, first: tuple[float, dict], last: tuple[float, dict]) -> str:
    """Cores each process kept busy from the snapshot `first` to `last` ((time, process_tree_cpu)): the root, then
    the busiest others, each with its busiest thread's share where it ran more than one (a replica's engine loop
    is one thread: the rest is its transport and, over Ray, Ray's own threads). A process or thread the first
    snapshot did not see counts all its CPU time (it started since), and a thread gone by the last one drops out;
    the two are read moments apart, so a thread may show a hair more than its process."""
    (t0, before), (t1, after) = first, last
    if t1 <= t0:
        return "CPU: no interval"
    used = {}
    for pid, (name, seconds, threads) in after.items():
        _, seconds_before, threads_before = before.get(pid, (name, 0.0, {}))
        busiest = max((spent - threads_before.get(tid, 0.0) for tid, spent in threads.items()), default=0.0)
        used[pid] = (name, (seconds - seconds_before) / (t1 - t0), busiest / (t1 - t0), len(threads))
    _, root_cores, _, _ = used.pop(root, ("?", 0.0, 0.0, 0))
    others = sorted(used.values(), key=lambda item: -item[1])[:4]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"cores busy: run-batch {root_cores:.2f}"
            + "".join(f", {name} {cores:.2f}" + (f" (busiest thread {top:.2f})" if count > 1 else "")
                      for name, cores, top, count in others)
            + f" (host: {os.cpu_count()} cores, load {load:.1f})")


@dataclass
class SteadyProbe:
    """Snapshots of the process tree over the steady state: the first once it begins, then every half second. Each
    process counts up to the last snapshot that saw it (replicas end with the run)."""

    root: int
    gpus: GpuBusy
    first: tuple[float, dict] | None = None
    latest: dict = field(default_factory=dict)  # pid -> process_tree_cpu's entry in the last snapshot that saw it
    last_time: float = 0.0

    def sample(self, now: float, steady: bool) -> None:
        self.gpus.poll(now)
        if steady and (self.first is None or now - self.last_time >= 0.5):
            snapshot = process_tree_cpu(self.root)
            self.first = self.first or (now, snapshot)
            self.latest.update(snapshot)
            self.last_time = now

    def describe(self) -> str:
        self.gpus.stop()
        if self.first is None:
            return "steady state: not reached"
        return (f"steady state ({self.last_time - self.first[0]:.0f} s): "
                f"{cpu_between(self.root, self.first, (self.last_time, self.latest))}; "
                f"{self.gpus.between(self.first[0], self.last_time)}")
