from collections import deque
from types import SimpleNamespace

from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import PENDING, Sequence, SequenceStatus
from nanovllm.engine.step import Step
from nanovllm.sampling_params import SamplingParams

BS = 16
EOS = 999


def make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024) -> Scheduler:
    config = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len, eos_token_ids=(EOS,), kvcache_block_size=BS)
    return Scheduler(config, num_blocks)


def make_seq(n: int, token: int = 1, max_tokens: int = 64, ignore_eos: bool = False) -> Sequence:
    return Sequence([token] * n, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos), BS)


def launch(s: Scheduler, seqs: list[Sequence], is_prefill: bool = False) -> Step:
    """What the engine does around a launch: the step object, then the scheduler's accounting."""
    launched = Step.of(seqs, is_prefill)
    s.advance(launched)
    return launched


def step(s: Scheduler, token: int = 7) -> tuple[list[Sequence], bool]:
    seqs, is_prefill = s.schedule()
    s.postprocess(launch(s, seqs, is_prefill), [token] * len(seqs))
    return seqs, is_prefill


def run_to_end(s: Scheduler) -> None:
    for _ in range(10_000):
        if s.is_finished():
            return
        step(s)
    raise AssertionError("scheduler did not finish")


def test_prefill_first_in_arrival_order_then_decode():
    s = make_scheduler()
    seqs = [make_seq(10, token=i) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    batch, is_prefill = step(s)
    assert is_prefill and batch == seqs
    batch, is_prefill = step(s)
    assert not is_prefill and batch == seqs
    assert all(len(seq) == 12 for seq in seqs)


def test_token_budget_limits_prefill():
    s = make_scheduler(max_num_batched_tokens=100)
    seqs = [make_seq(40, token=i) for i in range(3)]
    for seq in seqs:
        s.add(seq)
    batch, _ = s.schedule()
    # 40 + 40 fit, the third is chunked to the 20 tokens left
    assert [seq.num_scheduled_tokens for seq in batch] == [40, 40, 20]
    assert s.waiting[0] is seqs[2] and seqs[2].block_table


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(5, token=i))
    batch, _ = step(s)
    assert len(batch) == 2 and len(s.waiting) == 1
    batch, is_prefill = step(s)
    assert not is_prefill and len(batch) == 2


def test_prefill_is_possible_only_with_a_free_seat():
    s = make_scheduler(max_num_seqs=2)
    assert not s.may_prefill()
    for i in range(3):
        s.add(make_seq(5, token=i, max_tokens=2))
    assert s.may_prefill()
    step(s)
    assert s.waiting and not s.may_prefill()  # two running, both seats taken
    step(s)  # each samples its last token: both finish
    assert s.may_prefill()


def test_freed_seats_are_refilled_in_batches():
    # 16 seats: admission waits for 2 free ones (an eighth), or for as many as there are waiting requests
    s = make_scheduler(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=1024)
    for i in range(16):
        s.add(make_seq(5, token=i, max_tokens=2 + i))  # request i finishes after its (2 + i)th token
    for i in range(3):
        s.add(make_seq(5, token=100 + i, max_tokens=50))
    batch, is_prefill = step(s)
    assert is_prefill and len(batch) == 16 and len(s.waiting) == 3
    batch, is_prefill = step(s)  # the second token: request 0 finishes, one seat is free
    assert not is_prefill and len(s.running) == 15
    assert not s.may_prefill()
    batch, is_prefill = step(s)  # request 1 finishes too: two free seats
    assert not is_prefill and len(s.running) == 14 and s.may_prefill()
    batch, is_prefill = step(s)
    assert is_prefill and [seq.token_ids[0] for seq in batch] == [100, 101]
    while len(s.running) == 16:
        batch, is_prefill = step(s)
        assert not is_prefill
    assert len(s.running) == 15 and len(s.waiting) == 1
    assert s.may_prefill()  # one seat is enough for the last waiting request
    batch, is_prefill = step(s)
    assert is_prefill and [seq.token_ids[0] for seq in batch] == [102]


def test_budget_counts_only_uncached_tokens():
    s = make_scheduler(max_num_batched_tokens=4 * BS)
    first = make_seq(3 * BS + 2, token=4)
    s.add(first)
    step(s)
    second = make_seq(3 * BS + 2, token=4)
    third = make_seq(BS, token=5)
    s.add(second)
    s.add(third)
    batch, is_prefill = s.schedule()
    assert is_prefill and batch == [second, third]
    assert second.num_cached_tokens == 3 * BS and second.num_scheduled_tokens == 2
    assert third.num_scheduled_tokens == BS


def test_chunked_prefill_spans_steps_and_samples_only_at_the_end():
    s = make_scheduler(max_num_batched_tokens=32)
    seq = make_seq(80)
    s.add(seq)
    chunks = []
    while seq.num_completion_tokens == 0:
        batch, is_prefill = s.schedule()
        assert is_prefill and batch == [seq]
        chunks.append(seq.num_scheduled_tokens)
        s.postprocess(launch(s, batch, True), [7])
    assert chunks == [32, 32, 16]
    assert seq.token_ids[-1] == 7 and len(seq) == 81 and seq.status == SequenceStatus.RUNNING


def test_chunks_register_only_blocks_they_compute():
    s = make_scheduler(max_num_batched_tokens=BS + 4)
    seq = make_seq(3 * BS, token=3)
    s.add(seq)
    s.schedule()
    bm = s.block_manager
    assert [bm.blocks[b].hash != -1 for b in seq.block_table] == [True, False, False]


def test_preemption_takes_the_youngest_and_recovers():
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=1024)
    old = make_seq(2 * BS, token=1, max_tokens=20, ignore_eos=True)
    young = make_seq(2 * BS, token=2, max_tokens=20, ignore_eos=True)
    s.add(old)
    s.add(young)
    step(s)  # both prefilled: 4 blocks in use, each sequence at 2 * BS + 1 tokens
    preempted = []
    original = s._preempt
    s._preempt = lambda seq: (preempted.append(seq), original(seq))
    batch, is_prefill = step(s)  # both need a third block; only the young one gives way
    assert not is_prefill and preempted == [young] and batch == [old]
    assert s.waiting[0] is young and not young.block_table
    run_to_end(s)
    assert old.finish_reason == young.finish_reason == "length"
    assert len(old.completion_token_ids) == len(young.completion_token_ids) == 20
    assert len(s.block_manager.free_block_ids) == 4


def test_lone_sequence_that_cannot_grow_finishes_with_length():
    s = make_scheduler(num_blocks=2)
    seq = make_seq(2 * BS - 1, max_tokens=100)
    s.add(seq)
    run_to_end(s)
    assert seq.finish_reason == "length" and len(seq) == 2 * BS + 1  # the last token needs no KV of its own
    assert len(s.block_manager.free_block_ids) == 2


def test_finish_on_eos_max_tokens_and_max_model_len():
    s = make_scheduler(max_model_len=20)
    eos, capped, long = make_seq(4), make_seq(4, max_tokens=3), make_seq(15, max_tokens=100)
    for seq in (eos, capped, long):
        s.add(seq)
    seqs, _ = s.schedule()
    s.postprocess(launch(s, seqs), [EOS, 5, 5])
    assert eos.finish_reason == "stop" and eos.completion_token_ids == [EOS]
    run_to_end(s)
    assert capped.finish_reason == "length" and len(capped.completion_token_ids) == 3
    assert long.finish_reason == "length" and len(long) == 20


def test_ignore_eos_keeps_going():
    s = make_scheduler()
    seq = make_seq(4, max_tokens=5, ignore_eos=True)
    s.add(seq)
    for _ in range(5):
        step(s, token=EOS)
    assert seq.completion_token_ids == [EOS] * 5 and seq.finish_reason == "length"


def test_abort_all_frees_everything():
    s = make_scheduler(max_num_batched_tokens=20)
    for i in range(3):
        s.add(make_seq(30, token=i))
    s.schedule()
    aborted = s.abort_all()
    assert len(aborted) == 3 and s.is_finished()
    bm = s.block_manager
    assert len(bm.free_block_ids) == bm.num_blocks and not bm.hash_to_block_id


def test_lookahead_next_step_is_scheduled_before_tokens_arrive():
    """The engine's pipeline: step n+1 is scheduled and launched before step n's tokens are read back."""
    s = make_scheduler()
    a, b = make_seq(10, token=1, max_tokens=3), make_seq(10, token=2, max_tokens=50)
    s.add(a)
    s.add(b)
    first, _ = s.schedule()
    first_step = launch(s, first)
    assert a.token_ids[-1] == PENDING and len(a) == 11
    second, is_prefill = s.schedule()  # scheduled with the first step's tokens still pending
    assert not is_prefill and second == [a, b]
    second_step = launch(s, second)
    assert len(a) == 12 and a.token_ids[-2:] == [PENDING, PENDING]
    s.postprocess(first_step, [EOS, 5])  # a stops: its slot for the second step is dropped
    assert a.finish_reason == "stop" and a.completion_token_ids == [EOS] and not a.block_table
    assert s.running == deque([b])
    s.postprocess(second_step, [9, 6])
    assert a.completion_token_ids == [EOS] and b.completion_token_ids == [5, 6]


def test_length_is_known_at_launch_so_no_step_is_wasted():
    s = make_scheduler()
    seq = make_seq(5, max_tokens=1)
    s.add(seq)
    batch, _ = s.schedule()
    launched = launch(s, batch)
    assert seq.is_finished and seq.finish_reason == "length" and not s.running
    s.postprocess(launched, [EOS])  # the last token turns out to be EOS: that is the better reason
    assert seq.finish_reason == "stop" and seq.completion_token_ids == [EOS]
