"""vLLM users' code runs unchanged: output objects, prompt forms, SamplingParams, and clear errors."""
import json
import os
import shutil

import numpy as np
import pytest
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=32) as engine:
        yield engine


def test_outputs_are_vllm_objects_and_still_read_as_dicts(llm, hf_model):
    prompt = random_prompts([40], seed=50)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert isinstance(out, RequestOutput) and out.finished and out.prompt is None
    assert out.prompt_token_ids == prompt and isinstance(out.request_id, str)
    completion = out.outputs[0]
    assert isinstance(completion, CompletionOutput) and completion.index == 0
    assert completion.token_ids == hf_greedy(hf_model, prompt, 6)
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.logprobs is None and completion.cumulative_logprob is None
    assert out["text"] == completion.text and out["token_ids"] == completion.token_ids
    assert out["finish_reason"] == "length" and "logprobs" not in out


def test_stop_reasons_logprobs_and_stop_string_in_output(llm):
    prompt = random_prompts([30], seed=51)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[4]],
                                                  ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tokens[4] and by_id.token_ids == tokens[:5]
    stop = llm.tokenizer.decode(tokens[6:8])
    cut, kept = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                                       include_stop_str_in_output=keep), use_tqdm=False)[0].outputs[0]
                 for keep in (False, True))
    assert cut.stop_reason == stop == kept.stop_reason and cut.finish_reason == "stop"
    assert kept.text == cut.text + stop and not cut.text.endswith(stop)
    with_logprobs = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0]
    assert len(with_logprobs.logprobs) == 4
    total = 0.0
    for token, position in zip(with_logprobs.token_ids, with_logprobs.logprobs):
        assert all(isinstance(entry, Logprob) for entry in position.values())
        assert position[token].rank == 1  # greedy: the sampled token is the most likely
        assert sorted(entry.rank for entry in position.values()) == [1, 2]
        assert position[token].decoded_token == llm.tokenizer.decode([token])
        total += position[token].logprob
    assert with_logprobs.cumulative_logprob == pytest.approx(total)


def test_every_prompt_form(llm):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = random_prompts([12], seed=52)[0]
    text = llm.tokenizer.decode(ids)
    reference = llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids
    one_string = llm.generate("Hello there", params, use_tqdm=False)
    assert len(one_string) == 1 and one_string[0].prompt == "Hello there"
    assert len(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)) == 1
    mixed = llm.generate((p for p in [{"prompt_token_ids": ids}, {"prompt": text}, np.array(ids, dtype=np.int32),
                                      ids, text]), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed][:4:3] == [reference, reference]
    assert mixed[2].outputs[0].token_ids == reference and mixed[1].prompt == mixed[4].prompt == text
    assert len(llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids) <= 16  # default params


@pytest.mark.parametrize("prompts, message", [
    ([[1, 2, True]], r"prompt 0 holds True \(bool\), which is not a token id"),
    ([[1, 2], [3, 4.0]], r"prompt 1 holds 4.0 \(float\)"),
    (["ok", b"bytes"], r"prompt 1 is a bytes"),
    ([1, 2, 3], r"prompt 0 is a int.*pass \[\[\.\.\.\]\] for one"),
    ([{"text": "x"}], r"prompt 0 is a dict without a 'prompt' string or 'prompt_token_ids'"),
    (42, r"prompts must be a string, a prompt dict, or an iterable of prompts, not int"),
])
def test_bad_prompts_are_type_errors_naming_the_index(llm, prompts, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert_no_leaks(llm)


def test_sampling_params_as_vllm(llm):
    with pytest.raises(TypeError):
        SamplingParams(2)  # vLLM's first field is n: positional use is refused rather than misread
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == [] and params.max_tokens == 16 and params.top_k == 0
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=-5 is out of range"):
        params.temperature = -5
    assert params.temperature == 1.0  # the bad value is not kept
    params.stop = "x"
    assert params.stop == ["x"]
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a list of them, or None, not dict"):
        llm.generate(["hi"], {"temperature": 0})
    with pytest.raises(TypeError, match=r"sampling_params\[1\] is a dict"):
        llm.generate(["hi", "there"], [SamplingParams(), {}])
    with pytest.raises(ValueError, match=r"logprobs=21 exceeds 20: the engine option max_logprobs=20"):
        llm.generate(["hi"], SamplingParams(logprobs=21))


def test_end_token_stops_with_no_stop_reason_and_special_tokens_kept_when_asked(llm):
    prompt = random_prompts([30], seed=51)[0]  # greedy reaches the model's end token on the tiny checkpoint
    skipped, kept = (llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=skip),
                                  use_tqdm=False)[0].outputs[0] for skip in (True, False))
    eos = skipped.token_ids[-1]
    assert eos in llm.config.eos_token_ids and skipped.finish_reason == "stop" and skipped.stop_reason is None
    eos_text = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert kept.text == skipped.text + eos_text and eos_text not in skipped.text


def test_other_architectures_are_refused_by_name(tiny_model, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model: architectures=\['LlamaForCausalLM'\], "
                                         r"model_type='llama'; supported: \['Qwen3ForCausalLM'\]"):
        LLM(str(path))
    assert os.path.isdir(path)
