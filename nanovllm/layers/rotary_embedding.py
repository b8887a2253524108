import math

import torch
from torch import nn

from nanovllm.layers import fused


@fused
def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


ROPE_TYPES = ("default", "llama3")


def rope_parameters(config) -> dict:
    """The model config's RoPE settings as one dict: rope_theta, rope_type and the scaling fields.

    transformers 5 keeps all of them in `rope_parameters`; earlier versions in `rope_theta` and `rope_scaling`
    (whose type may be spelled `type`). A scaling type this engine does not implement is refused by name."""
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.update(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"model config rope scaling of type {params['rope_type']!r} is not supported; "
                         f"supported: {list(ROPE_TYPES)}")
    return params


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int, **_) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than the original context / low_freq_factor are divided by
    `factor`, shorter than original / high_freq_factor kept, and those between interpolated smoothly."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed float32 cos/sin table per position.

    `scaling` (rope_parameters' dict) with rope_type "llama3" rescales the frequencies as Llama 3.1 does."""

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if scaling is not None and scaling.get("rope_type") == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, **scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat((freqs.cos(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(positions, q, k, self.cos_sin_cache)
