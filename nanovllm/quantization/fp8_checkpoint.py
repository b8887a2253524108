"""The FP8 checkpoint format, and what a checkpoint's quantization settings mean for loading it.

The published layout (Qwen3-*-FP8 and others, read by vLLM and SGLang): config.json carries
quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}; each quantized linear's `weight` is float8_e4m3fn and beside it
`weight_scale_inv` [ceil(out/128), ceil(in/128)] (float32 or bf16) holds the factor each 128x128 block is multiplied
by. Embeddings, norms and the modules named in modules_to_not_convert (lm_head) stay as stored.
"""
from dataclasses import dataclass

from nanovllm.config import QUANTIZATION_METHODS
from nanovllm.quantization.fp8_linear import BLOCK

SUPPORTED_QUANTIZATION = QUANTIZATION_METHODS
SCALE_SUFFIX = "weight_scale_inv"


@dataclass(frozen=True, slots=True)
class Fp8Settings:
    """How a model's linear weights are FP8: stored so in the checkpoint (block scales), or quantized at load."""

    checkpoint: bool  # True: the checkpoint holds e4m3 weights and weight_scale_inv; False: quantize bf16 at load
    block: tuple[int, int] = (BLOCK, BLOCK)
    not_converted: tuple[str, ...] = ("lm_head",)


def quantization_settings(option: str | None, hf_config) -> Fp8Settings | None:
    """The FP8 settings of the engine option `quantization` and the checkpoint's quantization_config, checked.

    A checkpoint's own quantization_config wins, as in vLLM: quantization=None loads a published FP8 checkpoint
    as FP8, and quantization='fp8' on it changes nothing."""
    if option not in (None, *SUPPORTED_QUANTIZATION):
        raise ValueError(f"quantization={option!r} is not supported; supported: {list(SUPPORTED_QUANTIZATION)} "
                         f"or None")
    stored = getattr(hf_config, "quantization_config", None)
    if stored is None:
        return Fp8Settings(checkpoint=False) if option == "fp8" else None
    if not isinstance(stored, dict):
        stored = stored.to_dict() if hasattr(stored, "to_dict") else dict(vars(stored))
    method = stored.get("quant_method")
    if method not in SUPPORTED_QUANTIZATION:
        raise ValueError(f"checkpoint quantization_config quant_method={method!r} is not supported; supported: "
                         f"{list(SUPPORTED_QUANTIZATION)} (published FP8 checkpoints with block scales)")
    fmt = stored.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"checkpoint quantization_config fmt={fmt!r} is not supported; supported: 'e4m3'")
    scheme = stored.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"checkpoint quantization_config activation_scheme={scheme!r} is not supported; supported: "
                         f"'dynamic' (static schemes need input scales this engine does not read)")
    block = stored.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"checkpoint quantization_config weight_block_size={block!r} is not supported; supported: "
                         f"two positive integers such as [128, 128] (per-tensor FP8 checkpoints are not read)")
    not_converted = tuple(stored.get("modules_to_not_convert") or ("lm_head",))
    return Fp8Settings(checkpoint=True, block=(block[0], block[1]), not_converted=not_converted)
