"""Cases where the reference design crashes or misbehaves, each handled and checked end to end on CPU."""
import pickle

import pytest
from hf_reference import assert_no_leaks, assert_teacher_forced_greedy, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=12, max_model_len=1024) as engine:
        yield engine


def test_fully_cached_prompt_computes_one_token_and_matches_uncached(llm, tiny_model):
    prompt = random_prompts([512], seed=20)[0]  # exactly two blocks
    uncached = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    scheduled = []
    schedule = llm.scheduler.schedule

    def logging_schedule():
        seqs, is_prefill = schedule()
        scheduled.extend((s.num_cached_tokens, s.num_scheduled_tokens) for s in seqs if is_prefill)
        return seqs, is_prefill

    llm.scheduler.schedule = logging_schedule
    cached = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    llm.scheduler.schedule = schedule
    assert scheduled == [(511, 1)]
    assert cached["token_ids"] == uncached["token_ids"]
    assert_no_leaks(llm)


def test_requests_that_can_never_fit_fail_up_front(llm, tiny_model):
    with pytest.raises(ValueError, match="not shorter than max_model_len=1024"):
        llm.generate([[2] * 5, [1] * 1024], GREEDY)
    assert llm.scheduler.is_finished()  # the good request was not queued either
    assert_no_leaks(llm)
    with LLM(tiny_model, num_kvcache_blocks=3) as small:
        with pytest.raises(ValueError, match="needs 4 KV blocks but the cache holds only 3 blocks"):
            small.generate([[2] * 5, [1] * 800], GREEDY)
        assert small.scheduler.is_finished()


def test_sequence_stops_at_max_model_len(llm, hf_model):
    prompt = random_prompts([1000], seed=21)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(prompt) + len(out["token_ids"]) == 1024
    assert_teacher_forced_greedy(hf_model, prompt, out["token_ids"])


def test_lone_sequence_out_of_blocks_finishes_without_harming_others(tiny_model, hf_model):
    prompts = random_prompts([500, 10], seed=22)
    with LLM(tiny_model, num_kvcache_blocks=3) as llm:  # 768 tokens of KV in all
        outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=600, ignore_eos=True),
                                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
                               use_tqdm=False)
        assert_no_leaks(llm)
    long, short = outputs
    assert long["finish_reason"] == "length" and len(prompts[0]) + len(long["token_ids"]) == 3 * 256 + 1
    assert short["finish_reason"] == "length" and len(short["token_ids"]) == 5
    for prompt, out in zip(prompts, outputs):
        assert_teacher_forced_greedy(hf_model, prompt, out["token_ids"])



@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_that_outgrow_a_tiny_cache_end_at_length_and_the_rest_run(tiny_model, hf_model, async_scheduling):
    """A request that can never grow in the whole cache ends at "length" whoever it was running beside: alone
    (the others, preempted, then run), or preempted itself (an n-th sample of a prompt that fills the cache)."""
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = random_prompts([20, 3], seed=25)
    with LLM(tiny_model, num_kvcache_blocks=2, kvcache_block_size=16, async_scheduling=async_scheduling) as llm:
        outputs = llm.generate(prompts, greedy, use_tqdm=False)  # 32 tokens of KV in all
        assert_no_leaks(llm)
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs] == [(13, "length"),
                                                                                             (20, "length")]
    for prompt, out in zip(prompts, outputs):
        assert_teacher_forced_greedy(hf_model, prompt, out.outputs[0].token_ids)
    fills_the_cache = random_prompts([64], seed=26)
    with LLM(tiny_model, num_kvcache_blocks=4, kvcache_block_size=16, async_scheduling=async_scheduling) as llm:
        two = llm.generate(fills_the_cache, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2),
                           use_tqdm=False)[0].outputs
        assert_no_leaks(llm)
    assert [(len(c.token_ids), c.finish_reason) for c in two] == [(1, "length")] * 2
    assert two[0].token_ids == two[1].token_ids == hf_greedy(hf_model, fills_the_cache[0], 1)

def test_identical_prompts_in_one_step_and_preempted_prefix_hits(tiny_model, hf_model):
    shared = random_prompts([600], seed=23)[0]
    prompts = [shared, shared, shared[:300] + [5] * 220, shared]
    with LLM(tiny_model, num_kvcache_blocks=9) as llm:
        allocate, preempt = llm.scheduler.block_manager.allocate, llm.scheduler._preempt
        hits, preempted = [], []
        llm.scheduler.block_manager.allocate = lambda seq: (allocate(seq), hits.append(seq.num_cached_tokens))
        llm.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                               use_tqdm=False)
        assert preempted and any(n > 0 for n in hits[1:]), (preempted, hits)
        bm = llm.scheduler.block_manager
        assert len(set(bm.hash_to_block_id.values())) == len(bm.hash_to_block_id)  # no block under two hashes
        assert_no_leaks(llm)
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"] == outputs[3]["token_ids"]
    for prompt, out in zip(prompts, outputs):
        assert_teacher_forced_greedy(hf_model, prompt, out["token_ids"])


def test_interrupted_generate_leaves_engine_usable(llm):
    prompts = random_prompts([300, 20, 700], seed=24)
    expected = llm.generate(prompts, GREEDY, use_tqdm=False)
    launch, calls = llm.model_runner.launch, []

    def interrupted_launch(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return launch(*args)

    llm.model_runner.launch = interrupted_launch
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.model_runner.launch = launch
    assert_no_leaks(llm)
    assert llm.generate(prompts, GREEDY, use_tqdm=False) == expected


def test_workers_get_the_tokens_a_step_computes_and_decode_ships_one():
    seq = Sequence(list(range(600)), block_size=256)
    seq.block_table = [3, 4, 5]
    seq.num_cached_tokens, seq.num_scheduled_tokens = 256, 344  # a re-prefill after preemption, prefix cached
    shipped = pickle.loads(pickle.dumps(seq))
    assert shipped.scheduled_token_ids == list(range(256, 600)) and shipped.token_ids is None
    seq.num_cached_tokens = 600
    seq.append_token(7)
    seq.num_scheduled_tokens = 1
    shipped = pickle.loads(pickle.dumps(seq))
    assert shipped.scheduled_token_ids == [7] and len(shipped) == 601 and shipped.block_table == [3, 4, 5]
    assert len(pickle.dumps(seq)) < 200  # the history is not sent every decode step
