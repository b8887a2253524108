"""The FP8 cache's decode kernel in CUDA (paged_decode_fp8.cu), compiled at first use by NVRTC and launched through
the driver, both reached through ctypes: no compiler is needed at install time, and NVRTC ships with torch's CUDA
wheels. The .cu file says why the kernel is not Triton's.

Where it cannot run, `decode_kernel` returns None and the caller uses the Triton kernel (paged_decode.py): no NVRTC
or driver, a GPU before compute capability 8.9 (no e4m3 conversion), more than 8 query heads per KV head, head
sizes other than 64 and 128, a query that is neither bf16 nor float16, an empty batch, or a query on a device other
than the current one."""
import ctypes
import functools
import glob
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nanovllm.quantization.e4m3 import FP8

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_fp8.cu")
MAX_GROUP = 8  # query heads per KV head: the columns of the kernel's P.V product
HEAD_DIMS = (64, 128)
# warps per SM the registers must allow, where measured (Hopper: 12 warps at 167-168 registers beat 11 at 177 by 5-16%
# and 16 at 128, which spills); elsewhere the compiler's choice
MIN_BLOCKS = {(9, 0): 12}


def _nvrtc_library() -> ctypes.CDLL:
    """NVRTC of torch's CUDA version: the one torch's wheels bring (nvidia/*/lib), which knows every GPU that torch
    does, else the system's (an older toolkit's may not know a newer GPU)."""
    major = (torch.version.cuda or "12").split(".")[0]
    names = []
    for path in sys.path:
        names += sorted(glob.glob(os.path.join(path, "nvidia", "*", "lib", f"libnvrtc.so.{major}*")))
    names += [f"libnvrtc.so.{major}", "libnvrtc.so"]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError(f"no NVRTC for CUDA {major} (tried torch's nvidia packages and libnvrtc.so.{major})")


def _compile(source: str, options: list[str]) -> bytes:
    nvrtc = _nvrtc_library()
    program = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"paged_decode_fp8.cu", 0, None, None),
           "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        status = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if status != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile {SOURCE.name} ({' '.join(options)}):\n{log.value.decode()}")
        size = ctypes.c_size_t()
        _check(nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} returned {status}")


@dataclass(frozen=True)
class DecodeKernel:
    """The compiled kernel on one device; `launch` queues it on the current stream (and so into a CUDA graph
    being captured there)."""
    driver: ctypes.CDLL
    function: ctypes.c_void_p

    def launch(self, grid: tuple[int, int, int], pointers: list[torch.Tensor], floats: list[float], ints: list[int],
               longs: list[int]) -> None:
        values = ([ctypes.c_void_p(tensor.data_ptr()) for tensor in pointers] + [ctypes.c_float(x) for x in floats]
                  + [ctypes.c_int(x) for x in ints] + [ctypes.c_longlong(x) for x in longs])
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(self.driver.cuLaunchKernel(self.function, *grid, 32, 1, 1, 0, stream, params, None), "cuLaunchKernel")


def compile_kernel(device_index: int, head_dim: int, query_bf16: bool, defines: tuple[str, ...] = ()) -> DecodeKernel:
    """Compiles and loads the kernel for a device (its primary context); `defines` such as "MIN_BLOCKS=16"."""
    major, minor = torch.cuda.get_device_capability(device_index)
    options = [f"--gpu-architecture=sm_{major}{minor}", "--std=c++17", f"-DHEAD_DIM={head_dim}",
               f"-DQUERY_BF16={int(query_bf16)}"] + [f"-D{define}" for define in defines]
    if (major, minor) in MIN_BLOCKS and not any(define.startswith("MIN_BLOCKS") for define in defines):
        options.append(f"-DMIN_BLOCKS={MIN_BLOCKS[major, minor]}")
    cubin = _compile(SOURCE.read_text(), options)
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    with torch.cuda.device(device_index):
        # the module loads into the context current on this thread: the device's primary one, which torch creates
        # at its first allocation there
        torch.ones(1, device=torch.device("cuda", device_index))
        _check(driver.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
    _check(driver.cuModuleGetFunction(ctypes.byref(function), module, b"fp8_paged_decode"), "cuModuleGetFunction")
    return DecodeKernel(driver, function)


@functools.cache
def _kernel_on(device_index: int, head_dim: int, query_bf16: bool) -> DecodeKernel | None:
    try:
        kernel = compile_kernel(device_index, head_dim, query_bf16)
    except (OSError, RuntimeError, AttributeError) as error:
        logger.warning("FP8 KV cache: decode attention falls back to the Triton kernel (%s)", error)
        return None
    logger.info("FP8 KV cache: decode attention by the CUDA kernel (head size %d)", head_dim)
    return kernel


def decode_kernel(q: torch.Tensor, group: int, tensors: tuple[torch.Tensor, ...] = (),
                  split_len: int = 16) -> DecodeKernel | None:
    """The CUDA kernel for this query (batch, heads, head_dim) and GQA group, or None where it does not run.
    `tensors` (the caches, block tables, lengths, counters) must be on the query's device, the caches' rows 16-byte
    aligned, the tables and lengths int32; `split_len` a multiple of 16 (the kernel's step)."""
    # the launch goes to the current device's stream and context (the engine's processes each set their device)
    if (not q.is_cuda or torch.version.hip or q.device.index != torch.cuda.current_device() or q.size(0) == 0
            or q.dtype not in (torch.bfloat16, torch.float16) or q.size(-1) not in HEAD_DIMS or group > MAX_GROUP
            or split_len % 16 or torch.cuda.get_device_capability(q.device) < (8, 9)):
        return None
    for tensor in tensors:
        if tensor.device != q.device or tensor.dtype not in (FP8, torch.int32):
            return None
        cache_rows_misaligned = tensor.data_ptr() % 16 or any(stride % 16 for stride in tensor.stride()[:-1])
        if tensor.dtype == FP8 and (cache_rows_misaligned or tensor.stride(-1) != 1):
            return None  # the kernel reads each lane's share of a row in 16-byte loads
    return _kernel_on(q.device.index, q.size(-1), q.dtype == torch.bfloat16)
