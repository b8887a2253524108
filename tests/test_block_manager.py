from nanovllm.engine.block_manager import BlockManager, chained_hash
from nanovllm.engine.sequence import Sequence

BS = 16


def seq_of(tokens: list[int]) -> Sequence:
    return Sequence(tokens, block_size=BS)


def check_invariants(bm: BlockManager) -> None:
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == bm.num_blocks
    assert set(bm.free_block_ids).isdisjoint(bm.used_block_ids)
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    for block in bm.blocks:
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """What the scheduler does for an unchunked prefill."""
    bm.allocate(seq)
    bm.register_full_blocks(seq, seq.num_cached_tokens, len(seq))
    seq.num_cached_tokens = len(seq)


def test_hash_chain_depends_on_prefix():
    block = list(range(BS))
    assert chained_hash(block) == chained_hash(list(block))
    assert chained_hash(block, 1) != chained_hash(block, 2) != chained_hash(block)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, BS)
    seqs = [seq_of([i] * n) for i, n in enumerate((1, BS, BS + 1, 3 * BS - 1))]
    for seq in seqs:
        assert bm.can_allocate(seq)
        prefill(bm, seq)
        assert len(seq.block_table) == seq.num_blocks
        check_invariants(bm)
    assert len(bm.used_block_ids) == 1 + 1 + 2 + 3
    for seq in seqs:
        bm.deallocate(seq)
        check_invariants(bm)
    assert len(bm.free_block_ids) == 8 and all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_shares_full_blocks_but_never_the_partial_last_one():
    bm = BlockManager(10, BS)
    a = seq_of(list(range(2 * BS + 5)))
    prefill(bm, a)
    b = seq_of(list(range(2 * BS + 5)))
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_cached_tokens == 2 * BS
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    check_invariants(bm)


def test_same_block_after_different_prefix_misses():
    bm = BlockManager(10, BS)
    shared = list(range(100, 100 + BS))
    prefill(bm, seq_of(list(range(BS)) + shared))
    other = seq_of([7] * BS + shared)
    bm.allocate(other)
    assert other.num_cached_tokens == 0


def test_first_miss_ends_reuse():
    bm = BlockManager(10, BS)
    prefill(bm, seq_of(list(range(3 * BS))))
    changed = list(range(3 * BS))
    changed[BS + 3] = 999  # second block differs, third is equal again
    seq = seq_of(changed + [1])
    bm.allocate(seq)
    assert seq.num_cached_tokens == BS


def test_token_ids_checked_on_hash_hit():
    bm = BlockManager(10, BS)
    a = seq_of(list(range(BS)) + [1])
    prefill(bm, a)
    # forge a collision: the stored tokens disagree with the tokens that hash there
    bm.blocks[a.block_table[0]].token_ids = [5] * BS
    b = seq_of(list(range(BS)) + [2])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]


def test_freed_block_is_reused_with_its_hash_until_overwritten():
    bm = BlockManager(4, BS)
    a = seq_of(list(range(BS)) + [1])
    prefill(bm, a)
    first = a.block_table[0]
    bm.deallocate(a)
    assert first in bm.free_block_ids
    b = seq_of(list(range(BS)) + [2])
    bm.allocate(b)
    assert b.block_table[0] == first and b.num_cached_tokens == BS
    assert bm.blocks[first].ref_count == 1 and first in bm.used_block_ids
    check_invariants(bm)
    bm.deallocate(b)
    # now fill the cache with other tokens: the old block is overwritten and its hash forgotten
    c = seq_of([9] * (4 * BS))
    prefill(bm, c)
    assert bm.hash_to_block_id.get(chained_hash(list(range(BS)))) is None
    check_invariants(bm)


def test_fully_cached_prompt_recomputes_its_last_token():
    bm = BlockManager(4, BS)
    prefill(bm, seq_of(list(range(2 * BS))))
    seq = seq_of(list(range(2 * BS)))
    bm.allocate(seq)
    assert seq.num_cached_tokens == 2 * BS - 1


def test_decode_opens_block_at_boundary_and_registers_full_block():
    bm = BlockManager(4, BS)
    seq = seq_of(list(range(BS - 1)))
    prefill(bm, seq)
    seq.append_token(50)  # len == BS: the token just appended fills the first block
    assert bm.can_append(seq)
    bm.may_append(seq)
    assert len(seq.block_table) == 1 and bm.blocks[seq.block_table[0]].hash == -1
    bm.register_full_blocks(seq, BS - 1, BS)  # once the step that fed it has run
    assert bm.blocks[seq.block_table[0]].hash == chained_hash(list(range(BS - 1)) + [50])
    seq.num_cached_tokens = len(seq)
    seq.append_token(51)  # len == BS + 1: opens the second block
    bm.may_append(seq)
    assert len(seq.block_table) == 2
    check_invariants(bm)


def test_can_append_false_when_full():
    bm = BlockManager(1, BS)
    seq = seq_of(list(range(BS)))
    prefill(bm, seq)
    seq.append_token(1)
    assert not bm.can_append(seq)


def test_reset_frees_everything_and_forgets_registrations():
    bm = BlockManager(4, BS)
    seq = seq_of(list(range(2 * BS)))
    bm.allocate(seq)
    bm.register_full_blocks(seq, 0, 2 * BS)
    bm.free_block_ids.popleft()  # as an interrupt inside _take_free_block would leave it: in no table, not free
    bm.reset()
    assert not bm.hash_to_block_id and len(bm.free_block_ids) == 4 and not bm.used_block_ids
    check_invariants(bm)


def test_registration_never_chains_from_an_unregistered_block():
    bm = BlockManager(4, BS)
    seq = seq_of(list(range(3 * BS)))
    bm.allocate(seq)
    bm.register_full_blocks(seq, BS, 3 * BS)  # block 0 was never registered
    assert not bm.hash_to_block_id
