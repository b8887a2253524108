import json
import os
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from nanovllm.attention import BACKEND_NAMES
from nanovllm.attention.kv_quant import check_kv_cache_dtype
from nanovllm.layers.rotary_embedding import rope_parameters
from nanovllm.models import MODEL_REGISTRY, model_class
from nanovllm.utils.device import check_dtype, model_dtype
from nanovllm.utils.fp8_checkpoint import Fp8Settings, quantization_settings


@dataclass(slots=True)
class Config:
    """Engine settings plus the Hugging Face config of the model at `model`."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    attention_backend: str | None = None  # None: the fastest for the device; see nanovllm.attention
    async_scheduling: bool = True  # launch step n+1 before reading step n's tokens back
    max_logprobs: int = 20  # the most logprobs a request may ask for, as vLLM's
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"/"fp8_e4m3"; see attention/kv_quant.py
    quantization: str | None = None  # "fp8": FP8 linear weights from a bf16 checkpoint; see docs/fp8_weights.md
    # vLLM's: "auto" (the checkpoint's), "bfloat16", "float16", "float32" or a torch dtype; a torch dtype once built
    dtype: str | torch.dtype = "auto"
    seed: int | None = None  # seeds the random stream unseeded requests draw from, once, at start (as vLLM)
    # accepted for vLLM's scripts; this engine runs only the models it implements, never a checkpoint's own code
    trust_remote_code: bool = False
    hf_config: PretrainedConfig = field(init=False, repr=False)
    fp8: Fp8Settings | None = field(init=False, default=None)  # from `quantization` and the checkpoint's config
    eos_token_ids: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a local checkpoint directory, got {self.model!r}")
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_model_len", self.max_model_len)
        _check_positive("tensor_parallel_size", self.tensor_parallel_size)
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got {self.max_logprobs!r}")
        utilization = self.gpu_memory_utilization
        if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0.0 < utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}")
        if not _is_int(self.kvcache_block_size) or self.kvcache_block_size <= 0 or self.kvcache_block_size % 16:
            raise ValueError(f"kvcache_block_size must be a positive multiple of 16, got {self.kvcache_block_size!r}")
        if not _is_int(self.num_kvcache_blocks) or self.num_kvcache_blocks == 0 or self.num_kvcache_blocks < -1:
            raise ValueError(f"num_kvcache_blocks must be -1 (size from memory) or a positive integer, "
                             f"got {self.num_kvcache_blocks!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an integer, got {self.seed!r}")
        for name in ("enforce_eager", "async_scheduling", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_backend not in (None, *BACKEND_NAMES):
            raise ValueError(f"attention_backend={self.attention_backend!r} is unknown; choose one of "
                             f"{BACKEND_NAMES} or None (the fastest for the device)")
        check_kv_cache_dtype(self.kv_cache_dtype)
        dtype = check_dtype(self.dtype)  # None for "auto": the checkpoint's, known once its config is read
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash_attn":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs attention_backend 'triton' or "
                             f"'flashinfer' (or None) on the GPU: flash-attn's paged decode cannot read an FP8 cache")
        check_no_remote_code(self.model)  # before transformers, which would ask to run the checkpoint's code
        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.dtype = dtype or model_dtype(self.hf_config)
        model_class(self.hf_config)  # an unsupported architecture is refused before anything else
        check_model_config(self.hf_config)
        self.fp8 = quantization_settings(self.quantization, self.hf_config)
        self.max_model_len = min(self.max_model_len, self.hf_config.max_position_embeddings)
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"):
            size = getattr(self.hf_config, name, None)
            if size is not None and size % self.tensor_parallel_size != 0:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide {name}={size}")
        self.eos_token_ids = _eos_token_ids(self.model, self.hf_config)

    @classmethod
    def from_options(cls, model: str, **options) -> "Config":
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known options are {sorted(known - {'model'})}")
        return cls(model, **options)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a size


def _check_positive(name: str, value: int) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _eos_token_ids(model: str, hf_config: PretrainedConfig) -> tuple[int, ...]:
    """Every id that ends generation: the model config's and generation_config.json's (Qwen3 lists several)."""
    ids: set[int] = set()
    candidates = [getattr(hf_config, "eos_token_id", None)]
    gen_path = os.path.join(model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            candidates.append(json.load(f).get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return tuple(sorted(ids))


def check_no_remote_code(model: str) -> None:
    """Refuse a checkpoint that names its own code (config.json's auto_map) for an architecture this engine does
    not implement: trust_remote_code cannot help, since the model classes here are the only ones that run."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return  # transformers names the missing file
    with open(path) as f:
        raw = json.load(f)
    architectures = raw.get("architectures") or []
    if raw.get("auto_map") and not any(name in MODEL_REGISTRY for name in architectures):
        raise ValueError(f"the checkpoint at {model} needs its own code (auto_map {raw['auto_map']}) for "
                         f"architectures={architectures}, which this engine does not implement and will not run, "
                         f"trust_remote_code or not; supported: {sorted(MODEL_REGISTRY)}")


def check_model_config(hf_config: PretrainedConfig) -> None:
    """Refuse a model config no model can be built from, naming the field, before any weight is read.

    Otherwise a zero size builds empty layers that load and generate nothing useful, or fails much later with a
    message about something else (max_position_embeddings=0 became "KV cache budget holds no block")."""
    sizes = ["hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "intermediate_size",
             "vocab_size", "max_position_embeddings"]
    if getattr(hf_config, "head_dim", None) is not None:  # optional: hidden_size // num_attention_heads otherwise
        sizes.append("head_dim")
    if getattr(hf_config, "num_experts_per_tok", None) is not None:  # mixture of experts (Qwen3-MoE)
        sizes += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"]
    for name in sizes:
        value = getattr(hf_config, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"model config {name}={value!r} is impossible: it must be a positive integer")
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    if heads % kv_heads != 0:
        raise ValueError(f"model config num_attention_heads={heads} must be a multiple of "
                         f"num_key_value_heads={kv_heads}: each key/value head serves a whole group of query heads")
    experts, top_k = getattr(hf_config, "num_experts", None), getattr(hf_config, "num_experts_per_tok", None)
    if top_k is not None and top_k > experts:
        raise ValueError(f"model config num_experts_per_tok={top_k} is impossible: there are only "
                         f"num_experts={experts} experts")
    layer_types = getattr(hf_config, "layer_types", None) or []
    if getattr(hf_config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("model config asks for sliding-window attention, which this engine does not implement "
                         f"(use_sliding_window={getattr(hf_config, 'use_sliding_window', None)}, "
                         f"layer_types={sorted(set(layer_types))})")
    rope_parameters(hf_config)  # an unsupported rope scaling type is refused by name
    eps = getattr(hf_config, "rms_norm_eps", None)
    # written so NaN fails too
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"model config rms_norm_eps={eps!r} is impossible: it must be a positive number")
