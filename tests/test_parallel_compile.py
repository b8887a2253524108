"""Triton kernels compiled side by side at start-up (utils/parallel_compile.py): the dry pass launches nothing, the
real pass after it compiles nothing and computes what it would have computed, and an engine's start-up leaves no
kernel for its real passes to compile."""
import os
import subprocess
import sys

import pytest
import torch

from nanovllm.utils.parallel_compile import KernelCompiles


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) + 1, mask=offsets < n)

    @triton.jit
    def double(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)

    return add_one, double


@pytest.mark.gpu
def test_the_dry_pass_launches_nothing_and_the_real_pass_compiles_nothing():
    import triton
    from triton import knobs

    add_one, double = _kernels()  # defined here: no earlier test in this process compiled them
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    sums, products = torch.full_like(x, -7.0), torch.full_like(x, -7.0)

    def passes() -> None:
        for n in (1000, 1):  # two sizes: n == 1 is a variant of its own (Triton specialises integers equal to 1)
            add_one[(triton.cdiv(n, 256),)](x, sums, n, BLOCK=256)
            double[(triton.cdiv(n, 256),)](x, products, n, BLOCK=256)

    compiles = KernelCompiles(x.device)
    compiles.dry_run(passes)
    torch.cuda.synchronize()
    assert (sums == -7).all() and (products == -7).all(), "the dry pass launched a kernel"
    assert sorted(name for name, _ in compiles.compiles) == ["add_one", "add_one", "double", "double"]
    assert compiles.wait().startswith("4 Triton kernel variants compiled side by side")

    compiles_after = []
    knobs.runtime.jit_post_compile_hook = lambda **kwargs: compiles_after.append(kwargs["repr"])
    try:
        passes()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    torch.cuda.synchronize()
    assert compiles_after == []
    assert torch.equal(sums, x + 1) and torch.equal(products, x * 2)


ENGINE_COMPILES = r'''
import sys, threading
from triton import knobs
compiles = []  # (thread name, kernel) of every Triton compile in this process
knobs.runtime.jit_post_compile_hook = lambda **kwargs: compiles.append((threading.current_thread().name,
                                                                        kwargs["fn"].name))
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], attention_backend=sys.argv[2], max_model_len=1024, max_num_seqs=64)
for seed in (None, 1):  # a first unseeded and a first seeded request, of odd batch sizes and prompt lengths
    params = SamplingParams(max_tokens=20, temperature=0.6, seed=seed)
    llm.generate([[1, 2, 3]] * 3 + [[4] * 21], params, use_tqdm=False)
for thread, kernel in compiles:
    print("compile:", thread, kernel)
print("compiles:", len(compiles))
'''


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    from nanovllm.utils.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "Qwen3-0.6B", std=0.05, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_an_engine_compiles_its_start_up_kernels_side_by_side(backend, small_model, tmp_path):
    """A fresh compile cache, as on a user's first start: every kernel variant that start-up and the first requests
    (seeded and not) meet is compiled in the compile threads at start-up; nothing compiles on the engine's thread."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    result = subprocess.run([sys.executable, "-c", ENGINE_COMPILES, small_model, backend], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiles = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("compile:")]
    assert compiles, result.stdout  # a fresh cache: the start-up compiled something
    in_passes = [line for line in compiles if not line.startswith("triton-compile")]
    assert in_passes == [], "\n".join(compiles)
