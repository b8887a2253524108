"""What vLLM's sampling options cost on bench.py's workload, in one engine:

    python benchmarks/sampling_options.py [--runs 3]

1. penalties: every request with presence 0.5, frequency 0.5 and repetition 1.1, against none (alternating
   runs, fresh token ids each run, after one warmup run of each).
2. n: 64 prompts with n=4, against the same 64 prompts each sent 4 times as 256 separate requests (which share
   full blocks through the prefix cache too), and against 256 distinct prompts of those lengths (no sharing).
"""
import argparse
import statistics
import time
from random import Random

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def workload(rng: Random, num_seqs: int, max_id: int) -> tuple[list[list[int]], list[int]]:
    lengths = [rng.randint(100, 1024) for _ in range(num_seqs)]
    outputs = [rng.randint(100, 1024) for _ in range(num_seqs)]
    return [[rng.randint(0, max_id) for _ in range(n)] for n in lengths], outputs


def timed(llm: LLM, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-0.6B")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(default_checkpoint(args.shape), max_model_len=4096)
    max_id = min(10000, llm.vocab_size - 1)
    rng = Random(0)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)
    results: dict[str, list[float]] = {"plain": [], "penalties": []}
    for run in range(args.runs + 1):
        for name in results:
            prompts, lengths = workload(rng, 256, max_id)
            extra = penalties if name == "penalties" else {}
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, **extra) for n in lengths]
            seconds, tokens = timed(llm, prompts, params)
            if run:  # the first round compiles
                results[name].append(tokens / seconds)
    for name, rates in results.items():
        print(f"{name}: {statistics.median(rates):,.0f} tok/s (median of {len(rates)}: "
              f"{', '.join(f'{r:,.0f}' for r in rates)})")
    print(f"penalties / plain: {statistics.median(results['penalties']) / statistics.median(results['plain']):.3f}")

    shared: dict[str, list[float]] = {"n=4 x 64 prompts": [], "the 64 prompts x 4 as 256 requests": [],
                                      "256 distinct prompts": []}
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=256)
    for run in range(args.runs + 1):
        for name in shared:
            prompts, _ = workload(rng, 64, max_id)  # new ids for every call: nothing cached from the last
            if name.startswith("n=4"):
                seconds, _ = timed(llm, prompts, SamplingParams(n=4, temperature=0.6, ignore_eos=True,
                                                                max_tokens=256))
            elif name.startswith("the 64"):
                seconds, _ = timed(llm, [p for p in prompts for _ in range(4)], params)
            else:
                seconds, _ = timed(llm, [[rng.randint(0, max_id) for _ in p] for p in prompts for _ in range(4)],
                                   params)
            if run:
                shared[name].append(seconds)
    for name, times in shared.items():
        print(f"{name}: {statistics.median(times):.2f} s (median of {len(times)})")


if __name__ == "__main__":
    main()
