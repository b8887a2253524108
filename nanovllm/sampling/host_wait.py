"""Structured outputs: a device stream that waits for a counter in host memory (CUDA's stream memory operations,
cuStreamWaitValue32), so that a step's sampler is queued before its mask is filled.

Without it the engine's thread waits for the mask worker before it queues the sampler, and everything the engine
does after that (scheduling and launching the next step) is late by that wait: the device idles for it at every
step. With it the device waits instead, behind the step's forward, and only for as long as the worker is late.
The driver call is reached through ctypes (torch does not expose it); where it is missing the engine's thread
waits, as before."""
import ctypes
import logging

import torch

logger = logging.getLogger(__name__)


class HostCounterWait:
    """Waits of the current stream until the 32-bit counter at a host address (in memory registered with the
    device as mapped: cudaHostRegister with cudaHostRegisterMapped) reaches a value."""

    def __init__(self, wait_value: ctypes._CFuncPtr, device_pointer: int) -> None:
        self._wait_value, self.device_pointer = wait_value, device_pointer

    @classmethod
    def load(cls, host_pointer: int) -> "HostCounterWait | None":
        """The wait for the counter at `host_pointer`, or None where this driver cannot do it."""
        try:
            driver = ctypes.CDLL("libcuda.so.1")
            wait_value = driver.cuStreamWaitValue32_v2  # CUDA 11.7+: stream memory operations on by default
            wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            pointer = ctypes.c_uint64()
            status = driver.cuMemHostGetDevicePointer_v2(ctypes.byref(pointer), ctypes.c_void_p(host_pointer), 0)
            if status != 0:
                raise OSError(f"cuMemHostGetDevicePointer returned {status}")
        except (OSError, AttributeError) as error:
            logger.info("structured outputs: the engine's thread waits for each mask (no stream wait: %s)", error)
            return None
        return cls(wait_value, pointer.value)

    def until(self, value: int) -> None:
        """Work queued on the current stream after this starts once the counter is at least `value` (compared
        cyclically over 32 bits, so a 64-bit counter's low half serves while it counts up)."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        status = self._wait_value(stream, self.device_pointer, value & 0xFFFFFFFF, 0)  # 0: greater or equal
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 returned {status}")
