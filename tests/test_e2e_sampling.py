"""Request options and validation through the whole engine on CPU."""
import pytest
import torch
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=16, max_model_len=1024) as engine:
        yield engine


def test_seed_gives_the_same_tokens_whatever_the_batch(llm):
    prompt = random_prompts([50], seed=30)[0]
    others = random_prompts([20, 300, 7], seed=31)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=123, max_tokens=12, ignore_eos=True)
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0]["token_ids"]
    mixed = llm.generate(others[:1] + [prompt] + others[1:], [free, seeded, free, free], use_tqdm=False)
    assert mixed[1]["token_ids"] == alone
    other_seed = SamplingParams(temperature=1.0, top_k=50, seed=124, max_tokens=12, ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0]["token_ids"] != alone


def test_stop_string_split_across_tokens(llm):
    prompt = random_prompts([40], seed=32)[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    tokens = greedy[0]["token_ids"]
    pieces = [llm.tokenizer.decode([t]) for t in tokens]
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(i for i in range(2, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:1]
    text_before = llm.tokenizer.decode(tokens[: i + 2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop]), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == tokens[: i + 2]  # up to the token that completed the stop string
    assert stop not in out["text"] and out["text"] == text_before[: text_before.find(stop)]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = random_prompts([30], seed=33)[0]
    tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)[0]["token_ids"]
    stop_id = tokens[1]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0]
    assert out["token_ids"] == tokens[: tokens.index(stop_id) + 1] and out["finish_reason"] == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert stop_id not in out["token_ids"][:4] and len(out["token_ids"]) >= 5
    assert out["token_ids"][0] == tokens[0] or tokens[0] == stop_id


def test_logprobs_match_transformers(llm, hf_model):
    prompt = random_prompts([60], seed=34)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out["logprobs"]) == 6
    only_sampled = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, logprobs=0, ignore_eos=True),
                                use_tqdm=False)[0]
    assert [list(entry) for entry in only_sampled["logprobs"]] == [[t] for t in only_sampled["token_ids"]]
    with torch.inference_mode():
        ids = torch.tensor([prompt + out["token_ids"][:-1]])
        expected = hf_model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    for step, (token, entry) in enumerate(zip(out["token_ids"], out["logprobs"])):
        assert set(entry) == set(expected[step].topk(3).indices.tolist()) | {token}
        for token_id, value in entry.items():
            assert value == pytest.approx(expected[step, token_id].item(), abs=1e-4)


def test_every_end_token_of_the_model_counts(llm):
    assert sorted(llm.config.eos_token_ids) == sorted([llm.tokenizer.eos_token_id,
                                                       llm.tokenizer.convert_tokens_to_ids("<|endoftext|>")])


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", "hot"), ("top_k", -2), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.2),
    ("min_p", -0.1), ("min_p", 1.5), ("seed", "x"), ("max_tokens", 0), ("min_tokens", -1), ("min_tokens", 100),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", -1),
])
def test_sampling_params_reject_out_of_range(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* allowed"):
        SamplingParams(**{field: value})


def test_bad_requests_are_rejected_before_any_work_and_leave_the_engine_usable(llm, hf_model):
    good = random_prompts([25], seed=35)[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    bad_calls = [
        ([good, []], greedy, "empty prompt"),
        ([good, ""], greedy, "empty prompt"),
        ([good, [5, 1024]], greedy, r"token id 1024 outside the vocabulary \[0, 1024\)"),
        ([good, [-1]], greedy, "token id -1 outside"),
        ([good, [1] * 1024], greedy, "not shorter than max_model_len=1024"),
        ([good, good], [greedy], "got 1 SamplingParams for 2 prompts"),
    ]
    for prompts, params, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.is_finished()
        assert_no_leaks(llm)
    assert llm.generate([], greedy) == []
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(llm.config.model, max_num_seq=4)
    out = llm.generate([good], greedy, use_tqdm=False)[0]
    assert out["token_ids"] == hf_greedy(hf_model, good, 8)
