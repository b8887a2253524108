"""Start-up of data parallelism on CPU: replicas start concurrently (over processes, forked or spawned, and over
Ray) and run at the driver's priority, a forked replica leaves with its driver, the start-up times that run-batch
reports add up, run-batch launches Ray actors and spawned replicas before it imports the engine and forks
processes after it, and the start-up probe times each of a driver's steps."""
import glob
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from test_data_parallel import GREEDY, OPTIONS, needs_ray, prompts

from nanovllm.data_parallel import DataParallel, processes
from nanovllm.engine import startup
from nanovllm.engine.startup import StartupTimes, describe_engine, describe_replicas

OPTION_FLAGS = ["--num-kvcache-blocks", "32", "--max-model-len", "512", "--max-num-seqs", "2"]  # OPTIONS, as flags
MEETING = "NANOVLLM_TEST_MEETING"  # a folder where MeetingEngine replicas announce themselves
MEET_S = 120.0  # how long an engine waits for the others to start theirs (a loaded 2-core machine is slow)


class MeetingEngine:
    """An engine whose start-up finishes only once every replica's engine has begun its own: if replicas started
    one after another (a replica's start-up waiting for the one before it to end), the first would wait alone and
    fail. Its last start-up phase is named for its process's niceness. Answers each request with its prompt."""

    def __init__(self, model: str, **options) -> None:
        self.startup = StartupTimes()
        folder = os.environ[MEETING]
        open(os.path.join(folder, f"began-{uuid.uuid4().hex}"), "w").close()
        with open(os.path.join(folder, "replicas")) as f:
            replicas = int(f.read())
        deadline = time.monotonic() + MEET_S
        while len(glob.glob(os.path.join(folder, "began-*"))) < replicas:
            if time.monotonic() > deadline:
                raise RuntimeError(f"this replica's start-up waited {MEET_S:g} s alone: the other replicas did not "
                                   f"start theirs meanwhile")
            time.sleep(0.01)
        self.startup.lap("meeting")
        self.startup.lap(f"niceness {os.nice(0)}")

    def __enter__(self) -> "MeetingEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def iter_generate(self, prompts, params, errors="yield"):
        for index, (prompt, _) in enumerate(zip(prompts, params)):
            yield index, prompt


@pytest.fixture
def meeting(tmp_path, monkeypatch):
    """The folder, in the environment that replicas inherit, for `replicas` MeetingEngines."""
    monkeypatch.setenv(MEETING, str(tmp_path))

    def expect(replicas: int) -> None:
        (tmp_path / "replicas").write_text(str(replicas))
    return expect


def start_and_answer(meeting, model: str, backend: str, **options) -> DataParallel:
    meeting(2)
    with DataParallel(model, 2, backend, engine_class=MeetingEngine, **OPTIONS, **options) as dp:
        answers = dict(dp.iter_generate(prompts(8), GREEDY))
    assert answers == dict(enumerate(prompts(8)))  # each answered, once, after both started
    for held in dp.held:  # each reported its start-up, its engine's laps included, and runs at our priority
        assert held.startup is not None and held.startup.ready is not None
        assert [name for name, _ in held.startup.phases][-2:] == ["meeting", f"niceness {os.nice(0)}"]
    return dp


def only_the_main_thread() -> None:
    """Replicas are forked only from a process that runs no other Python thread: stop the tqdm monitor that an
    earlier test's progress bar left running (tqdm starts another with its next bar)."""
    from tqdm._monitor import TMonitor

    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):
            thread.exit()  # and joins it
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        pytest.skip(f"threads {others} run in this test process: replicas would be spawned, not forked")


@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_process_replicas_start_concurrently(meeting, tiny_model, fork):
    if fork:
        only_the_main_thread()
    dp = start_and_answer(meeting, tiny_model, "mp", fork=fork)
    assert all(("forked pid" if fork else "spawned pid") in held.name for held in dp.held)


@needs_ray
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own
def test_ray_replicas_start_concurrently(meeting, tiny_model, monkeypatch):
    """On a local Ray instance that the driver starts (its workers inherit the meeting folder from our
    environment), whose workers Ray would otherwise run at niceness 15."""
    import ray

    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # Ray's workers cannot import this test module: MeetingEngine travels by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        start_and_answer(meeting, tiny_model, "ray")
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not ray.is_initialized()  # the driver stopped the instance it started


def test_replicas_are_spawned_where_the_cuda_driver_is_initialised(monkeypatch):
    """A child forked after cuInit cannot use CUDA: the CUDA driver's own answer decides (cuDeviceGetCount is
    CUDA_ERROR_NOT_INITIALIZED, 3, until cuInit has run)."""
    only_the_main_thread()

    class Libcuda:
        def __init__(self, answer: int) -> None:
            self.answer = answer

        def cuDeviceGetCount(self, count) -> int:
            return self.answer

    for answer, method in ((3, "fork"), (0, "spawn"), (100, "spawn")):
        monkeypatch.setattr(processes.ctypes, "CDLL", lambda name, answer=answer: Libcuda(answer))
        assert processes.start_method(True) == method, f"cuDeviceGetCount answered {answer}"
        assert processes.start_method(False) == "spawn"


def test_a_forked_replica_leaves_when_its_driver_dies(tiny_model):
    """A forked replica holds copies of the driver's pipe ends unless it closes them; then a killed driver would
    leave it waiting forever for work instead of reading end-of-file."""
    script = ("import sys, time\nfrom nanovllm.data_parallel import DataParallel\n"
              f"dp = DataParallel({tiny_model!r}, 2, 'mp', fork=True, **{OPTIONS!r})\n"
              "assert dp.replicas.start_method == 'fork', dp.replicas.start_method\n"
              "print(*[p.pid for p in dp.replicas.processes], flush=True)\ntime.sleep(600)\n")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        pids = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(pids) == 2, "the driver did not start its replicas"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 120
        while alive := [pid for pid in pids if is_running(pid)]:
            assert time.monotonic() < deadline, f"replicas {alive} outlived their driver by 120 s"
            time.sleep(0.1)
    finally:
        driver.kill()
        driver.wait()
        driver.stdout.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux signals (fork and SIG_IGN inheritance)")
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned"])
def test_replicas_stop_at_once_when_the_driver_ignores_ctrl_c(tiny_model, fork):
    """A driver started as a background job of a script ignores SIGINT, and so do the replicas it starts; stopping
    them after a failure (close(False)) still ends their engines at once, mid-generation, and they end by the stop
    signal once their engines are released, rather than being killed JOIN_S later."""
    script = f"""
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
from nanovllm.data_parallel import processes
from nanovllm.data_parallel.replica import DRAIN, Work
from nanovllm.sampling_params import SamplingParams
replicas = processes.ProcessReplicas(2, "nanovllm.llm:LLM", {tiny_model!r}, {OPTIONS!r}, fork={fork!r})
assert replicas.start_method == {"fork" if fork else "spawn"!r}, replicas.start_method
ready, results = set(), 0
deadline = time.monotonic() + 240
while len(ready) < 2:
    assert time.monotonic() < deadline, "the replicas did not start"
    ready |= {{r for r, (kind, _) in replicas.receive(0.2) if kind == "ready"}}
for r in range(2):
    # DRAIN: the engine has all its work and steps, rather than waiting for more
    replicas.send(r, [Work(i, [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True)) for i in range(2)] + [DRAIN])
time.sleep(1.0)  # both engines are generating now (two 400-token requests take longer than this here)
began = time.monotonic()
replicas.close(False)
print(round(time.monotonic() - began, 1), *[p.exitcode for p in replicas.processes])
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    closing, *codes = result.stdout.split()
    # -15: each released its engine, then ended by the stop signal (a replica killed JOIN_S later reads -9)
    assert float(closing) < 15 and codes == ["-15", "-15"], (f"closing took {closing} s (JOIN_S {processes.JOIN_S:g}), "
                                                         f"exit codes {codes}", result.stderr[-2000:])


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead and not yet reaped by init, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def times(began: float, laps: list[tuple[str, float]], ready: float | None = None,
          first: float | None = None) -> StartupTimes:
    t = StartupTimes(began)
    t.phases = list(laps)
    t.mark = began + sum(seconds for _, seconds in laps)
    t.ready, t.first_request = ready, first
    return t


def test_startup_laps_and_extend(monkeypatch):
    clock = iter([100.0, 101.5, 104.0, 104.5, 110.0, 110.02])
    monkeypatch.setattr(startup, "_now", lambda: next(clock))
    replica = StartupTimes()  # began at 100.0
    replica.lap("start and imports")  # 101.5
    engine = StartupTimes()  # began at 104.0: 2.5 s after the replica's lap, listed as "other"
    engine.lap("weights")  # 104.5
    engine.set_ready()  # 110.0: 5.5 s after its last lap, more than OTHER_S
    replica.extend(engine)
    replica.set_ready()  # 110.02: 0.02 s after the engine's mark, too short to list
    assert replica.phases == [("start and imports", 1.5), ("other", 2.5), ("weights", 0.5), ("other", 5.5)]
    assert replica.ready == 110.02 and replica.total() == 10.0
    assert replica.describe() == "start and imports 1.5 s, other 2.5 s, weights 0.5 s, other 5.5 s"


def test_the_startup_lines_run_batch_prints():
    engine = times(103.0, [("tokenizer", 0.5), ("CUDA graphs", 4.0)], ready=107.5, first=107.75)
    assert describe_engine(100.0, engine) == ("7.8 s to the first request (process start and imports 3.0 s, "
                                              "tokenizer 0.5 s, CUDA graphs 4.0 s, first dispatch 0.2 s)")
    driver = times(102.0, [("config", 0.25), ("replicas launched", 0.25)])
    replicas = [("replica 0", times(102.5, [("start and imports", 0.5), ("weights", 9.0)], ready=112.0), 102.6),
                ("replica 1", times(102.5, [("start and imports", 2.0)], ready=104.5), 105.0),
                ("replica 2", None, None)]
    assert describe_replicas(100.0, driver, replicas) == (
        "driver ready at 2.5 s (process start and imports 2.0 s, config 0.2 s, replicas launched 0.2 s); "
        "replica 0 took its first request at 12.0 s (start and imports 0.5 s, weights 9.0 s, first dispatch 0.0 s); "
        "replica 1 took its first request at 5.0 s (start and imports 2.0 s, first dispatch 0.5 s); "
        "replica 2 was never ready")


def test_the_startup_probe_times_every_step(tiny_model):
    """benchmarks/startup_probe.py: a row per step with its seconds and the CUDA driver's state, none failed."""
    probe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                         "startup_probe.py")
    result = subprocess.run([sys.executable, probe, "--model", tiny_model], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    steps = [row.split(" | ")[0][2:] for row in rows]
    assert steps[-8:] == ["import torch", "import triton", "import transformers", "import nanovllm.llm",
                          "import nanovllm.batch.run", "config check (checked_config)", "torch.compile(f) (no call)",
                          "count GPUs (visible_gpus)"], result.stdout
    for row in rows:
        _, seconds, initialised = row.strip("| ").split(" | ")
        assert float(seconds) >= 0 and initialised in ("True", "False"), row


# a thread running in the driver, as in a caller's process that has one: no fork is safe, replicas are spawned
NO_SAFE_FORK = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"


@pytest.mark.parametrize("backend", ["mp", pytest.param("ray", marks=needs_ray)])
def test_run_batch_launches_its_replicas_before_it_imports_the_engine(tiny_model, tmp_path, backend, monkeypatch):
    """Where replicas are Ray actors, or processes that no safe fork allows (spawned: they import everything
    themselves), the command line's first work after its file checks is their launch: in a fresh process, once
    batch/start.py's start has returned them, neither transformers nor the engine has been imported by the driver; and
    replicas stopped mid-import leave cleanly at once (an interrupt inside a replica's imports once left it hanging
    until the driver killed it, JOIN_S later: spawned replicas now hold it back as forked ones do)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "body": {"prompt": "hi", "max_tokens": 2}, "url": "/v1/completions"}\n')
    code = NO_SAFE_FORK + f"""
import sys
from nanovllm.cli import parse_args
from nanovllm.batch.start import start
from nanovllm.data_parallel.processes import JOIN_S
args = parse_args(["run-batch", "-i", {str(inp)!r}, "-o", {str(tmp_path / "out.jsonl")!r}, "--model",
                   {tiny_model!r}, "-dp", "2", "-dpb", {backend!r}])
started = start(args)
heavy = [name for name in ("transformers", "nanovllm.llm", "nanovllm.engine.llm_engine") if name in sys.modules]
replicas = started.launched.replicas
assert not heavy, f"imported before the launch: {{heavy}}"
assert len(replicas.names) == 2, replicas.names
if {backend!r} == "mp":
    assert replicas.start_method == "spawn", replicas.start_method
    alive = [process.is_alive() for process in replicas.processes]
    began = time.monotonic()
    replicas.close(False)  # at once, as after a bad option: the replicas are still importing
    closing = time.monotonic() - began
    assert alive == [True, True], alive
    assert closing < JOIN_S and [p.exitcode for p in replicas.processes] == [-15, -15], (closing, replicas.processes)
else:
    replicas.close(False)
"""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_run_batch_forks_its_replicas_after_its_imports_where_a_fork_is_safe(tiny_model, tmp_path):
    """Processes that can be forked are not launched early: run-batch forks them once it has imported the engine
    and checked the options, so they start with the imports done (each replica's "start and imports" is the fork
    alone), and they still start before the driver's tokenizer."""
    spy = """
from nanovllm.data_parallel import launch
def early(*args):
    raise AssertionError("launched before the engine's import")
launch.launch_replicas = early
"""
    result = run_cli_in_a_process(tiny_model, tmp_path, spy, *OPTION_FLAGS)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stderr.splitlines() if "driver ready at" in line)
    driver_phases = re.search(r"driver ready at [\d.]+ s \(([^)]*)\)", line).group(1)
    assert [phase.rsplit(" ", 2)[0] for phase in driver_phases.split(", ")] == [
        "process start and imports", "config", "replicas launched", "tokenizer"], line
    assert line.count("(forked pid ") == 2, line
    # one request: a replica may have had none before the run ended; one that imported torch took seconds
    imports = [float(s) for s in re.findall(r"took its first request at [\d.]+ s \(start and imports ([\d.]+) s",
                                            line)]
    assert imports and max(imports) < 1.0, line


def run_with_a_bad_option(tiny_model, tmp_path, capsys):
    """run-batch -dp 2 in this process with gpu_memory_utilization 1.5: it fails with the option's message; returns
    the output file's path (which it must not have created)."""
    from nanovllm import cli as command_line

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "body": {"prompt": "hi", "max_tokens": 2}, "url": "/v1/completions"}\n')
    out = tmp_path / "out.jsonl"
    code = command_line.main(["run-batch", "-i", str(inp), "-o", str(out), "--model", tiny_model, "-dp", "2",
                           "--gpu-memory-utilization", "1.5"])
    err = capsys.readouterr().err
    assert code == 1 and "cannot start the engine: ValueError: gpu_memory_utilization must be" in err, err
    return out


def test_a_bad_option_stops_the_replicas_launched_early(tiny_model, tmp_path, capsys, monkeypatch):
    """Options are checked by the driver after an early launch (no safe fork here): a bad one fails the run with
    its message, stops the replicas, and leaves no output file."""
    import multiprocessing

    from nanovllm.batch import start as batch_start
    from nanovllm.data_parallel import launch

    monkeypatch.setattr(batch_start, "why_not_fork", lambda: "no safe fork here")

    launched = []
    real = launch.launch_replicas
    def spy(*args):
        result = real(*args)
        launched.append(result.replicas)  # handed over and cleared by the engine later
        return result

    monkeypatch.setattr(launch, "launch_replicas", spy)

    out = run_with_a_bad_option(tiny_model, tmp_path, capsys)
    assert not out.exists()
    assert len(launched) == 1 and [p.exitcode is not None for p in launched[0].processes] == [True, True]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("nanovllm-dp-")]


def test_a_bad_option_fails_before_any_replica_where_they_are_forked(tiny_model, tmp_path, capsys, monkeypatch):
    """Where replicas are forked after the driver's imports, the options are checked before them: a bad one fails
    the run with its message and starts no replica."""
    from nanovllm.batch import start as batch_start
    from nanovllm.data_parallel import driver, launch

    started = []
    monkeypatch.setattr(batch_start, "why_not_fork", lambda: "")
    monkeypatch.setattr(launch, "launch_replicas", lambda *args: started.append("early"))
    monkeypatch.setattr(driver, "start_replicas", lambda *args, **kwargs: started.append("after the imports"))
    out = run_with_a_bad_option(tiny_model, tmp_path, capsys)
    assert started == [] and not out.exists()


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no POSIX signal masks on this platform")
def test_an_interrupt_during_the_launch_stops_the_replicas_started(tiny_model, monkeypatch):
    """Ctrl-C while replicas are being started arrives once the launch's hold ends: the replicas already started
    are stopped, not left running with nobody to feed or stop them."""
    started = []

    class Started:
        def __init__(self) -> None:
            self.killed = False

        def kill(self) -> None:
            self.killed = True

    def start(self, ctx, r, *args) -> None:
        self.processes.append(Started())
        started.append(self.processes[-1])
        if r == 0:
            os.kill(os.getpid(), signal.SIGINT)  # held back until every replica of the launch has started

    monkeypatch.setattr(processes.ProcessReplicas, "_start", start)
    with pytest.raises(KeyboardInterrupt):
        processes.ProcessReplicas(2, "nanovllm.llm:LLM", tiny_model, dict(OPTIONS))
    assert len(started) == 2 and all(process.killed for process in started)


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no POSIX signal masks on this platform")
def test_holding_interrupts_restores_the_mask_it_found():
    """The driver holds SIGINT and its stop signal back only while it starts a replica: a caller's own mask is left
    as it was."""
    def blocked() -> bool:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        assert (signal.SIGINT in mask) == (signal.SIGTERM in mask), mask  # the driver's stop signal goes with it
        return signal.SIGINT in mask

    assert not blocked()
    with processes.interrupts_held():
        assert blocked()
    assert not blocked()
    signal.pthread_sigmask(signal.SIG_BLOCK, processes.INTERRUPTS)
    try:
        with processes.interrupts_held():
            assert blocked()
        assert blocked()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, processes.INTERRUPTS)


def run_cli_in_a_process(tiny_model, tmp_path, code_before: str, *flags: str) -> subprocess.CompletedProcess:
    """`nanovllm run-batch -dp 2` on a one-request input through cli.main in a fresh process, after `code_before`."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "body": {"prompt": "hi", "max_tokens": 2}, "url": "/v1/completions"}\n')
    argv = ["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", tiny_model, "-dp", "2", *flags]
    code = code_before + f"\nimport sys\nfrom nanovllm.cli import main\nsys.exit(main({argv!r}))\n"
    # a driver left waiting on its replicas never ends: the timeout fails the test
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_the_command_line_launches_before_the_engine_import(tiny_model, tmp_path):
    """Through cli.main itself, where no fork is safe: when the launch is asked for, the driver has imported neither
    transformers nor the engine (a bad option then ends the run quickly)."""
    spy = NO_SAFE_FORK + """
import sys
from nanovllm.data_parallel import launch
real = launch.launch_replicas
def spy(*args):
    heavy = [m for m in ("transformers", "nanovllm.llm") if m in sys.modules]
    print(f"imported at the launch: {heavy}", file=sys.stderr)
    return real(*args)
launch.launch_replicas = spy
"""
    result = run_cli_in_a_process(tiny_model, tmp_path, spy, "--gpu-memory-utilization", "1.5")
    assert result.returncode == 1 and "imported at the launch: []" in result.stderr, result.stderr[-3000:]
    assert "cannot start the engine: ValueError: gpu_memory_utilization" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("failure", ["RuntimeError('boom')", "KeyboardInterrupt()"])
def test_a_failure_between_launch_and_takeover_stops_the_replicas(tiny_model, tmp_path, failure):
    """The driver fails after launching its replicas and before its engine took them over (its own import
    interrupted, say): the launched replicas are stopped and the process ends, instead of waiting on replicas that
    wait for work. An interrupt ends it with 130 and a message."""
    broken = NO_SAFE_FORK + f"""
import sys
from nanovllm.data_parallel import launch
real = launch.launch_replicas
def spy(*args):
    print("replicas launched early", file=sys.stderr)
    return real(*args)
launch.launch_replicas = spy
import nanovllm.batch.run as run_batch
def run(*args, **kwargs):
    raise {failure}
run_batch.run = run
"""
    result = run_cli_in_a_process(tiny_model, tmp_path, broken)
    if failure.startswith("KeyboardInterrupt"):
        assert result.returncode == 130 and "interrupted before any request was answered" in result.stderr, \
            result.stderr[-3000:]
    else:
        assert result.returncode == 1 and "RuntimeError: boom" in result.stderr, result.stderr[-3000:]
    assert "replicas launched early" in result.stderr and not (tmp_path / "out.jsonl").exists()


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no POSIX signal masks on this platform")
def test_the_hold_keeps_an_interrupt_another_thread_takes():
    """A process-directed SIGINT goes to any thread that does not block it, and Python raises it in the main
    thread all the same: with another thread running, a mask on the launching thread alone let it through mid-
    launch (the replicas after it never started). The hold records it and raises it once it ends."""
    code = """
import os, signal, threading, time
from nanovllm.data_parallel.processes import interrupts_held
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
order = []
try:
    with interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        order.append("held")
    order.append("not raised")
except KeyboardInterrupt:
    order.append("raised")
print(order, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "['held', 'raised'] True", done.stdout + done.stderr
