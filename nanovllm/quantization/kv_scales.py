"""Where an FP8 KV cache's per-layer scales come from.

1. The checkpoint, when it has them: vLLM's names (`self_attn.k_scale` / `self_attn.v_scale`, as llm-compressor
   writes them; `self_attn.attn.k_scale`), AutoFP8's (`k_proj.output_scale` / `v_proj.output_scale`) and the
   older single `self_attn.kv_scale` for both. Each is a number with x ~= fp8 * scale.
2. Otherwise measured: the start-up pass (the largest prefill, which runs before the cache exists) records each
   layer's largest |key| and |value| after RoPE, and the scale maps that to 200 (keys) or 100 (values) of e4m3's
   448, vLLM's headroom for activations larger than the ones measured. A value beyond the range saturates at
   +-448 x scale rather than becoming NaN.
"""
import re

import torch

# the e4m3 value a measured largest |key| / |value| maps to (vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT)
MEASURED_KEY_TARGET = 200.0
MEASURED_VALUE_TARGET = 100.0
# a layer whose measured keys or values were all zero still gets a usable scale
MIN_SCALE = 1e-8

_LAYER = r"^model\.layers\.(\d+)\.self_attn\."
_CHECKPOINT_NAMES = {
    re.compile(_LAYER + r"(?:attn\.)?k_scale$"): "k",
    re.compile(_LAYER + r"(?:attn\.)?v_scale$"): "v",
    re.compile(_LAYER + r"k_proj\.output_scale$"): "k",
    re.compile(_LAYER + r"v_proj\.output_scale$"): "v",
    re.compile(_LAYER + r"kv_scale$"): "kv",
}


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer, 'k' | 'v' | 'kv') when the checkpoint tensor `name` is a KV-cache scale, else None."""
    for pattern, which in _CHECKPOINT_NAMES.items():
        match = pattern.match(name)
        if match:
            return int(match.group(1)), which
    return None


def is_kv_scale(name: str) -> bool:
    return kv_scale_name(name) is not None


def checkpoint_kv_scales(tensors: dict[str, torch.Tensor], num_layers: int) -> list[tuple[float, float]] | None:
    """Each layer's (key scale, value scale) from the checkpoint's KV-scale tensors, or None when it has none.
    A checkpoint that has them for some layers only, or holds a scale that is not one positive finite number,
    is refused by name: a guessed scale would clamp or waste the range silently."""
    if not tensors:
        return None
    found: dict[int, dict[str, float]] = {}
    for name, tensor in tensors.items():
        layer, which = kv_scale_name(name)
        if tensor.numel() != 1 or not (torch.isfinite(tensor).all() and tensor.float().item() > 0):
            raise ValueError(f"checkpoint KV-cache scale {name!r} must be one positive finite number; found "
                             f"shape {list(tensor.shape)}: {tensor.flatten()[:4].tolist()}")
        for part in which:
            found.setdefault(layer, {})[part] = tensor.float().item()
    incomplete = [i for i in range(num_layers) if set(found.get(i, {})) != {"k", "v"}]
    if incomplete:
        raise ValueError(f"the checkpoint has KV-cache scales for some layers but not both scales of layer(s) "
                         f"{incomplete[:8]}{' ...' if len(incomplete) > 8 else ''} of {num_layers}")
    return [(found[i]["k"], found[i]["v"]) for i in range(num_layers)]


def measured_kv_scales(amax: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Each layer's (key scale, value scale) from its measured (largest |key|, largest |value|)."""
    for layer, (key, value) in enumerate(amax):
        if not (key < float("inf") and value < float("inf")):  # also NaN
            raise ValueError(f"layer {layer}'s keys or values overflowed in the start-up pass (largest |key| "
                             f"{key}, |value| {value}): an FP8 KV cache cannot be scaled for them")
    return [(max(key / MEASURED_KEY_TARGET, MIN_SCALE), max(value / MEASURED_VALUE_TARGET, MIN_SCALE))
            for key, value in amax]
