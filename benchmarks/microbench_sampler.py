"""The sampler alone on the GPU, per step: each sampling option's device time and the host's time to prepare it.

    python benchmarks/microbench_sampler.py

bf16 logits over Qwen3's 151,936-token vocabulary, as the LM head hands them over; device time by CUDA events over
repeated calls, host time by the wall clock of `prepare` + launching (the sampler runs outside the CUDA graphs, as
here). Also the step that replaces a topk over the vocabulary: the 20 largest logits found chunk-wise.
"""
import time

import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.floors import LargestLogits
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling_params import SamplingParams

VOCAB = 151936
OPTIONS = {"plain": {}, "seeded": dict(seed=0), "top_k=20,top_p=0.95": dict(top_k=20, top_p=0.95),
           "min_p=0.05": dict(min_p=0.05), "top_p=0.9": dict(top_p=0.9)}


def time_us(fn, iters: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def host_us(fn, iters: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds * 1e6 / iters


def main() -> None:
    sampler = Sampler(device=torch.device("cuda"))
    print("| rows | sampling | device us | host us (prepare + launch) |")
    print("| --- | --- | --- | --- |")
    for rows in (64, 256, 512):
        logits = torch.randn(rows, VOCAB, device="cuda").to(torch.bfloat16)
        for name, options in OPTIONS.items():
            seqs = [Sequence([1], SamplingParams(temperature=0.6, **{**options, **(
                {"seed": i} if "seed" in options else {})})) for i in range(rows)]
            tensors = sampler.prepare(seqs)
            device = time_us(lambda logits=logits, tensors=tensors: sampler(logits, tensors))
            host = host_us(lambda logits=logits, seqs=seqs: sampler(logits, sampler.prepare(seqs)))
            print(f"| {rows} | {name} | {device:.0f} | {host:.0f} |")
        topk_us = time_us(lambda logits=logits: logits.topk(20, dim=-1))
        pool_us = time_us(lambda logits=logits: LargestLogits(logits, 20, chunked=True))
        print(f"| {rows} | the 20 largest: torch.topk over the vocabulary | {topk_us:.0f} | |")
        print(f"| {rows} | the 20 largest: chunk maxima, then topk over 20 chunks | {pool_us:.0f} | |")

if __name__ == "__main__":
    main()
