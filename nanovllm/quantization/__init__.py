"""FP8: linear weights in e4m3 with their scales, and the FP8 KV cache's format and per-layer scales."""
