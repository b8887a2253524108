"""The temperature-only sampler alone, on the GPU: compiled torch Gumbel-max against the Triton kernel.

    python benchmarks/microbench_sampler.py

bf16 logits over Qwen3's 151,936-token vocabulary, as the LM head hands them over; timed with CUDA events
over repeated calls (the sampler runs outside the CUDA graphs, as here).
"""
import torch

from nanovllm.layers.gumbel_max import gumbel_max_sample
from nanovllm.layers.sampler import gumbel_max_torch


def time_us(fn, iters: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    compiled = torch.compile(gumbel_max_torch, dynamic=True)
    counters = torch.zeros(512, dtype=torch.int32, device="cuda")
    print("| rows | compiled torch us | triton us | logits GB/s (triton) |")
    print("| --- | --- | --- | --- |")
    for rows in (1, 16, 64, 128, 256):
        logits = torch.randn(rows, 151936, device="cuda").to(torch.bfloat16)
        temperatures = torch.full((rows,), 0.6, device="cuda")
        torch_us = time_us(lambda logits=logits, t=temperatures: compiled(logits, t))
        triton_us = time_us(lambda logits=logits, t=temperatures: gumbel_max_sample(logits, t, 1, counters))
        print(f"| {rows} | {torch_us:.1f} | {triton_us:.1f} | {logits.numel() * 2 / triton_us / 1e3:.0f} |")


if __name__ == "__main__":
    main()
