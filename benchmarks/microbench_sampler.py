"""The sampler alone on the GPU, per step: each sampling option's device time and the host's time to prepare it.

    python benchmarks/microbench_sampler.py

bf16 logits over Qwen3's 151,936-token vocabulary, as the LM head hands them over; device time by CUDA events over
repeated calls, host time by the wall clock of `prepare` + launching (the sampler runs outside the CUDA graphs, as
here; with a penalty every call copies the histories, as a prefill does). Also the step that replaces a topk over the
vocabulary: the 20 largest logits found chunk-wise; and top-p's floor search alone at 512 rows, for logits as flat
as a random model's (std 0.64) and as spread as these (std 1), with the rounds its rows took, over a few sizes.
"""
import time

import numpy as np
import torch
from cuda_timing import loop_time_us

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling import top_p_passes
from nanovllm.sampling.floors import LargestLogits
from nanovllm.sampling.sampler import Sampler
from nanovllm.sampling.top_p_floor import ScratchLayout, top_p_floors
from nanovllm.sampling_params import SamplingParams

VOCAB = 151936
OPTIONS = {"plain": {}, "seeded": dict(seed=0), "top_k=20,top_p=0.95": dict(top_k=20, top_p=0.95),
           "min_p=0.05": dict(min_p=0.05), "top_p=0.9": dict(top_p=0.9), "top_p=0.9 (sorted)": dict(top_p=0.9),
           "top_k=20,top_p=0.8,T=0.7,repetition=1.05": dict(top_k=20, top_p=0.8, temperature=0.7,
                                                            repetition_penalty=1.05)}


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
            seqs = [Sequence(list(range(i, i + 100)), SamplingParams(**{"temperature": 0.6, **options, **(
                {"seed": i} if "seed" in options else {})})) for i in range(rows)]
            sampler.top_p_by_sort = name.endswith("(sorted)")
            tensors = sampler.prepare(seqs)
            device = loop_time_us(lambda logits=logits, tensors=tensors: sampler(logits, tensors))
            host = host_us(lambda logits=logits, seqs=seqs: sampler(logits, sampler.prepare(seqs)))
            print(f"| {rows} | {name} | {device:.0f} | {host:.0f} |")
        topk_us = loop_time_us(lambda logits=logits: logits.topk(20, dim=-1))
        pool_us = loop_time_us(lambda logits=logits: LargestLogits(logits, 20, chunked=True))
        print(f"| {rows} | the 20 largest: torch.topk over the vocabulary | {topk_us:.0f} | |")
        print(f"| {rows} | the 20 largest: chunk maxima, then topk over 20 chunks | {pool_us:.0f} | |")
    print()
    print("| top-p's floor search, 512 rows, T 0.6, top_p 0.9 | logits' std | device us | rows by rounds |")
    print("| --- | --- | --- | --- |")
    rows = torch.arange(512, device="cuda")
    temperatures, top_p = torch.full((512,), 0.6, device="cuda"), torch.full((512,), 0.9, device="cuda")
    for std in (0.64, 1.0):
        logits = (torch.randn(512, VOCAB, device="cuda") * std).to(torch.bfloat16)
        for sizes in (dict(), dict(num_warps=8), dict(tile_rows=128), dict(tile_rows=512, num_warps=8),
                      dict(row_warps=8)):
            floors = torch.full((512,), float("-inf"), device="cuda")
            scratch = top_p_floors(logits, rows, temperatures, top_p, floors, **sizes)
            layout = ScratchLayout(4096, 8192, sizes.get("tile_rows", 256))
            rounds = scratch[:, layout.state_at + top_p_passes.ROUNDS.value].int().cpu().numpy()
            device = loop_time_us(lambda logits=logits, floors=floors, sizes=sizes: top_p_floors(
                logits, rows, temperatures, top_p, floors, **sizes))
            print(f"| {sizes or 'default'} | {std} | {device:.0f} | {np.bincount(rounds).tolist()} |")


if __name__ == "__main__":
    main()
