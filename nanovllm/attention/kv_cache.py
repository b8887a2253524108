import math
from dataclasses import dataclass

import torch

from nanovllm.attention.backend import LayerKV
from nanovllm.attention.kv_quant import FP8


@dataclass(frozen=True)
class KVCacheLayout:
    """The one place that knows how the paged KV cache is laid out: one tensor
    [K and V, layers, blocks, tokens per block, this rank's KV heads, head_dim]; token t of block b sits at slot
    b * block_size + t of every layer's K and V. An FP8 cache adds one float32 scale per row in a second tensor
    [K and V, layers, blocks, tokens per block, KV heads] (attention/kv_quant.py)."""

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
        scales = math.prod(self.shape(1)[:-1]) * torch.float32.itemsize if self.quantized else 0
        return math.prod(self.shape(1)) * self.dtype.itemsize + scales

    def copy_blocks(self, tensors: tuple[torch.Tensor, ...], copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's K and V (and their scales) in every layer."""
        source, destination = (torch.tensor(ids, device=tensors[0].device) for ids in zip(*copies))
        for tensor in tensors:
            tensor[:, :, destination] = tensor[:, :, source]

    def allocate(self, num_blocks: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], list[LayerKV]]:
        """The cache tensor (and the scales tensor of an FP8 cache) and each layer's views of them."""
        cache = torch.empty(self.shape(num_blocks), dtype=self.dtype, device=device)
        if not self.quantized:
            return (cache,), [LayerKV(cache[0, i], cache[1, i]) for i in range(self.num_layers)]
        # ones, not garbage: a padding row of a block table may point at a never-written block (it is masked
        # out, but a NaN scale times a zero weight would still be NaN in a sum)
        scales = torch.ones(self.shape(num_blocks)[:-1], dtype=torch.float32, device=device)
        return (cache, scales), [LayerKV(cache[0, i], cache[1, i], scales[0, i], scales[1, i])
                                 for i in range(self.num_layers)]
