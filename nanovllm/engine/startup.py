"""Where start-up goes. An engine times its phases lap by lap (config, tokenizer, CUDA init, model and weights,
warmup, KV cache, decode warmup and compile, CUDA graphs) and logs them as one line once it is ready; `run-batch`
shows the user one line for the whole run: the engine's phases after the process's own start and imports, or, with data
parallelism, the driver's and each replica's, placed on one clock (seconds since the driver's process started).

Marks are wall-clock times (time.time()): they are compared across the processes of a host (and, for Ray, across
hosts, as far as their clocks agree).
"""
import os
import time
from dataclasses import dataclass, field

OTHER_S = 0.05  # time between the last named lap and `ready` is listed as "other" only from this long


def _now() -> float:
    return time.time()


@dataclass
class StartupTimes:
    """One start-up: its phases in order, (name, seconds), each timed from the end of the one before it."""

    began: float = field(default_factory=lambda: _now())
    phases: list[tuple[str, float]] = field(default_factory=list)
    ready: float | None = None  # when it could take requests
    first_request: float | None = None  # when it took its first one
    mark: float = field(init=False)  # where the next lap starts

    def __post_init__(self) -> None:
        self.mark = self.began

    def lap(self, name: str) -> None:
        """The phase `name` ends now: it began where the previous one ended."""
        now = _now()
        self.phases.append((name, now - self.mark))
        self.mark = now

    def extend(self, other: "StartupTimes | None") -> None:
        """Append the phases of a start-up that ran inside this one (an engine's, inside its replica's)."""
        if other is None:
            return
        gap = other.began - self.mark  # between this one's last lap and the inner start-up's beginning
        if gap >= OTHER_S:
            self.phases.append(("other", gap))
        self.phases += other.phases
        self.mark = max(self.mark, other.mark)

    def set_ready(self) -> None:
        now = _now()
        if now - self.mark >= OTHER_S:
            self.phases.append(("other", now - self.mark))
        self.ready = self.mark = now

    def took_first_request(self) -> None:
        if self.first_request is None:
            self.first_request = _now()

    def total(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def describe(self) -> str:
        """'name 1.2 s, name 0.4 s, ...': the phases in order."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)


def process_started() -> float | None:
    """When this process started, as a time.time() value (from Linux's /proc, to about 10 ms); None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            # the command name (2nd field) may hold spaces: fields are counted after its closing bracket
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def describe_engine(origin: float | None, times: StartupTimes) -> str:
    """run-batch's line for one engine in the process: '17.2 s to the first request (process start and imports
    3.1 s, config 0.1 s, ..., first dispatch 0.0 s)'. origin: when the process started (None: unknown, then the
    line starts at the engine)."""
    phases = list(times.phases)
    start = times.began
    if origin is not None:
        phases.insert(0, ("process start and imports", times.began - origin))
        start = origin
    end = times.ready if times.ready is not None else times.mark
    if times.first_request is not None and times.ready is not None:
        phases.append(("first dispatch", max(0.0, times.first_request - times.ready)))
        end = times.first_request
    listed = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases)
    return f"{end - start:.1f} s to the first request ({listed})"


def describe_replicas(origin: float, driver: StartupTimes,
                      replicas: list[tuple[str, StartupTimes | None, float | None]]) -> str:
    """run-batch's line for data parallelism: the driver's phases, then when (seconds since `origin`, the driver's
    process start) each replica took its first request, and its phases. replicas: (name, its start-up as it
    reported it once ready, when the driver first sent it work)."""
    parts = [f"driver ready at {driver.mark - origin:.1f} s (process start and imports {driver.began - origin:.1f} "
             f"s, {driver.describe()})"]
    for name, times, first_sent in replicas:
        if times is None or times.ready is None:
            parts.append(f"{name} was never ready")
            continue
        first = times.ready if first_sent is None else max(times.ready, first_sent)
        parts.append(f"{name} took its first request at {first - origin:.1f} s ({times.describe()}, first dispatch "
                     f"{first - times.ready:.1f} s)")
    return "; ".join(parts)
