"""What does the first run in a process do that later runs do not? (docs/PERFORMANCE.md)

    python benchmarks/diag_cold_run.py

Runs bench.py's default workload three times in one process with torch.compile's recompile log on and a hook
that prints every Triton kernel compiled, times each engine step, then lists the steps of run 1 that took
longest against the same step of run 3. Run 1 also computes prefill that later runs find in the prefix cache.
"""
import time
from random import randint, seed

import torch
from triton import knobs

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def main() -> None:
    torch._logging.set_logs(recompiles=True)
    phase = ["startup"]

    def on_triton_compile(*args, **kwargs) -> bool:
        print(f"triton compile during {phase[0]}: {str(kwargs.get('repr', args))[:200]}", flush=True)
        return False

    knobs.runtime.jit_cache_hook = on_triton_compile
    llm = LLM(default_checkpoint("Qwen3-0.6B"), max_model_len=4096)
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024)) for _ in range(256)]

    # CPU seconds per engine phase and run: is the first run's extra spent launching work or waiting for it?
    phases: dict[str, float] = {}

    def timed(obj, name: str, label: str) -> None:
        method = getattr(obj, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - start

        setattr(obj, name, wrapper)

    from nanovllm.engine.step import Step
    runner = llm.model_runner
    for obj, name in ((llm.scheduler, "schedule"), (llm.scheduler, "postprocess"), (runner.inputs, "prefill"),
                      (runner.inputs, "decode"), (runner.sampler, "prepare"), (runner, "launch"),
                      (runner.sampler, "forward"), (Step, "result")):
        timed(obj, name, f"{getattr(obj, '__name__', type(obj).__name__)}.{name}")
    step, log = llm.step, []

    def timed_step():
        start = time.perf_counter()
        result = step()
        log.append((result[1], time.perf_counter() - start))  # (token count, negative for decode; seconds)
        return result

    llm.step = timed_step
    runs = []
    for run in range(1, 4):
        phase[0] = f"run {run}"
        log.clear()
        phases.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        print(f"run {run}: {time.perf_counter() - start:.2f} s, {len(log)} steps; CPU seconds by phase: "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])), flush=True)
        runs.append(list(log))
    diffs = sorted(((a[1] - b[1], i, a[0]) for i, (a, b) in enumerate(zip(runs[0], runs[2]))), reverse=True)
    print("slowest steps of run 1 against run 3 (extra seconds, step, tokens):",
          [(round(d, 3), i, n) for d, i, n in diffs[:15]])
    print(f"extra in all {sum(d for d, _, _ in diffs):.3f} s, of which prefill steps "
          f"{sum(d for d, _, n in diffs if n > 0):.3f} s")
    llm.exit()


if __name__ == "__main__":
    main()
