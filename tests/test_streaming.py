"""The iterator form of generate, and chat."""
import json
import shutil

import pytest
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm import cli as command_line

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


def test_a_call_while_this_thread_holds_an_open_iterator_is_an_error_not_a_hang(llm):
    prompts = random_prompts([12, 14, 16], seed=64)
    iterator = llm.iter_generate(prompts, GREEDY, window=1)
    first = next(iterator)
    with pytest.raises(RuntimeError, match="still open in this thread"):
        llm.generate(random_prompts([10], seed=65), GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="still open in this thread"):
        next(llm.iter_generate(random_prompts([10], seed=65), GREEDY))
    assert sorted([first[0], *(index for index, _ in iterator)]) == [0, 1, 2]  # the open one is unharmed
    assert_no_leaks(llm)
    assert len(llm.generate(random_prompts([10], seed=65), GREEDY, use_tqdm=False)) == 1


def test_chat_prompts_get_no_second_bos_from_the_tokenizer(tiny_model, tmp_path):
    """Llama 3's tokenizer adds a BOS and its chat template writes one: the prompt must hold one, as transformers'
    apply_chat_template(tokenize=True) gives."""
    path = tmp_path / "bos-model"
    shutil.copytree(tiny_model, path)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    bos = "<|endoftext|>"
    bos_id = next(t["id"] for t in tokenizer_json["added_tokens"] if t["content"] == bos)
    tokenizer_json["post_processor"] = {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos}))
    template = path / "chat_template.jinja"
    template.write_text("{{ bos_token }}" + template.read_text())
    conversation = [{"role": "user", "content": "hello there"}]
    with LLM(str(path), num_kvcache_blocks=8) as engine:
        expected = engine.tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)  # a BatchEncoding in v5
        assert engine.tokenizer.encode("x")[0] == bos_id and expected[0] == bos_id != expected[1]
        out = engine.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected and out.prompt == engine.chat_prompt(conversation)
    line = {"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": conversation, "max_tokens": 2}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    assert command_line.main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           "--model", str(path), "--num-kvcache-blocks", "8"]) == 0
    record = json.loads((tmp_path / "out.jsonl").read_text())
    assert record["response"]["body"]["usage"]["prompt_tokens"] == len(expected)
