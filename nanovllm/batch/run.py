"""The run-batch command's work: OpenAI batch-format requests through the engine. The command line is cli.py,
which imports this module (at the engine's turn, once the files are checked); nothing here imports cli.py back."""
import argparse
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nanovllm.batch import io as batch_io
from nanovllm.batch.flags import engine_options
from nanovllm.batch.io import Done, LineError
from nanovllm.batch.output import OutputWriter, WriteFailed
from nanovllm.batch.requests import CHAT, COMPLETIONS, check_fields, prompt_of, sampling_params
from nanovllm.batch.start import BatchStart, check_files, fail, say, serial, sigterm_as_interrupt
from nanovllm.data_parallel import DataParallel, ReplicasLost
from nanovllm.engine.progress import ProgressBar, TokenCounter
from nanovllm.engine.startup import process_started
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams


@dataclass
class Pending:
    """What writing one request's result needs once it finishes; held only while it is in flight."""

    custom_id: str
    line: int
    chat: bool
    top_logprobs: int | None  # chat: how many alternatives to list per token


@dataclass
class Stats:
    succeeded: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    per_replica: list[int] | None = None  # data parallel: requests each replica answered


class RequestSource:
    """Turns input lines into (prompt, params) for iter_generate, writing error records for bad lines itself.

    iter_generate takes prompts and params as two iterables pulled in step, so prompts() queues each request's
    params for params() to hand over next, and remembers what writing its result needs under its input index."""

    def __init__(self, path: str, done: Done, llm: LLM, on_error: Callable[[dict], None]) -> None:
        self.path, self.done, self.llm, self.on_error = path, done, llm, on_error
        self.pending: dict[int, Pending] = {}
        self._params: deque[SamplingParams] = deque()
        gen = llm.get_default_sampling_params()  # vLLM's defaults: the checkpoint's generation_config.json
        self.defaults = {name: getattr(gen, name) for name in ("temperature", "top_k", "top_p", "min_p",
                                                               "repetition_penalty")}

    def prompts(self) -> Iterator[dict]:
        index = 0
        for line, raw in batch_io.input_lines(self.path):
            custom_id = None
            try:
                request = batch_io.parse_line(raw)
                custom_id = request["custom_id"]
                if self.done.has(custom_id, line):
                    continue
                prompt, params, pending = self._request(request, custom_id, line)
            except LineError as error:
                if not self.done.has(custom_id, line):
                    self.on_error(batch_io.error_record(custom_id, line, error.code, error.message))
                continue
            self.pending[index] = pending
            self._params.append(params)
            index += 1
            yield prompt

    def params(self) -> Iterator[SamplingParams]:
        while True:
            if not self._params:
                raise RuntimeError("iter_generate pulled params ahead of their prompt")
            yield self._params.popleft()

    def _request(self, request: dict, custom_id: str, line: int) -> tuple[dict, SamplingParams, Pending]:
        if request.get("method", "POST") != "POST":
            raise LineError("invalid_request", f"method must be POST, got {request.get('method')!r}")
        url, body = request.get("url"), request.get("body")
        if url not in (COMPLETIONS, CHAT):
            raise LineError("invalid_url", f"url {url!r} is not supported; use {COMPLETIONS} or {CHAT}")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "the request has no body object")
        check_fields(body, url)
        text, token_ids = prompt_of(body, url, self.llm)
        limit = self.llm.config.max_model_len
        if len(token_ids) >= limit:
            raise LineError("prompt_too_long", f"prompt of {len(token_ids)} tokens is not shorter than "
                                               f"max_model_len={limit}, so no token could be generated")
        params = sampling_params(body, url, self.defaults, limit, len(token_ids))
        prompt = {"prompt_token_ids": token_ids} if text is None else {"prompt": text, "prompt_token_ids": token_ids}
        return prompt, params, Pending(custom_id, line, url == CHAT, params.logprobs if url == CHAT else None)


def run(args: argparse.Namespace, llm: LLM | None = None, engine_class: type = LLM,
        started: BatchStart | None = None) -> int:
    """The run-batch command. llm: an open engine to use instead of loading args.model (left open); engine_class:
    what each replica runs (benchmarks/data_parallel.py passes one that answers instantly); started: the files'
    checks done, and replicas perhaps launched, before the engine was imported (start.py, as cli.main does).

    Exit codes: 0 done, 1 failed (nothing of an output that could not start is created or changed), 2 a usage
    error found before any work, 130 interrupted."""
    started = started or check_files(args)
    if isinstance(started, int):
        return started
    try:
        with sigterm_as_interrupt():
            return _run(args, llm, engine_class, started)
    finally:  # the lock goes, and the output too where this run created it and wrote nothing
        started.output.release()


def _run(args: argparse.Namespace, llm: LLM | None, engine_class: type, started: BatchStart) -> int:
    done, todo, launched = started.done, started.todo, started.launched
    stats = Stats(skipped=started.skipped)
    engine = None
    if todo:  # nothing left: no model to load
        try:  # one engine here, or a driver that feeds replicas (it holds only the tokenizer and config)
            # fork=True: this process runs nothing that a fork would break, so replicas may skip their imports
            engine = llm or (LLM(args.model, **engine_options(args)) if serial(args) and engine_class is LLM
                             else DataParallel(args.model, args.data_parallel_size, args.data_parallel_backend,
                                               engine_class=engine_class, fork=True, launched=launched,
                                               **engine_options(args)))
        except (OSError, ValueError, TypeError, ImportError) as error:  # options, checkpoint, devices, ray
            return fail(f"cannot start the engine: {type(error).__name__}: {error}")
    if done.torn is not None:  # only now that work can start: a run that cannot start leaves the file as it was
        batch_io.drop_torn(args.output_file, done.torn)
        torn = done.torn
        say(f"{args.output_file}: dropped its last line, line {torn.line} ({torn.size} bytes): a record an "
            f"interrupted run did not finish writing")
    if engine is not None:
        try:
            with OutputWriter(started.output) as out:
                try:
                    _generate(args, engine, out, done, todo, stats)
                except KeyboardInterrupt:  # every finished result is on disk already
                    return fail(f"interrupted after {stats.succeeded + stats.failed} of {todo} requests; run the "
                                f"same command again to resume", code=130)
                except ReplicasLost as error:  # as above: what was answered is on disk
                    return fail(f"{error}; {stats.succeeded + stats.failed} of {todo} requests were answered; "
                                f"run the same command again to resume")
                finally:
                    if llm is None:
                        engine.exit()
        except WriteFailed as error:  # the records before it are whole; a torn one is dropped by the next run
            return fail(f"{error}; free some space (or fix the error) and run the same command again to resume: "
                        f"it answers only the requests not yet in the output")
        if isinstance(engine, DataParallel):
            stats.per_replica = engine.answered
        if llm is None:  # where this process's start-up went, up to the first request (engine/startup.py)
            say(f"start-up: {engine.describe_startup(process_started())}")
    print(f"nanovllm run-batch: {stats.succeeded} succeeded, {stats.failed} failed, {stats.skipped} skipped "
          f"(already done); {stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated tokens; "
          f"{time.perf_counter() - started.began:.1f} s"
          + (f"; per replica: {stats.per_replica}" if stats.per_replica else ""), file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace, llm: LLM, out: OutputWriter, done: Done, todo: int,
              stats: Stats) -> None:
    # the engine counts its tokens at every step, so the rates move before the first request finishes; replicas
    # of data parallelism count in their own processes, so there the driver counts finished requests instead
    counter = getattr(llm, "token_counter", None)
    per_request = counter is None
    counter = counter or TokenCounter()
    with ProgressBar(counter, todo, "run-batch", unit="req") as bar:
        def finish(record: dict) -> None:
            out.write(record)
            bar.update(1)

        def line_error(record: dict) -> None:
            stats.failed += 1
            finish(record)

        source = RequestSource(args.input_file, done, llm, line_error)
        for index, result in llm.iter_generate(source.prompts(), source.params(), errors="yield"):
            pending = source.pending.pop(index)
            if isinstance(result, Exception):  # the engine's own checks: vocabulary, max_logprobs, KV cache size
                line_error(batch_io.error_record(pending.custom_id, pending.line, "invalid_request", str(result)))
                continue
            stats.succeeded += 1
            prompt_tokens = len(result.prompt_token_ids)
            generated_tokens = sum(len(c.token_ids) for c in result.outputs)
            stats.prompt_tokens += prompt_tokens
            stats.generated_tokens += generated_tokens
            if per_request:
                counter.add(prompt_tokens, generated_tokens)
            body = batch_io.response_body(result, pending.chat, args.model, pending.top_logprobs)
            finish(batch_io.success_record(pending.custom_id, body))

