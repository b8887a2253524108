"""FP8 checkpoints of mixture-of-experts models: each expert's e4m3 weights and block scales, loaded into the
stacked expert parameters (models/qwen3_moe.py: Experts) and dequantized once at load.

The published MoE FP8 checkpoints (Qwen3-30B-A3B-FP8) store every expert's gate_proj, up_proj and down_proj as
e4m3 with its own weight_scale_inv, like any linear layer; the router (mlp.gate) stays bf16. The fused MoE kernel
multiplies bf16 weights, so the experts are dequantized after loading: they load as published but keep their bf16
memory (a block-scaled grouped matmul is the next step).
"""
import torch
from torch import nn

from nanovllm.quantization.e4m3 import FP8
from nanovllm.quantization.fp8_linear import dequantize_blocks
from nanovllm.utils.loader import check_shape


def stacked_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding every expert's gate/up and down weights stacked, as the loader's `checkpoint_names` say."""
    return {name: m for name, m in model.named_modules()
            if hasattr(getattr(m, "gate_up_proj", None), "checkpoint_names")
            and hasattr(getattr(m, "down_proj", None), "checkpoint_names")}


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def prepare_experts(name: str, experts: nn.Module, block: tuple[int, int]) -> None:
    """e4m3 gate_up/down parameters and one scale parameter each, filled from the checkpoint's per-expert tensors."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    num_experts, hidden = gate_up.size(0), gate_up.size(2)
    inter, inter_full = down.size(2), experts.intermediate_size
    rank, tp_size = experts.tp_rank, experts.tp_size
    if tp_size > 1 and inter % block[0]:
        raise ValueError(f"FP8 experts {name}: moe_intermediate_size {inter_full} split over {tp_size} ranks gives "
                         f"shards of {inter}, not a multiple of the {block[0]}-wide scale block; use a "
                         f"tensor_parallel_size that splits it on block boundaries")
    inter_blocks = _blocks(inter, block[0])

    def load_gate_up_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        check_shape(loaded, (_blocks(inter_full, block[0]), _blocks(hidden, block[1])),
                    f" (weight_scale_inv of a [{inter_full}, {hidden}] expert weight in {block} blocks)")
        rows = loaded.narrow(0, rank * inter_blocks, inter_blocks)
        param.data[expert].narrow(0, part * inter_blocks, inter_blocks).copy_(rows)

    def load_down_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, None]) -> None:
        check_shape(loaded, (_blocks(hidden, block[0]), _blocks(inter_full, block[1])),
                    f" (weight_scale_inv of a [{hidden}, {inter_full}] expert weight in {block} blocks)")
        param.data[shard_id[0]].copy_(loaded.narrow(1, rank * _blocks(inter, block[1]), _blocks(inter, block[1])))

    for attr, loader, scale_shape, scale_loader in (
            ("gate_up_proj", experts.load_gate_up, (2 * inter_blocks, _blocks(hidden, block[1])), load_gate_up_scale),
            ("down_proj", experts.load_down, (_blocks(hidden, block[0]), _blocks(inter, block[1])), load_down_scale)):
        old = getattr(experts, attr)
        weight = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
        weight.weight_loader, weight.checkpoint_names = _checked(loader), old.checkpoint_names
        setattr(experts, attr, weight)
        scale = nn.Parameter(torch.empty(num_experts, *scale_shape, dtype=torch.float32, device=old.device),
                             requires_grad=False)
        scale.weight_loader = scale_loader
        scale.checkpoint_names = [(part.removesuffix("weight") + "weight_scale_inv", shard_id)
                                  for part, shard_id in old.checkpoint_names]
        setattr(experts, attr + "_scale_inv", scale)


def _checked(loader):
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if loaded.dtype != FP8:
            raise ValueError(f"expected a float8_e4m3fn weight (config.json's quantization_config is fp8), "
                             f"found {loaded.dtype}")
        loader(param, loaded, shard_id)
    return load


def finish_experts(experts: nn.Module, block: tuple[int, int], dtype: torch.dtype) -> int:
    """Dequantize the loaded experts to `dtype`, part by part (gate and up each start on a block row); returns the
    bytes they now hold."""
    gate_up, down = experts.gate_up_proj.data, experts.down_proj.data
    gate_up_scale, down_scale = experts.gate_up_proj_scale_inv.data, experts.down_proj_scale_inv.data
    inter = down.size(2)
    inter_blocks = _blocks(inter, block[0])
    dense_gate_up = torch.empty(gate_up.shape, dtype=dtype, device=gate_up.device)
    dense_down = torch.empty(down.shape, dtype=dtype, device=down.device)
    for e in range(gate_up.size(0)):
        for part in range(2):
            dense_gate_up[e, part * inter:(part + 1) * inter] = dequantize_blocks(
                gate_up[e, part * inter:(part + 1) * inter],
                gate_up_scale[e, part * inter_blocks:(part + 1) * inter_blocks], dtype, block)
        dense_down[e] = dequantize_blocks(down[e], down_scale[e], dtype, block)
    experts.gate_up_proj = nn.Parameter(dense_gate_up, requires_grad=False)
    experts.down_proj = nn.Parameter(dense_down, requires_grad=False)
    del experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
    return (dense_gate_up.numel() + dense_down.numel()) * dtype.itemsize
