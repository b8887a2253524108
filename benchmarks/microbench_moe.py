"""One MoE layer's experts alone on the GPU: the fused Triton path against a per-expert loop, per batch size.

    python benchmarks/microbench_moe.py [--experts 128 --top-k 8 --hidden 2048 --inter 768] [--sweep]

Defaults are Qwen3-30B-A3B's shapes at TP=1 (--inter 384 for one rank of TP=2). Routing is random and uniform.
The fused path is timed both eagerly and replayed from a CUDA graph (as the engine's decode runs it); the loop
(the CPU path, which asks the host which experts are in use) can only run eagerly. GB/s counts the weights of the
experts in use once, the floor a step cannot beat; several layers' weights rotate past L2.
"""
import argparse
import itertools

import torch
from cuda_timing import graph_time_us, loop_time_us

from nanovllm.layers.fused_moe import TileConfig, experts_torch, experts_triton, route, tile_config


def calls(run, x, layers, weights, ids, *config) -> list:
    """One call of `run` per layer's weights (bound now, not when called)."""
    return [lambda w13=w13, w2=w2: run(x, w13, w2, weights, ids, *config) for w13, w2 in layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--batches", default="1,8,32,64,128,256,512,4096,16384")
    parser.add_argument("--layers", type=int, default=4, help="weight copies rotated through (past L2)")
    parser.add_argument("--sweep", action="store_true", help="every tile configuration per batch")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    layers = [((torch.randn(args.experts, 2 * args.inter, args.hidden, dtype=dtype, device=device) * 0.02),
               (torch.randn(args.experts, args.hidden, args.inter, dtype=dtype, device=device) * 0.02))
              for _ in range(args.layers)]
    expert_bytes = 3 * args.inter * args.hidden * 2
    print(f"{torch.cuda.get_device_name()}: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, "
          f"inter {args.inter}, bf16; times per layer")
    print(f"{'tokens':>6} {'experts used':>12} {'loop us':>9} {'fused eager':>11} {'fused graph':>11} {'GB/s':>6} "
          f"{'speedup':>7}  tiles")
    for batch in map(int, args.batches.split(",")):
        x = torch.randn(batch, args.hidden, dtype=dtype, device=device)
        weights, ids = route(torch.randn(batch, args.experts, device=device), args.top_k, True)
        used = ids.unique().numel()
        config = tile_config(ids.numel(), args.experts)
        fused = calls(experts_triton, x, layers, weights, ids, config)
        graph_us = graph_time_us(fused)
        eager_us = sum(loop_time_us(call, 20) for call in fused) / len(fused)
        loop = calls(experts_torch, x, layers, weights, ids)
        loop_us = sum(loop_time_us(call, 5) for call in loop) / len(loop)
        print(f"{batch:>6} {used:>12} {loop_us:>9.1f} {eager_us:>11.1f} {graph_us:>11.1f} "
              f"{used * expert_bytes / graph_us / 1e3:>6.0f} {loop_us / graph_us:>6.1f}x  {config}")
        if args.sweep:
            # taller tiles than twice the pairs an expert gets would be mostly padding
            pairs_per_expert = ids.numel() / args.experts
            heights = [m for m in (16, 32, 64, 128) if m == 16 or m <= 2 * pairs_per_expert]
            for m, n, k, warps, stages in itertools.product(heights, (32, 64, 128), (64, 128), (4, 8), (2, 3, 4)):
                candidate = TileConfig(m, n, k, warps, stages)
                try:
                    us = graph_time_us(calls(experts_triton, x, layers, weights, ids, candidate))
                except Exception as error:  # out of shared memory for this tile shape
                    print(f"       {candidate}: {type(error).__name__}")
                    continue
                print(f"       {candidate}: {us:8.1f} us, {used * expert_bytes / us / 1e3:5.0f} GB/s")


if __name__ == "__main__":
    main()
