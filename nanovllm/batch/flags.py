"""The engine options as command-line flags, with vLLM's names and meanings (--max-model-len, ...).

Every flag defaults to argparse.SUPPRESS, so only the flags given reach LLM() and the engine's own defaults hold
(Config is the one place they are set; the help texts read them from there).
"""
import argparse
from dataclasses import fields

from nanovllm.config import (
    ATTENTION_BACKENDS,
    DEFAULT_MAX_MODEL_LEN,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    Config,
)

# engine option -> (type, help); "{default}" is filled in from Config, so a help text cannot drift from the default
ENGINE_FLAGS: dict[str, tuple[type, str]] = {
    "max_model_len": (int, f"context length in tokens, prompt and output together; at most the model's "
                           f"max_position_embeddings (default: {DEFAULT_MAX_MODEL_LEN}, or the model's limit when "
                           f"lower)"),
    "max_num_seqs": (int, "the most requests running at once, one decode token each per step (default: {default})"),
    "max_num_batched_tokens": (int, "the most prompt tokens one step prefills; longer prompts are prefilled in "
                                    "chunks (default: {default})"),
    "gpu_memory_utilization": (float, "fraction of GPU memory for weights, activations and the KV cache, in (0, 1] "
                                      "(default: {default}; on CPU, this fraction of a quarter of free memory "
                                      "holds the KV cache)"),
    "tensor_parallel_size": (int, "GPUs each engine's model is split across (default: {default})"),
    "kvcache_block_size": (int, "tokens per KV-cache block, a multiple of 16 (default: {default})"),
    "num_kvcache_blocks": (int, "KV-cache blocks to allocate, as vLLM's --num-gpu-blocks-override (default: "
                                "{default}, as many as the memory budget holds)"),
    "attention_backend": (str, "how attention reads the KV cache (default: the fastest for the device: triton "
                               "on CUDA, torch on CPU; flashinfer needs the flashinfer extra)"),
    "max_logprobs": (int, "the most logprobs a request may ask for (default: {default})"),
    "kv_cache_dtype": (str, "auto: the model's dtype; fp8 (= fp8_e4m3): K and V in float8 e4m3 with one scale "
                            "per layer for each, about twice the blocks (default: {default})"),
    "quantization": (str, "fp8: quantize a bf16 checkpoint's linear weights to FP8 at load; an FP8 checkpoint "
                          "is FP8 without it (default: none)"),
    "dtype": (str, "the dtype weights and activations run in: auto (the checkpoint's torch_dtype), bfloat16, "
                   "float16 or float32 (default: {default})"),
    "seed": (int, "seeds the engine's random stream, which requests without a seed of their own draw from "
                  "(default: a fresh one each run)"),
}
FLAG_CHOICES = {"attention_backend": ATTENTION_BACKENDS, "kv_cache_dtype": KV_CACHE_DTYPES,
                "quantization": QUANTIZATION_METHODS, "dtype": DTYPES}
METAVARS = {int: "N", float: "FRACTION"}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add a flag for every engine option, each with a help text that says its default."""
    defaults = {f.name: f.default for f in fields(Config)}
    for name, (kind, text) in ENGINE_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=argparse.SUPPRESS,
                            choices=FLAG_CHOICES.get(name), metavar=METAVARS.get(kind),
                            help=text.format(default=defaults[name]))
    parser.add_argument("--enforce-eager", action="store_true", default=argparse.SUPPRESS,
                        help="run the model eagerly, without CUDA graphs for decode (default: CUDA graphs on a GPU)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                        help="launch step n+1 before step n's tokens are read back, hiding host work behind the "
                             "GPU (default: on)")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the command line set; the others are absent (SUPPRESS), so the engine's defaults hold."""
    return {name: getattr(args, name) for name in [*ENGINE_FLAGS, "enforce_eager", "async_scheduling"]
            if hasattr(args, name)}
