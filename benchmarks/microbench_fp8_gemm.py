"""One decoder layer's four matmuls on the GPU: bf16 against row-wise and block-wise FP8, per number of rows.

    python benchmarks/microbench_fp8_gemm.py [--shape Qwen3-8B] [--rows 16,64,256,1024,8192]

Each FP8 mode is timed with the activation quantization the engine runs before it (nanovllm/quantization/fp8_linear.py,
"+quant") and without it (the matmul alone); row-wise also with Hopper's fast accumulation ("fast"). Speed-ups
are against bf16 F.linear at the same rows. Weights rotate through enough copies to overflow L2, as in a forward
pass where the other layers' weights pass between two uses of the same matrix; timed inside a CUDA graph, as
decode runs.
The rows where FP8 first wins give the crossover (fp8_linear.BF16_BELOW_ROWS) and which mode wins per shape.
"""
import argparse
import functools

import torch
import torch.nn.functional as F
from cuda_timing import graph_time_us

from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_linear import quantize_blockwise
from nanovllm.utils.random_checkpoint import SHAPES


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of qkv, o, gate_up and down for one layer of a Qwen3 shape."""
    c = SHAPES[shape]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    return {"qkv": (q + 2 * kv, c["hidden_size"]), "o": (c["hidden_size"], q),
            "gate_up": (2 * c["intermediate_size"], c["hidden_size"]),
            "down": (c["hidden_size"], c["intermediate_size"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-8B", choices=sorted(SHAPES))
    parser.add_argument("--rows", default="16,64,256,1024,8192")
    parser.add_argument("--copies", type=int, default=4, help="weight copies rotated per layer (past L2)")
    parser.add_argument("--producers", action="store_true",
                        help="time RMSNorm and SiLU-and-mul writing the quantized input against the op, then the "
                             "quantization kernel (quantization/fp8_fused.py)")
    args = parser.parse_args()
    device = torch.device("cuda")
    fp8.SCALED_MM_ON_GPU = True  # the kernels themselves, whether or not the engine uses them yet
    rowwise, blockwise = fp8.fp8_supported(device)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape}, "
          f"row-wise FP8: {rowwise}, block-wise FP8: {blockwise}")
    if not rowwise:
        raise SystemExit("this GPU has no FP8 matmul (needs compute capability 8.9 or later)")
    g = torch.Generator(device).manual_seed(0)
    if args.producers:
        return producers(args, g, device)
    weights = {}
    for name, (n, k) in layer_shapes(args.shape).items():
        copies = []
        for _ in range(args.copies):
            w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
            w8, scale = fp8.quantize_per_channel(w)
            channel = fp8.Fp8Weight(w8, scale, "channel", scale.view(1, -1))
            b8, block_scale = quantize_blockwise(w)
            block = fp8.Fp8Weight(b8, block_scale, "block", fp8.block_kernel_scale(block_scale))
            copies.append((w, channel, block))
        weights[name] = copies

    modes = ["bf16", "row+quant", "row", "row fast", "block+quant", "block"]
    if not blockwise:
        modes = [m for m in modes if not m.startswith("block")]
    print("| rows | layer | " + " | ".join(f"{m} us" for m in modes) + " | " +
          " | ".join(f"{m} x" for m in modes[1:]) + " |")
    print("|" + " --- |" * (2 + 2 * len(modes) - 1))
    for rows in (int(r) for r in args.rows.split(",")):
        totals = dict.fromkeys(modes, 0.0)
        for name, copies in weights.items():
            k = copies[0][0].size(1)
            x = torch.randn(rows, k, generator=g, device=device, dtype=torch.bfloat16)
            x8_row, xs_row = fp8.quantize_per_row(x)
            x8_group, xs_group = fp8.quantize_per_group(x)
            xs_group = torch.empty_strided(xs_group.shape, (1, rows), device=device).copy_(xs_group)
            times = {}
            for mode in modes:
                calls = [_call(mode, x, w, channel, block, x8_row, xs_row, x8_group, xs_group)
                         for w, channel, block in copies]
                try:
                    times[mode] = graph_time_us(calls, repeat=4)
                except RuntimeError as error:  # a mode this torch or GPU lacks: say so, time the others
                    print(f"{mode} at {rows} rows, {name}: {str(error).splitlines()[0][:200]}")
                    times[mode] = float("nan")
                totals[mode] += times[mode]
            _row(rows, name, times, modes)
        _row(rows, "layer", totals, modes)


def _call(mode, x, w, channel, block, x8_row, xs_row, x8_group, xs_group):
    if mode == "bf16":
        return lambda: F.linear(x, w)
    if mode == "row+quant":
        return lambda: fp8.fp8_linear(x, channel, None)
    if mode == "block+quant":
        return lambda: fp8.fp8_linear(x, block, None)
    fast = mode.endswith("fast")
    if mode.startswith("row"):
        return lambda: torch._scaled_mm(x8_row, channel.weight.t(), scale_a=xs_row, scale_b=channel.kernel_scale,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
    return lambda: F.scaled_mm(x8_group, block.weight.t(), xs_group, fp8.ACT_1x128, block.kernel_scale,
                               fp8.WEIGHT_128x128, output_dtype=torch.bfloat16)


def producers(args: argparse.Namespace, g: torch.Generator, device: torch.device) -> None:
    """The ops before the block-scaled matmuls, per row count: unfused (the op, then the quantization kernel)
    against fused, in us."""
    from nanovllm.layers.activation import silu_and_mul
    from nanovllm.layers.layernorm import add_rms_norm
    from nanovllm.quantization.fp8_fused import rms_norm_quantized, silu_and_mul_quantized

    c = SHAPES[args.shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    print("| rows | add+RMSNorm, quantize | fused | SiLU-and-mul, quantize | fused |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        x, residual = (torch.randn(rows, hidden, generator=g, device=device, dtype=torch.bfloat16) for _ in range(2))
        gate_up = torch.randn(rows, 2 * inter, generator=g, device=device, dtype=torch.bfloat16)
        calls = [lambda x, residual: fp8.quantized_input(add_rms_norm(x, residual, weight, 1e-6)[0], 128, 4),
                 lambda x, residual: rms_norm_quantized(x, weight, 1e-6, residual)]
        times = [graph_time_us([functools.partial(call, x, residual)], repeat=20) for call in calls]
        times += [graph_time_us([functools.partial(call, gate_up)], repeat=20)
                  for call in (lambda y: fp8.quantized_input(silu_and_mul(y), 128, 4), silu_and_mul_quantized)]
        print(f"| {rows} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


def _row(rows: int, name: str, times: dict[str, float], modes: list[str]) -> None:
    base = times["bf16"]
    print(f"| {rows} | {name} | " + " | ".join(f"{times[m]:.1f}" for m in modes) + " | " +
          " | ".join(f"{base / times[m]:.2f}" for m in modes[1:]) + " |")


if __name__ == "__main__":
    main()
