"""Writing a checkpoint in the published FP8 layout (nanovllm/quantization/fp8_checkpoint.py describes it), as
random_checkpoint does for its -FP8 shapes."""
from collections.abc import Iterable, Iterator

import torch

from nanovllm.quantization.fp8_checkpoint import SCALE_SUFFIX
from nanovllm.quantization.fp8_linear import BLOCK, quantize_blockwise


def fp8_quantization_config(block: int = BLOCK) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block, block], "modules_to_not_convert": ["lm_head"]}


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """A checkpoint tensor the published layout stores in FP8: a 2-D linear weight, not an embedding, a norm, the
    head or a MoE router (mlp.gate, whose few outputs stay in bf16 as in the published MoE checkpoints)."""
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")
    return tensor.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def to_fp8_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                      block: int = BLOCK) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs in the published FP8 layout: each linear weight as e4m3, followed by its
    weight_scale_inv; one tensor at a time, as random_checkpoint makes them."""
    for name, tensor in weights:
        if is_quantized_weight(name, tensor):
            w8, scale = quantize_blockwise(tensor, block)
            yield name, w8
            yield name.removesuffix("weight") + SCALE_SUFFIX, scale
        else:
            yield name, tensor
