"""The CUDA FP8 decode kernel against a variant computing S^T = K.Q^T (paged_decode_fp8_t.cu beside this file:
half the query-key products, no padded query rows, P^T by movmatrix) at several register bounds; max diff against
the Triton kernel and the main CUDA kernel. Run: python benchmarks/probes/fp8_decode_cuda/t59.py (a CUDA machine)."""
import functools
import sys
from pathlib import Path

import torch

import nanovllm.attention.paged_decode as pd
import nanovllm.attention.paged_decode_cuda as pc
from nanovllm.quantization.kv_quant import quantize

sys.path.insert(0, "benchmarks")
from microbench import graph_time_us  # noqa: E402

SHAPES = [(512, 32, 8, 1500, 1700, 128), (256, 16, 8, 100, 2048, 128), (64, 16, 8, 6000, 14800, 128),
          (64, 64, 8, 1, 3000, 128), (64, 8, 8, 1, 3000, 64), (48, 28, 4, 1, 5000, 128)]
product = pc.SOURCE


def build(head_dim: int) -> dict:
    kernels = {"main B12": pc.compile_kernel(0, head_dim, True)}
    pc.SOURCE = Path("benchmarks/probes/fp8_decode_cuda/paged_decode_fp8_t.cu")
    for blocks in (1, 12, 14, 16):
        kernels[f"transposed B{blocks}"] = pc.compile_kernel(0, head_dim, True, (f"MIN_BLOCKS={blocks}",))
    pc.SOURCE = product
    return kernels


built = {128: build(128), 64: build(64)}
print("| shape | kernel | us (two passes) | GB/s | max diff vs Triton | vs main CUDA |")
print("| --- | --- | --- | --- | --- | --- |")
for batch, heads, kv_heads, lo, hi, head_dim in SHAPES:
    torch.manual_seed(0)
    page = 256
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
    args = (q, k8, v8, tables, lens, head_dim ** -0.5 * 1.3, counters)
    ref = pd.paged_decode_attention(*args, k_scale=ks, v_scale=vs, fp8_kernel="triton").float()
    main = None
    times = {}
    kernels = built[head_dim]
    for round_ in range(2):
        for name, kernel in kernels.items():
            pd.decode_kernel = lambda *a, kernel=kernel, **kw: kernel
            for splits in ((None, 1, 16) if round_ == 0 else (None,)):
                call = functools.partial(pd.paged_decode_attention, *args, k_scale=ks, v_scale=vs, max_splits=splits)
                out = call().float()
                if splits is None and name == "main B12":
                    main = out
                if round_ == 0:
                    diff = (out - ref).abs().max().item()
                    times.setdefault(name, [None, 0.0, 0.0])
                    times[name][1] = max(times[name][1], diff)
                    if splits is None:
                        times[name][2] = (out - main).abs().max().item()
            times[name].append(graph_time_us([call], repeat=20))
    for name, (_, diff, vs_main, *us) in times.items():
        print(f"| {batch}x{lo}-{hi} {heads}/{kv_heads} d{head_dim} | {name} | {' / '.join(f'{u:.1f}' for u in us)} | "
              f"{nbytes / min(us) / 1e3:.0f} | {diff:.2e} | {vs_main:.2e} |")
    del k8, v8
