"""What generate returns: vLLM's output objects, readable with the reference's dict keys too."""
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's own distribution (before temperature and filters)."""

    logprob: float
    rank: int  # 1 for the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None  # per position: the sampled token and the top k
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (None for EOS)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str = field(compare=False)  # outputs of equal content compare equal whatever their ids
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # when SamplingParams.prompt_logprobs is set: None for the first prompt token, then per prompt token a dict of
    # that token and the top k, each token id -> Logprob given the tokens before it (vLLM's; a keyword here)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __getitem__(self, key: str):
        """The reference engine's dict outputs (`out["text"]`, `out["token_ids"]`, `out["finish_reason"]`,
        `out["logprobs"]` as {token id: logprob} per position), read from the first completion."""
        first = self.outputs[0]
        if key == "logprobs":
            if first.logprobs is None:
                raise KeyError(key)
            return [{token: lp.logprob for token, lp in position.items()} for position in first.logprobs]
        if key in ("text", "token_ids", "finish_reason"):
            return getattr(first, key)
        raise KeyError(key)

    def __contains__(self, key: str) -> bool:
        return key in ("text", "token_ids", "finish_reason") or (key == "logprobs"
                                                                 and self.outputs[0].logprobs is not None)
