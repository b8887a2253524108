"""The CUDA FP8 decode kernel's register bound (MIN_BLOCKS) and slice counts at three shapes."""
import functools
import sys

import torch

import nanovllm.attention.paged_decode as pd
from nanovllm.attention.paged_decode_cuda import compile_kernel
from nanovllm.quantization.kv_quant import quantize

sys.path.insert(0, "benchmarks")  # run from the repository root
from microbench import graph_time_us  # noqa: E402

SHAPES = [(512, 32, 8, 1500, 1700), (256, 16, 8, 100, 2048), (64, 16, 8, 6000, 14800)]
VARIANTS = [(), ("MIN_BLOCKS=12",), ("MIN_BLOCKS=16",)]
kernels = {v: compile_kernel(0, 128, True, v) for v in VARIANTS}
print("| shape | variant | max_splits | us | GB/s | max diff vs Triton |")
print("| --- | --- | --- | --- | --- | --- |")
for batch, heads, kv_heads, lo, hi in SHAPES:
    torch.manual_seed(0)
    page, head_dim = 256, 128
    width = -(-max(hi, 4096) // page)
    num_blocks = batch * width + 16
    k = torch.randn(num_blocks, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.randint(lo, hi + 1, (batch,), dtype=torch.int32, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda")[: batch * width].view(batch, width).int()
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    ks, vs = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, ks), quantize(v, vs)
    del k, v
    nbytes = lens.sum().item() * kv_heads * head_dim * 2
    ref = pd.paged_decode_attention(q, k8, v8, tables, lens, 0.088, counters, k_scale=ks, v_scale=vs,
                                    fp8_kernel="triton").float()
    tri = graph_time_us([functools.partial(pd.paged_decode_attention, q, k8, v8, tables, lens, 0.088, counters,
                                           k_scale=ks, v_scale=vs, fp8_kernel="triton")], repeat=20)
    print(f"| {batch}x{lo}-{hi} {heads}/{kv_heads} | Triton | default | {tri:.1f} | {nbytes / tri / 1e3:.0f} | |")
    for variant, kernel in kernels.items():
        pd.decode_kernel = lambda q, g, kernel=kernel: kernel
        for splits in (None, 8, 16):
            call = functools.partial(pd.paged_decode_attention, q, k8, v8, tables, lens, 0.088, counters,
                                     k_scale=ks, v_scale=vs, max_splits=splits)
            diff = (call().float() - ref).abs().max().item()
            us = graph_time_us([call], repeat=20)
            print(f"| {batch}x{lo}-{hi} {heads}/{kv_heads} | {variant or 'unbounded'} | {splits or 'default'} | "
                  f"{us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2e} |")
    del k8, v8
