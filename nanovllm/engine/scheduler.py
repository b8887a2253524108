from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import PENDING, Sequence, SequenceStatus
from nanovllm.engine.step import Step


class Scheduler:
    """Decides what each step computes: prefill first (chunked past the token budget), else one decode token each."""

    def __init__(self, config: Config, num_blocks: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        # seats freed by finished requests are refilled in batches of this many (see may_prefill)
        self.admission_batch = max(1, config.max_num_seqs // 8)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def may_prefill(self) -> bool:
        """Whether schedule() may admit waiting requests now.

        Free seats are refilled in batches (an eighth of max_num_seqs, or every waiting request if fewer): a
        prefill step runs eagerly, outside the CUDA graphs, so admitting prompts one by one as single seats
        free up costs far more than leaving a few seats empty for some steps."""
        if not self.waiting:
            return False
        if self.waiting[0].block_table:  # a chunked prompt is part-way through its prefill
            return True
        free_seats = self.max_num_seqs - len(self.running)
        return free_seats >= min(len(self.waiting), self.admission_batch)

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled = self._schedule_prefill() if self.may_prefill() else []
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            assert seq.token_ids[-1] != PENDING, "a prefill must feed known tokens (see LLMEngine.step)"
            if scheduled and self._shares_prompt(seq, scheduled[-1]):
                # it computes nothing: the step's row before it (its prompt's last token) gives its logits
                self.block_manager.fork(seq, scheduled[-1])
            elif budget <= 0:
                break
            elif not seq.block_table:  # a chunked prompt keeps its blocks between its steps
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            # the budget counts only tokens that are not cached yet
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            # prompt tokens are known now, and this step writes their KV before any later reader runs (within
            # the step, each layer stores before it attends), so identical prompts in one batch share blocks
            start = seq.num_cached_tokens
            self.block_manager.register_full_blocks(seq, start, start + seq.num_scheduled_tokens)
            scheduled.append(seq)
            if not seq.completes_prompt:
                break  # the budget is spent; the rest of this prompt comes in the next steps
            seq.status = SequenceStatus.RUNNING
            # appended before it leaves waiting: an interrupt in between leaves it in both, never in neither
            self.running.append(seq)
            self.waiting.popleft()
        return scheduled

    @staticmethod
    def _shares_prompt(seq: Sequence, previous: Sequence) -> bool:
        """Whether seq is one of n samples of the prompt whose last token `previous` (the row scheduled just before
        it) computes in this step, or shares: then seq forks that prompt's KV instead of computing it."""
        owner = seq.prompt_owner
        return (owner is not None and not seq.block_table and owner in (previous, previous.prompt_owner)
                and previous.completes_prompt and previous.num_completion_tokens == 0
                and seq.num_completion_tokens == 0)

    def _schedule_decode(self) -> list[Sequence]:
        """One token for each running sequence, oldest first, preempting the youngest when blocks run out.

        Sequences stay in `running` while this walks them, so an interrupt at any point leaves every request in a
        deque, where abort_all finds it."""
        scheduled: list[Sequence] = []
        for seq in list(self.running):
            if len(scheduled) == self.max_num_seqs:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted below as the youngest, to make room for an older one
            while not self.block_manager.can_append(seq):
                if self.running[-1] is not seq:  # everything after seq is younger and not scheduled yet
                    self._preempt(self.running[-1])  # the youngest gives way
                elif scheduled:
                    self._preempt(seq)
                    break
                else:
                    # it holds the whole cache alone and still cannot grow: it can never fit
                    self._finish(seq, "length")
                    self.running.remove(seq)
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        if seq.num_blocks > self.block_manager.num_blocks:  # its recompute would need more than the whole cache
            self._finish(seq, "length")
            self.running.remove(seq)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)  # before leaving running, so it is always in one deque at least
        self.running.remove(seq)
        self.block_manager.deallocate(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def advance(self, step: Step) -> None:
        """Account a launched step before its tokens are read back, so the next step can be scheduled meanwhile.

        The step's KV counts as computed, and each sequence that samples gets a PENDING slot for its token.
        A sequence that reaches max_tokens or max_model_len with that token is finished now, whatever the
        token turns out to be, so no step is spent on it.
        """
        for seq, (_, end) in zip(step.seqs, step.spans):
            seq.num_cached_tokens = end
            seq.num_scheduled_tokens = 0
            if end < len(seq):
                continue  # a prefill chunk that does not reach the end of the prompt samples nothing
            seq.append_token(PENDING)
            if seq.num_completion_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                self._finish(seq, "length")
                self.running.remove(seq)

    def postprocess(self, step: Step, token_ids: list[int]) -> list[tuple[Sequence, int]]:
        """Fill in a step's sampled tokens, register the blocks it completed and stop on stop or end tokens.

        Decode registers here, not when scheduled: the token it fed may have been PENDING then. Returns the
        (sequence, index) of each new token that may still end its request by other means (stop strings: see
        Detokenizer), that is, one past min_tokens and not already stopped here."""
        may_stop = []
        for i, (seq, (start, end), token_id) in enumerate(zip(step.seqs, step.spans, token_ids)):
            if seq.block_table and seq.status != SequenceStatus.FINISHED:
                self.block_manager.register_full_blocks(seq, start, end)
            if end >= len(seq) or seq.token_ids[end] != PENDING:
                continue  # a prefill chunk, or a request that finished while this step was in flight
            seq.token_ids[end] = token_id
            if step.logprobs is not None and step.logprobs[i] is not None:
                seq.logprobs.append(step.logprobs[i])
            params = seq.params
            if end + 1 - seq.num_prompt_tokens <= params.min_tokens:  # the sampler masks stop tokens before that
                continue
            if token_id in params.stop_token_ids:
                self.stop(seq, end, reason=token_id)
            elif not params.ignore_eos and token_id in self.eos_token_ids:
                self.stop(seq, end)
            else:
                may_stop.append((seq, end))
        return may_stop

    def stop(self, seq: Sequence, index: int, reason: int | str | None = None) -> None:
        """Finish seq because the token at `index` ends it (reason: the stop token id or string; None for an end
        token of the model), dropping the slots of steps launched after it."""
        already_finished = seq.is_finished
        seq.truncate(index + 1)
        self._finish(seq, "stop")
        seq.stop_reason = reason
        if not already_finished:
            (self.running if seq in self.running else self.waiting).remove(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every request after a failed or interrupted step and free the whole cache.

        Nothing survives an abort, so the block manager starts afresh rather than trusting its state (an
        interrupt may have stopped it halfway through taking a block), and prefix-cache entries whose KV may
        never have been written are forgotten with the rest."""
        aborted = list(dict.fromkeys([*self.running, *self.waiting]))  # an interrupt may leave one in both
        for seq in aborted:
            seq.block_table = []
            seq.num_cached_tokens = seq.num_scheduled_tokens = 0
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        self.block_manager.reset()
        return aborted

    def why_stuck(self) -> str | None:
        """Why nothing can be scheduled while requests wait and none runs (which frees no block), or None."""
        if self.running or not self.waiting:
            return None
        seq, bm = self.waiting[0], self.block_manager
        if seq.block_table or bm.can_allocate(seq):  # it fits now: a decode just finished one that never could
            return None
        return (f"request {seq.seq_id} ({len(seq)} tokens) needs {seq.num_blocks} KV blocks and holds "
                f"{len(seq.block_table)}; {len(bm.free_block_ids)} of {bm.num_blocks} are free and no running "
                f"request can free more")
