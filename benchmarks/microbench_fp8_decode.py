"""The paged decode kernel over a bf16 cache, an FP8 cache with a scale per row (the engine's), and an FP8 cache
with one static scale per layer (vLLM's default), on the GPU: time and effective bandwidth of the bytes read.

    python benchmarks/microbench_fp8_decode.py                       # the long-context shape (64 x 6k-14.8k)
    python benchmarks/microbench_fp8_decode.py --batch 256 --min-context 100 --max-context 2048   # bench.py's

Also prints each FP8 variant's largest difference from the bf16 output (scales chosen from the data, so the
static one does not clamp here; see docs/fp8_kv_cache.md for what it does to real activations).
"""
import argparse
import functools

import torch
from cuda_timing import graph_time_us

from nanovllm.attention.kv_quant import quantize_rows, quantize_static
from nanovllm.attention.paged_decode import paged_decode_attention


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=6000)
    parser.add_argument("--max-context", type=int, default=14800)
    args = parser.parse_args()
    torch.manual_seed(0)
    page, head_dim = 256, 128
    width = -(-max(args.max_context, 4096) // page)
    num_blocks = args.batch * width + 16
    k = torch.randn(num_blocks, page, args.kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(args.batch, args.heads, head_dim, dtype=torch.bfloat16, device="cuda")
    context_lens = torch.randint(args.min_context, args.max_context + 1, (args.batch,), dtype=torch.int32,
                                 device="cuda")
    block_tables = torch.randperm(num_blocks, device="cuda")[: args.batch * width].view(args.batch, width).int()
    counters = torch.zeros(args.batch * args.kv_heads, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    (k8, k_row), (v8, v_row) = quantize_rows(k), quantize_rows(v)
    k_layer = (k.abs().amax().float() / 448).reshape(1)
    v_layer = (v.abs().amax().float() / 448).reshape(1)
    k8s, v8s = quantize_static(k, k_layer.item()), quantize_static(v, v_layer.item())
    tokens = context_lens.sum().item() * args.kv_heads
    cases = [("bf16", k, v, {}, tokens * head_dim * 2 * 2),
             ("fp8, scale per row", k8, v8, dict(k_scale=k_row, v_scale=v_row), tokens * (head_dim + 4) * 2),
             ("fp8, static scale per layer", k8s, v8s, dict(k_scale=k_layer, v_scale=v_layer),
              tokens * head_dim * 2)]
    print(f"batch {args.batch}, heads {args.heads}/{args.kv_heads}, contexts {args.min_context}-{args.max_context}")
    print("| KV cache | us | MB read | GB/s | speed-up vs bf16 | max abs diff vs bf16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    reference, base = None, None
    for name, kc, vc, scales, nbytes in cases:
        call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                 **scales)
        out = call().float()
        reference = out if reference is None else reference
        us = graph_time_us([call], repeat=20)
        base = base or us
        print(f"| {name} | {us:.1f} | {nbytes / 1e6:.0f} | {nbytes / us / 1e3:.0f} | {base / us:.2f}x | "
              f"{(out - reference).abs().max().item():.2e} |")


if __name__ == "__main__":
    main()
