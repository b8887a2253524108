"""Turning a model's parallel linear layers into FP8 ones: before loading (checkpoint layout) and after it.

`prepare_fp8` runs on the freshly built model when the checkpoint stores FP8 weights: each converted layer's
`weight` becomes an e4m3 parameter and a `weight_scale_inv` parameter appears beside it, so the loader's strict
name checks expect exactly the tensors a published FP8 checkpoint holds and route each one to its layer. The
scale's weight_loader takes this rank's shard the way the layer takes its weight's: column-parallel layers keep
their scale rows, row-parallel ones their scale columns, and packed layers (qkv, gate/up) put each part's scales
after the previous part's.

`finish_fp8` runs after loading: it quantizes bf16 weights (quantization='fp8'), or readies checkpoint FP8 weights
for the device's scaled matmul, or dequantizes them where the device has none (CPU), and reports the memory.
"""
import logging
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.quantization import fp8_linear
from nanovllm.quantization.e4m3 import FP8
from nanovllm.quantization.fp8_checkpoint import Fp8Settings
from nanovllm.quantization.fp8_experts import finish_experts, prepare_experts, stacked_experts
from nanovllm.quantization.fp8_fused import quantize_in_producers
from nanovllm.quantization.fp8_linear import Fp8Weight, quantize_blockwise
from nanovllm.utils.loader import ShardId, check_shape

logger = logging.getLogger(__name__)
# layers/linear.py's column-parallel (tp_dim 0: output rows split, packed parts in output_parts()) and row-parallel
# (tp_dim 1) layers, known by what they have rather than imported: layers/ sits above quantization/
Linear = nn.Module


def _parallel_linear(module: nn.Module) -> bool:
    return hasattr(module, "fp8") and getattr(module, "tp_dim", None) in (0, 1)


@dataclass(slots=True)
class _Part:
    """One checkpoint tensor's place in a (possibly packed) column-parallel layer on this rank."""

    shard_id: ShardId
    full_rows: int  # in the checkpoint
    rows: int  # on this rank
    row_offset: int  # in the packed weight
    block_offset: int  # in the packed scale


def _layout(name: str, layer: Linear, block_rows: int) -> list[_Part]:
    parts, row_offset, block_offset = [], 0, 0
    for shard_id, full_rows in layer.output_parts().items():
        rows = full_rows // layer.tp_size
        if layer.tp_size > 1 and rows % block_rows:
            part = "" if shard_id is None else f" part {shard_id!r}"
            raise ValueError(f"FP8 layer {name}{part}: {full_rows} output rows split over {layer.tp_size} ranks "
                             f"gives shards of {rows} rows, not a multiple of the {block_rows}-row scale block; "
                             f"use a tensor_parallel_size that splits it on block boundaries")
        parts.append(_Part(shard_id, full_rows, rows, row_offset, block_offset))
        row_offset, block_offset = row_offset + rows, block_offset + -(-rows // block_rows)
    return parts


def _matches(name: str, entries: tuple[str, ...]) -> bool:
    # whole dotted components, so "mlp.gate" does not match "mlp.gate_proj"
    return any(f".{entry}." in f".{name}." for entry in entries)


def fp8_layers(model: nn.Module, settings: Fp8Settings) -> dict[str, Linear]:
    """The parallel linear layers to convert: all but those in modules_to_not_convert (named as the checkpoint
    names them, so a packed layer is skipped when all its parts are, and half of one is an error)."""
    packed: dict[str, list[str]] = {}
    for checkpoint_name, (packed_name, _) in getattr(model, "packed_modules_mapping", {}).items():
        packed.setdefault(packed_name, []).append(checkpoint_name)
    layers = {}
    for name, module in model.named_modules():
        if not _parallel_linear(module):
            continue
        prefix, _, last = name.rpartition(".")
        names = [f"{prefix}.{part}" if prefix else part for part in packed.get(last, [last])]
        skipped = [n for n in names if _matches(n, settings.not_converted)]
        if skipped and len(skipped) != len(names):
            raise ValueError(f"modules_to_not_convert leaves {skipped} unquantized but not the rest of the packed "
                             f"layer {name} ({names}): one matmul cannot mix FP8 and bf16 parts")
        if not skipped:
            layers[name] = module
    return layers


def prepare_fp8(model: nn.Module, settings: Fp8Settings) -> None:
    """Give each converted layer an e4m3 `weight` and a `weight_scale_inv`, for a checkpoint that stores them."""
    block_rows, block_cols = settings.block
    layers = fp8_layers(model, settings)
    plans = {}  # name -> (weight shape, device, parts): checked before anything changes
    for name, layer in layers.items():
        shape, device = layer.weight.shape, layer.weight.device
        if layer.tp_dim == 1 and layer.tp_size > 1 and shape[1] % block_cols:
            raise ValueError(f"FP8 layer {name}: {shape[1] * layer.tp_size} input columns split over "
                             f"{layer.tp_size} ranks gives shards of {shape[1]} columns, not a multiple of the "
                             f"{block_cols}-column scale block; use a tensor_parallel_size that splits it on blocks")
        parts = _layout(name, layer, block_rows) if layer.tp_dim == 0 else None
        plans[name] = (shape, device, parts)
    # every model-dtype weight goes before any e4m3 one is made: made one by one, each would be carved out of
    # the memory its predecessor just left, and those half-used regions could then not go to the KV cache
    for layer in layers.values():
        del layer.weight
    if any(device.type == "cuda" for _, device, _ in plans.values()):
        torch.cuda.empty_cache()
    for name, layer in layers.items():
        shape, device, parts = plans[name]
        scale_rows = sum(-(-p.rows // block_rows) for p in parts) if parts else -(-shape[0] // block_rows)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=FP8, device=device), requires_grad=False)
        layer.weight.weight_loader = _fp8_weight_loader(layer.weight_loader)
        layer.weight_scale_inv = nn.Parameter(torch.empty(scale_rows, -(-shape[1] // block_cols),
                                                          dtype=torch.float32, device=device),
                                              requires_grad=False)
        layer.weight_scale_inv.weight_loader = _scale_loader(layer, parts, settings.block)
        layer.fp8_parts = parts
    for name, experts in stacked_experts(model).items():  # MoE layers' experts, stacked
        if not _matches(name, settings.not_converted):
            prepare_experts(name, experts, settings.block)


def _fp8_weight_loader(loader):
    def load(param: nn.Parameter, loaded: torch.Tensor, *shard_id) -> None:
        # copy_ would convert a bf16 tensor silently, and the scales would then scale it a second time
        if loaded.dtype != FP8:
            raise ValueError(f"expected a float8_e4m3fn weight (config.json's quantization_config is fp8), "
                             f"found {loaded.dtype}")
        loader(param, loaded, *shard_id)
    return load


def _scale_loader(layer: Linear, parts: list[_Part] | None, block: tuple[int, int]):
    rank, tp_size = layer.tp_rank, layer.tp_size

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if parts is None:  # row-parallel: all scale rows, this rank's scale columns
            cols = param.size(1)
            in_full = layer.weight.size(1) * tp_size
            check_shape(loaded, (param.size(0), -(-in_full // block[1])),
                        f" (weight_scale_inv of a [{layer.weight.size(0)}, {in_full}] weight in {block} blocks)")
            param.data.copy_(loaded.narrow(1, rank * cols, cols))
            return
        part = next(p for p in parts if p.shard_id == shard_id)
        in_full = layer.weight.size(1)
        check_shape(loaded, (-(-part.full_rows // block[0]), -(-in_full // block[1])),
                    f" (weight_scale_inv of a [{part.full_rows}, {in_full}] weight in {block} blocks)")
        blocks = -(-part.rows // block[0])
        param.data.narrow(0, part.block_offset, blocks).copy_(loaded.narrow(0, rank * blocks, blocks))
    return load


@dataclass(slots=True)
class Fp8Summary:
    layers: int
    fp8_bytes: int  # the converted layers' weights and scales as they are now held
    dense_bytes: int  # the same weights in the model dtype
    modes: dict[str, int]  # how many layers run each way: channel, block, dequantized (no FP8 matmul here)
    fused: int = 0  # ops that write their block-scaled consumer's quantized input (quantize_in_producers)

    def describe(self) -> str:
        modes = ", ".join(f"{n} {mode}" for mode, n in sorted(self.modes.items()))
        fused = f"; {self.fused} norms and activations write their quantized input" if self.fused else ""
        return (f"{self.layers} linear layers ({modes}{fused}) hold {self.fp8_bytes / 2**30:.2f} GiB against "
                f"{self.dense_bytes / 2**30:.2f} GiB in the model dtype: "
                f"{(self.dense_bytes - self.fp8_bytes) / 2**30:.2f} GiB more for the KV cache")


def finish_fp8(model: nn.Module, settings: Fp8Settings, dtype: torch.dtype) -> Fp8Summary:
    """Ready every converted layer for the forward pass, after loading; see the module docstring."""
    summary = Fp8Summary(0, 0, 0, {})
    layers = fp8_layers(model, settings)
    quantized = {} if settings.checkpoint else _quantize_at_load(layers, dtype)
    for name, layer in layers.items():
        # the scaled matmuls write bf16 (row-wise ones nothing else): other model dtypes take the portable paths
        rowwise, blockwise = fp8_linear.fp8_supported(layer.weight.device) if dtype == torch.bfloat16 else \
            (False, False)
        if settings.checkpoint:
            mode = _finish_checkpoint_layer(name, layer, settings, dtype, rowwise, blockwise)
        else:
            layer.fp8, mode = quantized[name]
        if layer.fp8 is not None and fp8_linear.BF16_BELOW_ROWS > 0 and layer.fp8.kernel_scale is not None:
            layer.fp8.dense = _dense(layer, dtype)
        summary.layers += 1
        summary.modes[mode] = summary.modes.get(mode, 0) + 1
        summary.dense_bytes += layer.weight.numel() * dtype.itemsize
        held = [layer.weight] + ([layer.fp8.scale] if layer.fp8 is not None else [])
        held += [layer.fp8.dense] if layer.fp8 is not None and layer.fp8.dense is not None else []
        summary.fp8_bytes += sum(t.numel() * t.element_size() for t in held)
    summary.fused = quantize_in_producers(model, fp8_linear.BF16_BELOW_ROWS)
    for experts in stacked_experts(model).values():
        if hasattr(experts, "gate_up_proj_scale_inv"):  # loaded from an FP8 checkpoint; run as bf16 for now
            held = finish_experts(experts, settings.block, dtype)
            summary.layers += 1
            summary.modes["experts dequantized"] = summary.modes.get("experts dequantized", 0) + 1
            summary.dense_bytes, summary.fp8_bytes = summary.dense_bytes + held, summary.fp8_bytes + held
    return summary


def _blocks_fit(layer: Linear) -> bool:
    """Whether 128x128 blocks tile this rank's weight with no block across two packed parts (q/k/v, gate/up),
    as the published checkpoints' blocks do."""
    rows, cols = layer.weight.shape
    parts = [p // layer.tp_size for p in layer.output_parts().values()] if layer.tp_dim == 0 \
        else [rows]
    return cols % fp8_linear.BLOCK == 0 and all(p % fp8_linear.BLOCK == 0 for p in parts)


def _quantize_blockwise_in_slabs(weight: torch.Tensor, slab: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blockwise a slab of rows at a time: its float32 temporaries (several copies of what it quantizes)
    then stay small beside the model-dtype weights still on the device."""
    parts = [quantize_blockwise(weight[start:start + slab]) for start in range(0, weight.size(0), slab)]
    return torch.cat([w8 for w8, _ in parts]), torch.cat([scale for _, scale in parts])


def _quantize_at_load(layers: dict[str, Linear], dtype: torch.dtype) -> dict[str, tuple[Fp8Weight, str]]:
    """quantization='fp8': each layer's weight in e4m3 (now its `weight`), as the device multiplies fastest.

    Where block-scaled matmuls exist (Hopper), in 128x128 blocks: at decode's batch sizes cuBLAS's block-wise
    matmul with its 1x128 activation scales beats the row-wise one, and loses little on prefill
    (docs/fp8_weights.md has the figures); elsewhere one scale per output channel.
    On a GPU the e4m3 weights wait in host memory until every model-dtype weight is gone: made one after another
    on the device, each would be carved out of the memory its predecessor just left, and those half-used regions
    could then not go to the KV cache."""
    staged = {}
    for name, layer in layers.items():
        weight = layer.weight.data
        rowwise, blockwise = fp8_linear.fp8_supported(weight.device) if dtype == torch.bfloat16 else (False, False)
        if blockwise and _blocks_fit(layer):
            (w8, scale), mode = _quantize_blockwise_in_slabs(weight), "block"
        else:
            (w8, scale), mode = fp8_linear.quantize_per_channel(weight), "channel" if rowwise else "channel (emulated)"
        staged[name] = (w8.cpu() if w8.is_cuda else w8, scale, mode)
        del layer.weight, weight, w8
    if any(scale.is_cuda for _, scale, _ in staged.values()):
        torch.cuda.empty_cache()
    quantized = {}
    for name, (w8, scale, mode) in staged.items():
        w8 = w8.to(scale.device)
        layers[name].weight = nn.Parameter(w8, requires_grad=False)
        if mode == "block":
            quantized[name] = Fp8Weight(w8, scale, "block", fp8_linear.block_kernel_scale(scale)), mode
        else:
            quantized[name] = Fp8Weight(w8, scale, "channel", scale.view(1, -1) if mode == "channel" else None), mode
    return quantized


def _dense(layer: Linear, dtype: torch.dtype) -> torch.Tensor:
    fp8 = layer.fp8
    if fp8.mode == "channel":
        return (fp8.weight.float() * fp8.scale.unsqueeze(1)).to(dtype)
    return fp8_linear.dequantize_blocks(fp8.weight, fp8.scale, dtype)


def _finish_checkpoint_layer(name: str, layer: Linear, settings: Fp8Settings, dtype: torch.dtype, rowwise: bool,
                             blockwise: bool) -> str:
    w8, scale = layer.weight.data, layer.weight_scale_inv.data
    parts = layer.fp8_parts
    rows, cols = w8.shape
    # blocks line up with the packed weight's rows only when every part fills whole blocks
    aligned = settings.block == (128, 128) and cols % 128 == 0 and \
        all(p.rows % 128 == 0 for p in parts or [_Part(None, rows, rows, 0, 0)])
    folded = fp8_linear.fold_to_channel(scale, rows) if aligned and rowwise else None
    if folded is not None:
        layer.fp8 = Fp8Weight(w8, folded, "channel", folded.view(1, -1))
        return "channel (folded from blocks)"
    if aligned and blockwise:
        layer.fp8 = Fp8Weight(w8, scale, "block", fp8_linear.block_kernel_scale(scale))
        return "block"
    # no scaled matmul for this layout here: dequantize once, part by part (each part's edge blocks are partial)
    dense = torch.empty(rows, cols, dtype=dtype, device=w8.device)
    for p in parts or [_Part(None, rows, rows, 0, 0)]:
        blocks = -(-p.rows // settings.block[0])
        dense[p.row_offset:p.row_offset + p.rows] = fp8_linear.dequantize_blocks(
            w8[p.row_offset:p.row_offset + p.rows], scale[p.block_offset:p.block_offset + blocks], dtype,
            settings.block)
    layer.weight = nn.Parameter(dense, requires_grad=False)
    del layer.weight_scale_inv
    return "dequantized"
