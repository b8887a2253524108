"""A seeded random walk over the Scheduler and BlockManager, checking every invariant after every operation.

A simulated KV cache records, for every slot written, a fingerprint of the whole token prefix it was computed
from. Every step first checks that the slots a sequence reads (its cached prefix) hold exactly its own prefix:
a stale hash entry, a block shared across different prefixes, or a block freed too early shows up there.
"""
import random
from types import SimpleNamespace

from nanovllm.engine.block_manager import chained_hash
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.step import Step
from nanovllm.sampling_params import SamplingParams

BS, NUM_BLOCKS, EOS = 16, 14, 0


def check_invariants(s: Scheduler, live: list[Sequence]) -> None:
    bm = s.block_manager
    assert len(bm.free_block_ids) + len(bm.used_block_ids) == bm.num_blocks
    assert len(set(bm.free_block_ids)) == len(bm.free_block_ids)
    assert set(bm.free_block_ids).isdisjoint(bm.used_block_ids)
    holders = [0] * bm.num_blocks
    for seq in live:
        for block_id in seq.block_table:
            holders[block_id] += 1
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]
        assert (block.ref_count > 0) == (block.block_id in bm.used_block_ids)
    for h, block_id in bm.hash_to_block_id.items():
        block = bm.blocks[block_id]
        assert block.hash == h and len(block.token_ids) == BS
    for seq in live:  # the registered blocks of every sequence form its own hash chain
        prefix_hash = -1
        for i, block_id in enumerate(seq.block_table):
            block = bm.blocks[block_id]
            if block.hash == -1:
                break
            prefix_hash = chained_hash(seq.block(i), prefix_hash)
            assert block.hash == prefix_hash and block.token_ids == seq.block(i)


def fingerprint(seq: Sequence, pos: int, oracle: dict) -> int:
    """The prefix up to pos, with PENDING tokens resolved from what the simulated sampler already chose."""
    tokens = [oracle.get((seq.seq_id, i), t) if t == PENDING else t for i, t in enumerate(seq.token_ids[: pos + 1])]
    assert PENDING not in tokens
    return hash(tuple(tokens))


def simulate_step(cache: dict, seqs: list[Sequence], is_prefill: bool, oracle: dict) -> None:
    for seq in seqs:
        start = seq.num_cached_tokens if is_prefill else len(seq) - 1
        end = start + seq.num_scheduled_tokens
        for pos in range(start):  # what attention reads must be this sequence's own prefix
            slot = seq.block_table[pos // BS] * BS + pos % BS
            assert cache.get(slot) == fingerprint(seq, pos, oracle), f"stale KV at position {pos}"
        for pos in range(start, end):
            cache[seq.block_table[pos // BS] * BS + pos % BS] = fingerprint(seq, pos, oracle)


def test_random_walk_keeps_every_invariant():
    """Driven the way the engine drives it: step n+1 is scheduled before step n's tokens are read back."""
    rng = random.Random(1234)
    config = SimpleNamespace(max_num_seqs=6, max_num_batched_tokens=40, max_model_len=120, eos_token_ids=(EOS,),
                             kvcache_block_size=BS)
    s = Scheduler(config, NUM_BLOCKS)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([16, 32, 40]))] for _ in range(4)]
    cache: dict[int, int] = {}
    oracle: dict[tuple[int, int], int] = {}  # (seq id, index) -> the token the simulated sampler drew
    live: list[Sequence] = []
    pending = None
    preemptions = 0
    preempt = s._preempt

    def counting_preempt(seq):
        nonlocal preemptions
        preemptions += 1
        preempt(seq)

    s._preempt = counting_preempt

    def launch(seqs, is_prefill):
        simulate_step(cache, seqs, is_prefill, oracle)
        launched = Step.of(seqs, is_prefill)
        s.advance(launched)
        # EOS now and then; otherwise tokens from a small alphabet, so decoded blocks repeat and get shared
        tokens = [EOS if rng.random() < 0.03 else rng.randrange(1, 4) for _ in seqs]
        for seq, (_, end), token in zip(seqs, launched.spans, tokens):
            if end < len(seq) and seq.token_ids[end] == PENDING:
                oracle[(seq.seq_id, end)] = token
        return launched, tokens

    def step() -> None:
        nonlocal pending, live
        if pending is not None and s.waiting:
            s.postprocess(*pending)
            pending = None
        seqs, is_prefill = s.schedule()
        launched = launch(seqs, is_prefill) if seqs else None
        if pending is not None:
            s.postprocess(*pending)
        pending = launched
        live = [seq for seq in live if not seq.is_finished]

    ops = 0
    while ops < 3000:
        ops += 1
        if rng.random() < 0.3 and len(live) < 12:
            prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
            tail = [rng.randrange(1, 50) for _ in range(rng.randrange(0 if prefix else 1, 30))]
            params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 80), ignore_eos=rng.random() < 0.3)
            seq = Sequence(prefix + tail, params, BS)
            s.add(seq)
            live.append(seq)
        elif not s.is_finished() or pending is not None:
            step()
        check_invariants(s, live)
    while not s.is_finished() or pending is not None:
        step()
        check_invariants(s, live)
    bm = s.block_manager
    assert len(bm.free_block_ids) == NUM_BLOCKS and all(b.ref_count == 0 for b in bm.blocks)
    finished = len({seq_id for seq_id, _ in oracle})
    # the walk must actually have exercised sharing, preemption and completion
    assert finished > 100 and preemptions > 10 and len(bm.hash_to_block_id) > 5, (finished, preemptions)
