"""FlashInfer, the optional `flashinfer` extra (the package flashinfer-python): imported only where a FlashInfer
path is asked for, so the engine, CI and every CPU path run without it. It compiles its kernels with the
machine's nvcc at first use (the engine triggers that at start-up: attention/flashinfer_backend.py,
quantization/fp8_flashinfer.py)."""
import importlib
import importlib.util
import sys
from types import ModuleType

INSTALL = 'pip install -e ".[cuda,flashinfer]"'


def flashinfer_installed() -> bool:
    """Whether `import flashinfer` can find the package (without importing it, which takes a while)."""
    if "flashinfer" in sys.modules:  # imported already, or blocked (None), as a test does to simulate absence
        return sys.modules["flashinfer"] is not None
    return importlib.util.find_spec("flashinfer") is not None


def require_flashinfer(what: str, submodule: str = "") -> ModuleType:
    """flashinfer (or flashinfer.<submodule>), or an ImportError that says what needed it and how to install it."""
    name = "flashinfer" + (f".{submodule}" if submodule else "")
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"{what} needs FlashInfer (the package flashinfer-python), and `import {name}` failed "
                          f"here ({error}); install the extra: {INSTALL}") from error
