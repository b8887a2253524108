"""The whole engine on CPU against transformers' Qwen3 on the same tiny checkpoint, greedy, token for token."""
import pytest
import torch
from hf_reference import assert_no_leaks, assert_teacher_forced_greedy, hf_greedy

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# around and across the 256-token block: full blocks, partial ones, and decodes that open a new block
LENGTHS = [1, 7, 100, 250, 255, 256, 257, 300, 513, 700]


def random_prompts(lengths: list[int], seed: int, vocab: int = 1000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_against_hf(hf_model, prompts, outputs) -> None:
    near_ties = sum(assert_teacher_forced_greedy(hf_model, p, o["token_ids"]) for p, o in zip(prompts, outputs))
    assert near_ties <= 1, f"{near_ties} near-ties: the random weights are not peaked enough for a stable test"


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=64) as engine:
        yield engine


def record(obj, name: str) -> list:
    """Wrap obj.name to log the sequences it is called with (what the tests assert actually happened)."""
    calls, original = [], getattr(obj, name)

    def wrapper(seq, *args):
        result = original(seq, *args)
        calls.append((seq, seq.num_cached_tokens, seq.num_scheduled_tokens))
        return result

    setattr(obj, name, wrapper)
    return calls


def test_mixed_batch_identical_to_transformers_generate(llm, hf_model):
    prompts = random_prompts(LENGTHS, seed=1)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outputs] == [24] * len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(hf_model, prompt, 24)
        assert output["finish_reason"] == "length"
    assert_no_leaks(llm)


def test_string_prompts_and_input_order(llm, hf_model):
    prompts = ["hello world, this is a prompt", "short", "a much longer prompt " * 20]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = llm.tokenizer.encode(prompt)
        assert output["token_ids"] == hf_greedy(hf_model, ids, 24)
        assert output["text"] == llm.tokenizer.decode(output["token_ids"], skip_special_tokens=True)


def test_prefix_cache_hits_give_identical_tokens(llm, hf_model):
    prefix = random_prompts([600], seed=2)[0]
    suffixes = random_prompts([1, 30, 256, 90], seed=3)
    prompts = [prefix + s for s in suffixes] + [prefix[:512]]  # the last is wholly cached after the others
    allocations = record(llm.scheduler.block_manager, "allocate")
    first = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    cached = [n for _, n, _ in allocations]
    assert cached[0] == 0 and all(n >= 511 for n in cached[1:]), cached
    assert cached[-1] == 511  # fully cached: the last token is recomputed for its logits
    assert [o["token_ids"] for o in second[:2]] == [o["token_ids"] for o in first]
    check_against_hf(hf_model, prompts, second)
    assert_no_leaks(llm)


def test_preemption_gives_identical_tokens(tiny_model, hf_model):
    # four prompts take all 8 blocks; each then needs a third block to decode past 512 tokens
    prompts = random_prompts([500, 480, 460, 490, 300], seed=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(tiny_model, num_kvcache_blocks=8) as llm:
        preempted = record(llm.scheduler, "_preempt")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert preempted, "the cache was meant to be too small for every sequence at once"
        assert all(len(o["token_ids"]) == 60 for o in outputs)
        check_against_hf(hf_model, prompts, outputs)
        assert_no_leaks(llm)


def test_chunked_prefill_gives_identical_tokens(tiny_model, hf_model):
    prompts = random_prompts([700, 90, 520, 33], seed=5)
    with LLM(tiny_model, num_kvcache_blocks=32, max_num_batched_tokens=200) as llm:
        scheduled = []
        original = llm.scheduler.schedule

        def logging_schedule():
            seqs, is_prefill = original()
            scheduled.extend(s.num_scheduled_tokens for s in seqs if is_prefill)
            return seqs, is_prefill

        llm.scheduler.schedule = logging_schedule
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert max(scheduled) <= 200 and sum(scheduled) == sum(len(p) for p in prompts)
        check_against_hf(hf_model, prompts, outputs)
        assert_no_leaks(llm)


def test_small_blocks_many_boundaries(tiny_model, hf_model):
    prompts = random_prompts([15, 16, 17, 47, 48, 200], seed=6)
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=40, max_num_batched_tokens=100) as llm:
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        second = llm.generate(prompts, GREEDY, use_tqdm=False)  # now every full block is a cache hit
        assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
        check_against_hf(hf_model, prompts, first)
        assert_no_leaks(llm)


def test_sampling_params_per_prompt_and_eos(llm, hf_model):
    prompts = random_prompts([20, 40], seed=7)
    greedy = hf_greedy(hf_model, prompts[0], 8)
    eos = llm.scheduler.eos_token_ids
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8),
                                     SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)], use_tqdm=False)
    expected = greedy[: next((i + 1 for i, t in enumerate(greedy) if t in eos), 8)]
    assert outputs[0]["token_ids"] == expected
    assert len(outputs[1]["token_ids"]) == 5
    assert llm.generate([], GREEDY) == []


@pytest.mark.slow
def test_tensor_parallel_2_identical_to_1(tiny_model, hf_model):
    prompts = random_prompts([500, 480, 460, 490, 300, 20], seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_model, num_kvcache_blocks=8) as single:
        expected = single.generate(prompts, params, use_tqdm=False)
    with LLM(tiny_model, num_kvcache_blocks=8, tensor_parallel_size=2) as llm:
        preempted = record(llm.scheduler, "_preempt")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # now with prefix-cache hits
        assert preempted
        assert_no_leaks(llm)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in expected]
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in expected]
    check_against_hf(hf_model, prompts, outputs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_async_scheduling_on_and_off(tiny_model, hf_model, async_scheduling):
    """With async scheduling a step is launched while the previous one's tokens are still on the device (PENDING
    rows gathered there); without, every step completes before the next is scheduled. Same tokens either way,
    through preemption, prefix-cache hits and stop strings."""
    prompts = random_prompts([500, 480, 460, 490, 300, 20], seed=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(tiny_model, num_kvcache_blocks=8, async_scheduling=async_scheduling) as llm:
        launch, overlapped = llm.model_runner.launch, []

        def spying_launch(step, previous=None):
            overlapped.append(previous is not None)
            return launch(step, previous)

        llm.model_runner.launch = spying_launch
        preempted = record(llm.scheduler, "_preempt")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert preempted and any(overlapped) == async_scheduling
        text = llm.tokenizer.decode(outputs[5]["token_ids"][10:13])
        stopped = llm.generate([prompts[5]], SamplingParams(temperature=0, max_tokens=40, stop=text),
                               use_tqdm=False)[0]
        assert_no_leaks(llm)
    assert stopped["finish_reason"] == "stop" and len(stopped["token_ids"]) <= 13
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(hf_model, prompt, 40)
