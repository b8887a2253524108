"""Structured outputs, xgrammar's batch calls over a step's matchers (in the mask worker, sampling/mask_worker.py):
the matchers take their new tokens, then fill their next masks into rows of the shared buffers.

At 512 rows the Python around these calls costs as much as xgrammar's own work: each walks the rows once, and
xgrammar's bindings are called with cached handles (its public wrappers build a list of handles first, and its
public batch accept reads each answer back)."""
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nanovllm.utils.device import allowed_cpu_cores

logger = logging.getLogger(__name__)
# xgrammar's threads for one step's fill. It starts them anew at every call, so more is not faster: at 512 rows
# on a 16-core host, 4 fill in 1.6 ms, 15 in 2.7 ms, 1 in 2.5 ms. The engine's own thread keeps a core.
FILL_THREADS = max(1, min(4, allowed_cpu_cores() - 1))


@dataclass
class Constraint:
    """One request's matcher: it has taken the first `num_accepted` of `tokens` (every kept token its request
    sampled, in order)."""

    matcher: Any
    handle: Any  # the matcher's binding object, for calls without the public wrappers
    stop_token_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    num_accepted: int = 0
    rejected: bool = False  # a token the grammar refused was sampled (every allowed one banned): end the output
    terminated: bool = False  # the matcher took a stop token: the output ends
    filled: tuple[int, int, int] | None = None  # next mask filled ahead: (source row, generation, accepted)


class MaskFiller:
    """`rows`: both buffers' bitmask rows, [2 * span, width] int32, all filled through one view."""

    def __init__(self, xgr: Any, rows: np.ndarray, stop_token_ids: list[int], fill_threads: int = FILL_THREADS) -> None:
        self.xgr, self.rows = xgr, rows
        self.bitmask = torch.from_numpy(rows)  # what xgrammar fills
        self.filler = xgr.BatchGrammarMatcher(max_threads=fill_threads)
        self.core = accept_binding(xgr)
        self.fill_binding = fill_binding(self.filler, self.bitmask)
        self.stop_only = np.zeros(rows.shape[1], dtype=np.int32)
        for token in stop_token_ids:
            self.stop_only[token // 32] |= _bit(token % 32)

    def fill(self, constraints: list[Constraint], at: Sequence[int]) -> None:
        """Each matcher's next mask into its row of `at` (stop-only for one that ended: its row is still in the
        step launched before the engine knew, and its token will be dropped)."""
        handles, indices, stop_rows = [], [], []
        for constraint, row in zip(constraints, at):
            if constraint.rejected or constraint.terminated:
                stop_rows.append(row)
            else:
                handles.append(constraint.handle if self.fill_binding else constraint.matcher)
                indices.append(row)
        if handles:
            (self.fill_binding or self.filler.batch_fill_next_token_bitmask)(handles, self.bitmask, indices, False)
        if stop_rows:
            self.rows[stop_rows] = self.stop_only

    def take(self, constraints: list[Constraint], tokens: list[int], allowed: list[bool] | None,
             mark: tuple[int, int]) -> None:
        """Each matcher takes its one new token. allowed: whether the mask each token was sampled under allowed it,
        when known: xgrammar's verdict too (a mask is the set of tokens its matcher accepts), so it is not read
        back. mark: (first source row, generation) of the fill ahead that follows, noted on each with its row (the
        first, the next, ...)."""
        if allowed is None or self.core is None:
            allowed, handles = self._accept_public(constraints, tokens), None
        else:
            handles, taken = [], []
        stops, counted, (first_row, generation) = [], 0, mark
        try:
            for j, (constraint, token, ok) in enumerate(zip(constraints, tokens, allowed)):
                if constraint.rejected or constraint.terminated:
                    pass
                elif not ok:
                    self.reject(constraint)
                else:
                    if handles is not None:
                        handles.append(constraint.handle)
                        taken.append(token)
                    if token in constraint.stop_token_ids:
                        stops.append(constraint)
                constraint.num_accepted += 1
                counted = j + 1
                constraint.filled = (first_row + j, generation, constraint.num_accepted)
            if handles:
                self.core.BatchGrammarMatcher.batch_accept_token(handles, taken, False)
        except BaseException:  # the next fill takes the tokens again
            for constraint in constraints[:counted]:
                constraint.num_accepted -= 1
                constraint.filled = None
            raise
        for constraint in stops:
            constraint.terminated = constraint.matcher.is_terminated()

    def allowed(self, tokens: list[int], sources: np.ndarray | None) -> list[bool] | None:
        """Whether each token is in the mask row `sources` names (None: not known for every row)."""
        if sources is None or (sources < 0).any():
            return None
        ids = np.asarray(tokens)
        return ((self.rows[sources, ids >> 5] >> (ids & 31)) & 1).astype(bool).tolist()

    def _accept_public(self, constraints: list[Constraint], tokens: list[int]) -> list[bool]:
        """xgrammar's public batch accept of the open rows' tokens; each row's verdict (an ended row's: True)."""
        open_rows = [j for j, c in enumerate(constraints) if not (c.rejected or c.terminated)]
        answers = self.xgr.BatchGrammarMatcher.batch_accept_token([constraints[j].matcher for j in open_rows],
                                                                  [tokens[j] for j in open_rows])
        verdicts = [True] * len(constraints)
        for j, ok in zip(open_rows, answers):
            verdicts[j] = ok
        return verdicts

    @staticmethod
    def reject(constraint: Constraint) -> None:
        logger.warning("a constrained request sampled a token its grammar refuses (were all the allowed tokens "
                       "banned by bad_words?): it may only end now")
        constraint.rejected = True


def accept_binding(xgr: Any) -> Any:
    """xgrammar's binding under its public batch accept, if it takes a call that does not read the answers back;
    else None, and the public call is used."""
    core = getattr(getattr(xgr, "base", None), "_core", None)
    try:
        core.BatchGrammarMatcher.batch_accept_token([], [], False)
    except Exception:  # noqa: BLE001 - another xgrammar version: any failure means "use the public call"
        return None
    return core


def fill_binding(filler: Any, bitmask: torch.Tensor) -> Any:
    """xgrammar's binding under its public batch fill, if it takes the call `fill` makes (cached handles); else
    None."""
    try:
        binding = filler._handle.batch_fill_next_token_bitmask
        binding([], bitmask, [], False)
    except Exception:  # noqa: BLE001 - another xgrammar version: use the public call
        return None
    return binding


def _bit(position: int) -> int:
    # bit 31 of an int32 is its sign
    return (1 << position) - (1 << 32 if position == 31 else 0)
