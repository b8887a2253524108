"""Issue 59 probe (next GPU session): the CUDA FP8 decode kernel against variants given as probe/wide.py takes
them (FILE.cu, or FILE.cu:WARPS for a multi-warp variant; 12 warps per SM), at large and small batches, with the
product's slice rule and fixed slice counts; max diff against the Triton kernel and the main CUDA kernel. Run:
    python probe/variants59.py probe/paged_decode_fp8_t3.cu probe/paged_decode_fp8_mw.cu:4 (after .device/setup.sh)
"""
import functools
import sys
from pathlib import Path

import torch

import nanovllm.attention.paged_decode as pd
from nanovllm.quantization.kv_quant import quantize

sys.path.insert(0, "benchmarks")
from microbench import graph_time_us  # noqa: E402

sys.path.insert(0, "probe")
from wide import compile_variant  # noqa: E402

SHAPES = [(512, 32, 8, 1500, 1700, 128), (256, 16, 8, 100, 2048, 128), (64, 16, 8, 6000, 14800, 128),
          (128, 16, 8, 100, 2048, 128), (32, 16, 8, 100, 2048, 128), (8, 16, 8, 100, 2048, 128),
          (64, 64, 8, 1, 3000, 128), (64, 8, 8, 1, 3000, 64), (48, 28, 4, 1, 5000, 128)]


SPECS = {"main": "main"} | {Path(spec).name: spec for spec in sys.argv[1:]}


def build(head_dim: int) -> dict:
    return {name: compile_variant(spec, head_dim) for name, spec in SPECS.items()}


built = {128: build(128), 64: build(64)}
totals = dict.fromkeys(SPECS, 0.0)  # with the product's slice rule, over the shapes of 32+ sequences
print("| shape | kernel | slices | us (two passes) | GB/s | max diff vs Triton | vs main |")
print("| --- | --- | --- | --- | --- | --- | --- |")
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
    splits_list = (None, 4, 8, 16, 32) if batch <= 128 else (None, 8)
    rows = {}
    main_out = {}
    for round_ in range(2):
        for name, kernel in built[head_dim].items():
            pd.decode_kernel = lambda *a, kernel=kernel, **kw: kernel
            for splits in splits_list:
                call = functools.partial(pd.paged_decode_attention, *args, k_scale=ks, v_scale=vs, max_splits=splits)
                row = rows.setdefault((name, splits), [0.0, 0.0])
                if round_ == 0:
                    out = call().float()
                    main_out.setdefault(splits, out)
                    row[0] = (out - ref).abs().max().item()
                    row[1] = (out - main_out[splits]).abs().max().item()
                row.append(graph_time_us([call], repeat=20))
    for (name, splits), (diff, vs_main, *us) in rows.items():
        if splits is None and batch >= 32:
            totals[name] += min(us) if diff < 2e-2 else float("inf")
        print(f"| {batch}x{lo}-{hi} {heads}/{kv_heads} d{head_dim} | {name} | {splits or 'rule'} | "
              f"{' / '.join(f'{u:.1f}' for u in us)} | {nbytes / min(us) / 1e3:.0f} | {diff:.2e} | {vs_main:.2e} |")
    del k8, v8
print("totals (us, rule slicing, 32+ sequences):", {name: round(us, 1) for name, us in totals.items()})
print("BEST", SPECS[min((name for name in totals if name != "main"), key=totals.get)])
