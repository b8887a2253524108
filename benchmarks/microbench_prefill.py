"""Prefill alone: how fast does the engine turn prompts into KV cache, and which kernels take the time?

    python benchmarks/microbench_prefill.py [--num-seqs 256]

bench.py's cold run spends ~0.3 s more than a warm run, all in prefill steps (benchmarks/diag_cold_run.py): the
prompts that later runs find in the prefix cache. This runs bench.py's prompt lengths with one output token
each, fresh prompts every trial (so nothing is cached), and reports tokens/s and matmul TFLOP/s, then profiles
one trial by kernel.
"""
import argparse
import time
from random import randint, seed

import torch
from torch.profiler import ProfilerActivity, profile

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--profile-first", action="store_true", help="profile the first trial's CPU side too")
    args = parser.parse_args()
    llm = LLM(default_checkpoint("Qwen3-0.6B"), max_model_len=4096)
    llm.generate(["warm up"], SamplingParams(max_tokens=1), use_tqdm=False)
    hf = llm.model_runner.config.hf_config
    # weights a prompt token passes through (the LM head only sees each sequence's last token)
    layer_params = sum(p.numel() for name, p in llm.model_runner.model.named_parameters()
                       if ".layers." in name and p.dim() == 2)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1)

    def prompts(trial: int) -> list[list[int]]:
        seed(1000 + trial)
        return [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(args.num_seqs)]

    for trial in range(args.trials):
        batch = prompts(trial)
        tokens = sum(map(len, batch))
        segments = torch.cuda.memory_stats().get("segment.all.allocated", 0)
        reserved = torch.cuda.memory_reserved()
        torch.cuda.synchronize()
        start = time.perf_counter()
        if trial == 0 and args.profile_first:  # what the first large prefill of a process does on the CPU
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.generate(batch, params, use_tqdm=False)
                torch.cuda.synchronize()
        else:
            llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        new_segments = torch.cuda.memory_stats().get("segment.all.allocated", 0) - segments
        new_gib = (torch.cuda.memory_reserved() - reserved) / 2**30
        print(f"trial {trial + 1}: {tokens} prompt tokens in {elapsed:.3f} s: {tokens / elapsed:,.0f} tok/s, "
              f"matmuls {2 * layer_params * tokens / elapsed / 1e12:.0f} TFLOP/s ({hf.num_hidden_layers} layers); "
              f"{new_segments} new allocator segments ({new_gib:.2f} GiB)")
        if trial == 0 and args.profile_first:
            events = prof.key_averages()
            print("  first trial, top CPU self time:")
            for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
                print(f"  {e.key[:80]:<80} {e.self_cpu_time_total / 1e6:6.3f} s  x{e.count}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(args.trials), params, use_tqdm=False)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and e.device_time_total > 0]
    total = sum(e.device_time_total for e in kernels) / 1e6
    print(f"profiled later trial: GPU kernels {total:.3f} s")
    for e in sorted(kernels, key=lambda e: -e.device_time_total)[:12]:
        print(f"  {e.key[:80]:<80} {e.device_time_total / 1e6:6.3f} s  x{e.count}")
    llm.exit()


if __name__ == "__main__":
    main()
