"""Triton kernels compiled side by side at start-up, not one after another.

A warmup pass meets its Triton kernels in order, and on a fresh machine each one compiles (a fraction of a second,
seconds in all) before the pass goes on. Compiles of different kernels are independent and spend most of their time
outside the GIL (Triton's MLIR passes, LLVM, ptxas), so the engine runs its start-up passes dry: every launch of a
kernel variant that this process has not compiled yet is recorded and skipped (Triton's `jit_cache_hook` returning
True skips the compile and the launch), and the recorded variants compile in a thread pool (`JITFunction.preload`,
which fills the kernel's in-memory cache as the launch's own compile would) while start-up goes on. Whatever runs
after `wait()` finds them compiled.

A dry pass leaves the outputs of the kernels it skipped unwritten. It must be a pass whose results are thrown away
and whose torch operations accept any values: index tensors that torch operations compute (top-k, argsort) stay in
range whatever the scores were, and the inputs that kernels index with (positions, slots, block tables) are the
pass's own. A variant the pool has finished by a later dry pass launches in it for real, on whatever its inputs
hold: that is safe as long as a kernel that indexes memory with another Triton kernel's output (the sampler's
scratch offsets, the penalties' marks) meets that kernel within one pass, where both are skipped or both compiled.
Every dry pass must also be safe to run for real: without Triton's hooks it is. Its memory is what the real
pass's would be: torch allocates a kernel's outputs before the launch.

Triton before 3.7 also builds a C launcher per kernel signature (gcc, cached on disk with the kernels) at a
variant's first launch, on the launching thread: the compile threads build it after each variant, so that the
launch mostly only loads it (a launch that comes first builds it itself).
"""
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from nanovllm.utils.device import allowed_cpu_cores

logger = logging.getLogger(__name__)

MAX_THREADS = 16  # about as many variants as a start-up's passes meet


def _runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # a Triton without hooks (before 3.4): the real passes compile as they go
        return None
    return knobs.runtime if hasattr(knobs.runtime, "jit_cache_hook") else None


def _build_launcher(compiled: Any) -> None:
    """Triton before 3.7 builds a C launcher per kernel signature (gcc) at a variant's first launch, on the
    launching thread: building it here, in a compile thread, leaves that launch only loading it from Triton's disk
    cache (later Tritons' launchers are plain Python, quick either way). The variant's own handles are left to its
    first launch on the engine's thread, so that no launch can see it half set up."""
    from triton.runtime import driver

    driver.active.launcher_cls(compiled.src, compiled.metadata)


class KernelCompiles:
    """The kernel variants that dry passes met, compiling in a thread pool until wait()."""

    def __init__(self, device: torch.device, processes: int = 1, max_threads: int = MAX_THREADS) -> None:
        """processes: how many engine processes of this host compile at once (tensor-parallel ranks share its
        cores)."""
        self.device = device
        self.knobs = _runtime_knobs()
        self.threads = max(1, min(allowed_cpu_cores() // processes, max_threads))
        self.ran_for_real = False  # a pass ran for real: Triton without hooks, or someone else's hook set
        self.pool: ThreadPoolExecutor | None = None  # from the first variant met to the next wait()
        self.met: set[tuple[int, str]] = set()
        self.compiles: list[tuple[str, Future]] = []  # (kernel name, its compile), since the last wait()
        self.began = 0.0

    def dry_run(self, dry_pass: Callable[[], None]) -> None:
        """Run `dry_pass` with this thread's launches of uncompiled variants skipped and recorded, then hand them to
        the pool. Without Triton's hooks (or with someone else's hook set) the pass runs for real instead."""
        knobs = self.knobs
        if knobs is None or knobs.jit_cache_hook is not None:
            self.ran_for_real = True
            dry_pass()
            return
        pass_thread = threading.get_ident()
        recorded: list[tuple[Any, str]] = []

        def record(*, key: str, fn: Any, **hook_args: Any) -> bool | None:
            if threading.get_ident() != pass_thread:  # a compile thread's own compile, another thread's kernel
                return None
            if (id(fn.jit_function), key) not in self.met:
                self.met.add((id(fn.jit_function), key))
                recorded.append((fn.jit_function, hook_args["compile"]["specialization_data"]))
            return True

        knobs.jit_cache_hook = record
        try:
            dry_pass()
        finally:
            knobs.jit_cache_hook = None
        # submitted only now: a variant compiled while its pass still ran would launch in that pass for real
        if recorded and self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="triton-compile")
            self.began = time.perf_counter()
        for kernel, specialization in recorded:
            self.compiles.append((kernel.fn.__name__, self.pool.submit(self._compile, kernel, specialization)))

    def _compile(self, kernel: Any, specialization: str) -> None:
        with torch.cuda.device(self.device):  # the kernel's per-device cache: this rank's, not the thread's default
            compiled = kernel.preload(specialization)
            try:
                _build_launcher(compiled)
            except Exception as error:  # noqa: BLE001 - the variant is compiled; its first launch builds this again
                logger.debug("launcher of %s ahead of its launch failed: %r", kernel.fn.__name__, error)

    def wait(self) -> str:
        """Join the compiles handed to the pool since the last wait; returns a line for the log. A compile that
        raised is only logged: the first real launch of that variant compiles it itself."""
        if self.pool is None:
            if self.ran_for_real:
                return "Triton compiled in the passes themselves (no jit_cache_hook before Triton 3.4, or one set)"
            return "no Triton kernel variant to compile"
        failed = []
        for name, future in self.compiles:
            try:
                future.result()
            except Exception as error:  # noqa: BLE001 - see the docstring
                logger.debug("compile of %s ahead of its launch failed: %r", name, error)
                failed.append(name)
        self.pool.shutdown()
        seconds = time.perf_counter() - self.began
        left = f", {len(failed)} left to their first launch ({', '.join(failed)})" if failed else ""
        line = (f"{len(self.compiles)} Triton kernel variants compiled side by side, the last done {seconds:.1f} s "
                f"after the first was met{left}")
        self.pool, self.compiles = None, []
        return line
