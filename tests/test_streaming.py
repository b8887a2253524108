"""The iterator form of generate, and chat."""
import pytest
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=32, max_num_seqs=4) as engine:
        yield engine


def test_iter_generate_yields_every_request_once_as_it_finishes(llm, hf_model):
    prompts = random_prompts([30, 5, 200, 17, 60, 9, 120, 44], seed=60)
    lengths = [6, 2, 9, 3, 1, 7, 4, 5]
    pulled = []

    def source():
        for prompt in prompts:
            pulled.append(len(pulled))
            yield prompt

    params = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths)
    seen = {}
    for index, output in llm.iter_generate(source(), params, window=3):
        assert len(pulled) - len(seen) <= 3 + 1  # at most the window outstanding (plus the one being added)
        seen[index] = output.outputs[0].token_ids
    assert sorted(seen) == list(range(8))
    for i, prompt in enumerate(prompts):
        assert seen[i] == hf_greedy(hf_model, prompt, lengths[i])
    assert_no_leaks(llm)


def test_iter_generate_yields_bad_requests_as_errors_and_goes_on(llm):
    prompts = [[1, 2, 3], [], [5, 2000], [7, 8]]
    results = dict(llm.iter_generate(prompts, GREEDY, errors="yield"))
    assert isinstance(results[1], ValueError) and "empty prompt" in str(results[1])
    assert isinstance(results[2], ValueError) and "outside the vocabulary" in str(results[2])
    assert len(results[0].outputs[0].token_ids) == 6 and len(results[3].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="empty prompt"):
        list(llm.iter_generate(prompts, GREEDY))
    assert_no_leaks(llm)


def test_closing_the_iterator_early_frees_everything(llm):
    iterator = llm.iter_generate(random_prompts([40] * 6, seed=61), GREEDY, window=4)
    next(iterator)
    iterator.close()
    assert_no_leaks(llm)
    assert len(llm.generate(random_prompts([10], seed=62), GREEDY, use_tqdm=False)) == 1


def test_chat_applies_the_template_with_the_generation_prompt(llm, hf_model):
    conversation = [{"role": "user", "content": "hello there"}]
    expected_text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert llm.chat_prompt(conversation) == expected_text
    one = llm.chat(conversation, GREEDY, use_tqdm=False)
    two = llm.chat([conversation, conversation + [{"role": "assistant", "content": "hi"},
                                                  {"role": "user", "content": "more"}]], GREEDY, use_tqdm=False)
    assert len(one) == 1 and len(two) == 2 and one[0].outputs[0].token_ids == two[0].outputs[0].token_ids
    ids = llm.tokenizer.encode(expected_text)
    assert one[0].prompt_token_ids == ids and one[0].outputs[0].token_ids == hf_greedy(hf_model, ids, 6)


def test_chat_without_a_template_is_a_clear_error(llm, monkeypatch):
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "x"}])


def test_fewer_params_than_prompts_is_an_error_not_a_truncation(llm):
    prompts = random_prompts([10, 12, 14], seed=63)
    with pytest.raises(ValueError, match="sampling_params ran out at prompt 2"):
        list(llm.iter_generate(iter(prompts), iter([GREEDY, GREEDY])))
    assert_no_leaks(llm)
    assert len(list(llm.iter_generate(iter(prompts), iter([GREEDY] * 3)))) == 3
