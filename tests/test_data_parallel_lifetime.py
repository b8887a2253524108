"""A replica's life beside its driver's, on CPU: no fork into a thread pool that cannot survive it, a deadline on a
replica that never finishes its start-up, no replica outliving its driver, a stop that no caller's handler or
second signal can spoil, and a lost replica named for what ended it."""
import os
import signal
import subprocess
import sys
import time

import pytest
from test_data_parallel import OPTIONS
from test_data_parallel_startup import is_running

pytestmark = [pytest.mark.slow,  # processes: seconds each
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, signals and /proc are Linux's")]


def run_driver(code: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python, in a session of its own: past `timeout` s every process of it is killed (a hung
    driver, its replicas and their workers) and the test fails, rather than hanging or leaving them behind."""
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, **env})
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the driver did not finish in {timeout:g} s\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # whatever of it is left
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_no_fork_after_the_callers_threaded_torch_work(tiny_model):
    """The caller ran a multi-threaded torch op before asking for forked replicas that run torch at 2 threads: a
    fork would leave each replica waiting forever in the OpenMP pool; they are spawned instead, and say why."""
    code = f"""
import torch
torch.set_num_threads(2)
torch.randn(512, 512) @ torch.randn(512, 512)
from nanovllm import SamplingParams
from nanovllm.data_parallel import DataParallel
with DataParallel({tiny_model!r}, 2, "mp", fork=True, **{OPTIONS!r}) as dp:
    answers = list(dp.iter_generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_tokens=2)))
    print(dp.replicas.start_method, len(answers), dp.replicas.spawn_reason, sep="|")
"""
    result = run_driver(code, 120, OMP_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr[-3000:]
    method, answered, reason = result.stdout.strip().split("|")
    assert (method, answered) == ("spawn", "2"), result.stdout
    assert "torch's intra-op thread pool has run in this process" in reason and "at 2 threads" in reason, reason


# stand-in engines for forked replicas (a fork needs no import of them): they start at once and load no model
ENGINES = """
import os, signal, sys, threading, time
from nanovllm.data_parallel import driver, processes
from nanovllm.data_parallel.replica import DRAIN, Work
from nanovllm.sampling_params import SamplingParams

class Stuck:
    '''Stuck for good in its start-up and deaf to signals, as a replica forked into a running OpenMP pool is.'''
    def __init__(self, model, **options):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        threading.Event().wait()

class Slow:
    '''Answers each request with its prompt, 50 ms apart; leaves only when interrupted.'''
    def __init__(self, model, **options):
        pass
    def __enter__(self):
        return self
    def __exit__(self, *exc_info):
        pass
    def iter_generate(self, prompts, params, errors="yield"):
        for index, (prompt, _) in enumerate(zip(prompts, params)):
            time.sleep(0.05)
            yield index, prompt
"""


def test_a_replica_never_ready_is_stopped_at_the_startup_deadline(tiny_model):
    code = ENGINES + f"""
from nanovllm.data_parallel import DataParallel, ReplicasLost
driver.STARTUP_S = 3.0
dp = DataParallel({tiny_model!r}, 2, "mp", engine_class=Stuck, fork=True, **{OPTIONS!r})
began = time.monotonic()
try:
    list(dp.iter_generate([[1, 2, 3]], SamplingParams(max_tokens=2)))
except ReplicasLost as error:
    print(error)
processes = dp.replicas.processes
dp.exit()
print(round(time.monotonic() - began, 1), *[p.exitcode for p in processes])
"""
    result = run_driver(code, 90)
    assert result.returncode == 0, result.stderr[-3000:]
    lost, timing = result.stdout.strip().splitlines()
    assert lost.startswith("every data-parallel replica is gone: replica 0 (forked pid ") and lost.count(
        "not ready 3 s after its launch (driver.STARTUP_S); stopped") == 2, lost
    seconds, *codes = timing.split()
    assert float(seconds) < 15 and codes == ["-9", "-9"], timing


def test_no_replica_outlives_its_driver_even_when_stuck(tiny_model):
    """A replica deaf to signals (stuck in native code) whose driver is killed: it used to stay, re-parented to
    init, for good."""
    code = ENGINES + f"""
from nanovllm.data_parallel import DataParallel
dp = DataParallel({tiny_model!r}, 2, "mp", engine_class=Stuck, fork=True, **{OPTIONS!r})
print(*[p.pid for p in dp.replicas.processes], flush=True)
time.sleep(600)
"""
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2, "the driver did not start its replicas"
        time.sleep(1.0)  # both are in their engine's start-up by now
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        limit = 20  # ORPHAN_S (5 s) and WATCH_S (0.5 s) in replica_process.py, and a loaded machine
        deadline = time.monotonic() + limit
        while alive := [pid for pid in pids if is_running(pid)]:
            assert time.monotonic() < deadline, f"replicas {alive} outlived their driver by {limit:g} s"
            time.sleep(0.1)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        driver.stdout.close()


def test_the_stop_does_not_run_the_callers_sigint_handler(tiny_model):
    """A forked replica starts with the driver's handlers: a caller's SIGINT handler that returns used to swallow
    the stop, and the driver killed each replica JOIN_S later. Stopped replicas end by the stop signal."""
    code = ENGINES + f"""
signal.signal(signal.SIGINT, lambda signum, frame: print("the caller's handler ran", flush=True))
replicas = processes.ProcessReplicas(2, Slow, {tiny_model!r}, {OPTIONS!r}, fork=True)
assert replicas.start_method == "fork", replicas.spawn_reason
ready, deadline = set(), time.monotonic() + 60
while len(ready) < 2:
    assert time.monotonic() < deadline, "the replicas did not start"
    ready |= {{r for r, (kind, _) in replicas.receive(0.2) if kind == "ready"}}
for r in range(2):
    replicas.send(r, [Work(i, [1, 2], SamplingParams()) for i in range(1000)] + [DRAIN])
time.sleep(0.5)  # both are answering
began = time.monotonic()
replicas.close(False)
print(round(time.monotonic() - began, 1), *[p.exitcode for p in replicas.processes])
"""
    result = run_driver(code, 90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the caller's handler ran" not in result.stdout, result.stdout
    closing, *codes = result.stdout.split()
    assert float(closing) < 10 and codes == ["-15", "-15"], (result.stdout, result.stderr[-2000:])


def test_a_replica_killed_from_outside_is_named_for_the_signal(tiny_model):
    code = ENGINES + f"""
import warnings
from nanovllm.data_parallel import DataParallel
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    with DataParallel({tiny_model!r}, 2, "mp", engine_class=Slow, fork=True, **{OPTIONS!r}) as dp:
        for n, _ in enumerate(dp.iter_generate([[i] for i in range(60)], SamplingParams())):
            if n == 3:
                os.kill(dp.replicas.processes[0].pid, signal.SIGTERM)
print(n + 1, *[str(w.message) for w in caught], sep="\\n")
"""
    result = run_driver(code, 90)
    assert result.returncode == 0, result.stderr[-3000:]
    answered, *warned = result.stdout.strip().splitlines()
    assert answered == "60" and len(warned) == 1, result.stdout
    assert "is gone (killed by SIGTERM)" in warned[0], warned[0]


def test_a_stop_pending_during_the_imports_does_not_hide_the_start_up_error(tiny_model, tmp_path):
    """A spawned replica whose imports fail while a SIGTERM waits for them to end: it used to exit 0, silently."""
    (tmp_path / "failing_engine.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)  # held back until the imports are done\n"
        "raise RuntimeError('the real start-up error')\n")
    code = f"""
from nanovllm.data_parallel import processes
replicas = processes.ProcessReplicas(1, "failing_engine:Engine", {tiny_model!r}, {OPTIONS!r})
messages = []
while not replicas.ended:
    messages += [message for _, message in replicas.receive(0.2)]
print(messages, replicas.lost())
"""
    result = run_driver(code, 60, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("('error', 'the engine failed to start: RuntimeError: the real start-up error')"
            in result.stdout), result.stdout


def test_a_local_ray_instance_ends_with_its_killed_driver():
    """A driver that started a local Ray instance is killed with SIGKILL: every process of the instance is gone
    within seconds (its DashboardAgent and RuntimeEnvAgent otherwise wait out a 60 s call to the dead GCS)."""
    pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
    import psutil  # Ray's own, on the path once ray is imported

    code = """
import ray, psutil, time
from nanovllm.data_parallel.ray_actors import _init_ray
reaper = _init_ray(ray)
watcher = reaper.process.pid if reaper else None
ours = [p for p in psutil.Process().children(recursive=True) if p.pid != watcher]
print(" ".join(f"{p.pid}:{p.create_time()!r}" for p in ours), flush=True)
time.sleep(600)
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        line = driver.stdout.readline()
        assert line.strip(), "the driver did not start Ray"
        started = [(int(pid), float(when)) for pid, when in (item.split(":") for item in line.split())]
        names = {psutil.Process(pid).name() for pid, _ in started}
        assert any("Agent" in name for name in names), names  # the processes that outlived a driver
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()

    def alive() -> list[int]:
        left = []
        for pid, when in started:
            try:
                if psutil.Process(pid).create_time() == when and psutil.Process(pid).status() != "zombie":
                    left.append(pid)
            except psutil.Error:
                pass
        return left

    deadline = time.monotonic() + 20
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = alive()
    for pid in left:  # do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} processes of the local Ray instance outlived its driver by 20 s"
