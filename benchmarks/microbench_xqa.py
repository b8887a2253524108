"""XQA's decode over an FP8 cache, both of its kernels, against the triton kernel: accuracy and time on one GPU.

    python benchmarks/microbench_xqa.py          # needs FlashInfer (pip install -e ".[cuda,flashinfer]")

Hopper's FP8 kernel (what xqa_batch_decode_with_kv_cache runs for an e4m3 cache on sm_90) rounds the query and the
probabilities to e4m3; XQA's generic kernel (the same module with run_sm90_fp8_mha=False) keeps the query in 16
bits. Prints each kernel's relative RMS error against float32 attention over the same cache (12 sequences of
6k-14k tokens, tests/test_gpu_flashinfer.py's data), then microseconds per call over random caches of a few batch
shapes, with the bf16 cache on triton beside them. 8 KV heads, head_dim 128, 256-token blocks.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from cuda_timing import loop_time_us  # noqa: E402
from test_gpu_flashinfer import BLOCK, HEAD_DIM, KV_HEADS, float32_attention, long_context_batch, relative_rms  # noqa: E402

from nanovllm.attention.flashinfer_backend import PAGE, paged_tables  # noqa: E402
from nanovllm.attention.paged_decode import paged_decode_attention  # noqa: E402
from nanovllm.quantization.kv_quant import dequantize  # noqa: E402
from nanovllm.utils.flashinfer import require_flashinfer  # noqa: E402

SHAPES = ((16, 256, 800), (16, 512, 500), (16, 64, 8000), (32, 128, 1500), (32, 32, 8000))  # heads, batch, context


class Xqa:
    """One XQA call as xqa_batch_decode_with_kv_cache makes it, with the kernel choice left to the caller."""

    def __init__(self) -> None:
        self.xqa_modules = require_flashinfer("benchmarks/microbench_xqa.py", "xqa").get_xqa_module
        self.workspace = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")
        self.sm_count = torch.cuda.get_device_properties(0).multi_processor_count
        self.offsets = torch.arange(BLOCK // PAGE, dtype=torch.int32, device="cuda")

    def __call__(self, q, k, v, tables, lens, scale, k_scale, v_scale, fp8_kernel: bool) -> torch.Tensor:
        k, v = k.view(-1, PAGE, *k.shape[2:]), v.view(-1, PAGE, *v.shape[2:])
        pages, seq_lens = paged_tables(tables, lens, BLOCK // PAGE, self.offsets)
        out = torch.empty_like(q)
        module = self.xqa_modules(q.dtype, k.dtype, PAGE, HEAD_DIM, q.size(1) // KV_HEADS, False, out.dtype, 1)
        q_scale = scale * k_scale / v_scale * HEAD_DIM ** 0.5  # the wrapper's: bmm1_scale / kv_scale * sqrt(d)
        module.xqa(fp8_kernel, self.sm_count, KV_HEADS, 0, q_scale, out.unsqueeze(1), 1.0, q.unsqueeze(1), None, k,
                   v, None, None, pages, pages.size(1) * PAGE, seq_lens.unsqueeze(1), q.size(0), v_scale,
                   self.workspace[:8 << 20], self.workspace[8 << 20:], True, 1, None, None)
        return out


def main() -> None:
    xqa, scale = Xqa(), HEAD_DIM ** -0.5
    for heads in (16, 32):
        batch = 12
        q, (k, v), cache, lens, tables = long_context_batch(batch, heads, True)
        real = slice(0, batch)
        stored = [dequantize(c, s, torch.float32) for c, s in ((cache.k, cache.k_scale), (cache.v, cache.v_scale))]
        reference = float32_attention(q[real], *stored, lens[real], tables[real])
        outputs = {"triton": paged_decode_attention(q, cache.k, cache.v, tables, lens, scale, k_scale=cache.k_scale,
                                                    v_scale=cache.v_scale),
                   "XQA FP8 kernel": xqa(q, cache.k, cache.v, tables, lens, scale, cache.k_scale, cache.v_scale, True),
                   "XQA generic": xqa(q, cache.k, cache.v, tables, lens, scale, cache.k_scale, cache.v_scale, False)}
        print(f"{heads} query heads, contexts {lens[real].min().item()}-{lens[real].max().item()}: relative RMS "
              "error against float32 over the same cache: "
              + ", ".join(f"{name} {relative_rms(out[real], reference):.4f}" for name, out in outputs.items()))
    print("| query heads | batch | context up to | triton FP8 | XQA FP8 kernel | XQA generic FP8 | triton bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for heads, batch, context in SHAPES:
        times = shape_times(xqa, heads, batch, context, scale)
        print(f"| {heads} | {batch} | {context} | " + " | ".join(f"{t:.0f} us" for t in times) + " |")


def shape_times(xqa: Xqa, heads: int, batch: int, context: int, scale: float) -> list[float]:
    """Microseconds per call of each kernel over a random cache: `batch` sequences of context/2 to context tokens
    in shuffled blocks."""
    width = -(-context // BLOCK)
    blocks = batch * width + 1
    k8, v8 = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(torch.float8_e4m3fn) for _ in range(2))
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)
    tables = torch.randperm(blocks - 1, device="cuda")[: batch * width].view(batch, width).int()
    lens = torch.randint(context // 2, context + 1, (batch,), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return [loop_time_us(lambda: paged_decode_attention(q, k8, v8, tables, lens, scale)),
            loop_time_us(lambda: xqa(q, k8, v8, tables, lens, scale, 1.0, 1.0, True)),
            loop_time_us(lambda: xqa(q, k8, v8, tables, lens, scale, 1.0, 1.0, False)),
            loop_time_us(lambda: paged_decode_attention(q, k16, v16, tables, lens, scale))]


if __name__ == "__main__":
    main()
