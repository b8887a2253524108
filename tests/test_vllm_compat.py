"""A vLLM user's first script runs unchanged: the engine options, SamplingParams fields, prompt types and LLM
methods of vLLM that test_vllm_api.py does not cover, with the project's own errors for their misuse."""
import re

import pytest
import torch
from hf_reference import assert_no_leaks
from test_e2e_transformers import random_prompts
from test_vllm_api import record_steps

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=32) as engine:
        yield engine


# --- requests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, allowed", [
    ("prompt_logprobs", -1, "None or an integer >= 0"),
])
def test_new_sampling_params_are_checked(field, value, allowed):
    message = f"SamplingParams.{field}={value!r} is out of range: allowed {allowed}"
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{field: value})


# --- prompt_logprobs ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities of the token after position i."""
    return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def prompt_logprob_values(out, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))])


def assert_prompt_logprobs_equal_transformers(hf_model, out, prompt: list[int], k: int) -> None:
    assert out.prompt_token_ids == prompt and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    reference = hf_prompt_logprobs(hf_model, prompt)
    for i in range(1, len(prompt)):
        entry, row, token = out.prompt_logprobs[i], reference[i - 1], prompt[i]
        for t, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[t]), abs=1e-4), (i, t)
        # the rank counts the tokens more likely than the prompt's own (a near-tie may count either way)
        target = float(row[token])
        assert int((row > target + 1e-4).sum()) + 1 <= entry[token].rank <= int((row > target - 1e-4).sum()) + 1
        top = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _ in top] == list(range(1, k + 1))
        assert [v for _, v in top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
        assert len(entry) in (k, k + 1) and all(lp.decoded_token is not None for lp in entry.values())


def test_prompt_logprobs_equal_transformers_with_prefix_cache_and_n(llm, hf_model):
    prompts = random_prompts([600, 1, 9], seed=93)  # two full 256-token blocks and a partial one; one token
    llm.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)  # its full blocks are now cached
    step_tokens, _ = record_steps(llm)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3),
                                  SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                  SamplingParams(n=2, temperature=1.0, max_tokens=2, prompt_logprobs=0)],
                        use_tqdm=False)
    # no prefix-cache hit: the cached blocks were not scored, so the whole prompt was computed
    assert step_tokens[0] == 600 + 1 + 9
    assert outs[1].prompt_logprobs == [None]
    assert outs[0].prompt_logprobs[5][prompts[0][5]].decoded_token == llm.tokenizer.decode([prompts[0][5]])
    for out, prompt, k in zip(outs, prompts, (3, 1, 0)):
        assert_prompt_logprobs_equal_transformers(hf_model, out, prompt, k)
    assert len(outs[2].outputs) == 2
    # a request without prompt_logprobs still takes the hits, and reports none
    step_tokens.clear()
    again = llm.generate([prompts[0]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert step_tokens[0] == 600 - 512 and again.prompt_logprobs is None
    del llm.step  # record_steps' spy
    assert_no_leaks(llm)
    with pytest.raises(ValueError, match=r"SamplingParams.prompt_logprobs=21 exceeds 20: the engine option "
                                         r"max_logprobs=20"):
        llm.generate(["hi"], SamplingParams(prompt_logprobs=21))


def test_prompt_logprobs_through_chunked_prefill_and_preemption(tiny_model, hf_model):
    prompts = random_prompts([130, 50, 45], seed=94)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)]
    # 48-token chunks cut the first prompt in three, each chunk's scores arriving a step after the next chunk is
    # launched; 16 blocks of 16 cannot hold all three to the end: preemption, and a recompute that scores nothing
    with LLM(tiny_model, max_num_batched_tokens=48, kvcache_block_size=16, num_kvcache_blocks=16) as engine:
        preempted = []
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
        outs = engine.generate(prompts, params, use_tqdm=False)
        assert preempted, "the cache was meant to be too small for all three"
        assert_no_leaks(engine)
    assert outs[1].prompt_logprobs is None
    assert_prompt_logprobs_equal_transformers(hf_model, outs[0], prompts[0], 2)
    assert_prompt_logprobs_equal_transformers(hf_model, outs[2], prompts[2], 1)


def test_prompt_logprobs_under_tensor_parallelism(tiny_model, hf_model):
    prompt = random_prompts([70], seed=95)[0]
    with LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=8) as engine:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                              use_tqdm=False)[0]
    assert_prompt_logprobs_equal_transformers(hf_model, out, prompt, 2)
