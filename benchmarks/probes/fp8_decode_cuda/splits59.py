"""Issue 59 probe: the CUDA FP8 decode kernel's slice count at the batch sizes of a run's tail (bench.py's default
workload: 16/8 heads, contexts 100-2048, a 4,096-token table), against the bf16 Triton kernel.
Run: python benchmarks/probes/fp8_decode_cuda/splits59.py (a CUDA machine)."""
import functools
import sys

import torch

import nanovllm.attention.paged_decode as pd
from nanovllm.quantization.kv_quant import quantize

sys.path.insert(0, "benchmarks")
from microbench import graph_time_us  # noqa: E402

SPLITS = (None, 8, 16, 32, 64)
columns = " | ".join(f"FP8 CUDA splits {s or 'default'} us (GB/s)" for s in SPLITS)
print(f"| batch | bf16 Triton us (GB/s) | {columns} |")
print("| --- " * (2 + len(SPLITS)) + "|")
for batch in (4, 8, 16, 32, 64, 128, 256):
    torch.manual_seed(batch)
    page, head_dim, kv_heads, heads = 256, 128, 8, 16
    width = 16
    num_blocks = batch * width + 16
    k = torch.randn(num_blocks, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.randint(100, 2049, (batch,), dtype=torch.int32, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda")[: batch * width].view(batch, width).int()
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")
    ks, vs = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, ks), quantize(v, vs)
    tokens = lens.sum().item() * kv_heads * head_dim * 2
    bf16 = functools.partial(pd.paged_decode_attention, q, k, v, tables, lens, 0.088, counters)
    cells = [f"{(us := graph_time_us([bf16], repeat=20)):.1f} ({2 * tokens / us / 1e3:.0f})"]
    ref = pd.paged_decode_attention(q, k8, v8, tables, lens, 0.088, counters, k_scale=ks, v_scale=vs,
                                    fp8_kernel="triton").float()
    for splits in SPLITS:
        call = functools.partial(pd.paged_decode_attention, q, k8, v8, tables, lens, 0.088, counters,
                                 k_scale=ks, v_scale=vs, max_splits=splits)
        diff = (call().float() - ref).abs().max().item()
        assert diff < 2e-2, (batch, splits, diff)
        us = graph_time_us([call], repeat=20)
        cells.append(f"{us:.1f} ({tokens / us / 1e3:.0f})")
    print(f"| {batch} | " + " | ".join(cells) + " |")
    del k, v, k8, v8
