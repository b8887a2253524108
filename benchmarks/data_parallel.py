"""Data parallelism through `run-batch`: the chat workload at DP=1, DP=2 over processes and DP=2 over Ray, each
seeded and unseeded (GPU), and the driver's own ceiling: requests/s it reads, dispatches and writes with replicas
that answer instantly.

    python benchmarks/data_parallel.py gpu [--model PATH]        # on a host with 2 GPUs
    python benchmarks/data_parallel.py gpu --cpu-smoke           # the same six runs, small, on CPU
    python benchmarks/data_parallel.py driver --replicas 1 2 8   # anywhere (CPU is fine): processes, then Ray

The chat workload: 4,096 completions of random token ids, prompts of 20-200 tokens, outputs of 20-400 (uniform,
seed 0), temperature 0.6, ignore_eos; seeded runs give request i the body field "seed": i.
"""
import argparse
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from random import Random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm import batch_io, run_batch  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.utils.random_checkpoint import default_checkpoint  # noqa: E402

STEADY_FROM = 0.02  # steady state starts once this fraction of the output exists: startup and ramp-up left out
BARRIER = "NANOVLLM_BENCH_BARRIER"  # a folder where instant replicas wait for each other (inherited by replicas)
SMOKE_ENGINE = ["--num-kvcache-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "16"]


def write_workload(path: str, count: int, seeded: bool = False, vocab: int = 10000,
                   prompt_len: tuple[int, int] = (20, 200), output_len: tuple[int, int] = (20, 400)) -> None:
    rng = Random(0)
    with open(path, "w") as f:
        for i in range(count):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_len))]
            body = {"prompt": prompt, "max_tokens": rng.randint(*output_len), "temperature": 0.6, "ignore_eos": True}
            if seeded:
                body["seed"] = i
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


def steady_rate(samples: list[tuple[float, int]], total: int, start_fraction: float = STEADY_FROM) -> float:
    """Requests/s from the moment `start_fraction` of the `total` lines exist to the last sample: (lines at the
    end - lines then) / (time at the end - time then). samples: (time, lines so far) as the output grew."""
    mark = max(1, math.ceil(start_fraction * total))
    start = next(((t, lines) for t, lines in samples if lines >= mark), None)
    if start is None or samples[-1][0] <= start[0]:
        raise ValueError(f"the output reached {mark} of {total} lines only at its last sample, if at all: no "
                         f"interval to time")
    (start_time, start_lines), (end_time, end_lines) = start, samples[-1]
    return (end_lines - start_lines) / (end_time - start_time)


class InstantEngine:
    """A replica's engine that answers each request the moment it is pulled, with max_tokens tokens of text:
    what is left to time is the driver (read, parse, dispatch, collect, format, write) and the transport. Where
    BARRIER names a folder, replicas answer only once all of them have started: replica startup is not the
    driver's."""

    def __init__(self, model: str, **options) -> None:
        folder = os.environ.get(BARRIER)
        if folder:
            open(os.path.join(folder, f"ready-{uuid.uuid4().hex}"), "w").close()
            with open(os.path.join(folder, "replicas")) as f:
                replicas = int(f.read())
            deadline = time.monotonic() + 600
            while len(glob.glob(os.path.join(folder, "ready-*"))) < replicas:
                assert time.monotonic() < deadline, "the other replicas did not start"
                time.sleep(0.01)

    def __enter__(self) -> "InstantEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def iter_generate(self, prompts, params, errors="yield"):
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            ids = [42] * p.max_tokens
            completion = CompletionOutput(0, "word " * p.max_tokens, ids, None, None, "length")
            yield index, RequestOutput(str(index), None, prompt["prompt_token_ids"], [completion])


def start_ray(replicas: int) -> str | None:
    """A local Ray instance with a logical CPU per instant replica (they need next to none); why not, if not."""
    try:
        import ray

        ray.init(num_cpus=max(replicas, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def driver(args: argparse.Namespace) -> None:
    model = default_checkpoint("tiny")  # only its tokenizer and config are read: the replicas load nothing
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.jsonl")
        write_workload(inp, args.requests)
        barrier = os.environ[BARRIER] = os.path.join(tmp, "barrier")  # before Ray starts: its workers inherit it
        for backend in args.backends:
            if backend == "ray":
                why = "ray is not installed" if importlib.util.find_spec("ray") is None else start_ray(
                    max(args.replicas))
                if why:
                    print(f"driver, ray: left out, Ray did not start here ({why})", flush=True)
                    continue
            for replicas in args.replicas:
                os.makedirs(barrier, exist_ok=True)
                for name in os.listdir(barrier):
                    os.remove(os.path.join(barrier, name))
                with open(os.path.join(barrier, "replicas"), "w") as f:
                    f.write(str(replicas))
                with MessageCount(backend) as count:
                    rate, per_core = time_driver(inp, os.path.join(tmp, f"out-{backend}-{replicas}.jsonl"), model,
                                                 ["-dp", str(replicas), "-dpb", backend, "--max-num-seqs",
                                                  str(args.max_num_seqs)])
                print(f"driver, {backend}, {replicas} instant replicas: {args.requests} requests, {rate:,.0f} req/s "
                      f"(first to last record); by the driver's CPU time {per_core:,.0f} req/s per core; messages "
                      f"per request: {count.sent / args.requests:.3f} to replicas, "
                      f"{count.received / args.requests:.3f} back", flush=True)


class MessageCount:
    """Counts the driver's messages to its replicas and theirs to it, on the backend's transport class."""

    def __init__(self, backend: str) -> None:
        from nanovllm.data_parallel import processes, ray_actors  # neither imports Ray

        self.transport = processes.ProcessReplicas if backend == "mp" else ray_actors.RayReplicas
        self.sent = self.received = 0

    def __enter__(self) -> "MessageCount":
        send, receive = self.original = self.transport.send, self.transport.receive

        def counted_send(replicas, r: int, items: list) -> None:
            self.sent += 1
            send(replicas, r, items)

        def counted_receive(replicas, timeout: float) -> list:
            messages = receive(replicas, timeout)
            self.received += len(messages)
            return messages

        self.transport.send, self.transport.receive = counted_send, counted_receive
        return self

    def __exit__(self, *exc_info) -> None:
        self.transport.send, self.transport.receive = self.original


def time_driver(inp: str, out: str, model: str, flags: list[str]) -> tuple[float, float]:
    """Requests/s from the first record to the last, by the clock and by the driver process's CPU time (all its
    threads): the second is what one core of its own would give, whatever else shares this machine's cores."""
    times: list[tuple[float, float]] = []
    write = batch_io.OutputWriter.write

    def timed(self, record, write=write, times=times):
        write(self, record)
        times.append((time.perf_counter(), time.process_time()))

    batch_io.OutputWriter.write = timed  # first to last record: replica startup is not the driver's
    try:
        argv = ["run-batch", "-i", inp, "-o", out, "--model", model, *flags]
        assert run_batch.run(run_batch.build_parser().parse_args(argv), engine_class=InstantEngine) == 0
    finally:
        batch_io.OutputWriter.write = write
    (wall_first, cpu_first), (wall_last, cpu_last) = times[0], times[-1]
    return (len(times) - 1) / (wall_last - wall_first), (len(times) - 1) / (cpu_last - cpu_first)


def gpu(args: argparse.Namespace) -> None:
    if args.cpu_smoke:  # the tiny model, few short requests: proves the script, measures nothing
        model, requests, engine = args.model or default_checkpoint("tiny"), args.requests or 96, SMOKE_ENGINE
        shape = {"vocab": 1000, "prompt_len": (20, 100), "output_len": (8, 48)}
        # one thread per engine: on a CPU host shared with other work, torch's threads spin against each other
        # (a DP=1 run of this workload took 260 s with two threads, 4 s with one)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
    else:
        model, requests, engine, shape = args.model or default_checkpoint("Qwen3-0.6B"), args.requests or 4096, [], {}
        env = None
    runs = [("DP=1", []), ("DP=2 mp", ["-dp", "2"]), ("DP=2 ray", ["-dp", "2", "-dpb", "ray"])]
    if importlib.util.find_spec("ray") is None:
        print("ray is not installed here (pip install -e '.[ray]'): DP=2 ray is left out", flush=True)
        runs.pop()
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seeded in (False, True):
            inp = os.path.join(tmp, f"in-{seeded}.jsonl")
            write_workload(inp, requests, seeded, **shape)
            for name, flags in runs:
                out = os.path.join(tmp, f"{name.replace(' ', '-').replace('=', '')}-{seeded}.jsonl")
                result = timed_run(model, inp, out, requests, [*engine, *flags], env)
                label = f"{name}, {'seeded' if seeded else 'unseeded'}"
                if isinstance(result, str):
                    print(f"{label}: failed: {result}", flush=True)
                    failed.append(label)
                    continue
                total, steady, summary = result
                print(f"{label}: {steady:.1f} req/s steady, {total:.1f} req/s in all; {summary}", flush=True)
                rows.append((name, seeded, total, steady))
    print(table(rows, requests))
    if failed:
        sys.exit(f"failed: {'; '.join(failed)}")


def timed_run(model: str, inp: str, out: str, requests: int, flags: list[str],
              env: dict | None) -> tuple[float, float, str] | str:
    """One run-batch, watched as its output grows: (requests/s in all, steady requests/s, its summary line), or
    why it failed."""
    with open(out + ".stderr", "w+") as log:  # a file, not a pipe: progress bars would fill a pipe nobody reads
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "nanovllm", "run-batch", "-i", inp, "-o", out, "--model",
                                 model, *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        samples = lines_over_time(proc, out)
        end = time.perf_counter()
        log.seek(0)
        last = (log.read().strip().splitlines() or [f"exit code {proc.returncode}, nothing on stderr"])[-1]
    if proc.returncode != 0 or not samples or samples[-1][1] != requests:
        return last
    try:
        return requests / (end - start), steady_rate(samples, requests), last
    except ValueError as error:  # too few requests to see the output grow
        return str(error)


def lines_over_time(proc: subprocess.Popen, path: str) -> list[tuple[float, int]]:
    """(time, lines in the output) each time the count changed, polled every 20 ms until the process ends."""
    samples: list[tuple[float, int]] = []
    offset = count = 0
    while True:
        running = proc.poll() is None
        if os.path.exists(path):
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            if data.count(b"\n"):
                count += data.count(b"\n")
                samples.append((time.perf_counter(), count))
        if not running:
            return samples
        time.sleep(0.02)


def table(rows: list[tuple[str, bool, float, float]], requests: int) -> str:
    """Markdown: each run's rates, and its steady rate over DP=1's with the same seeding."""
    base = {seeded: steady for name, seeded, _, steady in rows if name == "DP=1"}
    lines = [f"| configuration | seeding | req/s in all (with startup) | steady req/s (from {STEADY_FROM:.0%} of "
             f"{requests:,} lines) | steady vs DP=1 |", "| --- | --- | --- | --- | --- |"]
    for name, seeded, total, steady in rows:
        ratio = f"{steady / base[seeded]:.2f}x" if seeded in base else "n/a"
        lines.append(f"| {name} | {'seeded' if seeded else 'unseeded'} | {total:.1f} | {steady:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("driver", help="the driver's ceiling with instantly answering replicas")
    d.add_argument("--replicas", type=int, nargs="+", default=[2, 8])
    d.add_argument("--requests", type=int, default=20000)
    d.add_argument("--backends", nargs="+", choices=["mp", "ray"], default=["mp", "ray"])
    # small, so that what the replicas are handed before the first record (3 x this each) is a small part of the
    # run: the timing starts at the first record
    d.add_argument("--max-num-seqs", type=int, default=64)
    g = commands.add_parser("gpu", help="the chat workload through run-batch at DP=1, DP=2 mp, DP=2 ray, each "
                                        "seeded and unseeded")
    g.add_argument("--model", default=None, help="checkpoint (default: Qwen3-0.6B-shaped random weights; tiny "
                                                 "with --cpu-smoke)")
    g.add_argument("--requests", type=int, default=None, help="default 4,096 (96 with --cpu-smoke)")
    g.add_argument("--cpu-smoke", action="store_true", help="the tiny model and short requests, to run the "
                                                            "script end to end where there is no GPU")
    args = parser.parse_args()
    driver(args) if args.command == "driver" else gpu(args)


if __name__ == "__main__":
    main()
