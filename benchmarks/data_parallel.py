"""Data parallelism through `run-batch`: the chat workload at DP=1, DP=2 over processes and DP=2 over Ray (GPU),
and the driver's own ceiling: requests/s it reads, dispatches and writes with replicas that answer instantly.

    python benchmarks/data_parallel.py gpu [--model PATH]        # on a host with 2 GPUs
    python benchmarks/data_parallel.py driver --replicas 2 8     # anywhere (CPU is fine)

The chat workload: 4,096 completions of random token ids, prompts of 20-200 tokens, outputs of 20-400 (uniform,
seed 0), temperature 0.6, ignore_eos.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from random import Random

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from nanovllm import batch_io, run_batch  # noqa: E402
from nanovllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanovllm.utils.random_checkpoint import default_checkpoint  # noqa: E402


def write_workload(path: str, count: int, vocab: int = 10000) -> None:
    rng = Random(0)
    with open(path, "w") as f:
        for i in range(count):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(20, 200))]
            body = {"prompt": prompt, "max_tokens": rng.randint(20, 400), "temperature": 0.6, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                    + "\n")


class InstantEngine:
    """A replica's engine that answers each request the moment it is pulled, with max_tokens tokens of text:
    what is left to time is the driver (read, parse, dispatch, collect, format, write) and the transport."""

    def __init__(self, model: str, **options) -> None:
        pass

    def __enter__(self) -> "InstantEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def iter_generate(self, prompts, params, errors="yield"):
        for index, (prompt, p) in enumerate(zip(prompts, params)):
            ids = [42] * p.max_tokens
            completion = CompletionOutput(0, "word " * p.max_tokens, ids, None, None, "length")
            yield index, RequestOutput(str(index), None, prompt["prompt_token_ids"], [completion])


def driver(args: argparse.Namespace) -> None:
    model = default_checkpoint("tiny")  # only its tokenizer and config are read: the replicas load nothing
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.jsonl")
        write_workload(inp, args.requests)
        for replicas in args.replicas:
            out = os.path.join(tmp, f"out-{replicas}.jsonl")
            times: list[float] = []
            write = batch_io.OutputWriter.write

            def timed(self, record, write=write, times=times):
                write(self, record)
                times.append(time.perf_counter())

            batch_io.OutputWriter.write = timed  # first to last record: replica startup is not the driver's
            try:
                argv = ["run-batch", "-i", inp, "-o", out, "--model", model, "-dp", str(replicas),
                        "-dpb", args.backend]
                assert run_batch.run(run_batch.build_parser().parse_args(argv), engine_class=InstantEngine) == 0
            finally:
                batch_io.OutputWriter.write = write
            rate = (len(times) - 1) / (times[-1] - times[0])
            print(f"driver, {args.backend}, {replicas} instant replicas: {len(times)} requests, {rate:,.0f} req/s "
                  f"(first to last record)", flush=True)


def gpu(args: argparse.Namespace) -> None:
    model = args.model or default_checkpoint("Qwen3-0.6B")
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "in.jsonl")
        write_workload(inp, args.requests)
        rates = {}
        runs = [("DP=1", []), ("DP=2 mp", ["-dp", "2"]), ("DP=2 ray", ["-dp", "2", "-dpb", "ray"])]
        if importlib.util.find_spec("ray") is None:
            print("ray is not installed here (pip install -e '.[ray]'): DP=2 ray is left out", flush=True)
            runs.pop()
        for name, flags in runs:
            out = os.path.join(tmp, name.replace(" ", "-").replace("=", "") + ".jsonl")
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "nanovllm", "run-batch", "-i", inp, "-o", out,
                                     "--model", model, *flags], cwd=ROOT, stderr=subprocess.PIPE, text=True)
            first, last = records_over_time(proc, out)
            stderr = proc.stderr.read()
            assert proc.wait() == 0, stderr[-3000:]
            rates[name] = (args.requests - 1) / (last - first)
            summary = stderr.strip().splitlines()[-1]
            print(f"{name}: {rates[name]:.1f} req/s from first to last record ({last - first:.1f} s; "
                  f"{time.perf_counter() - start:.1f} s wall with startup); {summary}", flush=True)
        print(f"DP=2 mp / DP=1: {rates['DP=2 mp'] / rates['DP=1']:.2f}x" +
              (f"; DP=2 ray / DP=2 mp: {rates['DP=2 ray'] / rates['DP=2 mp']:.3f}" if "DP=2 ray" in rates else ""))


def records_over_time(proc: subprocess.Popen, path: str) -> tuple[float, float]:
    """When the first and the last record reached the output (polled every 20 ms): startup left out."""
    first = last = None
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
                last = time.perf_counter()
                first = first or last
        if not running:
            assert first is not None and count > 1, f"the run wrote {count} records"
            return first, last
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("driver", help="the driver's ceiling with instantly answering replicas")
    d.add_argument("--replicas", type=int, nargs="+", default=[2, 8])
    d.add_argument("--requests", type=int, default=20000)
    d.add_argument("--backend", choices=["mp", "ray"], default="mp")
    g = commands.add_parser("gpu", help="the chat workload through run-batch at DP=1, DP=2 mp, DP=2 ray")
    g.add_argument("--model", default=None, help="checkpoint (default: Qwen3-0.6B-shaped random weights)")
    g.add_argument("--requests", type=int, default=4096)
    args = parser.parse_args()
    driver(args) if args.command == "driver" else gpu(args)


if __name__ == "__main__":
    main()
