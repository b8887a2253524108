"""A launch with WARPS warps per block for probe/paged_decode_fp8_mw.cu (the product's DecodeKernel launches 32
threads)."""
import ctypes
from pathlib import Path

import torch

import nanovllm.attention.paged_decode_cuda as pc


class WideKernel:
    def __init__(self, kernel: pc.DecodeKernel, warps: int) -> None:
        self.kernel, self.warps = kernel, warps

    def launch(self, grid, pointers, floats, ints, longs) -> None:
        values = ([ctypes.c_void_p(tensor.data_ptr()) for tensor in pointers] + [ctypes.c_float(x) for x in floats]
                  + [ctypes.c_int(x) for x in ints] + [ctypes.c_longlong(x) for x in longs])
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        pc._check(self.kernel.driver.cuLaunchKernel(self.kernel.function, *grid, 32 * self.warps, 1, 1, 0, stream,
                                                    params, None), "cuLaunchKernel")


def compile_variant(spec: str, head_dim: int, query_bf16: bool = True, blocks: int = 12):
    """spec: 'main', 'FILE.cu' or 'FILE.cu:WARPS' (a multi-warp variant)."""
    if spec == "main":
        return pc.compile_kernel(0, head_dim, query_bf16)
    path, _, warps = spec.partition(":")
    product = pc.SOURCE
    pc.SOURCE = Path(path)
    try:
        defines = (f"MIN_BLOCKS={blocks}",) + ((f"WARPS={warps}",) if warps else ())
        kernel = pc.compile_kernel(0, head_dim, query_bf16, defines)
    finally:
        pc.SOURCE = product
    return WideKernel(kernel, int(warps)) if warps else kernel
