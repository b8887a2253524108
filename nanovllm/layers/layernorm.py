import torch
from torch import nn

from nanovllm.layers import fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    @fused
    def rms_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)

    @fused
    def add_rms_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the residual add rounds to the model dtype, as transformers' does
        x = (x.float() + residual.float()).to(x.dtype)
        return self._norm(x), x

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.rms_forward(x) if residual is None else self.add_rms_forward(x, residual)
