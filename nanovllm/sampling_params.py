from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature: 0 means greedy (argmax); higher values flatten the distribution.
    max_tokens: the most tokens to generate (the request also stops at the engine's max_model_len).
    ignore_eos: keep generating past end-of-sequence tokens (for benchmarks).
    """

    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
