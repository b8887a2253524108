"""What the data-parallel replica path costs, on one GPU: run-batch with its engine in its own process against the
same requests through one forked replica process (the path each replica of `-dp 2` runs: the driver, the inbox, the
sender thread), seeded and unseeded, the seeded pair twice and once with a 0.5 ms GIL switch interval (inherited by
the forked replica). Each run is a fresh process; its output is watched as it grows (data_parallel_gpu's watcher).

    python benchmarks/replica_path.py [--requests 8192] [--model DIR]

Prints one line per run: steady req/s (from 2% of the lines to the last) and wall time, with its start-up line.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data_parallel import write_workload  # noqa: E402
from data_parallel_gpu import lines_over_time, steady_rate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (engine: "inproc" in run-batch's process or "replica" through one forked replica process, seeded, switch interval)
RUNS = [("inproc", True, ""), ("replica", True, ""), ("replica", True, "0.0005"), ("inproc", True, ""),
        ("replica", True, ""), ("inproc", False, ""), ("replica", False, "")]


def run_batch(engine: str, argv: list[str]) -> int:
    """run-batch in this process; "replica": through DataParallel with one replica over processes (an engine named
    as a string is not `LLM` itself, so run() starts replicas even at data_parallel_size 1)."""
    if os.environ.get("REPLICA_PATH_SWITCH"):
        sys.setswitchinterval(float(os.environ["REPLICA_PATH_SWITCH"]))
    from nanovllm import cli
    from nanovllm.batch import run as rb

    args = cli.build_parser().parse_args(["run-batch", *argv])
    return rb.run(args, engine_class="nanovllm.llm:LLM") if engine == "replica" else rb.run(args)


def timed(engine: str, seeded: bool, switch: str, inp: str, out: str, model: str, extra: list[str],
          requests: int) -> str:
    env = dict(os.environ, REPLICA_PATH_SWITCH=switch, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    with open(out + ".err", "w") as err:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--run", engine, "-i", inp, "-o", out,
                                 "--model", model, *extra], env=env, stdout=subprocess.DEVNULL, stderr=err)
        samples = lines_over_time(proc, out, start)
    last = samples[-1] if samples else (0.0, 0)
    try:
        steady = steady_rate(samples, requests)
    except ValueError:  # every line at once (a tiny run): no interval to time
        steady = float("nan")
    lines = open(out + ".err").read().replace("\r", "\n").splitlines()
    startup = next((line.split("start-up: ", 1)[1] for line in lines if "start-up: " in line), lines[-1:] or "?")
    return (f"{engine:8s} {'seeded' if seeded else 'unseeded':9s} switch={switch or 'default':7s} rc {proc.returncode} "
            f"lines {last[1]} steady {steady:6.1f} req/s  wall {last[0]:5.1f} s  | {startup}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--run":
        sys.exit(run_batch(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8192)
    parser.add_argument("--model", default=None, help="checkpoint (default: Qwen3-0.6B-shaped random weights)")
    parser.add_argument("--cpu-smoke", action="store_true", help="the tiny model, short requests: proves the script")
    args = parser.parse_args()
    from nanovllm.utils.random_checkpoint import default_checkpoint

    model = args.model or default_checkpoint("tiny" if args.cpu_smoke else "Qwen3-0.6B")
    shape = dict(vocab=1000, prompt_len=(5, 20), output_len=(4, 8)) if args.cpu_smoke else {}
    extra = ["--max-model-len", "128", "--num-kvcache-blocks", "64"] if args.cpu_smoke else []
    with tempfile.TemporaryDirectory(prefix="nanovllm-replica-path-") as tmp:
        for seeded in (True, False):
            write_workload(os.path.join(tmp, f"in-{seeded}.jsonl"), args.requests, seeded, **shape)
        for i, (engine, seeded, switch) in enumerate(RUNS):
            print(timed(engine, seeded, switch, os.path.join(tmp, f"in-{seeded}.jsonl"),
                        os.path.join(tmp, f"out-{i}.jsonl"), model, extra, args.requests), flush=True)


if __name__ == "__main__":
    main()
