"""Engine options: their names, defaults and allowed values, checked once when an engine starts.

This module imports neither torch nor transformers at import time, so the command line can print its help and
usage errors at once: what needs them (reading the checkpoint's config) is imported where it runs. Whether the
engine can build the model a config describes, and how its weights are quantized, is checked by models/ and
quantization/ (engine/config_checks.py calls them), so this module imports nothing of the engine's own.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

# the values the string options take (vLLM's names)
ATTENTION_BACKENDS = ("triton", "flash_attn", "flashinfer", "torch")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
QUANTIZATION_METHODS = ("fp8",)
DTYPES = ("auto", "bfloat16", "bf16", "float16", "half", "float32", "float")
DATA_PARALLEL_BACKENDS = ("mp", "ray")  # mp: processes of this host; ray: Ray actors
# the checkpoint architectures nanovllm.models implements (its MODEL_REGISTRY's keys)
ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM")
DEFAULT_MAX_MODEL_LEN = 4096  # used when the model allows as many positions; else the model's limit


@dataclass(slots=True)
class Config:
    """Engine settings plus the Hugging Face config of the model at `model`."""

    model: str
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int | None = None  # None: DEFAULT_MAX_MODEL_LEN, or the model's positions when fewer
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    attention_backend: str | None = None  # None: the fastest for the device; see nanovllm.attention
    async_scheduling: bool = True  # launch step n+1 before reading step n's tokens back
    max_logprobs: int = 20  # the most logprobs a request may ask for, as vLLM's
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"/"fp8_e4m3"; see quantization/kv_quant.py
    quantization: str | None = None  # "fp8": FP8 linear weights from a bf16 checkpoint; see docs/fp8_weights.md
    # vLLM's: "auto" (the checkpoint's), "bfloat16", "float16", "float32" or a torch dtype; a torch dtype once built
    dtype: str | torch.dtype = "auto"
    seed: int | None = None  # seeds the random stream unseeded requests draw from, once, at start (as vLLM)
    # accepted for vLLM's scripts; this engine runs only the models it implements, never a checkpoint's own code
    trust_remote_code: bool = False
    hf_config: PretrainedConfig = field(init=False, repr=False)
    eos_token_ids: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        # heavy imports here, not at module level: see the module docstring
        from transformers import AutoConfig

        from nanovllm.utils.device import check_dtype, model_dtype
        from nanovllm.utils.model_path import resolve_model

        if self.max_model_len is not None:
            _check_positive("max_model_len", self.max_model_len)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_num_seqs", self.max_num_seqs)
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
        # torch.Generator.manual_seed's range: a larger integer is an overflow deep in start-up, after the weights
        if self.seed is not None and not (_is_int(self.seed) and -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64) (what torch.Generator takes), "
                             f"got {self.seed!r}")
        for name in ("enforce_eager", "async_scheduling", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise ValueError(f"attention_backend={self.attention_backend!r} is unknown; choose one of "
                             f"{ATTENTION_BACKENDS} or None (the fastest for the device)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is unknown; choose one of {KV_CACHE_DTYPES} "
                             f"('auto': the model's dtype)")
        dtype = check_dtype(self.dtype)  # None for "auto": the checkpoint's, known once its config is read
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flash_attn":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs attention_backend 'triton' or "
                             f"'flashinfer' (or None) on the GPU: flash-attn's paged decode cannot read an FP8 cache")
        self.model = resolve_model(self.model)  # a local folder, or a hub id through the Hugging Face cache
        check_no_remote_code(self.model)  # before transformers, which would ask to run the checkpoint's code
        self.hf_config = AutoConfig.from_pretrained(self.model)
        self.dtype = dtype or model_dtype(self.hf_config)
        positions = self.hf_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, positions)
        # as vLLM: a longer context than the model was trained for is refused (positions < 1: the model checks
        # refuse the config itself, naming the field)
        elif self.max_model_len > positions > 0:
            raise ValueError(f"max_model_len={self.max_model_len} is more than the model's "
                             f"max_position_embeddings={positions} (config.json of {self.model}); pass "
                             f"max_model_len={positions} or less")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"):
            size = getattr(self.hf_config, name, None)
            if size is not None and size % self.tensor_parallel_size != 0:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide {name}={size}")
        self.eos_token_ids = _eos_token_ids(self.model, self.hf_config)

    @classmethod
    def from_options(cls, model: str, **options) -> Config:
        # vLLM's switch, which its users pass as True: here prefix caching is always on (a prompt's full blocks
        # are shared by hash, engine/block_manager.py), so True asks for what is already so; False cannot be had
        if options.pop("enable_prefix_caching", True) is not True:
            raise ValueError("enable_prefix_caching=False is not supported: prefix caching is always on in "
                             "nano-vllm (it changes no output, only skips recomputing a shared prefix); leave the "
                             "option out or pass True")
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
        raise ValueError(f"the checkpoint folder {model} has no config.json: a Hugging Face checkpoint folder "
                         f"holds config.json, the weights (*.safetensors) and the tokenizer files")
    with open(path) as f:
        raw = json.load(f)
    architectures = raw.get("architectures") or []
    if raw.get("auto_map") and not any(name in ARCHITECTURES for name in architectures):
        raise ValueError(f"the checkpoint at {model} needs its own code (auto_map {raw['auto_map']}) for "
                         f"architectures={architectures}, which this engine does not implement and will not run, "
                         f"trust_remote_code or not; supported: {sorted(ARCHITECTURES)}")
