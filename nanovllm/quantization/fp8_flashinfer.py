"""Block-scaled FP8 matmuls through FlashInfer's fp8_blockscale_gemm_sm90, for the batch sizes fp8_routes sends there.

The input is quantized by the engine as for cuBLAS (1x128 groups, fp8_activation.py or the fused producers of
fp8_fused.py), and its scales are already in the layout the kernel reads: column-major [rows padded to 4,
in / 128], the TMA-aligned layout DeepGEMM takes for the activation side in both its normal and its
swapped-operand kernels. The weight side takes the checkpoint's [out / 128, in / 128] float32 scales as stored.

The kernels are DeepGEMM's, compiled at run time (NVRTC, kept in memory for the process) per output width, input
width and tile configuration, which depends on the row count. prepare_flashinfer_gemm runs every routed row count
of every layer shape once at start-up, so no compile happens mid-run or inside a CUDA-graph capture.
"""
import logging
import os
import time

import torch
from torch import nn

from nanovllm.quantization.fp8_activation import quantize_activations
from nanovllm.quantization.fp8_fused import GROUP, ROW_MULTIPLE, Fp8Input
from nanovllm.quantization.fp8_routes import FLASHINFER, ROUTES_ENV, active_routes, routed_rows
from nanovllm.utils.flashinfer import flashinfer_installed, require_flashinfer

logger = logging.getLogger(__name__)


def flashinfer_fits(out_features: int, in_features: int) -> bool:
    """FlashInfer's kernel tiles the output in 64 columns and the reduction in 128."""
    return out_features % 64 == 0 and in_features % 128 == 0


def flashinfer_block_mm(x: torch.Tensor | Fp8Input, weight) -> torch.Tensor:
    """x W^T for a block-scaled Fp8Weight prepared by prepare_flashinfer_gemm; x [rows, in] in bf16, or already
    quantized (Fp8Input). Returns [rows, out] in the activations' dtype (bf16)."""
    gemm = require_flashinfer("FP8 matmuls routed to FlashInfer", "gemm").fp8_blockscale_gemm_sm90
    if isinstance(x, Fp8Input):
        rows, values, scales, dtype = x.rows, x.values, x.scales, x.dtype
    else:
        rows, dtype = x.size(0), x.dtype
        values, scales = quantize_activations(x.contiguous(), GROUP, ROW_MULTIPLE)
    out = torch.empty(rows, weight.weight.size(0), dtype=dtype, device=values.device)
    if rows:
        gemm(values[:rows], weight.weight, scales, weight.flashinfer_scale, out=out)
    return out


def _block_scaled_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "fp8", None) is not None and m.fp8.mode == "block"
            and m.fp8.kernel_scale is not None]


def prepare_flashinfer_gemm(model: nn.Module, max_rows: int) -> float | None:
    """Where the active routes (fp8_routes) send some batch sizes to FlashInfer: give every block-scaled layer it
    can run its routes and scales, then run each distinct layer shape at every routed row count up to max_rows,
    which compiles every kernel the engine will use. Returns the seconds that took; None where nothing goes to
    FlashInfer (no route names it, no block-scaled layer, not Hopper, or FlashInfer not installed and not asked
    for through the environment, in which case cuBLAS keeps every batch)."""
    routes = active_routes()
    rows = routed_rows(routes, FLASHINFER, max_rows)
    layers = _block_scaled_layers(model)
    if not rows or not layers or torch.cuda.get_device_capability(layers[0].fp8.weight.device)[0] != 9:
        return None
    if not flashinfer_installed() and ROUTES_ENV not in os.environ:
        logger.info("FP8 matmul routes name FlashInfer, which is not installed: cuBLAS runs every batch")
        return None
    start = time.perf_counter()
    try:
        _route_and_compile(layers, routes, rows)
    except Exception as error:
        for layer in layers:  # cuBLAS for every batch again
            layer.fp8.routes, layer.fp8.flashinfer_scale = (), None
        if ROUTES_ENV in os.environ:  # asked for by name: the failure is the answer
            raise
        # the built-in table only prefers FlashInfer where it is faster: an install that cannot build its kernels
        # (no nvcc, a broken JIT) costs that speed, not the engine
        logger.warning("FP8 matmuls stay on cuBLAS: FlashInfer's kernels failed to load or compile (%s: %s)",
                       type(error).__name__, error)
        return None
    return time.perf_counter() - start


def _route_and_compile(layers: list[nn.Module], routes, rows: list[int]) -> None:
    require_flashinfer(f"FP8 matmul routes {routes}", "gemm")
    shapes = {}
    for layer in layers:
        fp8 = layer.fp8
        if flashinfer_fits(*fp8.weight.shape):
            fp8.flashinfer_scale = fp8.scale.float().contiguous()
            fp8.routes = routes
            shapes.setdefault(tuple(fp8.weight.shape), fp8)
    g = torch.Generator(layers[0].fp8.weight.device).manual_seed(0)
    for (_, in_features), fp8 in shapes.items():
        x = torch.randn(rows[-1], in_features, generator=g, device=fp8.weight.device, dtype=torch.bfloat16)
        for n in rows:
            flashinfer_block_mm(x[:n], fp8)
    torch.cuda.synchronize()
