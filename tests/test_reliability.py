"""Interrupts, impossible values, threads: the engine never leaks, never spins, and fails before any work."""
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch
from hf_reference import assert_no_leaks
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# the host loop's own code: where an interrupt can land between two device steps
HOST_LOOP_FILES = ("nanovllm/engine/", "nanovllm/sampling/sampler.py", "nanovllm/sampling_params.py")


@pytest.fixture(scope="module")
def llm(tiny_model):
    # small blocks, a small cache and a small token budget: chunked prefill, prefix sharing and preemption
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=40, max_num_batched_tokens=128,
             max_num_seqs=4) as engine:
        yield engine


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts([30, 200, 17, 300, 5, 90], seed=31)
    prompts.append(prompts[1][:100] + [3] * 20)  # shares a prefix with another
    stop = SamplingParams(temperature=0, max_tokens=12, stop=["a"])
    return prompts, [GREEDY] * 6 + [stop]


class InterruptAtLine:
    """A tracer that raises KeyboardInterrupt at the n-th line executed in the host loop's files (or counts
    lines when n is None). Python removes a tracer that raises, so each run is interrupted once."""

    def __init__(self, n: int | None) -> None:
        self.n, self.count, self.where = n, 0, None

    def __call__(self, frame, event, arg):
        if event == "call" and any(path in frame.f_code.co_filename for path in HOST_LOOP_FILES):
            return self.local
        return None

    def local(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.n:
                self.where = f"{frame.f_code.co_filename.rsplit('nanovllm/', 1)[1]}:{frame.f_lineno}"
                raise KeyboardInterrupt
        return self.local


def traced(llm, tracer, prompts, params):
    sys.settrace(tracer)
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        sys.settrace(None)


@pytest.mark.slow
def test_an_interrupt_at_any_line_of_the_host_loop_leaks_nothing(llm):
    prompts, params = workload()
    expected = llm.generate(prompts, params, use_tqdm=False)
    counter = InterruptAtLine(None)
    assert traced(llm, counter, prompts, params) == expected
    total = counter.count
    # every line of queuing and the first steps, then points spread over the whole run
    points = sorted({*range(1, 400, 9), *range(400, total, max(1, total // 150))})
    places = set()
    for i, n in enumerate(points):
        tracer = InterruptAtLine(n)
        with pytest.raises(KeyboardInterrupt):
            traced(llm, tracer, prompts, params)
        places.add(tracer.where.split(":")[0])
        assert llm.in_flight is None, tracer.where
        assert_no_leaks(llm)
        if i % 30 == 0:
            assert llm.generate(prompts, params, use_tqdm=False) == expected, tracer.where
    assert llm.generate(prompts, params, use_tqdm=False) == expected
    # the walk reached every part of the loop
    assert {"engine/llm_engine.py", "engine/scheduler.py", "engine/block_manager.py", "engine/model_runner.py",
            "engine/model_inputs.py", "engine/step.py"} <= places, places


def test_interrupt_inside_decode_scheduling_then_a_long_prompt(tiny_model):
    """The reported hang: an interrupt on may_append's 20th call used to strand the blocks of the sequences the
    decode loop had taken off `running`, and a prompt needing more than the rest then spun forever."""
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=64) as llm:
        bm = llm.scheduler.block_manager
        may_append, calls = bm.may_append, []

        def interrupted(seq):
            calls.append(1)
            if len(calls) == 20:
                raise KeyboardInterrupt
            may_append(seq)

        bm.may_append = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate(random_prompts([30] * 20, seed=4), GREEDY, use_tqdm=False)
        bm.may_append = may_append
        assert_no_leaks(llm)
        out = llm.generate(random_prompts([600], seed=5), GREEDY, use_tqdm=False)
        assert len(out[0]["token_ids"]) == 12


def test_nothing_schedulable_is_an_error_not_a_spin(llm):
    """The second line of defence: blocks lost to a bug would leave a request that can never be admitted."""
    bm = llm.scheduler.block_manager
    for _ in range(35):
        bm.free_block_ids.popleft()  # lost: in no block table, not free
    errors = []

    def call():
        try:
            llm.generate(random_prompts([300], seed=6), GREEDY, use_tqdm=False)
        except RuntimeError as error:
            errors.append(str(error))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "generate spun instead of raising"
    assert errors and "needs 19 KV blocks and holds 0; 5 of 40 are free" in errors[0], errors
    assert_no_leaks(llm)  # the abort after the error starts the block manager afresh


@pytest.mark.parametrize("params, message", [
    (dict(stop_token_ids=[5000], min_tokens=2), r"stop_token_ids holds 5000, outside the vocabulary \[0, 1024\)"),
    (dict(logprobs=5000), r"logprobs=5000 exceeds 20: the engine option max_logprobs=20 and the vocabulary"),
])
def test_values_checked_against_the_vocabulary_before_any_work(llm, params, message):
    prompts, _ = workload()
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts[:2] + [prompts[2]], [GREEDY, GREEDY, SamplingParams(max_tokens=4, **params)],
                     use_tqdm=False)
    assert_no_leaks(llm)


@pytest.mark.parametrize("field", ["top_k", "stop_token_ids", "max_tokens", "logprobs"])
def test_integers_beyond_64_bits_are_refused(field):
    value = [2**63] if field == "stop_token_ids" else 2**63
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_an_absurd_n_is_refused_before_any_sample_is_made():
    # n=10**9 used to build a billion SamplingParams (samples_of) before the first step, growing memory for minutes
    with pytest.raises(ValueError) as caught:
        SamplingParams(n=10**9)
    assert str(caught.value) == "SamplingParams.n=1000000000 is out of range: allowed an integer in [1, 16384]"
    params = SamplingParams(n=16384)  # vLLM's bound itself is allowed
    with pytest.raises(ValueError, match=r"SamplingParams.n=16385 is out of range"):
        params.n = 16385
    assert params.n == 16384


def test_top_k_above_the_vocabulary_means_all_tokens(llm):
    prompt = random_prompts([20], seed=7)
    sampled = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=11, max_tokens=8, top_k=k, top_p=0.99),
                            use_tqdm=False)[0]["token_ids"] for k in (-1, 1024, 10**12)]
    assert sampled[0] == sampled[1] == sampled[2]


def test_engine_options_beyond_the_machine_are_named(tiny_model):
    with pytest.raises(ValueError, match=r"num_kvcache_blocks=1000000000 needs .* GiB of KV cache but"):
        LLM(tiny_model, num_kvcache_blocks=10**9)
    # no buffer is sized by max_num_seqs alone: a batch never exceeds the cache's blocks
    with LLM(tiny_model, max_num_seqs=10**10, num_kvcache_blocks=8) as llm:
        assert len(llm.generate(random_prompts([10, 20], seed=8), GREEDY, use_tqdm=False)) == 2


def test_threads_share_one_engine_one_call_at_a_time(llm):
    prompts, params = workload()
    expected = llm.generate(prompts, params, use_tqdm=False)
    results, errors = {}, []

    def call(i):
        try:
            results[i] = llm.generate(prompts, params, use_tqdm=False)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors and all(results[i] == expected for i in range(3))
    assert_no_leaks(llm)


def test_generate_after_exit_is_a_clear_error(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=8)
    llm.exit()
    with pytest.raises(RuntimeError, match="this LLM has exited"):
        llm.generate(["hello"], GREEDY)
    assert torch.is_tensor(torch.zeros(1))  # the process is fine


def test_exit_frees_the_kv_cache_while_the_runner_and_model_are_still_held(tiny_model):
    # a caller's variable (or a traceback) that still holds the runner or the model must not keep the cache: the
    # next engine in the process sizes its own from the memory that is free
    llm = LLM(tiny_model, num_kvcache_blocks=8)
    runner, model = llm.model_runner, llm.model_runner.model
    cache = weakref.ref(runner.kv_cache)
    llm.exit()
    gc.collect()
    assert cache() is None and runner.model is None and model is not None


@pytest.mark.slow  # a tensor-parallel engine in a process of its own
def test_a_second_interrupt_during_exit_leaves_no_files(tiny_model, tmp_path):
    """A data-parallel replica takes SIGTERM as its Ctrl-C; a second one landing in its engine's exit (here while
    the tensor-parallel workers are joined) used to cut the clean-up short, leaving the workers' rendezvous folder
    (nanovllm-store-*) and a leaked shared-memory segment. The interrupt now waits for the exit, then is raised."""
    code = f"""
import os, signal
from nanovllm import LLM, SamplingParams
from nanovllm.engine import tp_workers

def interrupt(signum, frame):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, interrupt)
join = tp_workers.Workers.join
def join_interrupted(self, timeout=30.0):
    os.kill(os.getpid(), signal.SIGTERM)
    return join(self, timeout)
llm = LLM({tiny_model!r}, tensor_parallel_size=2, num_kvcache_blocks=32, max_model_len=256)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
tp_workers.Workers.join = join_interrupted
try:
    llm.exit()
except KeyboardInterrupt:
    print("interrupted after the exit", flush=True)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout == "interrupted after the exit\n", result.stderr[-3000:]
    assert not list(tmp_path.glob("nanovllm-store-*")), list(tmp_path.iterdir())
    assert "leaked" not in result.stderr, result.stderr[-3000:]
