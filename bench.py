"""Throughput on the reference workload: random prompts and output lengths, temperature 0.6, ignore_eos.

    python bench.py                      # Qwen3-0.6B shape with random weights, written on first use
    python bench.py --runs 4             # first run is "cold", the median of the others "warm"
"""
import argparse
import statistics
import time
from datetime import date
from random import randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: random Qwen3 weights)")
    parser.add_argument("--shape", default="Qwen3-0.6B", help="shape of the random checkpoint when --model is unset")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()

    path = args.model or default_checkpoint(args.shape)
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, args.max_input_len))] for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, args.max_output_len))
              for _ in range(args.num_seqs)]

    start = time.perf_counter()
    llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size)
    startup = time.perf_counter() - start
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}, date: {date.today()}, model: {path}, startup: {startup:.1f} s, "
          f"KV blocks: {llm.model_runner.num_kvcache_blocks}")
    times = []
    for run in range(args.runs):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        total = sum(len(o["token_ids"]) for o in outputs)
        times.append(elapsed)
        print(f"run {run + 1}: Total: {total} tok, Time: {elapsed:.2f} s, Throughput: {total / elapsed:.0f} tok/s")
    if torch.cuda.is_available():
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    cold = times[0]
    print(f"Total: {total} tok, Time: {cold:.2f} s, Throughput: {total / cold:.0f} tok/s  (cold: first run)")
    if len(times) > 1:
        warm = statistics.median(times[1:])
        print(f"Total: {total} tok, Time: {warm:.2f} s, Throughput: {total / warm:.0f} tok/s  "
              f"(warm: median of runs 2..{len(times)})")
    llm.exit()


if __name__ == "__main__":
    main()
