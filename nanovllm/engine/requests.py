"""One prompt and its SamplingParams -> validated Sequences, before anything is scheduled."""
from dataclasses import dataclass, replace

from transformers import PreTrainedTokenizerBase

from nanovllm.config import Config
from nanovllm.engine.prompts import samples_of
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.bad_words import bad_words_token_ids
from nanovllm.sampling_params import SamplingParams


@dataclass
class RequestBuilder:
    config: Config
    tokenizer: PreTrainedTokenizerBase
    num_blocks: int  # of the KV cache: a prompt that needs more can never run

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
        first, *others = [self.make_sequence(prompt, sample, index) for sample in samples_of(params)]
        for seq in others:
            seq.prompt_owner = first
        return [first, *others]
