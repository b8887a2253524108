"""FP8: linear weights in e4m3 with their scales, and the FP8 KV cache's format and per-layer scales.

The engine reaches quantization through these names only; the layers and attention kernels import the module
whose kernel or matmul they call (fp8_linear, fp8_fused, kv_quant). One scheme exists, so there is no method
interface: a second scheme would add its settings beside Fp8Settings and its branch in prepare/finish.
"""
from nanovllm.quantization.fp8_checkpoint import Fp8Settings, quantization_settings
from nanovllm.quantization.fp8_flashinfer import prepare_flashinfer_gemm
from nanovllm.quantization.fp8_model import finish_fp8, prepare_fp8
from nanovllm.quantization.fp8_routes import describe_routes
from nanovllm.quantization.kv_quant import kv_cache_dtype
from nanovllm.quantization.kv_scales import checkpoint_kv_scales, is_kv_scale, measured_kv_scales

__all__ = ["Fp8Settings", "checkpoint_kv_scales", "describe_routes", "finish_fp8", "is_kv_scale", "kv_cache_dtype",
           "measured_kv_scales", "prepare_flashinfer_gemm", "prepare_fp8", "quantization_settings"]
