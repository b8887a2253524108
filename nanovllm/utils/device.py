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
