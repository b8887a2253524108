import os

import numpy as np
import torch

# the names vLLM's dtype option takes ("bf16" too), and what each runs the model in
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                                  "half": torch.float16, "float32": torch.float32, "float": torch.float32}


def model_dtype(hf_config) -> torch.dtype:
    """The dtype the checkpoint's config declares (float32 when it declares none)."""
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def check_dtype(value: object) -> torch.dtype | None:
    """The torch dtype the engine option `dtype` names; None for "auto" (the checkpoint's)."""
    if isinstance(value, str) and value in ("auto", *DTYPES):
        return DTYPES.get(value)
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    raise ValueError(f"dtype={value!r} is not supported: choose 'auto' (the checkpoint's dtype), one of "
                     f"{list(DTYPES)}, or torch.bfloat16 / torch.float16 / torch.float32")


def allowed_cpu_cores() -> int:
    """The cores this process may run on (its affinity, where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def free_cpu_cores(processes: int = 1) -> int:
    """Cores this process may use on a CPU run: those it is allowed (affinity) less those other processes keep
    busy (the 1-minute load average, less this process's own share), split among `processes` engine processes."""
    allowed = allowed_cpu_cores()
    others = max(0.0, os.getloadavg()[0] - 1.0) if hasattr(os, "getloadavg") else 0.0
    return max(1, int(allowed - others + 0.5) // max(1, processes))


def cap_cpu_threads(processes: int = 1) -> int:
    """Lower torch's CPU threads to the free cores (never raise them), unless OMP_NUM_THREADS chose a number:
    threads beyond the idle cores wait on one another at every parallel op, and a step's many small ops then take
    many times longer. Returns the number in force."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = min(torch.get_num_threads(), free_cpu_cores(processes))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
    return torch.get_num_threads()


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host tensor over `array`, page-locked when it is bound for a GPU so the copy can run asynchronously."""
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if device.type == "cuda" else tensor


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return pinned(array, device).to(device, non_blocking=True)
