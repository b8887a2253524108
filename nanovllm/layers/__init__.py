import functools

import torch


def fused(fn):
    """Compile small elementwise chains into single kernels on CUDA, where kernel count dominates decode time.

    dynamic=True traces with symbolic sizes, so changing batch sizes reuse one compiled kernel instead of
    recompiling inside a timed run. On CPU the plain eager code runs (no C++ toolchain or compile time needed).
    torch.compile is called at the first call on a CUDA tensor (the engine's warmup), not at import: it imports
    TorchDynamo and Inductor, seconds that every process importing the package would pay (a data-parallel driver,
    which never runs a layer, included), and importing the package must not ask CUDA anything, or a process that
    sets CUDA_VISIBLE_DEVICES afterwards would see the GPUs counted before, and a forked replica could not use CUDA.
    """
    compiled = None

    @functools.wraps(fn)
    def run(first: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        # inside another compiled function Dynamo traces this body: the plain function keeps it from guarding
        # on (and recompiling for) `compiled` still being None at trace time
        if not first.is_cuda or torch.compiler.is_compiling():
            return fn(first, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(first, *args, **kwargs)

    return run
