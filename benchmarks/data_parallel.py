"""Data parallelism through `run-batch`: the chat workload at DP=1, DP=2 over processes and DP=2 over Ray, each
seeded and unseeded (GPU, data_parallel_gpu.py), and the driver's own ceiling: requests/s it reads, dispatches and
writes with replicas that answer instantly, and the CPU time the replicas spend on the transport meanwhile.

    python benchmarks/data_parallel.py gpu [--model PATH]        # on a host with 2 GPUs (see --help)
    python benchmarks/data_parallel.py gpu --cpu-smoke           # the same six runs, small, on CPU
    python benchmarks/data_parallel.py driver --replicas 1 2 8   # anywhere (CPU is fine): processes, then Ray

The chat workload: 16,384 completions of random token ids, prompts of 20-200 tokens, outputs of 20-400 (uniform,
seed 0), temperature 0.6, ignore_eos; seeded runs give request i the body field "seed": i.
"""
import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from random import Random

STARTED = time.perf_counter()  # gpu's budget counts from here: the checkpoint's first writing included
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm import cli  # noqa: E402
from nanovllm.batch import output as batch_output  # noqa: E402
from nanovllm.batch import run as run_batch  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.utils.random_checkpoint import default_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data_parallel_gpu  # noqa: E402
from data_parallel_gpu import steady_rate  # noqa: E402, F401 (tests use it from here)

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


class InstantEngine:
    """A replica's engine that answers each request the moment it is pulled, with max_tokens tokens of text:
    what is left to time is the driver (read, parse, dispatch, collect, format, write) and the transport. Where
    BARRIER names a folder, replicas answer only once all of them have started: replica startup is not the
    driver's."""

    def __init__(self, model: str, **options) -> None:
        self.cpu, self.answered = time.process_time(), 0
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
        """Leaves, where BARRIER names a folder, the CPU time its process spent (all its threads: the transport's)
        and the requests it answered."""
        folder = os.environ.get(BARRIER)
        if folder:
            with open(os.path.join(folder, f"cpu-{uuid.uuid4().hex}"), "w") as f:
                f.write(f"{time.process_time() - self.cpu} {self.answered}")

    def iter_generate(self, prompts, params, errors="yield"):
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            ids = [42] * p.max_tokens
            completion = CompletionOutput(0, "word " * p.max_tokens, ids, None, None, "length")
            self.answered += 1
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
                      f"{count.received / args.requests:.3f} back; replicas' CPU time "
                      f"{replica_cpu_us(barrier, args.requests)} per request", flush=True)


def replica_cpu_us(folder: str, requests: int) -> str:
    """The replicas' CPU time per request ('12 us'), from what their engines left in `folder` as they exited (a
    replica's process outlives the run's last record by a moment: waited for, up to 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        files = glob.glob(os.path.join(folder, "cpu-*"))
        reports = [open(path).read().split() for path in files]
        if sum(int(answered) for _, answered in reports) >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for path in files:
        os.remove(path)
    seconds, answered = sum(float(cpu) for cpu, _ in reports), sum(int(a) for _, a in reports)
    return f"{1e6 * seconds / answered:.0f} us" if answered else "unknown"


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
    write = batch_output.OutputWriter.write

    def timed(self, record, write=write, times=times):
        write(self, record)
        times.append((time.perf_counter(), time.process_time()))

    batch_output.OutputWriter.write = timed  # first to last record: replica startup is not the driver's
    try:
        argv = ["run-batch", "-i", inp, "-o", out, "--model", model, *flags]
        assert run_batch.run(cli.build_parser().parse_args(argv), engine_class=InstantEngine) == 0
    finally:
        batch_output.OutputWriter.write = write
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
        model, requests, engine, shape = args.model or default_checkpoint("Qwen3-0.6B"), args.requests or 16384, [], {}
        env = dict(os.environ)
    if "ray" in args.configs and importlib.util.find_spec("ray") is None:
        print("ray is not installed here (pip install -e '.[ray]'): DP=2 over Ray is left out", flush=True)
        args.configs = [config for config in args.configs if config != "ray"]
    # where a driver's imports go and whether they initialise CUDA (which makes replicas spawn), before the runs
    probe = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                         "startup_probe.py"), "--model", model],
                           capture_output=True, text=True, env=env, timeout=300)
    print(f"startup_probe.py (rc {probe.returncode}):\n{probe.stdout}{probe.stderr[-2000:]}", flush=True)
    runs, failed, left_out = data_parallel_gpu.run_all(
        args, STARTED, model, requests, engine, env,
        lambda path, count, seeded: write_workload(path, count, seeded, **shape))
    data_parallel_gpu.report(runs, failed, left_out)


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
                                        "seeded and unseeded", description=data_parallel_gpu.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    data_parallel_gpu.add_arguments(g)
    args = parser.parse_args()
    driver(args) if args.command == "driver" else gpu(args)


if __name__ == "__main__":
    main()
