import functools

import torch


def fused(fn):
    """Compile small elementwise chains into single kernels on CUDA, where kernel count dominates decode time.

    dynamic=True traces with symbolic sizes, so changing batch sizes reuse one compiled kernel instead of
    recompiling inside a timed run. On CPU the plain eager code runs (no C++ toolchain or compile time needed).
    The choice is made per call from the first argument's device, not at import: importing the package must not
    ask CUDA anything, or a process that sets CUDA_VISIBLE_DEVICES afterwards would see the GPUs counted before.
    """
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        return compiled(first, *args, **kwargs) if first.is_cuda else fn(first, *args, **kwargs)

    return run
