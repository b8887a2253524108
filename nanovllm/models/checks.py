"""Whether this engine can build the model a checkpoint's config describes, refused by name before any weight is
read (engine/config_checks.py calls it when an engine starts)."""
from transformers import PretrainedConfig

from nanovllm.layers.rotary_embedding import rope_parameters


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
