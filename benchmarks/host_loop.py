"""`python benchmarks/host_loop.py [rounds]`: how much host CPU a step of an engine-like loop takes (many small
torch calls, each of which releases and retakes the GIL, plus Python between them, then a 1 ms GIL-free wait like
a GPU sync) in three places in turn: a thread of a plain process, a thread of a Ray actor, and a process spawned by
a Ray actor. No GPU needed. Used to ask whether a Ray worker makes the same host loop slower than a process does;
on a virtual machine the answer is drowned by how much the host's own speed moves between runs, which is the
second thing it shows.

STEPS (default 3000) and OPS (default 400 torch calls per step) set the loop's size.
"""
import multiprocessing
import os
import sys
import threading
import time

import torch

STEPS = int(os.environ.get("STEPS", "3000"))
OPS = int(os.environ.get("OPS", "400"))


def loop(steps: int = STEPS) -> tuple[float, float]:
    """(steps/s, ms of this thread's CPU time per step)."""
    torch.set_num_threads(1)
    began, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        t = torch.zeros(8)
        for _ in range(OPS):
            t = t.add(1)
            _ = [i * 2 for i in range(20)]
        time.sleep(0.001)
    return steps / (time.perf_counter() - began), (time.thread_time() - cpu) / steps * 1e3


def in_thread() -> tuple[float, float]:
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("loop", loop()))
    thread.start()
    thread.join()
    return result["loop"]


def _child(results) -> None:
    results.put(in_thread())


def in_child() -> tuple[float, float]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_child, args=(results,))
    process.start()
    result = results.get()
    process.join()
    return result


def main() -> None:
    import ray

    here = os.path.dirname(os.path.abspath(__file__))
    # the actor's spawned child imports this module by name; a local instance's workers inherit this environment
    os.environ["PYTHONPATH"] = here + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["RAY_worker_niceness"] = "0"  # as run-batch's own local instance
    sys.path.insert(0, here)
    from host_loop import in_child as actor_child
    from host_loop import in_thread as actor_thread

    ray.init(num_cpus=4, log_to_driver=False)

    @ray.remote(num_cpus=1, max_concurrency=2)
    class Loop:
        def wait(self) -> None:
            time.sleep(3)  # the worker's own start-up is done before the first timing

        def threaded(self) -> tuple[float, float]:
            return actor_thread()

        def spawned(self) -> tuple[float, float]:
            return actor_child()

    actor = Loop.remote()
    ray.get(actor.wait.remote())
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for name, (rate, cpu) in (("process thread", in_thread()),
                                  ("ray actor thread", ray.get(actor.threaded.remote())),
                                  ("ray actor's process", ray.get(actor.spawned.remote()))):
            print(f"{name + ':':21}{rate:.1f} steps/s, {cpu:.3f} ms cpu/step", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
