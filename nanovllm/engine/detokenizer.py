import os

from transformers import PreTrainedTokenizerBase

from nanovllm.engine.sequence import Sequence
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput


class Detokenizer:
    """Token ids -> text: stop strings while a request runs, and its output once it is done."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def stop_string_at(self, seq: Sequence, index: int) -> str | None:
        """The stop string that the token at `index` has just completed, if any: one that ends in that token's
        text, not one already complete before it (which min_tokens let pass, as vLLM does)."""
        stop = seq.params.stop
        if not stop:
            return None
        # a stop string spans at most as many tokens as it has characters; a few more cover partial bytes
        window = max(len(s) for s in stop) + 8
        first = max(seq.num_prompt_tokens, index + 1 - window)
        tail = self.tokenizer.decode(seq.token_ids[first: index + 1])
        found = [s for s in stop if s in tail]
        if not found:  # the common case: one decode per token
            return None
        before = self.tokenizer.decode(seq.token_ids[first: index])
        # the new token's text starts where `before` stops being a prefix (a partial character may change);
        # a stop string counts if its last occurrence ends there or later, even if it also occurred before
        new_text_at = len(os.path.commonprefix([before, tail]))
        return next((s for s in found if tail.rfind(s) + len(s) > new_text_at), None)

    def output_text(self, seq: Sequence) -> str:
        params = seq.params
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=params.skip_special_tokens)
        stop = seq.stop_reason
        if isinstance(stop, str) and stop in text:
            # the text ends before the stop string that finished the request (its last occurrence: earlier ones
            # fell inside min_tokens), or with it; the token ids keep the token that completed it either way
            start = text.rfind(stop)
            text = text[: start + len(stop) if params.include_stop_str_in_output else start]
        return text

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def request_output(self, samples: list[Sequence], prompt: str | None) -> RequestOutput:
        """One request's output: its n samples as completions."""
        first = samples[0]
        prompt_logprobs = None
        if first.params.prompt_logprobs is not None:  # the first sample scored the prompt for all of them
            prompt_logprobs = [None, *self._decoded(first.prompt_logprobs)]
        return RequestOutput(str(first.seq_id), prompt, first.token_ids[: first.num_prompt_tokens],
                             [self._completion(index, seq) for index, seq in enumerate(samples)],
                             prompt_logprobs=prompt_logprobs)

    def _decoded(self, positions: list[dict[int, Logprob]]) -> list[dict[int, Logprob]]:
        """The same entries, each with its token's text (decoded_token)."""
        for position in positions:
            for token_id, entry in position.items():
                entry.decoded_token = self.token_text(token_id)
        return positions

    def _completion(self, index: int, seq: Sequence) -> CompletionOutput:
        logprobs = cumulative = None
        if seq.params.logprobs is not None:
            logprobs = self._decoded(seq.logprobs)
            cumulative = sum(position[token].logprob for position, token in zip(logprobs, seq.completion_token_ids))
        return CompletionOutput(index, self.output_text(seq), seq.completion_token_ids, cumulative, logprobs,
                                seq.finish_reason, seq.stop_reason)
