from collections import deque

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Decides what each step computes: prefill first (chunked past the token budget), else one decode token each."""

    def __init__(self, config: Config, num_blocks: int) -> None:
        self.max_num_seqs = config.max_num_seqs
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

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:  # a chunked prompt keeps its blocks between its steps
                if not self.block_manager.can_allocate(seq):
                    break
                self.block_manager.allocate(seq)
            # the budget counts only tokens that are not cached yet
            seq.num_scheduled_tokens = min(len(seq) - seq.num_cached_tokens, budget)
            budget -= seq.num_scheduled_tokens
            self.block_manager.register_full_blocks(seq, seq.num_cached_tokens + seq.num_scheduled_tokens)
            scheduled.append(seq)
            if not seq.completes_prompt:
                break  # the budget is spent; the rest of this prompt comes in the next steps
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())  # the youngest gives way
                elif scheduled:
                    self._preempt(seq)
                    break
                else:
                    # it holds the whole cache alone and still cannot grow: it can never fit
                    self._finish(seq, "length")
                    break
            else:
                seq.num_scheduled_tokens = 1
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.deallocate(seq)

    def postprocess(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        for seq, token_id in zip(seqs, token_ids):
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            if seq.num_cached_tokens < len(seq):
                continue  # a prefill chunk that does not reach the end of the prompt samples nothing
            seq.append_token(token_id)
            if not seq.ignore_eos and token_id in self.eos_token_ids:
                self._finish(seq, "stop")
            elif seq.num_completion_tokens >= seq.max_tokens or len(seq) >= self.max_model_len:
                self._finish(seq, "length")
            if seq.is_finished:
                self.running.remove(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every request after a failed or interrupted step, returning their blocks and forgetting
        prefix-cache entries whose KV may never have been written."""
        aborted = list(self.running) + list(self.waiting)
        for seq in aborted:
            if seq.block_table:
                self.block_manager.forget(seq)
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"
        self.running.clear()
        self.waiting.clear()
        return aborted
