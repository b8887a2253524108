"""Progress while a run works: the tokens the engine computes, counted at every step, and a tqdm bar of finished
requests that shows them as token rates (vLLM's "est. speed input: X toks/s, output: Y toks/s").

The rates come from the step counts, not from finished requests, so a batch whose requests all finish together
(every request in one batch, on CPU say) shows its speed from the first step instead of 0 until the end.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from nanovllm.engine.step import Step

REFRESH_S = 0.1  # a bar redraws at most this often (tqdm's own default), however short the steps


@dataclass(slots=True)
class TokenCounter:
    """Tokens an engine has computed since it was made: `prefilled` (prompt tokens written to the KV cache;
    prefix-cache hits cost nothing and are not counted; a preempted request's recompute is) and `generated`
    (one per sequence a step samples for). `listeners` run after each count: keep them cheap."""

    prefilled: int = 0
    generated: int = 0
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def count(self, step: Step) -> None:
        """Count a launched step. Called before Scheduler.advance, which appends the slots of the tokens it
        samples: a sequence samples exactly when the step reaches its last token."""
        if step.is_prefill:
            sampled = sum(end == len(seq) for seq, (_, end) in zip(step.seqs, step.spans))
            self.add(step.num_tokens, sampled)
        else:
            self.add(0, len(step.seqs))

    def add(self, prefilled: int, generated: int) -> None:
        self.prefilled += prefilled
        self.generated += generated
        for listener in self.listeners:
            listener()


class ProgressBar:
    """A tqdm bar of finished requests whose postfix gives the input and output token rates since it opened,
    redrawn as the counter counts (at most every REFRESH_S), so it moves while no request has finished yet."""

    def __init__(self, counter: TokenCounter, total: int | None, desc: str, unit: str = "it",
                 disable: bool = False, **tqdm_options) -> None:
        self.counter = counter
        self._start = time.perf_counter()
        self._base = counter.prefilled, counter.generated
        self._drawn = 0.0  # when the postfix was last redrawn
        self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=disable,
                        postfix=self._speed(self._start), **tqdm_options)
        self._listening = not disable  # a hidden bar costs the engine nothing
        if self._listening:
            counter.listeners.append(self.tick)

    def tick(self) -> None:
        """Redraw the rates if REFRESH_S has passed since the last redraw: one clock read per step otherwise."""
        now = time.perf_counter()
        if now - self._drawn >= REFRESH_S:
            self._drawn = now
            self.bar.set_postfix_str(self._speed(now), refresh=False)
            self.bar.refresh()

    def update(self, finished: int = 1) -> None:
        """Count finished requests; tqdm redraws when its own interval allows."""
        if self._listening:
            self.bar.set_postfix_str(self._speed(time.perf_counter()), refresh=False)
        self.bar.update(finished)

    def close(self) -> None:
        if self._listening:
            self._listening = False
            self.counter.listeners.remove(self.tick)
            self.bar.set_postfix_str(self._speed(time.perf_counter()), refresh=False)
        self.bar.close()

    def _speed(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        prefilled, generated = self.counter.prefilled - self._base[0], self.counter.generated - self._base[1]
        return f"est. speed input: {prefilled / elapsed:.2f} toks/s, output: {generated / elapsed:.2f} toks/s"

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
