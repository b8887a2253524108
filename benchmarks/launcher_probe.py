"""Where a fresh process's Triton compiles and C launcher builds go: each compile (when, how long, which thread,
which kernel) and, with Triton before 3.7, each C launcher build (gcc), through start-up and then N chat-like
requests unseeded and N seeded (prompts of 20-200 random token ids, 20-400 output tokens, temperature 0.6):

    python benchmarks/launcher_probe.py CHECKPOINT [N (default 512)] [timed]

CHECKPOINT needs a vocabulary of Qwen's size (prompt ids go up to 150,000): e.g. the Qwen3-0.6B-shaped random
checkpoint, `python -c "from nanovllm.utils.random_checkpoint import default_checkpoint as d; print(d('Qwen3-0.6B'))"`.

Run it with empty cache folders (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH) for a cold start, once
per tree to compare two builds. It prints READY (process start to a ready engine, with the start-up line), each
generate's seconds, a COMPILE and a LAUNCHER line per event, and the totals: how many launchers were built on the
engine's own thread (MainThread) and how long those took. `timed` also times each compile from its first launch
(this sets Triton's jit_cache_hook, which turns the engine's side-by-side compiles off)."""
import logging
import random
import sys
import threading
import time

from nanovllm.engine.startup import process_started

origin = process_started()
from triton import knobs  # noqa: E402

events = []  # (time since start, seconds from the first launch or -1, thread, kernel)
starts = {}
launchers = []  # (time since start, seconds, thread) of every C launcher build (Triton < 3.7)


def pre(**kw):
    starts[(kw["fn"].name, kw["key"])] = time.time()
    return None


def post(**kw):
    t = time.time()
    s = starts.get((kw["fn"].name, kw["key"]))
    events.append((t - origin, (t - s) if s else -1, threading.current_thread().name, kw["fn"].name))


knobs.runtime.jit_post_compile_hook = post
try:
    import triton.backends.nvidia.driver as nv

    _build = nv.compile_module_from_src

    def timed_build(*a, **k):
        t = time.time()
        try:
            return _build(*a, **k)
        finally:
            launchers.append((time.time() - origin, time.time() - t, threading.current_thread().name))

    nv.compile_module_from_src = timed_build
except Exception as e:  # noqa: BLE001 - a Triton without it: compiles are still counted
    print("no launcher hook:", e)
if len(sys.argv) > 3 and sys.argv[3] == "timed":
    knobs.runtime.jit_cache_hook = pre
logging.basicConfig(level=logging.INFO, format="%(message)s")

from nanovllm import LLM, SamplingParams  # noqa: E402

llm = LLM(sys.argv[1])
ready = time.time() - origin
print(f"READY {ready:.2f} s | {llm.describe_startup(origin)}", flush=True)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 512
rng = random.Random(0)
for seeded in (False, True):
    prompts = [[rng.randrange(100, 150000) for _ in range(rng.randint(20, 200))] for _ in range(n)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(20, 400), ignore_eos=True,
                             seed=i if seeded else None) for i in range(n)]
    t = time.time()
    llm.generate(prompts, params, use_tqdm=False)
    print(f"generate seeded={seeded}: {time.time() - t:.2f} s, ended at {time.time() - origin:.2f} s", flush=True)
for at, took, thread, name in events:
    print(f"COMPILE {at:7.2f} {'after-ready' if at > ready else 'start-up   '} {took:5.2f} {thread:18s} {name}")
print(f"COMPILES start-up {sum(e[0] <= ready for e in events)} after-ready {sum(e[0] > ready for e in events)}")
for at, took, thread in launchers:
    print(f"LAUNCHER {at:7.2f} {'after-ready' if at > ready else 'start-up   '} {took:5.2f} {thread}")
main = [entry for entry in launchers if entry[2] == "MainThread"]
print(f"LAUNCHERS {len(launchers)}, on the main thread {len(main)} ({sum(entry[1] for entry in main):.2f} s), "
      f"after ready {sum(entry[0] > ready for entry in launchers)}")
llm.exit()
