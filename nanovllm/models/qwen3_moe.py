"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in each sparse layer a router choosing
num_experts_per_tok of num_experts SwiGLU experts per token. Layers in mlp_only_layers, or off the
decoder_sparse_step, keep a dense MLP. Under tensor parallelism every rank holds every expert, each sliced along
its intermediate dimension (as a dense MLP is), so the ranks' partial sums are all-reduced once per block."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.layers.fused_moe import fused_experts, route
from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.decoder import Qwen3ForCausalLM
from nanovllm.utils.loader import check_shape
from nanovllm.utils.parallel import TensorParallelGroup


class Experts(nn.Module):
    """Every expert's gate/up (packed, gate rows first) and down weights, stacked: this rank's slice of each.

    The checkpoint holds one tensor per expert and projection ({e}.gate_proj.weight, ...); `checkpoint_names` on
    each parameter tells the loader which ones fill it."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.intermediate_size = intermediate_size
        inter = intermediate_size // tp.size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        self.gate_up_proj.weight_loader = self.load_gate_up
        self.gate_up_proj.checkpoint_names = [(f"{e}.{proj}.weight", (e, part)) for e in range(num_experts)
                                              for part, proj in enumerate(("gate_proj", "up_proj"))]
        self.down_proj.weight_loader = self.load_down
        self.down_proj.checkpoint_names = [(f"{e}.down_proj.weight", (e, None)) for e in range(num_experts)]

    def load_gate_up(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        expert, part = shard_id
        inter = param.size(1) // 2
        check_shape(loaded, (self.intermediate_size, param.size(2)))
        param.data[expert].narrow(0, part * inter, inter).copy_(loaded.narrow(0, self.tp_rank * inter, inter))

    def load_down(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, None]) -> None:
        inter = param.size(2)
        check_shape(loaded, (param.size(1), self.intermediate_size))
        param.data[shard_id[0]].copy_(loaded.narrow(1, self.tp_rank * inter, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)  # the router
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: PretrainedConfig, tp: TensorParallelGroup, layer: int) -> nn.Module:
        sparse = layer not in (config.mlp_only_layers or []) and (layer + 1) % config.decoder_sparse_step == 0
        return SparseMoeBlock(config, tp) if sparse else super().make_mlp(config, tp, layer)
