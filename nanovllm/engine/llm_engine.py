import atexit
import gc
import json
import os
import threading
from collections.abc import Iterable
from time import perf_counter

import torch
from tqdm.auto import tqdm

from nanovllm.attention import make_attention_backend
from nanovllm.config import Config
from nanovllm.engine.detokenizer import Detokenizer
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.prompts import Prompt, broadcast_params, parse_prompts, samples_of
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step import Step
from nanovllm.engine.tp_workers import Workers, deferred_interrupt
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.tokenizer import load_tokenizer


class LLMEngine:
    """Owns the tokenizer, the Scheduler, the ModelRunner of rank 0 (plus tensor-parallel workers) and the step
    in flight."""

    def __init__(self, model: str, **options) -> None:
        config = Config.from_options(model, **options)
        self.config = config
        self.workers = None
        self._exited = True  # until there is something to release
        # everything that can be checked without the model, before any process or memory is taken
        make_attention_backend(config.attention_backend, torch.cuda.is_available()).check_block_size(
            config.kvcache_block_size)
        self.tokenizer = load_tokenizer(config.model)
        if config.tensor_parallel_size > 1:
            if torch.cuda.is_available() and torch.cuda.device_count() < config.tensor_parallel_size:
                raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} exceeds the "
                                 f"{torch.cuda.device_count()} visible CUDA devices")
            self.workers = Workers(config)
        try:
            if self.workers is None:
                self.model_runner = ModelRunner(config)
            else:
                self.workers.wait_for("started")
                self.model_runner = ModelRunner(config, 0, self.workers.store, self.workers.wait_for)
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
        # launched, tokens not read back yet (async scheduling: the next step is launched before it completes)
        self.in_flight: Step | None = None
        self._lock = threading.Lock()  # one generate() at a time per engine
        self._exited = False
        atexit.register(self.exit)

    def exit(self) -> None:
        """Stop the workers, free the model and KV cache, and remove every shared-memory file. Idempotent."""
        if self._exited:
            return
        self._exited = True
        atexit.unregister(self.exit)
        self.in_flight = None
        try:
            if self.workers is not None:
                self.workers.tell_exit()
            self.model_runner.exit()
        finally:
            del self.model_runner
            if self.workers is not None:
                self.workers.close()
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()  # so the next engine in this process sizes its KV cache from real free memory

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling defaults the checkpoint's generation_config.json recommends (as vLLM's), else vLLM's."""
        path = os.path.join(self.config.model, "generation_config.json")
        if not os.path.exists(path):
            return SamplingParams()
        with open(path) as f:
            generation = json.load(f)
        names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
        return SamplingParams(**{ours: generation[theirs] for theirs, ours in names.items() if theirs in generation})

    # --- requests ----------------------------------------------------------------------------------------
    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the fields that index this model's vocabulary."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids holds {bad[0]}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        limit = min(self.config.max_logprobs, self.vocab_size)
        if params.logprobs is not None and params.logprobs > limit:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds {limit}: the engine option "
                             f"max_logprobs={self.config.max_logprobs} and the vocabulary size {self.vocab_size}")

    def make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; raises ValueError before anything is scheduled."""
        self.check_params(params)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError(f"empty prompt {prompt!r}: at least one token is needed")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens is not shorter than max_model_len="
                             f"{self.config.max_model_len}, so no token could be generated")
        seq = Sequence(token_ids, params, self.config.kvcache_block_size)
        num_blocks = self.scheduler.block_manager.num_blocks
        if seq.num_blocks > num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens needs {seq.num_blocks} KV blocks but the cache "
                             f"holds only {num_blocks} blocks of {self.config.kvcache_block_size} tokens")
        return seq

    # --- steps -------------------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        """Schedule and launch one batch, then complete the batch launched before it (async scheduling: its
        tokens are read back while the device works on the new one, which hides the host's bookkeeping behind
        device time). Returns the batch and its token count (negative for decode)."""
        # A prefill overlaps with the step in flight as a decode does: it feeds known prompt tokens (a request
        # preempted while its token was in flight gets that token when the step completes, which is before the
        # next schedule() can admit it again).
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:  # the step only retired requests, or all that is left is in flight
            if self.in_flight is None and (reason := self.scheduler.why_stuck()):
                raise RuntimeError(f"nothing can be scheduled: {reason}")  # never spin
            self._complete(self.in_flight)
            return seqs, 0
        step = Step.of(seqs, is_prefill)
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
        self.scheduler.advance(step)
        self._complete(previous)
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
        if self._exited:
            raise RuntimeError("this LLM has exited (llm.exit() or its with block ended); create a new one")
        parsed = parse_prompts(prompts)
        params = broadcast_params(sampling_params, len(parsed))
        if not parsed:
            return []
        with self._lock:
            # n samples of one prompt are n requests; identical prompts in one batch share their full blocks
            seqs = [self.make_sequence(prompt, sample) for (_, prompt), p in zip(parsed, params)
                    for sample in samples_of(p)]
            bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
            try:
                for seq in seqs:
                    self.scheduler.add(seq)
                self._run(seqs, bar)
            except BaseException:
                self.in_flight = None
                self.scheduler.abort_all()
                raise
            finally:
                bar.close()
        outputs, first = [], 0
        for (text, _), p in zip(parsed, params):
            outputs.append(self._output(seqs[first: first + p.n], text))
            first += p.n
        return outputs

    def _run(self, seqs: list[Sequence], bar: tqdm) -> None:
        prefill_throughput = decode_throughput = 0.0
        done = 0
        while not self.is_finished():
            start = perf_counter()
            _, num_tokens = self.step()
            elapsed = perf_counter() - start
            if num_tokens > 0:
                prefill_throughput = num_tokens / elapsed
            elif num_tokens < 0:
                decode_throughput = -num_tokens / elapsed
            finished = sum(seq.is_finished for seq in seqs)
            bar.update(finished - done)
            done = finished
            bar.set_postfix(prefill=f"{prefill_throughput:.0f}tok/s", decode=f"{decode_throughput:.0f}tok/s")

    def _output(self, samples: list[Sequence], prompt: str | None) -> RequestOutput:
        completions = [self._completion(index, seq) for index, seq in enumerate(samples)]
        first = samples[0]
        return RequestOutput(str(first.seq_id), prompt, first.token_ids[: first.num_prompt_tokens], completions)

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        logprobs = cumulative = None
        if seq.params.logprobs is not None:
            logprobs = seq.logprobs
            for position in logprobs:
                for token_id, entry in position.items():
                    entry.decoded_token = self.detokenizer.token_text(token_id)
            cumulative = sum(position[token].logprob for position, token in zip(logprobs, seq.completion_token_ids))
        return CompletionOutput(index, self.detokenizer.output_text(seq), seq.completion_token_ids, cumulative,
                                logprobs, seq.finish_reason, seq.stop_reason)
