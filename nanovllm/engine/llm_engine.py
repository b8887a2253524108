import atexit
import gc
import itertools
import logging
import threading
from collections.abc import Iterable, Iterator

import torch

from nanovllm.attention import make_attention_backend
from nanovllm.engine.chat import render
from nanovllm.engine.config_checks import checked_config
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.progress import ProgressBar, TokenCounter
from nanovllm.engine.prompt_logprobs import prompt_rows
from nanovllm.engine.prompts import Prompt, broadcast_params, parse_prompt, parse_prompts
from nanovllm.engine.requests import HeldRequests, RequestBuilder
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.spawn_guard import check_main_guard
from nanovllm.engine.startup import StartupTimes, describe_engine
from nanovllm.engine.step import Step
from nanovllm.engine.tp_workers import Workers, deferred_interrupt, interrupts_deferred_in_exit
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the tokenizer, the Scheduler, the ModelRunner of rank 0 (plus tensor-parallel workers) and the step
    in flight."""

    def __init__(self, model: str, **options) -> None:
        self.startup = StartupTimes()  # where start-up goes (engine/startup.py)
        self.config = config = checked_config(model, **options)
        self.startup.lap("config")
        self.workers = None
        self._exited = True  # until there is something to release
        # everything that can be checked without the model, before any process or memory is taken
        make_attention_backend(config.attention_backend, torch.cuda.is_available()).check_block_size(
            config.kvcache_block_size)
        self.tokenizer = load_tokenizer(config.model)
        self.startup.lap("tokenizer")
        if config.tensor_parallel_size > 1:
            if torch.cuda.is_available() and torch.cuda.device_count() < config.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} exceeds the "
                                 f"{torch.cuda.device_count()} visible CUDA devices")
            check_main_guard()
            self.workers = Workers(config)
        try:
            if self.workers is None:
                self.model_runner = ModelRunner(config, startup=self.startup)
            else:
                self.workers.wait_for("started")
                self.startup.lap("tensor-parallel workers")
                self.model_runner = ModelRunner(config, 0, self.workers.store, self.workers.wait_for, self.startup)
                self.workers.open_channel()
        except BaseException as error:
            if self.workers is None:
                raise
            try:  # a peer that died mid-collective surfaces as a socket error: name the worker instead
                self.workers.check_alive(grace=1.0)
            except RuntimeError as dead:
                raise dead from error
            finally:
                self.workers.close(timeout=5)
            raise
        self.detokenizer = Detokenizer(self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self.scheduler = Scheduler(config, self.model_runner.num_kvcache_blocks)
        self.requests = RequestBuilder(config, self.tokenizer, self.model_runner.num_kvcache_blocks)
        # launched, tokens not read back yet (async scheduling: the next step is launched before it completes)
        self.in_flight: Step | None = None
        self.token_counter = TokenCounter()  # tokens prefilled and generated, counted per step (progress bars)
        self._lock = threading.Lock()  # one generate() at a time per engine
        self._lock_holder: int | None = None  # its thread: one that asks again would wait on itself forever
        self._exited = False
        atexit.register(self.exit)
        if config.seed is not None:
            # the stream requests without their own seed draw from, restarted once the model is warmed up, so the
            # same script gives the same tokens; n samples still differ
            self.model_runner.sampler.reseed(config.seed)
        self.startup.set_ready()
        logger.info("start-up %.1f s: %s", self.startup.total(), self.startup.describe())

    def exit(self) -> None:
        """Stop the workers, free the model and KV cache, and remove every shared-memory file. Idempotent."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.in_flight = None
        with interrupts_deferred_in_exit():
            try:
                if self.workers is not None:
                    self.workers.tell_exit()
                self.model_runner.exit()
            finally:
                del self.model_runner
                if self.workers is not None:
                    self.workers.close()
                self.requests.close()  # the structured-output mask worker, if one was started
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()  # so the next engine in this process sizes its KV cache from real free memory

    def describe_startup(self, origin: float | None = None) -> str:
        """Where start-up went, up to the first request (engine/startup.py); origin: when the process started."""
        return describe_engine(origin, self.startup)

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling defaults the checkpoint's generation_config.json recommends (as vLLM's), else vLLM's."""
        return SamplingParams.from_generation_config(self.config.model)

    # --- steps -------------------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """Schedule and launch one batch, then complete the batch launched before it (async scheduling: its
        tokens are read back while the device works on the new one, which hides the host's bookkeeping behind
        device time). Returns the batch and its token count (negative for decode)."""
        # a prefill overlaps the step in flight as a decode does (a request preempted while its token was in
        # flight gets that token when the step completes, before the next schedule() can admit it again)
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:  # the step only retired requests, or all that is left is in flight
            if self.in_flight is None and (reason := self.scheduler.why_stuck()):
                raise RuntimeError(f"nothing can be scheduled: {reason}")  # never spin
            self._complete(self.in_flight)
            return seqs, 0
        step = Step.of(seqs, is_prefill, self.scheduler.block_manager.take_copies(), prompt_rows(seqs, is_prefill))
        previous, self.in_flight = self.in_flight, None
        if self.workers is None:
            self.model_runner.launch(step, previous)
        else:
            self.workers.check_alive()  # a dead peer would leave rank 0 waiting in a collective
            try:
                with deferred_interrupt():
                    self.workers.launch(step)
                    self.model_runner.launch(step, previous)
            except Exception as error:
                # the workers may be waiting in a collective that rank 0 never reached: they are out of step
                # for good, so they are stopped and the engine shuts down rather than hang in the next call
                self.workers.join(timeout=0)
                self.exit()
                raise RuntimeError("a tensor-parallel step failed on rank 0; the engine has exited") from error
        self.token_counter.count(step)  # before advance, which appends the slots of the tokens it samples
        self.scheduler.advance(step)
        self._complete(previous)
        self.model_runner.finish(step)  # sampling that waited for a structured-output mask, filled meanwhile
        if self.config.async_scheduling:
            self.in_flight = step
        else:
            self._complete(step)
        return seqs, step.num_tokens if is_prefill else -len(seqs)

    def _complete(self, step: Step | None) -> None:
        """Read a launched step's tokens back and apply them: new tokens, stop conditions, finished requests."""
        if step is None:
            return
        if step is self.in_flight:
            self.in_flight = None
        if step.prompt_logprobs is not None:
            step.prompt_logprobs.attach()
        for seq, index in self.scheduler.postprocess(step, step.result()):
            if (stop := self.detokenizer.stop_string_at(seq, index)) is not None:
                self.scheduler.stop(seq, index, reason=stop)

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.in_flight is None

    def generate(self, prompts: Prompt | Iterable[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs (vLLM's RequestOutput) in input order.

        prompts: one prompt or an iterable of them; a prompt is a string, a list of token ids, or a dict with
        "prompt" (text) or "prompt_token_ids". sampling_params: one for all, one per prompt, or None (defaults).
        Every request is validated before any is queued. One engine runs one call at a time: calls from several
        threads are serialised by a lock. An exception or Ctrl-C anywhere in the call aborts all of its requests
        and frees every KV block, leaving the engine ready for the next call."""
        self._check_open()
        parsed = parse_prompts(prompts)
        params = broadcast_params(sampling_params, len(parsed))
        numbered = enumerate(zip(parsed, params))
        requests = [(i, text, self.requests.make_samples(prompt, p, i)) for i, ((text, prompt), p) in numbered]
        self.requests.check_grammars(samples for _, _, samples in requests)  # a spec that fails: before any work
        outputs = dict(self._stream(iter(requests), max(1, len(requests)), len(requests), use_tqdm))
        return [outputs[i] for i in range(len(requests))]

    def iter_generate(self, prompts: Iterable[Prompt],
                      sampling_params: SamplingParams | Iterable[SamplingParams] | None = None, *,
                      window: int | None = None, errors: str = "raise",
                      use_tqdm: bool = False) -> Iterator[tuple[int, RequestOutput | Exception]]:
        """Yield (input index, output) for each request the moment it finishes, pulling prompts (and, when
        sampling_params is an iterable, their params in step) only as far as `window` requests outstanding
        (default 2 x max_num_seqs), so host memory does not grow with the input: for a generator over a file.

        errors="yield": a request that fails validation is yielded as (index, the ValueError or TypeError) and
        the others go on; "raise": it raises, aborting the requests in flight."""
        self._check_open()
        if errors not in ("raise", "yield"):
            raise ValueError(f"errors must be 'raise' or 'yield', got {errors!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive integer, got {window!r}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = itertools.repeat(sampling_params or SamplingParams())
        requests = self._validated(prompts, sampling_params, errors == "yield")
        return self._stream(requests, window or 2 * self.config.max_num_seqs, None, use_tqdm, errors == "yield")

    def chat_prompt(self, conversation: list[dict], chat_template_kwargs: dict | None = None, *,
                    chat_template: str | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The prompt text of one conversation through the chat template (engine/chat.py)."""
        return render(self.tokenizer, conversation, chat_template, add_generation_prompt, continue_final_message,
                      chat_template_kwargs, self.config.model)

    def _check_open(self) -> None:
        if self._exited:
            raise RuntimeError("this LLM has exited (llm.exit() or its with block ended); create a new one")

    def _validated(self, prompts: Iterable[Prompt], params: Iterable[SamplingParams],
                   yield_errors: bool) -> Iterator[tuple[int, str | None, list[Sequence] | Exception]]:
        params = iter(params)
        for index, prompt in enumerate(prompts):
            # each prompt's params are pulled with it, never ahead; too few is an error, not a truncation
            p = next(params, _MISSING)
            if p is _MISSING:
                raise ValueError(f"sampling_params ran out at prompt {index}: pass one SamplingParams, or one per "
                                 f"prompt")
            try:
                text, prompt = parse_prompt(index, prompt)
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{index}] is a {type(p).__name__}, not a SamplingParams")
                yield index, text, self.requests.make_samples(prompt, p, index)
            except (ValueError, TypeError) as error:
                if not yield_errors:
                    raise
                yield index, None, error

    def _stream(self, requests: Iterator[tuple[int, str | None, list[Sequence] | Exception]], window: int,
                total: int | None, use_tqdm: bool,
                yield_errors: bool = False) -> Iterator[tuple[int, RequestOutput | Exception]]:
        """Keep up to `window` requests queued or running, step, and yield each as it finishes. A request whose
        grammar still compiles waits beside the scheduler (HeldRequests), so the running ones go on."""
        if self._lock_holder == threading.get_ident():
            raise RuntimeError("an iter_generate() of this engine is still open in this thread: exhaust it or call "
                               "its close() before the next call")
        with self._lock:
            self._lock_holder = threading.get_ident()
            bar = ProgressBar(self.token_counter, total, "Processed prompts", disable=not use_tqdm)
            outstanding: dict[int, tuple[str | None, list[Sequence]]] = {}
            held = HeldRequests()
            exhausted = False
            try:
                while True:
                    while not exhausted and len(outstanding) + len(held) < window:
                        request = next(requests, None)
                        if request is None:
                            exhausted = True
                        elif isinstance(request[2], Exception):
                            yield request[0], request[2]
                        else:
                            self.startup.took_first_request()
                            held.add(*request)
                    for index, text, samples, error in held.ready():
                        if error is not None:  # its grammar did not compile
                            if not yield_errors:
                                raise error
                            yield index, error
                            continue
                        for seq in samples:
                            self.scheduler.add(seq)
                        outstanding[index] = text, samples
                    if exhausted and not outstanding and not held and self.is_finished():
                        break
                    if not outstanding and held:
                        held.wait()
                        continue
                    self.step()
                    done = [i for i, (_, samples) in outstanding.items() if all(map(_is_done, samples))]
                    for index in done:
                        text, samples = outstanding.pop(index)
                        bar.update(1)
                        yield index, self.detokenizer.request_output(samples, text)
            except BaseException:  # an error, Ctrl-C, or the caller closing the iterator early
                self.in_flight = None
                self.scheduler.abort_all()
                raise
            finally:
                bar.close()
                self._lock_holder = None


_MISSING = object()  # sampling_params ended before the prompts


def _is_done(seq: Sequence) -> bool:
    # one finished at launch for its length still waits for the token of that step (PENDING, always its last)
    return seq.is_finished and seq.token_ids[-1] != PENDING
