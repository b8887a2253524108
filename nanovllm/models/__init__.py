"""The model families this engine runs, by the architecture name a checkpoint's config.json declares."""
from torch import nn
from transformers import PretrainedConfig

from nanovllm.models.decoder import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(hf_config: PretrainedConfig) -> type[nn.Module]:
    """The class for the config's first supported architecture; any other is a ValueError naming the supported."""
    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported model: architectures={architectures}, model_type="
                     f"{getattr(hf_config, 'model_type', None)!r}; supported: {sorted(MODEL_REGISTRY)}")
