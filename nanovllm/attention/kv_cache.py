import math
from dataclasses import dataclass

import torch

from nanovllm.quantization.kv_quant import FP8


@dataclass
class LayerKV:
    """One layer's slice of the paged cache: [blocks, block_size, kv_heads, head_dim] each, contiguous. An FP8
    cache (quantization/kv_quant.py) holds x / scale, with one scale for the layer's keys and one for its values,
    fixed before the first write (plain numbers: kernels take them as arguments, CUDA graphs capture them)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def quantized(self) -> bool:
        return self.k.dtype == FP8


@dataclass(frozen=True)
class KVCacheLayout:
    """The one place that knows how the paged KV cache is laid out: one tensor
    [K and V, layers, blocks, tokens per block, this rank's KV heads, head_dim]; token t of block b sits at slot
    b * block_size + t of every layer's K and V. An FP8 cache has one key scale and one value scale per layer
    (quantization/kv_quant.py), numbers kept by each layer's LayerKV."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return math.prod(self.shape(1)) * self.dtype.itemsize

    def copy_blocks(self, cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K and V in every layer."""
        source, destination = (torch.tensor(ids, device=cache.device) for ids in zip(*copies))
        cache[:, :, destination] = cache[:, :, source]

    def allocate(self, num_blocks: int, device: torch.device,
                 scales: list[tuple[float, float]] | None = None) -> tuple[torch.Tensor, list[LayerKV]]:
        """The cache tensor and each layer's views of it; an FP8 cache needs each layer's (key, value) scales."""
        assert (scales is not None) == self.quantized and (scales is None or len(scales) == self.num_layers)
        cache = torch.empty(self.shape(num_blocks), dtype=self.dtype, device=device)
        scales = scales or [(1.0, 1.0)] * self.num_layers
        return cache, [LayerKV(cache[0, i], cache[1, i], *scales[i]) for i in range(self.num_layers)]
