"""The paged decode kernel over a bf16 cache and an FP8 cache (one scale per layer, the engine's), on the GPU:
time and effective bandwidth of the bytes read, and (--sweep) every chunk size / warps / stages setting.

    python benchmarks/microbench_fp8_decode.py                       # the long-context shape (64 x 6k-14.8k)
    python benchmarks/microbench_fp8_decode.py --batch 256 --min-context 100 --max-context 2048   # bench.py's
    python benchmarks/microbench_fp8_decode.py --sweep               # the table paged_decode.TUNED comes from
                                                                      # (and other slice counts at that setting)

Also prints the FP8 output's largest difference from the bf16 one.
"""
import argparse
import functools
import itertools

import torch
from cuda_timing import graph_time_us

from nanovllm.attention.paged_decode import TUNED, paged_decode_attention
from nanovllm.quantization.kv_quant import quantize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--min-context", type=int, default=6000)
    parser.add_argument("--max-context", type=int, default=14800)
    parser.add_argument("--sweep", action="store_true", help="time every (BLOCK_N, warps, stages) per cache dtype")
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
    k_scale, v_scale = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    tokens = context_lens.sum().item() * args.kv_heads
    cases = [("bf16", k, v, {}, tokens * head_dim * 2 * 2),
             ("fp8, scale per layer", k8, v8, dict(k_scale=k_scale, v_scale=v_scale), tokens * head_dim * 2)]
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
    if not args.sweep:
        return
    print("\n| KV cache | BLOCK_N | warps | stages | us | GB/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, kc, vc, scales, nbytes in cases:
        timings = {}
        for block_n, warps, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4)):
            call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                     block_n=block_n, num_warps=warps, num_stages=stages, **scales)
            try:
                timings[block_n, warps, stages] = graph_time_us([call], repeat=10)
            except Exception as error:  # a setting that needs more shared memory than the GPU has
                print(f"| {name} | {block_n} | {warps} | {stages} | failed: {type(error).__name__} | |")
        for setting, us in sorted(timings.items(), key=lambda item: item[1])[:5]:
            print(f"| {name} | {setting[0]} | {setting[1]} | {setting[2]} | {us:.1f} | {nbytes / us / 1e3:.0f} |")
        tuned = TUNED[name != "bf16"]
        print(f"| {name} (TUNED {tuned}) | | | | {timings.get(tuned, float('nan')):.1f} | |")
        for splits in (4, 16, 32):  # slices per sequence other than default_max_splits, at the tuned setting
            call = functools.partial(paged_decode_attention, q, kc, vc, block_tables, context_lens, scale, counters,
                                     block_n=tuned[0], num_warps=tuned[1], num_stages=tuned[2], max_splits=splits,
                                     **scales)
            print(f"| {name} (TUNED, max_splits {splits}) | | | | {graph_time_us([call], repeat=10):.1f} | |")


if __name__ == "__main__":
    main()
