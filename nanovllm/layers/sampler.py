import torch
from torch import nn

from nanovllm.layers import fused


class Sampler(nn.Module):
    """One token per row: argmax where temperature is 0, else a draw from softmax(logits / temperature)."""

    @fused
    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperatures.clamp_min(1e-5).unsqueeze(1), dim=-1)
        # Gumbel-max in exponential form: argmax(p / E) with E ~ Exp(1) is a draw from p, with no sync or sort
        sampled = probs.div_(torch.empty_like(probs).exponential_(1).clamp_min_(1e-10)).argmax(dim=-1)
        return torch.where(temperatures == 0, greedy, sampled)
