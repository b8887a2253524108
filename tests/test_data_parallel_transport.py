"""Data parallelism's transport on CPU: results and refills travel in batches over an in-process transport
(each replica a thread running the real serve()), an engine failing mid-batch leaves each request answered once,
a replica sends every result before it stops, and the benchmark's steady-state rate."""
import importlib.util
import os
import queue
import threading
import time

import pytest
from test_data_parallel import GREEDY, prompts

from nanovllm.data_parallel import DataParallel, processes
from nanovllm.data_parallel.replica import STOP, Work, serve
from nanovllm.data_parallel.sender import Sender, batch_results


class QuickEngine:
    """Answers each request (with its prompt) 1 ms after pulling it: results come one at a time, as from an
    engine's steps. The engine of the thread named "replica-0" fails after `fail_after` answers, if set."""

    fail_after: int | None = None

    def __init__(self, model: str, **options) -> None:
        pass

    def __enter__(self) -> "QuickEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        pass

    def iter_generate(self, prompts, params, errors="yield"):
        for local, (prompt, _params) in enumerate(zip(prompts, params)):
            if local == self.fail_after and threading.current_thread().name == "replica-0":
                raise RuntimeError("engine 0 failed")
            time.sleep(0.001)
            yield local, prompt


class Loopback:
    """The driver's transport with each replica a thread of this process running the real serve(); it records
    the messages both ways, and each replica's message takes SEND_S to go, as a pickle and a pipe write do."""

    SEND_S = 0.01

    def __init__(self, replicas: int, engine_class: type, model: str, options: dict) -> None:
        self.names = [f"replica {r} (thread)" for r in range(replicas)]
        self.inboxes = [queue.Queue() for _ in range(replicas)]
        self.outbox: queue.Queue = queue.Queue()
        self.sent: list[list] = []  # the driver's messages
        self.received: list[tuple] = []  # the replicas' messages
        self.dead: set[int] = set()
        self.threads = [threading.Thread(target=self._serve, args=(r, engine_class, model, options),
                                         name=f"replica-{r}", daemon=True) for r in range(replicas)]
        for thread in self.threads:
            thread.start()

    def _serve(self, r: int, engine_class: type, model: str, options: dict) -> None:
        def send(message: tuple) -> None:
            time.sleep(self.SEND_S)
            self.outbox.put((r, message))

        try:
            serve(lambda: engine_class(model, **options), self.inboxes[r], send)
        except RuntimeError:  # serve has sent the error
            pass

    def send(self, r: int, items: list) -> None:
        self.sent.append(items)
        for item in items:
            self.inboxes[r].put(item)

    def receive(self, timeout: float) -> list[tuple[int, tuple]]:
        try:
            messages = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self.outbox.empty():
            messages.append(self.outbox.get())
        messages = [(r, message) for r, message in messages if r not in self.dead]
        self.received += [message for _, message in messages]
        return messages

    def lost(self) -> dict[int, str]:
        return {}

    def kill(self, r: int) -> None:
        self.dead.add(r)

    def close(self, clean: bool) -> None:
        for inbox in self.inboxes:
            inbox.put(STOP)
        for thread in self.threads:
            thread.join(timeout=10)


def run_quick(tiny_model: str, n: int) -> Loopback:
    """n requests through 2 QuickEngine replicas over the Loopback (credit 24, refill 3); checks each answer."""
    with DataParallel(tiny_model, 2, "mp", engine_class=QuickEngine, max_model_len=512, max_num_seqs=8) as dp:
        answers = list(dp.iter_generate(prompts(n), GREEDY))
        transport = dp.replicas
    assert sorted(index for index, _ in answers) == list(range(n))  # each once
    assert all(answer == prompts(n)[index] for index, answer in answers)
    return transport


def test_results_travel_in_batches(tiny_model, monkeypatch):
    monkeypatch.setattr(processes, "ProcessReplicas", Loopback)
    transport = run_quick(tiny_model, 120)
    results = [payload for kind, payload in transport.received if kind == "results"]
    assert sum(map(len, results)) == 120
    # a result every ms, 10 ms per message: one message per result would be 120
    assert len(results) <= 120 // 4, f"{len(results)} messages carried 120 results"


def test_refills_travel_in_batches(tiny_model, monkeypatch):
    monkeypatch.setattr(processes, "ProcessReplicas", Loopback)
    monkeypatch.setattr(Loopback, "SEND_S", 0.0)  # results then come back one at a time
    transport = run_quick(tiny_model, 120)
    refills = [items for items in transport.sent if any(isinstance(item, Work) for item in items)]
    # topping a replica up after every answer would take ~72 messages after the first two fills of 24
    assert len(refills) <= 120 // 3, f"{len(refills)} messages carried 120 requests"


def test_an_engine_failing_mid_batch_leaves_each_request_answered_once(tiny_model, monkeypatch):
    monkeypatch.setattr(processes, "ProcessReplicas", Loopback)
    monkeypatch.setattr(QuickEngine, "fail_after", 5)
    with DataParallel(tiny_model, 2, "mp", engine_class=QuickEngine, max_model_len=512, max_num_seqs=8) as dp:
        with pytest.warns(RuntimeWarning, match=r"replica 0 .* \(generation failed: RuntimeError: engine 0 failed\)"):
            answers = list(dp.iter_generate(prompts(60), GREEDY))
        assert dp.answered[0] == 5 and not dp.held[0].alive  # its answers before the error count, once
    assert sorted(index for index, _ in answers) == list(range(60))


def test_a_replica_sends_every_result_before_it_stops():
    inbox: queue.Queue = queue.Queue()
    for i in range(30):
        inbox.put(Work(i, [i], GREEDY))
    inbox.put(STOP)  # straight after the work: serve returns only once all of it has been sent
    sent: list[tuple] = []

    def slow_send(message: tuple) -> None:
        time.sleep(0.01)
        sent.append(message)

    serve(lambda: QuickEngine("model"), inbox, slow_send)
    assert sent[0][0] == "ready" and all(kind == "results" for kind, _ in sent[1:])
    assert [index for _, batch in sent[1:] for index, _ in batch] == list(range(30))
    assert len(sent) - 1 <= 10, f"{len(sent) - 1} messages carried 30 results"


def test_batch_results_keeps_the_order_of_messages():
    messages = [("ready", "host"), ("result", (3, "a")), ("result", (1, "b")), ("error", "why"), ("result", (2, "c"))]
    assert batch_results(messages) == [("ready", "host"), ("results", [(3, "a"), (1, "b")]), ("error", "why"),
                                       ("results", [(2, "c")])]


def test_a_sender_whose_driver_is_gone_raises_on_the_next_put():
    def broken(message: tuple) -> None:
        raise BrokenPipeError("the driver is gone")

    sender = Sender(broken)
    sender.put(("ready", "host"))
    sender.close()  # the thread has stopped at the failure
    with pytest.raises(BrokenPipeError):
        sender.put(("result", (0, "a")))


def load_benchmark():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "data_parallel.py")
    spec = importlib.util.spec_from_file_location("data_parallel_benchmark", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_the_benchmarks_steady_rate_starts_at_2_percent_of_the_lines():
    benchmark = load_benchmark()
    # 2% of 150 lines is 3: from (1.0 s, 3 lines) to (5.0 s, 150 lines), the early second and its line left out
    samples = [(0.0, 1), (1.0, 3), (2.5, 60), (5.0, 150)]
    assert benchmark.steady_rate(samples, 150) == (150 - 3) / (5.0 - 1.0)
    assert benchmark.steady_rate([(0.0, 2), (2.0, 10), (4.0, 100)], 100) == (100 - 2) / 4.0  # 2 lines are 2%
    with pytest.raises(ValueError, match="no interval"):
        benchmark.steady_rate([(0.0, 1), (3.0, 100)], 100)  # 2% exist only at the end


def test_the_benchmark_compares_runs_within_a_round_and_medians_across_rounds():
    gpu = load_benchmark().data_parallel_gpu

    def run(config, steady, wall, round_):
        return gpu.Run(config, "seeded", 1000, steady, 1.0, wall, wall + 1, "", "", round_)

    runs = [run("dp1", 100, 80.0, 1), run("mp", 190, 50.0, 1), run("dp1", 120, 70.0, 2), run("mp", 180, 40.0, 2),
            run("dp1", 110, 75.0, 3), run("mp", 200, 45.0, 3)]
    rows = gpu.table(runs).splitlines()
    # each DP=2 run against the DP=1 run of its own round
    assert "| DP=2, processes, round 2 | seeded | 180 (1.50x) | 1.0 s | 40.0 s (1.75x) |" in rows[5]
    medians = gpu.medians(runs).splitlines()
    assert medians[2] == "| DP=1 | seeded | 3 | 110 | 75.0 s |"
    assert medians[3] == "| DP=2, processes | seeded | 3 | 190 (1.73x) | 45.0 s (1.67x) |"
    assert gpu.medians(runs[:2]) == ""  # one round: nothing to take a median of
    assert "Medians over the rounds" in gpu.summary(runs, [], []) and "Medians" not in gpu.summary(runs[:2], [], [])
