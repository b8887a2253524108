import os

import numpy as np
import torch


def model_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


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
