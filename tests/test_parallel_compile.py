"""Triton kernels compiled side by side at start-up (utils/parallel_compile.py). On a GPU: the dry pass launches
nothing, the real pass after it compiles nothing and computes what it would have computed, and an engine's start-up
leaves no kernel for its real passes to compile. On CPU, with a stand-in for Triton's hook and kernels: what a dry
pass records, where it compiles (the launcher too), and what happens when a compile or a pass fails."""
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanovllm.utils.parallel_compile import KernelCompiles
from nanovllm.utils.parallel_compile import _build_launcher as build_launcher  # before fake_triton replaces it


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
from dataclasses import replace
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], attention_backend=sys.argv[2], max_model_len=1024, max_num_seqs=64)
defaults = llm.get_default_sampling_params()
# first requests plainly, seeded, with the checkpoint's defaults (seeded and not) and with penalties, in batches
# of odd and even sizes and prompt lengths whose decode steps shrink from 5 rows to 1 as requests finish
settings = [SamplingParams(temperature=0.6), SamplingParams(temperature=0.6, seed=1), defaults,
            replace(defaults, seed=1), SamplingParams(temperature=0.6, repetition_penalty=1.2),
            SamplingParams(temperature=0.6, presence_penalty=0.5, frequency_penalty=0.5, seed=2)]
prompts = [[1, 2, 3]] * 3 + [[4] * 21, [5] * 8]
for params in settings:
    llm.generate(prompts, [replace(params, max_tokens=n, ignore_eos=True) for n in (2, 5, 9, 14, 20)],
                 use_tqdm=False)
for thread, kernel in compiles:
    print("compile:", thread, kernel)
print("compiles:", len(compiles))
'''


def with_generation_config(model: str, folder, **generation) -> str:
    """A copy of the checkpoint (its files linked) whose generation_config.json recommends `generation`."""
    folder.mkdir()
    for name in os.listdir(model):
        if name != "generation_config.json":
            os.symlink(os.path.join(model, name), folder / name)
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return str(folder)


# Qwen2.5-Instruct's recommended sampling: top-k, top-p and a repetition penalty
QWEN25_SAMPLING = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_an_engine_compiles_its_start_up_kernels_side_by_side(backend, small_model, tmp_path):
    """A fresh compile cache, as on a user's first start: every kernel variant that start-up and the first requests
    meet (plain, seeded, the checkpoint's default sampling seeded and not, penalties; decode batches of every size
    from 5 rows to 1) is compiled in the compile threads at start-up; nothing compiles on the engine's thread."""
    model = with_generation_config(small_model, tmp_path / "model", **QWEN25_SAMPLING)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    result = subprocess.run([sys.executable, "-c", ENGINE_COMPILES, model, backend], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiles = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if line.startswith("compile:")]
    assert compiles, result.stdout  # a fresh cache: the start-up compiled something
    in_passes = [line for line in compiles if not line.startswith("triton-compile")]
    assert in_passes == [], "\n".join(compiles)


def recording(prepare, calls: list):
    """The sampler's prepare, noting each batch's settings and whether it is a decode step's (fed tokens)."""
    def prepare_and_note(rows, fed=None):
        calls.append(([row.params for row in rows], fed is not None))
        return prepare(rows, fed)
    return prepare_and_note


def test_the_first_serving_passes_sample_what_the_first_requests_will_and_change_no_output(tiny_model, tmp_path,
                                                                                          monkeypatch):
    """The passes an engine runs dry at start-up on a GPU (here for real, on CPU): a prefill and a decode step's
    sampling for each setting the first requests are likely to meet, the checkpoint's defaults among them; and an
    engine that ran them generates what one that did not generates."""
    from nanovllm import LLM, SamplingParams

    model = with_generation_config(tiny_model, tmp_path / "model", **QWEN25_SAMPLING)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=8),
              SamplingParams(**QWEN25_SAMPLING, seed=3, max_tokens=8)]
    outputs = []
    for run_passes in (True, False):
        with LLM(model, max_model_len=128, max_num_seqs=8) as llm:
            if run_passes:
                sampler, prepared = llm.model_runner.sampler, []
                monkeypatch.setattr(sampler, "prepare", recording(sampler.prepare, prepared))
                llm.model_runner.first_serving_passes()
                monkeypatch.undo()
                expected = [SamplingParams(**settings, seed=seed) for settings in
                            ({}, {"repetition_penalty": 1.1}, QWEN25_SAMPLING) for seed in (None, 0)]
                assert prepared == [([p], False) for p in expected] + [([p, p], True) for p in expected]
            outputs.append([out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]


class FakeKernel:
    """Stands in for a Triton JITFunction: launch() asks the cache hook as Triton does for a variant it has not
    compiled, and runs unless the hook says to skip; preload() compiles a variant (here: records the thread)."""

    def __init__(self, name: str, knobs, fail: bool = False) -> None:
        self.fn = SimpleNamespace(__name__=name)
        self.knobs, self.fail = knobs, fail
        self.compiled: dict[str, str] = {}  # variant -> the thread that compiled it
        self.ran: list[str] = []

    def launch(self, variant: str) -> None:
        hook = self.knobs.jit_cache_hook
        if variant not in self.compiled and hook is not None and hook(
                key=variant, repr=variant, fn=SimpleNamespace(jit_function=self),
                compile={"specialization_data": f"data of {variant}"}, is_manual_warmup=False,
                already_compiled=False):
            return
        self.ran.append(variant)

    def preload(self, specialization: str) -> SimpleNamespace:
        import threading
        if self.fail:
            raise RuntimeError("no compiler")
        variant = specialization.removeprefix("data of ")
        self.compiled[variant] = threading.current_thread().name
        return SimpleNamespace(kernel=self, variant=variant)


@pytest.fixture
def fake_triton(monkeypatch):
    import contextlib
    import threading

    knobs = SimpleNamespace(jit_cache_hook=None, launchers={})  # launchers: (kernel name, variant) -> thread
    monkeypatch.setattr("nanovllm.utils.parallel_compile._runtime_knobs", lambda: knobs)
    monkeypatch.setattr("nanovllm.utils.parallel_compile._build_launcher", lambda compiled: knobs.launchers.update(
        {(compiled.kernel.fn.__name__, compiled.variant): threading.current_thread().name}))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return knobs


def test_a_dry_pass_records_each_variant_once_and_the_pool_compiles_them(fake_triton):
    import threading

    norm, attention = FakeKernel("norm", fake_triton), FakeKernel("attention", fake_triton)
    compiles = KernelCompiles(torch.device("cpu"), max_threads=4)

    def dry_pass() -> None:
        for _ in range(3):  # every layer launches the same variants
            norm.launch("rows=7")
            attention.launch("rows=7")
        norm.launch("rows=1")
        other = threading.Thread(target=attention.launch, args=("another thread's",))
        other.start()
        other.join()  # another thread's launch is Triton's business as usual: it runs

    compiles.dry_run(dry_pass)
    assert fake_triton.jit_cache_hook is None  # the hook is the pass's only
    assert norm.ran == [] and attention.ran == ["another thread's"]
    assert [name for name, _ in compiles.compiles] == ["norm", "attention", "norm"]
    assert re.fullmatch(r"3 Triton kernel variants compiled side by side, the last done \d+\.\d s after the "
                        r"first was met", compiles.wait())
    assert set(norm.compiled) == {"rows=7", "rows=1"} and set(attention.compiled) == {"rows=7"}
    # each variant's launcher is built where it compiled, not left to its first launch
    assert set(fake_triton.launchers) == {("norm", "rows=7"), ("norm", "rows=1"), ("attention", "rows=7")}
    assert all(thread.startswith("triton-compile") for thread in [*norm.compiled.values(),
                                                                  *attention.compiled.values(),
                                                                  *fake_triton.launchers.values()])
    norm.launch("rows=7")  # compiled: runs for real, no hook involved
    assert norm.ran == ["rows=7"]
    compiles.dry_run(lambda: norm.launch("rows=1"))  # met before: not compiled twice
    assert compiles.compiles == [] and compiles.wait() == "no Triton kernel variant to compile"


def test_a_failed_compile_is_left_to_its_launch_and_a_failed_pass_restores_the_hook(fake_triton):
    broken = FakeKernel("broken", fake_triton, fail=True)
    compiles = KernelCompiles(torch.device("cpu"))
    compiles.dry_run(lambda: broken.launch("rows=3"))
    assert compiles.wait().endswith(", 1 left to their first launch (broken)")

    def failing_pass() -> None:
        broken.launch("rows=5")
        raise ValueError("out of memory")

    with pytest.raises(ValueError):
        compiles.dry_run(failing_pass)
    assert fake_triton.jit_cache_hook is None


def test_with_someone_elses_hook_the_passes_run_for_real(fake_triton):
    fake_triton.jit_cache_hook = lambda **kwargs: None  # a user's own hook: leave Triton as it is
    kernel = FakeKernel("norm", fake_triton)
    compiles = KernelCompiles(torch.device("cpu"))
    compiles.dry_run(lambda: kernel.launch("rows=7"))
    assert kernel.ran == ["rows=7"] and compiles.compiles == []
    assert compiles.wait().startswith("Triton compiled in the passes themselves")


def test_the_launcher_is_built_from_the_compiled_variant_and_a_failure_is_not_a_failed_compile(fake_triton,
                                                                                              monkeypatch):
    """_build_launcher hands Triton's active driver the compiled variant's source and metadata (what the variant's
    first launch would build its launcher from); a launcher that fails to build leaves the compile counted as done,
    since that launch builds it again."""
    triton_runtime = pytest.importorskip("triton.runtime", reason="Triton is not installed here")
    from nanovllm.utils import parallel_compile

    built = []
    monkeypatch.setattr(triton_runtime, "driver", SimpleNamespace(active=SimpleNamespace(
        launcher_cls=lambda src, metadata: built.append((src, metadata)))))
    build_launcher(SimpleNamespace(src="its source", metadata="its metadata"))
    assert built == [("its source", "its metadata")]

    def failing(compiled) -> None:
        raise RuntimeError("no gcc")

    monkeypatch.setattr(parallel_compile, "_build_launcher", failing)
    compiles = KernelCompiles(torch.device("cpu"))
    kernel = FakeKernel("norm", fake_triton)
    compiles.dry_run(lambda: kernel.launch("rows=7"))
    assert re.fullmatch(r"1 Triton kernel variants compiled side by side, the last done \d+\.\d s after the first "
                        r"was met", compiles.wait())
    assert set(kernel.compiled) == {"rows=7"}
