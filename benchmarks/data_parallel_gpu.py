"""`python benchmarks/data_parallel.py gpu`: the chat workload through `run-batch` at DP=1, DP=2 over processes and
DP=2 over Ray, unseeded and seeded, each run a fresh process started as a user would start it and watched as its
output grows (its line count every 20 ms).

Per run: the steady rate (from the moment 2% of the lines exist to the last line), the time from process start to
2% of the lines, the wall time from process start to the last line, when the process ended, and run-batch's
start-up line (where start-up went, per replica). Compile caches are cold by default: each run gets fresh, empty
Triton, TorchInductor and CUDA cache folders, as a user's first job on a fresh machine; --warm-caches shares one
set among the runs, filled first by an untimed run of each seeding.

The whole set must fit one sitting (--budget-s, counted from this process's start): a run is left out when the
budget no longer has room for one as long as the longest so far, and a run still going at the end of the budget is
stopped; both are named, and the table shows what ran. The figures are written under $OUT (if set) after each run.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

from steady_probe import GpuBusy, SteadyProbe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEADY_FROM = 0.02  # steady state starts once this fraction of the output exists: startup and ramp-up left out
CONFIGS = {"dp1": ("DP=1", []), "mp": ("DP=2, processes", ["-dp", "2"]),
           "ray": ("DP=2, Ray", ["-dp", "2", "-dpb", "ray"])}
SEEDINGS = ("unseeded", "seeded")
CACHES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUDA_CACHE_PATH")
WARMUP_REQUESTS = 256


@dataclass
class Run:
    config: str  # a key of CONFIGS
    seeding: str
    requests: int
    steady: float  # requests/s from STEADY_FROM of the lines to the last line
    to_mark: float  # s from process start to STEADY_FROM of the lines
    wall: float  # s from process start to the last line
    end: float  # s from process start to its exit
    startup: str  # run-batch's start-up line
    steady_state: str = ""  # where the steady state's host and GPU time went (steady_probe.py)
    round: int = 1  # with --rounds: which pass over the configurations


def steady_rate(samples: list[tuple[float, int]], total: int, start_fraction: float = STEADY_FROM) -> float:
    """Requests/s from the moment `start_fraction` of the `total` lines exist to the last sample: (lines at the
    end - lines then) / (time at the end - time then). samples: (time, lines so far) as the output grew."""
    start = mark_sample(samples, total, start_fraction)
    if start is None or samples[-1][0] <= start[0]:
        raise ValueError(f"the output reached {math.ceil(start_fraction * total)} of {total} lines only at its last "
                         f"sample, if at all: no interval to time")
    (start_time, start_lines), (end_time, end_lines) = start, samples[-1]
    return (end_lines - start_lines) / (end_time - start_time)


def mark_sample(samples: list[tuple[float, int]], total: int, fraction: float) -> tuple[float, int] | None:
    mark = max(1, math.ceil(fraction * total))
    return next(((t, lines) for t, lines in samples if lines >= mark), None)


def lines_over_time(proc: subprocess.Popen, path: str, start: float, timeout_s: float = math.inf,
                    probe: SteadyProbe | None = None, steady: tuple[int, int] = (1, 0)) -> list[tuple[float, int]]:
    """(s since `start`, lines in the output) each time the count changed, polled every 20 ms until the process
    ends; killed once it has run `timeout_s`. probe: sampled on every poll, in steady state from steady[0] lines
    until steady[1] (the last line)."""
    samples: list[tuple[float, int]] = []
    offset = count = 0
    while True:
        running = proc.poll() is None
        if running and time.perf_counter() - start > timeout_s:
            proc.kill()
        if running and probe is not None:
            probe.sample(time.perf_counter() - start, steady[0] <= count < steady[1])
        if os.path.exists(path):
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            if data.count(b"\n"):
                count += data.count(b"\n")
                samples.append((time.perf_counter() - start, count))
        if not running:
            return samples
        time.sleep(0.02)


def timed_run(config: str, seeding: str, model: str, inp: str, out: str, requests: int, flags: list[str],
              env: dict, timeout_s: float) -> Run | str:
    """One run-batch in a process of its own: its Run, or why it failed."""
    with open(out + ".stderr", "w+") as log:  # a file, not a pipe: progress bars would fill a pipe nobody reads
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "nanovllm", "run-batch", "-i", inp, "-o", out, "--model",
                                 model, *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        probe = SteadyProbe(proc.pid, GpuBusy(out + ".gpu").start())
        try:
            samples = lines_over_time(proc, out, start, timeout_s, probe,
                                      (math.ceil(STEADY_FROM * requests), requests))
        finally:
            proc.kill()
            proc.wait()
            where = probe.describe()
        end = time.perf_counter() - start
        log.seek(0)
        lines = [line.strip() for line in log.read().replace("\r", "\n").splitlines() if line.strip()]
    startup = next((line.split("start-up: ", 1)[1] for line in lines if "run-batch: start-up: " in line), "")
    if proc.returncode != 0 or not samples or samples[-1][1] != requests:
        last = lines[-1] if lines else f"exit code {proc.returncode}, nothing on stderr"
        return f"{last} ({samples[-1][1] if samples else 0} of {requests} lines, {end:.0f} s)"
    try:
        steady = steady_rate(samples, requests)
    except ValueError as error:  # too few requests to see the output grow
        return str(error)
    return Run(config, seeding, requests, steady, mark_sample(samples, requests, STEADY_FROM)[0], samples[-1][0],
               end, startup, where)


def cache_env(base: dict, folder: str) -> dict:
    """`base` with every compile cache in (empty, until used) subfolders of `folder`."""
    return {**base, **{name: os.path.join(folder, name.lower()) for name in CACHES}}


def run_all(args: argparse.Namespace, began: float, model: str, requests: int, engine: list[str], base_env: dict,
            write_workload) -> tuple[list[Run], list[str], list[str]]:
    """(runs, failures, left out) for every configuration and seeding asked for, in the order unseeded DP=1,
    processes, Ray, then seeded, args.rounds times over (round 1 of every run before round 2). began: the
    perf_counter() the budget counts from."""
    runs, failed, left_out = [], [], []
    longest = 0.0
    with tempfile.TemporaryDirectory(prefix="nanovllm-dp-bench-") as tmp:
        inputs = {}
        for seeding in args.seeding:
            inputs[seeding] = os.path.join(tmp, f"in-{seeding}.jsonl")
            write_workload(inputs[seeding], requests, seeding == "seeded")
        shared = cache_env(base_env, os.path.join(tmp, "caches-shared"))
        if args.warm_caches:
            for seeding in args.seeding:  # untimed: fills the shared caches
                warm = os.path.join(tmp, f"warm-{seeding}.jsonl")
                write_workload(warm, WARMUP_REQUESTS, seeding == "seeded")
                result = timed_run("dp1", seeding, model, warm, warm + ".out", WARMUP_REQUESTS, engine, shared,
                                   min(args.run_timeout_s, args.budget_s - (time.perf_counter() - began)))
                print(f"warm-up, {seeding}: {'done' if isinstance(result, Run) else 'failed: ' + result}", flush=True)
        for round_, seeding, config in [(r, s, c) for r in range(1, args.rounds + 1) for s in args.seeding
                                        for c in args.configs]:
            label = f"{CONFIGS[config][0]}, {seeding}" + (f", round {round_}" if args.rounds > 1 else "")
            if time.perf_counter() - began + longest > args.budget_s:
                left_out.append(label)
                print(f"{label}: left out, the budget of {args.budget_s:.0f} s has no room for another run of "
                      f"{longest:.0f} s", flush=True)
                continue
            env = shared if args.warm_caches else cache_env(base_env, os.path.join(tmp, f"caches-{len(runs)}"
                                                                                    f"-{len(failed)}"))
            out = os.path.join(tmp, f"out-{config}-{seeding}-{round_}.jsonl")
            started = time.perf_counter()
            left = args.budget_s - (time.perf_counter() - began)  # a run never outlasts the budget
            result = timed_run(config, seeding, model, inputs[seeding], out, requests,
                               [*engine, *CONFIGS[config][1]], env, min(args.run_timeout_s, left))
            longest = max(longest, time.perf_counter() - started)
            if isinstance(result, str):
                print(f"{label}: failed: {result}", flush=True)
                failed.append(label)
                save(runs, failed, left_out)
                continue
            print(f"{label}: {result.steady:.1f} req/s steady, {result.to_mark:.1f} s to {STEADY_FROM:.0%} of the "
                  f"lines, {result.wall:.1f} s to the last line, process ended at {result.end:.1f} s; start-up: "
                  f"{result.startup}; {result.steady_state}", flush=True)
            runs.append(replace(result, round=round_))
            save(runs, failed, left_out)
    return runs, failed, left_out


def table(runs: list[Run]) -> str:
    """Markdown, as issue 44 set it out: each run's figures, with (in brackets) DP=2 over processes against DP=1
    (steady rate, and DP=1's wall time over this one's) and Ray against processes (steady rate), each against the
    run of the same seeding and round."""
    by = {(run.config, run.seeding, run.round): run for run in runs}
    requests = runs[0].requests if runs else 0
    lines = [f"| configuration | seeding | steady req/s | to {STEADY_FROM:.0%} of {requests:,} lines | wall, process "
             f"start to last line | process end |", "| --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        dp1, mp = by.get(("dp1", run.seeding, run.round)), by.get(("mp", run.seeding, run.round))
        steady, wall = f"{run.steady:,.0f}", f"{run.wall:.1f} s"
        if run.config == "mp" and dp1:
            steady += f" ({run.steady / dp1.steady:.2f}x)"
        if run.config == "ray" and mp:
            steady += f" ({run.steady / mp.steady:.2f}x of processes)"
        if run.config != "dp1" and dp1:
            wall += f" ({dp1.wall / run.wall:.2f}x)"
        name = CONFIGS[run.config][0] + (f", round {run.round}" if any(r.round > 1 for r in runs) else "")
        lines.append(f"| {name} | {run.seeding} | {steady} | {run.to_mark:.1f} s | {wall} | {run.end:.1f} s |")
    return "\n".join(lines)


def medians(runs: list[Run]) -> str:
    """Markdown: per configuration and seeding, the median over its rounds of the steady rate and of the wall time,
    and the same ratios as table() between those medians ("" where no configuration ran more than once)."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.config, run.seeding), []).append(run)
    if all(len(group) < 2 for group in groups.values()):
        return ""
    steady = {key: statistics.median(run.steady for run in group) for key, group in groups.items()}
    wall = {key: statistics.median(run.wall for run in group) for key, group in groups.items()}
    lines = ["| configuration | seeding | rounds | median steady req/s | median wall |",
             "| --- | --- | --- | --- | --- |"]
    for (config, seeding), group in groups.items():
        rate, time_ = f"{steady[config, seeding]:,.0f}", f"{wall[config, seeding]:.1f} s"
        dp1, mp = ("dp1", seeding), ("mp", seeding)
        if config == "mp" and dp1 in steady:
            rate += f" ({steady[config, seeding] / steady[dp1]:.2f}x)"
        if config == "ray" and mp in steady:
            rate += f" ({steady[config, seeding] / steady[mp]:.2f}x of processes)"
        if config != "dp1" and dp1 in wall:
            time_ += f" ({wall[dp1] / wall[config, seeding]:.2f}x)"
        lines.append(f"| {CONFIGS[config][0]} | {seeding} | {len(group)} | {rate} | {time_} |")
    return "\n".join(lines)


def summary(runs: list[Run], failed: list[str], left_out: list[str]) -> str:
    text = table(runs) + (f"\n\nMedians over the rounds:\n\n{medians(runs)}" if medians(runs) else "")
    text += "\n\nStart-up, per run (run-batch's line):\n\n" + "\n".join(
        f"- {CONFIGS[run.config][0]}, {run.seeding}: {run.startup}" for run in runs)
    text += "\n\nSteady state, per run:\n\n" + "\n".join(
        f"- {CONFIGS[run.config][0]}, {run.seeding}: {run.steady_state}" for run in runs)
    if failed:
        text += f"\n\nFailed: {'; '.join(failed)}"
    if left_out:
        text += f"\n\nLeft out (budget): {'; '.join(left_out)}"
    return text


def save(runs: list[Run], failed: list[str], left_out: list[str]) -> None:
    """The table and the runs' figures under $OUT, if set."""
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "data_parallel_gpu.md"), "w") as f:
            f.write(summary(runs, failed, left_out) + "\n")
        with open(os.path.join(out, "data_parallel_gpu.json"), "w") as f:
            json.dump({"runs": [asdict(run) for run in runs], "failed": failed, "left_out": left_out}, f, indent=1)


def report(runs: list[Run], failed: list[str], left_out: list[str]) -> None:
    print(summary(runs, failed, left_out), flush=True)
    save(runs, failed, left_out)
    if failed:
        sys.exit(f"failed: {'; '.join(failed)}")


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def add_arguments(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", default=None, help="checkpoint (default: Qwen3-0.6B-shaped random weights; tiny "
                                                 "with --cpu-smoke)")
    g.add_argument("--requests", type=int, default=None, help="default 16,384 (96 with --cpu-smoke)")
    g.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="which configurations, in this order (default: all three)")
    g.add_argument("--seeding", nargs="+", choices=SEEDINGS, default=list(SEEDINGS),
                   help="unseeded, seeded (request i carries \"seed\": i), or both (default)")
    g.add_argument("--warm-caches", action="store_true",
                   help="share one set of compile caches among the runs, filled first by an untimed run of each "
                        "seeding (default: fresh, empty caches for every run)")
    g.add_argument("--rounds", type=positive_int, default=1,
                   help="run every configuration this many times, round 1 of all before round 2, and add the "
                        "medians over the rounds (single runs of one configuration can differ by about 10%%)")
    g.add_argument("--budget-s", type=float, default=540.0,
                   help="leave out the runs that would end past this many seconds from the start (default 540)")
    g.add_argument("--run-timeout-s", type=float, default=300.0, help="a run still going after this long is killed")
    g.add_argument("--cpu-smoke", action="store_true", help="the tiny model and short requests, to run the "
                                                            "script end to end where there is no GPU")
