"""Tensor-parallel lifecycle on CPU (gloo): no collisions, no leftovers, clear errors."""
import ipaddress
import os

import pytest
import torch
from hf_reference import assert_no_leaks
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.engine.shm_channel import SHM_SIZE, WorkerChannel

pytestmark = pytest.mark.slow  # processes and actors: seconds each

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def assert_released(llm) -> None:
    assert not os.path.exists(f"/dev/shm/{llm.workers.shm_name}")
    assert not llm.workers.processes and not llm.workers.events  # dropped, so their semaphores are unlinked
    for pid in llm.workers.pids:  # joined and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_oversized_message_is_an_error_not_a_truncation():
    channel = WorkerChannel("nanovllm-test-oversized", create=True)
    try:
        with pytest.raises(RuntimeError, match="exceeds"):
            channel.send([], "run", b"x" * SHM_SIZE)
        assert int.from_bytes(channel.shm.buf[:4], "little") == 0  # nothing was written
    finally:
        channel.close()
    assert not os.path.exists("/dev/shm/nanovllm-test-oversized")


def test_bad_tensor_parallel_size_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(tiny_model, tensor_parallel_size=3)


def test_two_engines_at_once_exceptions_and_clean_exit(tiny_model):
    prompts = random_prompts([300, 40, 90], seed=9)
    with LLM(tiny_model, num_kvcache_blocks=16) as single:
        expected = [o["token_ids"] for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    first = LLM(tiny_model, num_kvcache_blocks=16, tensor_parallel_size=2)
    with pytest.raises(KeyError):
        with LLM(tiny_model, num_kvcache_blocks=16, tensor_parallel_size=2) as second:
            assert first.workers.shm_name != second.workers.shm_name
            assert first.workers.store_path != second.workers.store_path
            assert [o["token_ids"] for o in first.generate(prompts, GREEDY, use_tqdm=False)] == expected
            assert [o["token_ids"] for o in second.generate(prompts, GREEDY, use_tqdm=False)] == expected

            # an exception between steps: the engine frees everything and stays usable
            calls = 0
            postprocess = second.scheduler.postprocess

            def failing_postprocess(*args):
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise KeyboardInterrupt
                return postprocess(*args)

            second.scheduler.postprocess = failing_postprocess
            with pytest.raises(KeyboardInterrupt):
                second.generate(prompts, GREEDY, use_tqdm=False)
            assert_no_leaks(second)
            second.scheduler.postprocess = postprocess
            assert [o["token_ids"] for o in second.generate(prompts, GREEDY, use_tqdm=False)] == expected
            raise KeyError("leaving the with block by an exception")
    assert_released(second)
    assert [o["token_ids"] for o in first.generate(prompts, GREEDY, use_tqdm=False)] == expected

    # a worker that dies makes the next call fail fast, and exit still cleans up
    first.workers.processes[0].kill()
    first.workers.processes[0].join()
    with pytest.raises(RuntimeError, match="rank 1"):
        first.generate(prompts, GREEDY, use_tqdm=False)
    first.exit()
    assert_released(first)
    assert torch.multiprocessing.active_children() == []


def test_worker_dying_during_startup_is_an_error_not_a_hang(tiny_model, monkeypatch):
    from nanovllm.engine import tp_workers

    wait_for = tp_workers.Workers.wait_for
    spawned = []

    def kill_during_load(self, stage):
        if stage == "loaded":  # the worker dies loading its weights; rank 0 must not enter the next collective
            spawned.extend(self.processes)
            self.processes[0].kill()
        wait_for(self, stage)

    monkeypatch.setattr(tp_workers.Workers, "wait_for", kill_during_load)
    with pytest.raises(RuntimeError, match="rank 1"):
        LLM(tiny_model, num_kvcache_blocks=8, tensor_parallel_size=2)
    assert spawned and not any(p.is_alive() for p in spawned)


def test_nothing_left_in_dev_shm_after_exit_while_still_referenced(tiny_model):
    """The segment and the events' named semaphores (sem.mp-*) are gone once exit() returns, although the LLM
    object (and its Workers) are still referenced."""
    before = set(os.listdir("/dev/shm"))
    llm = LLM(tiny_model, num_kvcache_blocks=8, tensor_parallel_size=2)
    during = set(os.listdir("/dev/shm")) - before
    assert any(name.startswith("sem.") for name in during) and llm.workers.shm_name in during
    llm.generate(random_prompts([30], seed=1), GREEDY, use_tqdm=False)
    llm.exit()
    assert set(os.listdir("/dev/shm")) - before == set()
    assert_released(llm)


def listening_sockets(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of these processes holds, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or int(fields[9]) not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # the kernel prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_tensor_parallel_listens_on_loopback_only_and_not_after_exit(tiny_model):
    before = listening_sockets([os.getpid()])
    llm = LLM(tiny_model, num_kvcache_blocks=8, tensor_parallel_size=2)
    llm.generate(random_prompts([30], seed=2), GREEDY, use_tqdm=False)
    during = listening_sockets([os.getpid(), *llm.workers.pids])
    assert during, "gloo's listeners should be visible here: the check itself would be blind otherwise"
    assert all(is_loopback(address) for address, _ in during), during
    llm.exit()
    assert listening_sockets([os.getpid()]) - before == set()


def test_a_failed_step_on_rank_0_stops_the_engine_instead_of_hanging(tiny_model):
    llm = LLM(tiny_model, num_kvcache_blocks=8, tensor_parallel_size=2)
    forward, calls = llm.model_runner.sampler.forward, []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) == 3:  # after the logits gather, before the broadcast the workers wait in
            raise ValueError("injected")
        return forward(*args)

    llm.model_runner.sampler.forward = failing_forward
    with pytest.raises(RuntimeError, match="a tensor-parallel step failed on rank 0; the engine has exited"):
        llm.generate(random_prompts([30, 40], seed=3), GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="this LLM has exited"):
        llm.generate(random_prompts([30], seed=3), GREEDY, use_tqdm=False)
    assert_released(llm)


def test_missing_tokenizer_fails_before_any_worker_starts(tiny_model, tmp_path):
    import shutil

    path = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, path, ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*",
                                                                    "special_tokens*"))
    children = set(torch.multiprocessing.active_children())
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        LLM(str(path), num_kvcache_blocks=8, tensor_parallel_size=2)
    assert set(torch.multiprocessing.active_children()) == children
