"""The dense decoder the supported families share. Qwen3, Qwen2 (Qwen2.5) and Llama (3.x) differ only in a few
switches, set by the small classes at the end: per-head q/k RMSNorm before RoPE (Qwen3), which projections carry
a bias (Qwen2: q, k and v; Llama and Qwen3: as attention_bias says), and RoPE scaling (Llama 3.1's, read from the
config). Qwen3-MoE (qwen3_moe.py) is Qwen3 with a mixture-of-experts block in place of the MLP."""
import torch
from torch import nn
from transformers import PretrainedConfig

from nanovllm.attention import AttentionBackend, make_attention_backend
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from nanovllm.utils.context import get_context
from nanovllm.utils.parallel import TensorParallelGroup


def head_dim(config: PretrainedConfig) -> int:
    # Qwen3 configs state head_dim (128 in every size, not hidden_size / heads); older configs may not
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup, backend: AttentionBackend,
                 rotary_emb: RotaryEmbedding, qk_norm: bool, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        tp_size = tp.size
        self.head_dim = head_dim(config)
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, tp, bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, tp,
                                        bias=o_bias)
        self.rotary_emb = rotary_emb  # one table shared by all layers
        self.attn = Attention(self.head_dim ** -0.5, backend)
        self.qk_norms = None
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.qk_norms = (self.q_norm, self.k_norm)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        o = self.attn(positions, q, k, v, self.rotary_emb, self.qk_norms)
        return self.o_proj(o.flatten(1, -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, tp, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, tp, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, self_attn: DecoderAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class DecoderForCausalLM(nn.Module):
    """The shared decoder; a family sets `qk_norm`, `attention_biases` and, for other MLPs, `make_mlp`."""

    # checkpoint name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False  # per-head RMSNorm of q and k before RoPE

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """Whether q/k/v and o carry a bias."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def make_mlp(self, config: PretrainedConfig, tp: TensorParallelGroup, layer: int) -> nn.Module:
        return DenseMLP(config.hidden_size, config.intermediate_size, tp, bias=bool(getattr(config, "mlp_bias", False)))

    def __init__(self, config: PretrainedConfig, tp: TensorParallelGroup | None = None,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallelGroup()
        backend = backend or make_attention_backend("torch", use_cuda=False)
        self.backend = backend
        qkv_bias, o_bias = self.attention_biases(config)
        rope = rope_parameters(config)
        # one cos/sin table for all layers (at Llama 3.1's 131,072 positions it is 64 MiB)
        rotary_emb = RotaryEmbedding(head_dim(config), config.max_position_embeddings, rope["rope_theta"], rope)
        layers = [DecoderLayer(config, DecoderAttention(config, tp, backend, rotary_emb, self.qk_norm, qkv_bias,
                                                        o_bias), self.make_mlp(config, tp, i))
                  for i in range(config.num_hidden_layers)]
        self.model = DecoderModel(config, tp, layers)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.backend.begin_forward(get_context())
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 and Qwen2.5: biases on q, k and v, none on o."""

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 3.x: biases as attention_bias and mlp_bias say (none in the published checkpoints); its
    rope_scaling of type llama3 is read by rope_parameters."""
