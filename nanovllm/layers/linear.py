import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.quantization.fp8_linear import Fp8Weight, fp8_linear
from nanovllm.utils.loader import ShardId, check_shape, default_weight_loader
from nanovllm.utils.parallel import TensorParallelGroup


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole of W on every rank (a MoE router: small, and every rank needs all its outputs)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; each rank keeps its slice of y."""

    fp8: Fp8Weight | None = None  # set by quantization/fp8_model.py when the weight is FP8
    tp_dim = 0  # the weight dimension split across ranks: output rows

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        assert output_size % self.tp_size == 0, f"output size {output_size} not divisible by {self.tp_size} ranks"
        self.weight = nn.Parameter(torch.empty(output_size // self.tp_size, input_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size // self.tp_size))
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        # every rank is handed the full checkpoint tensor and keeps its rows
        shard = param.size(0)
        check_shape(loaded, (shard * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded.narrow(0, self.tp_rank * shard, shard))

    def output_parts(self) -> dict[ShardId, int]:
        """The checkpoint rows of each part packed into the weight, in packing order (here one: all of it)."""
        return {None: self.weight.size(0) * self.tp_size}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return fp8_linear(x, self.fp8, self.bias)
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input packed into one matmul (gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], tp: TensorParallelGroup, bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), tp, bias)

    def output_parts(self) -> dict[ShardId, int]:
        return dict(enumerate(self.output_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        check_shape(loaded, (self.output_sizes[shard_id], *param.shape[1:]))
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one matmul; each rank holds whole heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TensorParallelGroup,
                 bias: bool = False) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, tp, bias)

    def output_parts(self) -> dict[ShardId, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": q, "k": kv, "v": kv}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_dim // self.tp_size
        kv_size = self.num_kv_heads * self.head_dim // self.tp_size
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        check_shape(loaded, (size * self.tp_size, *param.shape[1:]))
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums are all-reduced."""

    fp8: Fp8Weight | None = None  # set by quantization/fp8_model.py when the weight is FP8
    tp_dim = 1  # input columns

    def __init__(self, input_size: int, output_size: int, tp: TensorParallelGroup, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        assert input_size % self.tp_size == 0, f"input size {input_size} not divisible by {self.tp_size} ranks"
        self.weight = nn.Parameter(torch.empty(output_size, input_size // self.tp_size))
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = default_weight_loader  # not split: every rank holds all of it

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.size(1)
        check_shape(loaded, (param.size(0), shard * self.tp_size))
        param.data.copy_(loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the bias is added once, on rank 0, so the all-reduce counts it once
        bias = self.bias if self.tp_rank == 0 else None
        y = fp8_linear(x, self.fp8, bias) if self.fp8 is not None else F.linear(x, self.weight, bias)
        return self.tp.all_reduce(y)
