import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers import fused


@fused
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up, with gate and up packed side by side in the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
