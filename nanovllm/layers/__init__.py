import functools

import torch


def fused(fn):
    """Compile small elementwise chains into single kernels on CUDA, where kernel count dominates decode time.

    dynamic=True traces with symbolic sizes, so changing batch sizes reuse one compiled kernel instead of
    recompiling inside a timed run. On CPU the plain eager code runs (no C++ toolchain or compile time needed).
    The choice is made from how torch was built and, per call, from the first argument's device: importing the
    package must not ask CUDA anything, or a process that sets CUDA_VISIBLE_DEVICES afterwards would see the GPUs
    counted before. The compiler is created at the first CUDA call, where the warmup pass makes it (the attention
    backends' own kernels do RoPE, so on most paths it is never needed).
    """
    if not torch.backends.cuda.is_built():  # a CPU build of torch: nothing to compile for, nor to import for it
        return fn
    compiled = None

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if not first.is_cuda:
            return fn(first, *args, **kwargs)
        if compiled is None:  # at first use: importing TorchDynamo costs seconds, and most engines never need it
            compiled = torch.compile(fn, dynamic=True)
        return compiled(first, *args, **kwargs)

    return run
