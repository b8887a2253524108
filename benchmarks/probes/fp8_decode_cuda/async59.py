"""The CUDA FP8 decode kernel against a variant that stages every 16-token tile through shared memory
(paged_decode_fp8_async.cu beside this file, cp.async, STAGES - 1 tiles ahead) at three shapes; max diff against
the Triton kernel. Run: python benchmarks/probes/fp8_decode_cuda/async59.py (a CUDA machine)."""
import functools
import sys
from pathlib import Path

import torch

import nanovllm.attention.paged_decode as pd
import nanovllm.attention.paged_decode_cuda as pc
from nanovllm.quantization.kv_quant import quantize

sys.path.insert(0, "benchmarks")
from microbench import graph_time_us  # noqa: E402

SHAPES = [(512, 32, 8, 1500, 1700), (256, 16, 8, 100, 2048), (64, 16, 8, 6000, 14800)]
kernels = {"main (MIN_BLOCKS 12)": pc.compile_kernel(0, 128, True)}
product_source = pc.SOURCE
pc.SOURCE = Path("benchmarks/probes/fp8_decode_cuda/paged_decode_fp8_async.cu")
for stages in (2, 3, 4):
    for blocks in (12, 14, 16):
        try:
            kernels[f"async S{stages} B{blocks}"] = pc.compile_kernel(0, 128, True, (f"STAGES={stages}",
                                                                                 f"MIN_BLOCKS={blocks}"))
        except RuntimeError as error:
            print(f"async S{stages} B{blocks}: {error}")
pc.SOURCE = product_source
print("| shape | kernel | us | GB/s | max diff vs Triton |")
print("| --- | --- | --- | --- | --- |")
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
    args = (q, k8, v8, tables, lens, 0.088, counters)
    ref = pd.paged_decode_attention(*args, k_scale=ks, v_scale=vs, fp8_kernel="triton").float()
    for name, kernel in kernels.items():
        pd.decode_kernel = lambda *a, kernel=kernel, **kw: kernel
        call = functools.partial(pd.paged_decode_attention, *args, k_scale=ks, v_scale=vs)
        diff = (call().float() - ref).abs().max().item()
        us = graph_time_us([call], repeat=20)
        print(f"| {batch}x{lo}-{hi} {heads}/{kv_heads} | {name} | {us:.1f} | {nbytes / us / 1e3:.0f} | {diff:.2e} |")
    del k8, v8
