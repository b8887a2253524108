"""`python benchmarks/replica_stop.py [fork|spawn]`: one data-parallel replica process (backend mp) under a driver
that ignores SIGINT, as a `run-batch ... &` of a shell script does: a clean run of 64 requests, then a second
replica stopped mid-generation the way the driver stops replicas after a failure (ProcessReplicas.close(False)).
Prints how long each replica took to be ready, how long the stop took and the exit codes: a stop that ends at once
with exit code 0 reached the engine; one that takes JOIN_S (30 s) and exits -9 was killed. Qwen3-0.6B-shaped
random weights, on the GPU where there is one.
"""
import signal
import subprocess
import sys
import time

from nanovllm.data_parallel import processes
from nanovllm.data_parallel.replica import DRAIN, Work
from nanovllm.sampling_params import SamplingParams

REQUESTS = 64


def started(fork: bool, model: str) -> processes.ProcessReplicas:
    began = time.monotonic()
    replicas = processes.ProcessReplicas(1, "nanovllm.llm:LLM", model, {}, fork=fork)
    print("start method", replicas.start_method, replicas.names, flush=True)
    ready = False
    while not ready:
        messages = replicas.receive(0.2)
        assert all(kind != "error" for _, (kind, _) in messages), messages
        ready = any(kind == "ready" for _, (kind, _) in messages)
    print(f"ready after {time.monotonic() - began:.1f} s", flush=True)
    return replicas


def work(max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Work(i, list(range(1, 50)), params) for i in range(REQUESTS)] + [DRAIN]


def main() -> None:
    fork = sys.argv[1:] != ["spawn"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by every replica, as from a script's background job
    # written by another process: torch's CPU thread pool, once this process had used it, would not survive a fork
    # (run-batch's driver runs no torch op before it forks either)
    model = subprocess.run([sys.executable, "-c", "from nanovllm.utils.random_checkpoint import default_checkpoint; "
                            "print(default_checkpoint('Qwen3-0.6B'))"], check=True, capture_output=True,
                           text=True).stdout.split()[-1]

    replicas = started(fork, model)
    replicas.send(0, work(32))
    answered = 0
    while answered < REQUESTS:
        for _, (kind, payload) in replicas.receive(0.2):
            assert kind == "results", (kind, payload)
            answered += len(payload)
    replicas.close(True)
    print(f"clean run: {answered} results, exit code {replicas.processes[0].exitcode}", flush=True)

    replicas = started(fork, model)
    replicas.send(0, work(2000))
    time.sleep(3)  # generating by now: 64 requests of 2,000 tokens take far longer
    began = time.monotonic()
    replicas.close(False)
    print(f"stop mid-generation: closed in {time.monotonic() - began:.2f} s, exit code "
          f"{replicas.processes[0].exitcode}", flush=True)


if __name__ == "__main__":  # spawned replicas import this module again
    main()
