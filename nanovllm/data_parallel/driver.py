"""The data-parallel driver: N engine replicas fed from one queue as they free up, results streamed back.

Feeding is dynamic: every replica holds at most `credit` requests (its engine's window of 2 x max_num_seqs
plus max_num_seqs in transit, so the engine never waits on the driver), and answers free room for more, so a
replica busy with long requests simply takes fewer (no static split that leaves the others idle at the end).
Both directions travel in batches: a replica sends whatever results finished while it sent the last ones
(sender.py), and the driver tops a replica up only once it has room for `refill` requests, in one message.

The driver keeps the table of what each replica holds; when one dies its unanswered requests go back to the
front of the queue for the others, and an answer counts only while its replica still holds the request, so each
is yielded exactly once. Every wait is bounded (POLL_S), and liveness is checked on each turn.
"""
import itertools
import time
import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from nanovllm.config import DATA_PARALLEL_BACKENDS
from nanovllm.engine.config_checks import checked_config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.prompts import Prompt
from nanovllm.engine.startup import StartupTimes, describe_replicas
from nanovllm.llm import LLM
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import load_tokenizer

from .launch import LaunchedReplicas, launched_phase, start_replicas
from .replica import DRAIN, Work

BACKENDS = DATA_PARALLEL_BACKENDS
POLL_S = 0.2  # the longest the driver waits for answers before it looks at liveness and its queue again
# a replica not ready this long after its launch counts as lost (a process stuck for good in its start-up is alive,
# and would be waited for forever): imports, weights, compiles and CUDA graphs take minutes at most
STARTUP_S = 900.0


class ReplicasLost(RuntimeError):
    """Every replica died; the requests they held are unanswered (a resumable run-batch picks them up)."""


@dataclass
class Held:
    """What the driver knows of one replica."""

    name: str
    requests: dict[int, Work] = field(default_factory=dict)  # sent and not answered yet
    drained: bool = True  # told DRAIN since its last work
    alive: bool = True
    answered: int = 0
    fate: str = ""  # why it is gone
    startup: StartupTimes | None = None  # its start-up, as it reported it once ready
    first_sent: float | None = None  # when it was first sent work


class DataParallel:
    """N replicas of LLM(model, **engine_options), each on its own tensor_parallel_size GPUs (or on CPU), in
    processes of this host (backend "mp") or as Ray actors (backend "ray"). iter_generate() is LLM's, spread
    over them. Duck-types the parts of LLM that run-batch uses (config, tokenizer, chat_prompt,
    get_default_sampling_params, describe_startup), all from the driver's own tokenizer and config: the driver
    loads no model. fork (backend "mp"): the caller allows replicas to be forked from this process rather than
    spawned, so that they skip their imports; it is done only where safe (processes.py), and a caller whose
    process runs native threads that do not survive a fork (a gRPC client, Ray's) must not allow it. launched:
    replicas the caller started before it imported the engine (launch.py), taken over instead of starting them."""

    chat_prompt = LLMEngine.chat_prompt  # they read only self.tokenizer and self.config
    get_default_sampling_params = LLMEngine.get_default_sampling_params

    def __init__(self, model: str, data_parallel_size: int, backend: str = "mp", *, engine_class: type = LLM,
                 fork: bool = False, launched: "LaunchedReplicas | None" = None, **engine_options) -> None:
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"data-parallel backend must be one of {BACKENDS}, got {backend!r}")
        self._clean = False  # until a run ends well, exit() interrupts the replicas
        self.launched_at = time.monotonic()  # for STARTUP_S
        if launched is not None:  # started by the caller before it imported the engine (launch.py)
            self.startup, self.replicas = launched.startup, launched.take()
            self.startup.lap("imports")
        else:
            self.startup = StartupTimes()
        try:  # options are checked here, once, rather than failing in every replica
            self.config = checked_config(model, **engine_options)
        except BaseException:
            self.exit()
            raise
        self.startup.lap("config")
        self.credit = 3 * self.config.max_num_seqs
        # a replica waits for a refill until it has room for this many, so requests travel in batches; it still
        # holds more than 7/8 of its credit, more than its engine's window of 2 x max_num_seqs
        self.refill = max(1, self.credit // 8)
        if launched is None:  # every replica at once, before the driver's own tokenizer: they all start meanwhile
            self.launched_at = time.monotonic()
            self.replicas = start_replicas(backend, data_parallel_size, engine_class, model, engine_options, fork)
            self.startup.lap(launched_phase(self.replicas, backend))
        self.held = [Held(name) for name in self.replicas.names]
        try:
            self.tokenizer = load_tokenizer(self.config.model)
        except BaseException:
            self.exit()
            raise
        self.startup.lap("tokenizer")

    @property
    def answered(self) -> list[int]:
        """How many requests each replica has answered so far."""
        return [h.answered for h in self.held]

    def iter_generate(self, prompts: Iterable[Prompt],
                      sampling_params: SamplingParams | Iterable[SamplingParams] | None = None, *,
                      errors: str = "raise") -> Iterator[tuple[int, RequestOutput | Exception]]:
        """Yield (input index, output) as each request finishes on any replica, pulling prompts (and their
        params, in step) only as far as the replicas have room. errors: as LLM.iter_generate. Raises
        ReplicasLost when no replica is left."""
        if errors not in ("raise", "yield"):
            raise ValueError(f"errors must be 'raise' or 'yield', got {errors!r}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = itertools.repeat(sampling_params or SamplingParams())
        for index, output in self._run(_requests(prompts, sampling_params)):
            if isinstance(output, Exception) and errors == "raise":
                raise output
            yield index, output

    def _run(self, requests: Iterator[Work]) -> Iterator[tuple[int, RequestOutput | Exception]]:
        retry: deque[Work] = deque()  # a dead replica's requests, handed out before new ones
        exhausted = self._feed(requests, retry, False)
        while not exhausted or retry or any(h.requests for h in self.held):
            answers = self._collect(retry)
            # refilled before the caller handles these answers (formats, writes): the replicas work meanwhile
            exhausted = self._feed(requests, retry, exhausted)
            for r, index, output in answers:
                self.held[r].answered += 1
                yield index, output
            if not any(h.alive for h in self.held):  # raised only now: what came in before is handed on
                raise ReplicasLost("every data-parallel replica is gone: " +
                                   "; ".join(f"{h.name}: {h.fate}" for h in self.held) +
                                   f"; {len(retry)} requests they held are unanswered")
        self._clean = True

    def _collect(self, retry: deque[Work]) -> list[tuple[int, int, RequestOutput | Exception]]:
        """(replica, index, output) for each answer that came within POLL_S from a replica that still holds its
        request (taken off its table); the requests of replicas that stopped go to `retry`."""
        answers = []
        for r, (kind, payload) in self.replicas.receive(POLL_S):
            held = self.held[r]
            if not held.alive:
                continue
            if kind == "results":  # an answer whose request was handed to another already is dropped
                answers += [(r, index, output) for index, output in payload
                            if held.requests.pop(index, None) is not None]
            elif kind == "ready":  # where it runs (a Ray actor's host is known only now), and its start-up
                host, held.startup = payload
                held.name = held.name[:-1] + f", on {host})"
            else:  # "error": the replica stops; its engine's last words name the cause
                self.replicas.kill(r)
                self._lose(r, payload, retry)
        for r, reason in self.replicas.lost().items():
            if self.held[r].alive:
                self._lose(r, reason, retry)
        if time.monotonic() - self.launched_at > STARTUP_S:
            for r, held in enumerate(self.held):
                if held.alive and held.startup is None:  # stopped at once: one stuck may not answer a stop
                    self.replicas.kill(r)
                    self._lose(r, f"not ready {STARTUP_S:g} s after its launch (driver.STARTUP_S); stopped", retry)
        return answers

    def _feed(self, requests: Iterator[Work], retry: deque[Work], exhausted: bool) -> bool:
        """Top up to its credit every live replica with room for `refill` requests, one request at a time to the
        least loaded of them (so that a short input is shared out evenly); DRAIN the ones that hold work once
        nothing is left to hand out. Returns whether the input is exhausted."""
        batches: dict[int, list] = {}
        due = [r for r, held in enumerate(self.held) if held.alive and self.credit - len(held.requests) >= self.refill]
        while due:
            r = min(due, key=lambda r: len(self.held[r].requests))
            held = self.held[r]
            if len(held.requests) >= self.credit:
                break
            work = retry.popleft() if retry else None if exhausted else next(requests, None)
            if work is None:
                exhausted = True
                break
            held.requests[work.index] = work
            batches.setdefault(r, []).append(work)
        if exhausted and not retry:  # a session ends only once nothing is left for it
            for r, held in enumerate(self.held):
                if held.alive and not held.drained:
                    batches.setdefault(r, []).append(DRAIN)
        for r, items in batches.items():
            held = self.held[r]
            held.drained = items[-1] == DRAIN
            if held.first_sent is None:
                held.first_sent = time.time()
            self.replicas.send(r, items)
        return exhausted

    def _lose(self, r: int, reason: str, retry: deque[Work]) -> None:
        held = self.held[r]
        held.alive, held.fate = False, reason
        lost = sorted(held.requests.values(), key=lambda work: work.index)
        held.requests = {}
        retry.extendleft(reversed(lost))
        left = sum(h.alive for h in self.held)
        warnings.warn(f"data-parallel {held.name} is gone ({reason}); its {len(lost)} unfinished requests go to "
                      f"the {left} replica(s) left", RuntimeWarning, stacklevel=2)

    def describe_startup(self, origin: float | None = None) -> str:
        """Where start-up went: the driver's phases, then when each replica took its first request and its phases
        (engine/startup.py); origin: when the driver's process started (else when this object was made)."""
        return describe_replicas(self.startup.began if origin is None else origin, self.startup,
                                 [(held.name, held.startup, held.first_sent) for held in self.held])

    def exit(self) -> None:
        """Stop the replicas (a clean stop lets engines release their memory; otherwise they are interrupted)."""
        if getattr(self, "replicas", None) is not None:
            replicas, self.replicas = self.replicas, None
            replicas.close(self._clean)

    def __enter__(self) -> "DataParallel":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()


def _requests(prompts: Iterable[Prompt], params: Iterable[SamplingParams]) -> Iterator[Work]:
    params = iter(params)
    for index, prompt in enumerate(prompts):
        p = next(params, None)  # pulled with its prompt, never ahead, as run-batch's RequestSource needs
        if p is None:
            raise ValueError(f"sampling_params ran out at prompt {index}: pass one SamplingParams, or one per prompt")
        yield Work(index, prompt, p)


def iter_generate(model: str, prompts: Iterable[Prompt],
                  sampling_params: SamplingParams | Iterable[SamplingParams] | None = None, *,
                  data_parallel_size: int, backend: str = "mp", errors: str = "raise",
                  **engine_options) -> Iterator[tuple[int, RequestOutput | Exception]]:
    """LLM(model, **engine_options).iter_generate(prompts, sampling_params) over `data_parallel_size`
    replicas: yields (input index, output) as each request finishes, in finishing order."""
    with DataParallel(model, data_parallel_size, backend, **engine_options) as dp:
        yield from dp.iter_generate(prompts, sampling_params, errors=errors)
