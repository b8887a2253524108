from transformers import PreTrainedTokenizerBase

from nanovllm.engine.sequence import Sequence


class Detokenizer:
    """Token ids -> text: stop strings while a request runs, and its output text once it is done."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def stop_string_at(self, seq: Sequence, index: int) -> bool:
        """Whether the text up to the token at `index` has just completed one of the request's stop strings."""
        stop = seq.params.stop
        if not stop:
            return False
        # a stop string spans at most as many tokens as it has characters; a few more cover partial bytes
        window = max(len(s) for s in stop) + 8
        tail = self.tokenizer.decode(seq.token_ids[max(seq.num_prompt_tokens, index + 1 - window): index + 1])
        return any(s in tail for s in stop)

    def output_text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        if seq.finish_reason == "stop" and seq.params.stop:
            # the text ends before the first stop string (the token ids keep the token that completed it)
            text = text[: min((text.find(s) for s in seq.params.stop if s in text), default=len(text))]
        return text
