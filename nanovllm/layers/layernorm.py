import torch
from torch import nn

from nanovllm.layers import fused
from nanovllm.quantization.fp8_fused import rms_norm_quantized


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(dtype) * weight


@fused
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the residual add rounds to the model dtype, as transformers' does
    x = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    # set by quantize_in_producers (quantization/fp8_fused.py) where the consumer is a block-scaled FP8 linear
    # layer: the output is then its quantized input, on CUDA
    fp8_output = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # free functions, not methods, are compiled: a compiled method would keep its module (and an
        # engine's weights) alive in the compile cache after the engine exits
        if self.fp8_output and x.is_cuda:
            return rms_norm_quantized(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
