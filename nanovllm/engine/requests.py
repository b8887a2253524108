"""One prompt and its SamplingParams -> validated Sequences, before anything is scheduled."""
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass, field, replace

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.prompts import samples_of
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.bad_words import bad_words_token_ids
from nanovllm.sampling.grammar import GrammarCompiler, GrammarState
from nanovllm.sampling.mask_process import MaskProcess
from nanovllm.sampling_params import SamplingParams


@dataclass
class RequestBuilder:
    config: Config
    tokenizer: PreTrainedTokenizerBase
    num_blocks: int  # of the KV cache: a prompt that needs more can never run
    grammars: GrammarCompiler | None = field(default=None, init=False)  # made at the first constrained request

    @property
    def vocab_size(self) -> int:
        return self.config.hf_config.vocab_size

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the fields that index this model's vocabulary."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids holds {bad[0]}, outside the vocabulary "
                             f"[0, {self.vocab_size})")
        limit = min(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > limit:
                raise ValueError(f"SamplingParams.{name}={k} exceeds {limit}: the engine option "
                                 f"max_logprobs={self.config.max_logprobs} and the vocabulary size {self.vocab_size}")

    def make_sequence(self, prompt: str | list[int], params: SamplingParams, index: int | None = None) -> Sequence:
        """Tokenize and validate one request; raises ValueError before anything is scheduled. index: the prompt's
        position in the caller's input, named in errors."""
        which = "prompt" if index is None else f"prompt {index}"
        self.check_params(params)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not token_ids:
            raise ValueError(f"empty prompt {prompt!r}: at least one token is needed")
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} outside the vocabulary [0, {self.vocab_size})")
        max_model_len = self.config.max_model_len
        if len(token_ids) >= max_model_len:
            raise ValueError(f"{which} of {len(token_ids)} tokens is not shorter than max_model_len="
                             f"{max_model_len}, so no token could be generated")
        if params.max_tokens is None:  # vLLM's "up to the model length"
            room = max_model_len - len(token_ids)
            if params.min_tokens > room:
                raise ValueError(f"SamplingParams.min_tokens={params.min_tokens} is more than the {room} tokens "
                                 f"{which} leaves (max_model_len={max_model_len} minus its {len(token_ids)} tokens)")
            params = replace(params, max_tokens=room)
        seq = Sequence(token_ids, params, self.config.kvcache_block_size)
        if seq.num_blocks > self.num_blocks:
            raise ValueError(f"{which} of {len(token_ids)} tokens needs {seq.num_blocks} KV blocks but the cache "
                             f"holds only {self.num_blocks} blocks of {self.config.kvcache_block_size} tokens")
        if params.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            outside = [t for word in seq.bad_words_token_ids for t in word if t >= self.vocab_size]
            if outside:  # a tokenizer with added tokens past the model's vocabulary
                raise ValueError(f"SamplingParams.bad_words {params.bad_words} tokenize to {outside[0]}, outside "
                                 f"the vocabulary [0, {self.vocab_size})")
        return seq

    def make_samples(self, prompt: str | list[int], params: SamplingParams, index: int | None = None) -> list[Sequence]:
        """The params.n requests of one prompt; the others fork the first one's prompt KV (see Scheduler)."""
        compiled = None
        if params.structured_outputs is not None:  # compiled beside the engine's thread; one matcher per sample
            compiled = self.grammar_compiler().submit(params.structured_outputs)
            # the grammar ends at the tokenizer's EOS too: the request must stop there even where the model's
            # config does not list it
            extra = [t for t in self.grammars.stop_token_ids if t not in self.config.eos_token_ids
                     and t not in params.stop_token_ids]
            params = replace(params, stop_token_ids=[*params.stop_token_ids, *extra]) if extra else params
        first, *others = [self.make_sequence(prompt, sample, index) for sample in samples_of(params)]
        for seq in others:
            seq.prompt_owner = first
        for seq in (first, *others) if compiled is not None else ():
            seq.grammar = GrammarState(compiled, params.structured_outputs, self.grammars.worker)
        return [first, *others]

    def grammar_compiler(self) -> GrammarCompiler:
        if self.grammars is None:
            # the grammar may end wherever the engine stops: the tokenizer's EOS and generation_config's
            eos = self.tokenizer.eos_token_id
            stop = {*self.config.eos_token_ids, *([eos] if isinstance(eos, int) and eos < self.vocab_size else [])}
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(stop))
            self.grammars.start_worker(MaskProcess)  # the matchers' process (sampling/mask_process.py): seconds
        return self.grammars

    def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()

    @staticmethod
    def check_grammars(requests: Iterable[list[Sequence]]) -> None:
        """Wait for the requests' grammars to compile; the first that does not is a ValueError naming why."""
        for samples in requests:
            if samples[0].grammar is not None and (error := samples[0].grammar.error()) is not None:
                raise error


class HeldRequests:
    """Requests on their way to the scheduler: one whose grammar still compiles waits here, the rest pass at once."""

    def __init__(self) -> None:
        self.waiting: list[tuple[int, str | None, list[Sequence]]] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, index: int, text: str | None, samples: list[Sequence]) -> None:
        self.waiting.append((index, text, samples))

    def ready(self) -> list[tuple[int, str | None, list[Sequence], BaseException | None]]:
        """The requests free to go, in arrival order, each with the error its grammar raised (or None)."""
        ready, still = [], []
        for request in self.waiting:
            grammar = request[2][0].grammar
            (ready if grammar is None or grammar.compiled.done() else still).append(request)
        self.waiting = still
        return [(i, text, samples, samples[0].grammar and samples[0].grammar.error()) for i, text, samples in ready]

    def wait(self) -> None:
        """Until one more grammar is compiled: nothing else can run meanwhile."""
        wait([samples[0].grammar.compiled for _, _, samples in self.waiting], return_when=FIRST_COMPLETED)
