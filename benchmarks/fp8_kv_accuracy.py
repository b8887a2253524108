"""Accuracy of FP8 KV scale granularities on CPU: one scale per layer as the engine measures it (the layer's
largest |key| maps to 200, |value| to 100: quantization/kv_scales.py), one per row (token x KV head, an earlier
design of the engine), and 1.0 (vLLM's default for a checkpoint without scales). Reports the relative RMS error
of the dequantised K and V and of the attention output, the share of values that clamp, and non-finite counts,
on two sources of K/V:

- synthetic: Gaussian rows with a few outlier channels (x20, as real keys have) and a few loud tokens (x50);
- model: the keys and values a random Qwen3-0.6B-shaped checkpoint writes for a 512-token prompt, all layers.

    python benchmarks/fp8_kv_accuracy.py
"""
import torch
import torch.nn.functional as F

from nanovllm.quantization.kv_quant import FP8, FP8_MAX, dequantize, quantize
from nanovllm.quantization.kv_scales import MEASURED_KEY_TARGET


def per_row(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-30)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def per_layer(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    # measured as the engine does it (the key target; values get 100, a factor 2 more headroom)
    scale = scale if scale is not None else x.abs().amax().item() / MEASURED_KEY_TARGET
    return dequantize(quantize(x, scale), scale, torch.float32)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [heads, n, d], k/v [kv_heads, n, d]: causal attention as the engine computes it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def report(name: str, layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    print(f"\n{name}: {len(layers)} layer(s), K/V {tuple(layers[0][1].shape)}")
    print("| scales | K rel. RMS error | V rel. RMS error | attention output rel. RMS error | clamped | non-finite |")
    print("| --- | --- | --- | --- | --- | --- |")
    variants = [("per layer, measured (the engine's)", lambda x: per_layer(x, None)),
                ("per row (token x head)", per_row),
                ("per layer, 1.0 (uncalibrated)", lambda x: per_layer(x, 1.0))]
    for label, quantise in variants:
        errors, clamped, total, bad = [0.0, 0.0, 0.0], 0, 0, 0
        for q, k, v in layers:
            kq, vq = quantise(k), quantise(v)
            errors[0] += rel_rms(kq, k) / len(layers)
            errors[1] += rel_rms(vq, v) / len(layers)
            errors[2] += rel_rms(attention(q, kq, vq), attention(q, k, v)) / len(layers)
            if label.endswith("(uncalibrated)"):
                clamped += int((k.abs() > FP8_MAX).sum() + (v.abs() > FP8_MAX).sum())
            total += k.numel() + v.numel()
            bad += int((~kq.isfinite()).sum() + (~vq.isfinite()).sum())
        print(f"| {label} | {errors[0]:.4f} | {errors[1]:.4f} | {errors[2]:.4f} | {clamped / total:.2%} | {bad} |")


def synthetic() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(16, 1024, 128, generator=g)
    k, v = torch.randn(2, 8, 1024, 128, generator=g)
    k[:, :, [3, 77]] *= 20  # outlier channels
    loud = torch.randint(0, 1024, (10,), generator=g)
    k[:, loud] *= 50  # a few loud tokens (attention sinks, punctuation)
    v[:, loud] *= 50
    return [(q, k, v)]


def model_kv() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run a random Qwen3-0.6B-shaped checkpoint (bf16 weights) over one prompt and keep what each layer's
    attention sees: post-norm, post-RoPE q and k, and v."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from nanovllm.utils.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint(tempfile.mkdtemp(), "Qwen3-0.6B", std=0.05, seed=1, num_hidden_layers=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    captured = []
    from transformers.models.qwen3 import modeling_qwen3

    original = modeling_qwen3.eager_attention_forward

    def capture(module, query, key, value, *args, **kwargs):
        captured.append((query[0].float(), key[0].float(), value[0].float()))
        return original(module, query, key, value, *args, **kwargs)

    modeling_qwen3.eager_attention_forward = capture
    model.config._attn_implementation = "eager"
    try:
        with torch.inference_mode():
            model(torch.randint(0, 150000, (1, 512), generator=torch.Generator().manual_seed(1)))
    finally:
        modeling_qwen3.eager_attention_forward = original
    return captured


if __name__ == "__main__":
    torch.set_num_threads(1)
    report("synthetic, outlier channels and loud tokens", synthetic())
    report("random Qwen3-0.6B shape (4 layers), 512-token prompt", model_kv())
