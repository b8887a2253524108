"""One decoder layer's four matmuls on the GPU: bf16 against row-wise FP8, cuBLAS's block-wise FP8 and FlashInfer's
block-wise FP8 (when installed, on Hopper), per number of rows, with each FP8 kernel's error against float32.

    python benchmarks/microbench_fp8_gemm.py [--shape Qwen3-8B,Llama-3.1-8B] [--rows 1,16,64,256,8192] [--out DIR]

Each FP8 mode is timed with the activation quantization the engine runs before it (nanovllm/quantization/fp8_linear.py,
"+quant") and without it (the matmul alone, on the engine's own padded input); row-wise also with Hopper's fast
accumulation ("fast"). Speed-ups are against bf16 F.linear at the same rows. Weights rotate through enough copies
to overflow L2, as in a forward pass where the other layers' weights pass between two uses of the same matrix;
timed inside a CUDA graph, as decode runs.

Error: max |y - ref| / max |ref| over the layer's outputs (the GPU tests' bar is 1%) and mean |y - ref| / mean |ref|,
against the same quantization multiplied in float32, the worst of the four layers. The routing table at the end
takes, per row count, the faster of cuBLAS and FlashInfer (the matmul alone: both read the same quantized input)
among those within the bar and no more than 1.25x cuBLAS's mean error, and prints it as fp8_routes.MEASURED_ROUTES.
--out writes the tables (markdown) and the measurements (JSON) there.
"""
import argparse
import functools
import json
import os

import torch
import torch.nn.functional as F
from cuda_timing import graph_time_us

from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_flashinfer import flashinfer_block_mm, flashinfer_fits
from nanovllm.quantization.fp8_fused import Fp8Input
from nanovllm.quantization.fp8_linear import quantize_blockwise
from nanovllm.utils.random_checkpoint import SHAPES

ROWS = "1,2,4,8,16,24,31,32,48,64,96,128,192,256,384,512,1024,2048,4096,8192"
MAX_ERROR, MEAN_ERROR_VS_CUBLAS = 0.01, 1.25


def layer_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """(out, in) of qkv, o, gate_up and down for one layer of a dense shape."""
    c = SHAPES[shape]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, c["hidden_size"]), "o": (c["hidden_size"], q),
            "gate_up": (2 * c["intermediate_size"], c["hidden_size"]),
            "down": (c["hidden_size"], c["intermediate_size"])}


def flashinfer_ready(device: torch.device) -> str | None:
    """Why FlashInfer's modes are left out, or None."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "not a Hopper GPU"
    try:
        import flashinfer  # noqa: F401
    except ImportError as error:
        return f"flashinfer does not import ({error})"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-8B,Llama-3.1-8B", help="comma-separated dense shapes")
    parser.add_argument("--rows", default=ROWS)
    parser.add_argument("--copies", type=int, default=4, help="weight copies rotated per layer (past L2)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for the tables and JSON")
    parser.add_argument("--producers", action="store_true",
                        help="time RMSNorm and SiLU-and-mul writing the quantized input against the op, then the "
                             "quantization kernel (quantization/fp8_fused.py)")
    args = parser.parse_args()
    device = torch.device("cuda")
    fp8.SCALED_MM_ON_GPU = True  # the kernels themselves, whether or not the engine uses them yet
    rowwise, blockwise = fp8.fp8_supported(device)
    no_flashinfer = flashinfer_ready(device)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, row-wise FP8: {rowwise}, "
          f"block-wise FP8: {blockwise}, FlashInfer: {no_flashinfer or 'yes'}")
    if not rowwise:
        raise SystemExit("this GPU has no FP8 matmul (needs compute capability 8.9 or later)")
    g = torch.Generator(device).manual_seed(0)
    if args.producers:
        return producers(args, g, device)
    modes = ["bf16", "row+quant", "row", "row fast", "block+quant", "block", "fi+quant", "fi"]
    modes = [m for m in modes if (blockwise or not m.startswith("block")) and (not no_flashinfer or
                                                                                 not m.startswith("fi"))]
    lines, results = [], {}
    for shape in args.shape.split(","):
        results[shape] = measure(shape, [int(r) for r in args.rows.split(",")], modes, args.copies, g, device, lines)
    if "fi" in modes:
        routing(results, lines)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_gemm.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "fp8_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)


def emit(lines: list[str], text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def make_weights(shape: str, copies: int, g: torch.Generator, device: torch.device) -> dict:
    weights = {}
    for name, (n, k) in layer_shapes(shape).items():
        layer = []
        for _ in range(copies):
            w = torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02
            w8, scale = fp8.quantize_per_channel(w)
            channel = fp8.Fp8Weight(w8, scale, "channel", scale.view(1, -1))
            b8, block_scale = quantize_blockwise(w)
            block = fp8.Fp8Weight(b8, block_scale, "block", fp8.block_kernel_scale(block_scale))
            if flashinfer_fits(n, k):
                block.flashinfer_scale = block_scale.float().contiguous()
            layer.append((w, channel, block))
        weights[name] = layer
    return weights


def measure(shape: str, row_counts: list[int], modes: list[str], copies: int, g: torch.Generator,
            device: torch.device, lines: list[str]) -> dict:
    weights = make_weights(shape, copies, g, device)
    fp8_modes = [m for m in modes if m != "bf16"]
    emit(lines, f"\n{shape}: us per call, speed-up against bf16, and error against float32 (max / mean, worst layer)")
    emit(lines, "| rows | layer | " + " | ".join(f"{m} us" for m in modes) + " | " +
         " | ".join(f"{m} x" for m in fp8_modes) + " | row err | block err | fi err |")
    emit(lines, "|" + " --- |" * (2 + len(modes) + len(fp8_modes) + 3))
    out = {}
    for rows in row_counts:
        totals = dict.fromkeys(modes, 0.0)
        errors = {"row": (0.0, 0.0), "block": (0.0, 0.0), "fi": (0.0, 0.0)}
        for name, layer in weights.items():
            x = torch.randn(rows, layer[0][0].size(1), generator=g, device=device, dtype=torch.bfloat16)
            inputs = (fp8.quantized_input(x, None), fp8.quantized_input(x, fp8.BLOCK, 4))
            times = {}
            for mode in modes:
                calls = [_call(mode, x, channel, block, w, inputs) for w, channel, block in layer]
                try:
                    times[mode] = graph_time_us(calls, repeat=4) if calls[0] else float("nan")
                except RuntimeError as error:  # a mode this torch or GPU lacks: say so, time the others
                    print(f"{mode} at {rows} rows, {name}: {str(error).splitlines()[0][:200]}")
                    times[mode] = float("nan")
                totals[mode] += times[mode]
            for kind, error in layer_errors(x, *layer[0][1:], inputs, modes).items():
                errors[kind] = tuple(max(a, b) for a, b in zip(errors[kind], error))
            _row(lines, rows, name, times, modes, fp8_modes, {})
        _row(lines, rows, "layer", totals, modes, fp8_modes, errors)
        out[rows] = {"us": totals, "errors": errors}
    return out


def _call(mode, x, channel, block, w, inputs):
    (x8_row, xs_row), (x8_group, xs_group) = inputs
    rows = x.size(0)
    if mode == "bf16":
        return lambda: F.linear(x, w)
    if mode == "row+quant":
        return lambda: fp8.fp8_linear(x, channel, None)
    if mode == "block+quant":
        return lambda: fp8.fp8_linear(x, block, None)
    if mode.startswith("fi"):
        if block.flashinfer_scale is None:
            return None
        if mode == "fi+quant":
            return lambda: flashinfer_block_mm(x, block)
        return lambda: flashinfer_block_mm(Fp8Input(x8_group, xs_group, rows, x.dtype), block)
    if mode.startswith("row"):
        return lambda: torch._scaled_mm(x8_row, channel.weight.t(), scale_a=xs_row, scale_b=channel.kernel_scale,
                                        out_dtype=torch.bfloat16, use_fast_accum=mode.endswith("fast"))
    return lambda: F.scaled_mm(x8_group, block.weight.t(), xs_group, fp8.ACT_1x128, block.kernel_scale,
                               fp8.WEIGHT_128x128, output_dtype=torch.bfloat16)[:rows]


def relative_errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (y.float() - ref).abs()
    return (diff.max() / ref.abs().max()).item(), (diff.mean() / ref.abs().mean()).item()


@torch.inference_mode()
def layer_errors(x, channel, block, inputs, modes) -> dict[str, tuple[float, float]]:
    """Each FP8 kernel's output against its own quantization multiplied in float32 (the activations as the engine
    quantizes them, the weights dequantized)."""
    (x8_row, xs_row), (x8_group, xs_group) = inputs
    rows = x.size(0)
    errors = {}
    ref = (x8_row[:rows].float() * xs_row[:rows]) @ (channel.weight.float() * channel.scale.unsqueeze(1)).t()
    errors["row"] = relative_errors(fp8.fp8_linear(x, channel, None), ref)
    if "block" in modes:
        x_dq = (x8_group[:rows].float() * xs_group[:rows].repeat_interleave(fp8.BLOCK, 1))
        ref = x_dq @ fp8.dequantize_blocks(block.weight, block.scale, torch.float32).t()
        errors["block"] = relative_errors(fp8.fp8_linear(x, block, None), ref)
        if "fi" in modes and block.flashinfer_scale is not None:
            errors["fi"] = relative_errors(flashinfer_block_mm(Fp8Input(x8_group, xs_group, rows, x.dtype), block),
                                           ref)
    return errors


def routing(results: dict, lines: list[str]) -> None:
    """Per row count, the faster accurate block-scaled kernel over every shape measured (all must agree for
    FlashInfer to win a row count), and the routes that gives."""
    emit(lines, "\n| rows | " + " | ".join(f"{s} cuBLAS / FlashInfer us" for s in results) + " | kernel |")
    emit(lines, "|" + " --- |" * (2 + len(results)))
    winners = []
    for rows in next(iter(results.values())):
        cells, wins = [], True
        for measured in results.values():
            us, errors = measured[rows]["us"], measured[rows]["errors"]
            accurate = errors["fi"][0] <= MAX_ERROR and errors["fi"][1] <= MEAN_ERROR_VS_CUBLAS * errors["block"][1]
            wins &= accurate and us["fi"] < us["block"]
            cells.append(f"{us['block']:.1f} / {us['fi']:.1f}{'' if accurate else ' (inaccurate)'}")
        winners.append((rows, "flashinfer" if wins else "cublas"))
        emit(lines, f"| {rows} | " + " | ".join(cells) + f" | {winners[-1][1]} |")
    emit(lines, f"\nsuggested for nanovllm/quantization/fp8_routes.py: MEASURED_ROUTES = {suggest_routes(winners)!r}")


def suggest_routes(winners: list[tuple[int, str]]) -> tuple[tuple[int, str], ...]:
    """Routes from the winner at each measured row count: an entry ends at the last row count of a run of equal
    winners, so a row count between two measured ones takes the larger one's winner; past the last entry, cuBLAS."""
    routes = [(rows, kernel) for (rows, kernel), following in zip(winners, winners[1:] + [(0, None)])
              if kernel != following[1]]
    while routes and routes[-1][1] == "cublas":
        routes.pop()
    return tuple(routes)


def producers(args: argparse.Namespace, g: torch.Generator, device: torch.device) -> None:
    """The ops before the block-scaled matmuls, per row count: unfused (the op, then the quantization kernel)
    against fused, in us."""
    from nanovllm.layers.activation import silu_and_mul
    from nanovllm.layers.layernorm import add_rms_norm
    from nanovllm.quantization.fp8_fused import rms_norm_quantized, silu_and_mul_quantized

    c = SHAPES[args.shape.split(",")[0]]
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


def _row(lines: list[str], rows: int, name: str, times: dict[str, float], modes: list[str], fp8_modes: list[str],
         errors: dict[str, tuple[float, float]]) -> None:
    base = times["bf16"]
    error_cells = [f"{errors[k][0]:.4f} / {errors[k][1]:.4f}" if errors.get(k, (0.0, 0.0))[0] else ""
                   for k in ("row", "block", "fi")]
    emit(lines, f"| {rows} | {name} | " + " | ".join(f"{times[m]:.1f}" for m in modes) + " | " +
         " | ".join(f"{base / times[m]:.2f}" for m in fp8_modes) + " | " + " | ".join(error_cells) + " |")


if __name__ == "__main__":
    main()
