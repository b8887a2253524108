from collections import deque

import numpy as np
import xxhash

from nanovllm.engine.prompt_logprobs import wants_prompt_logprobs
from nanovllm.engine.sequence import Sequence


def chained_hash(token_ids: list[int], prefix_hash: int = -1) -> int:
    """xxh64 of the previous block's hash and this block's tokens, so equal blocks after different prefixes differ."""
    h = xxhash.xxh64()
    if prefix_hash != -1:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.array(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1  # -1: not full, or not registered for sharing
        self.token_ids: list[int] = []

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


class BlockManager:
    """Paged KV memory: fixed-size blocks with ref counts, and a hash-chained prefix cache over full blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.reset()

    def reset(self) -> None:
        """Every block free, nothing cached."""
        for block in self.blocks:
            block.ref_count, block.hash, block.token_ids = 0, -1, []
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(len(self.blocks)))
        self.used_block_ids: set[int] = set()
        self.copies: list[tuple[int, int]] = []  # copy-on-write for the next step: (source, destination)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def _take_free_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        assert block.ref_count == 0
        # its old contents are about to be overwritten, so it can no longer answer for its hash
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_block_ids.remove(block_id)
            self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give seq a block table for all its tokens, reusing the longest cached run of its full blocks."""
        assert not seq.block_table
        prefix_hash = -1
        cache_hit = not wants_prompt_logprobs(seq)  # a cached prefix is not computed, so it could not be scored
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            block_id = -1
            if cache_hit and len(token_ids) == self.block_size:
                prefix_hash = chained_hash(token_ids, prefix_hash)
                block_id = self.hash_to_block_id.get(prefix_hash, -1)
                if block_id != -1 and self.blocks[block_id].token_ids != token_ids:
                    block_id = -1  # a hash collision: the stored tokens decide
            if block_id == -1:
                cache_hit = False
                block_id = self._take_free_block()
            else:
                seq.num_cached_tokens += self.block_size
                block = self.blocks[block_id]
                if block_id in self.used_block_ids:
                    block.ref_count += 1
                else:  # freed but not yet overwritten: take it back, hash and all
                    self.free_block_ids.remove(block_id)
                    self.used_block_ids.add(block_id)
                    block.ref_count = 1
            seq.block_table.append(block_id)
        if seq.num_cached_tokens == len(seq):
            # a fully cached prompt still computes its last token, so there are logits to sample from
            seq.num_cached_tokens -= 1

    def fork(self, seq: Sequence, parent: Sequence) -> None:
        """Share every block of parent's prompt with seq, the partial last one too: n samples of one prompt
        compute it once. Whichever of them first writes into a shared partial block gets its own copy."""
        assert not seq.block_table and len(seq) == len(parent)
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        seq.block_table = list(parent.block_table)
        seq.num_cached_tokens = len(seq)

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def register_full_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Register the hash of every block that a step computing tokens [start, end) left full.

        Called once the step's KV is written and its tokens are known, so a block is shared only when its
        contents are real.
        """
        for i in range(start // self.block_size, end // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                continue
            prefix_hash = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
            if i > 0 and prefix_hash == -1:
                break  # a chain with a gap would make this block look like the start of another sequence
            block.token_ids = seq.block(i)
            block.hash = chained_hash(block.token_ids, prefix_hash)
            self.hash_to_block_id[block.hash] = block.block_id

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def _needs_block(self, seq: Sequence) -> bool:
        # a new block is needed when the token about to be computed opens one, or lands in a forked partial
        # block that other samples still read
        return len(seq) % self.block_size == 1 or self.blocks[seq.block_table[-1]].ref_count > 1

    def can_append(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= self._needs_block(seq)

    def may_append(self, seq: Sequence) -> None:
        """Prepare seq for a decode step that computes the KV of its last token."""
        if len(seq) % self.block_size == 1:
            seq.block_table.append(self._take_free_block())
        elif self._needs_block(seq):
            shared = seq.block_table[-1]
            seq.block_table[-1] = self._take_free_block()
            self.copies.append((shared, seq.block_table[-1]))
            self._release(shared)
