# ruff: noqa
"""Probe: can a CUDA stream wait (cuStreamWaitValue32) on a counter in cudaHostRegister'd shared memory written by
another process, and does a copy queued behind the wait see the rows written before the counter?"""
import ctypes
import multiprocessing as mp
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch


def writer(name, rounds, width):
    shm = SharedMemory(name=name)
    arr = np.ndarray((1 + rounds * width,), np.int64, shm.buf)
    for i in range(1, rounds + 1):
        time.sleep(0.002)
        arr[1 + (i - 1) * width: 1 + i * width] = i * 1000 + np.arange(width)
        arr[0] = i
    del arr
    shm.close()


def main():
    torch.zeros(1, device="cuda")
    cuda = ctypes.CDLL("libcuda.so.1")
    rounds, width = 200, 4096
    size = 8 * (1 + rounds * width)
    shm = SharedMemory(create=True, size=size)
    arr = np.ndarray((1 + rounds * width,), np.int64, shm.buf)
    arr[:] = 0
    t = torch.from_numpy(arr)
    print("register", int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 2)))
    dptr = ctypes.c_uint64()
    print("getdevptr", cuda.cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(t.data_ptr()), 0),
          hex(dptr.value), hex(t.data_ptr()), "pinned?", t.is_pinned())
    for attr, label in ((92, "MEM_OPS_V1(92)"), (93, "64BIT_MEM_OPS(93)"), (94, "WAIT_NOR(94)")):
        v = ctypes.c_int()
        print(label, cuda.cuDeviceGetAttribute(ctypes.byref(v), attr, 0), v.value)
    wait = cuda.cuStreamWaitValue32_v2
    wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    stream = torch.cuda.current_stream().cuda_stream
    out = torch.zeros(rounds, width, dtype=torch.int64, device="cuda")
    p = mp.get_context("spawn").Process(target=writer, args=(shm.name, rounds, width))
    start = time.perf_counter()
    events = []
    for i in range(1, rounds + 1):
        assert wait(ctypes.c_void_p(stream), dptr.value, i, 0) == 0
        out[i - 1].copy_(t[1 + (i - 1) * width: 1 + i * width], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        events.append(ev)
    queued = time.perf_counter() - start
    time.sleep(0.3)
    print("first done before writer started?", events[0].query(), "queued in", round(queued * 1e3, 2), "ms")
    p.start()
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    print("all released after", round(time.perf_counter() - t0, 3), "s (writer sleeps 2 ms x", rounds, ")")
    expected = torch.arange(1, rounds + 1, device="cuda")[:, None] * 1000 + torch.arange(width, device="cuda")
    print("copies behind the waits saw the rows:", bool(torch.equal(out, expected)))
    p.join()
    # latency: one wait, host writes, how soon an event after it completes
    lat = []
    for k in range(20):
        v = rounds + 1 + k
        assert wait(ctypes.c_void_p(stream), dptr.value, v, 0) == 0
        ev = torch.cuda.Event(); ev.record()
        time.sleep(0.001)
        w = time.perf_counter(); arr[0] = v
        while not ev.query():
            pass
        lat.append(time.perf_counter() - w)
    print("wait release latency us median", round(sorted(lat)[10] * 1e6, 1))
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
    del t, arr
    shm.close(); shm.unlink()


if __name__ == "__main__":
    main()
