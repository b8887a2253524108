"""Decode-step matmuls alone, on the GPU: cuBLAS (F.linear) against a split-K Triton kernel, per shape and batch.

    python tests/microbench_gemm.py [--hidden 1024 --intermediate 3072 --heads 16 --kv-heads 8]

Weights rotate through enough copies to overflow L2, as in a decode step where ~1 GB of other weights and KV
pass between two uses of the same matrix. Timed inside a CUDA graph, as the engine runs decode.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F

from nanovllm.layers.skinny_gemm import skinny_gemm


def time_us(fns, repeat: int = 3) -> float:
    """Device time per call of a list of calls (one per weight copy), from a CUDA graph replay."""
    for fn in fns:
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeat * len(fns))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=3072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--batches", default="16,64,128,256")
    parser.add_argument("--sweep", action="store_true", help="try every tile config, not just the default choice")
    parser.add_argument("--blas", default="cublas", choices=("cublas", "cublaslt"), help="torch's BLAS backend")
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library(args.blas)
    h, d = args.hidden, 128
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * d, h), "o": (h, args.heads * d),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate), "lm_head": (151936, h)}
    print("| shape | M | cuBLAS us | cuBLAS TB/s | triton us | triton config | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    totals: dict[tuple[str, int], float] = {}
    for (name, (n, k)), m in itertools.product(shapes.items(), [int(b) for b in args.batches.split(",")]):
        copies = max(1, -(-128 * 2**20 // (n * k * 2)))
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
        cublas = time_us([lambda w=w, o=o, x=x: torch.matmul(x, w.t(), out=o) for w, o in zip(weights, outs)])
        expected = F.linear(x, weights[0]).float()
        totals[("cublas", m)] = totals.get(("cublas", m), 0.0) + cublas * (1 if name == "lm_head" else 28)
        configs = [None]
        if args.sweep and name != "lm_head":
            configs = list(itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4,)))
        best = (float("inf"), None, 0.0)
        for config in configs:
            options = {} if config is None else dict(zip(("block_n", "block_k", "split_k", "num_stages"), config))
            if options and (k % (options["block_k"] * options["split_k"]) or n < options["block_n"]):
                continue
            try:
                diff = (skinny_gemm(x, weights[0], **options).float() - expected).abs().max().item()
                us = time_us([lambda w=w, x=x, options=options: skinny_gemm(x, w, **options) for w in weights])
            except Exception as exc:  # noqa: BLE001 - a config may not fit; report and go on
                print(f"| {name} | {m} | config {options} failed: {type(exc).__name__} |")
                continue
            if us < best[0]:
                best = (us, options or "default", diff)
        totals[("triton", m)] = totals.get(("triton", m), 0.0) + best[0] * (1 if name == "lm_head" else 28)
        print(f"| {name} {n}x{k} | {m} | {cublas:.1f} | {n * k * 2 / cublas / 1e6:.2f} | {best[0]:.1f} | "
              f"{best[1]} | {best[2]:.1e} |")
        del weights, outs
    for m in sorted({m for _, m in totals}):
        print(f"per decode step at M={m} (28 layers + LM head): cuBLAS {totals[('cublas', m)]:.0f} us, "
              f"triton {totals[('triton', m)]:.0f} us")


if __name__ == "__main__":
    main()
