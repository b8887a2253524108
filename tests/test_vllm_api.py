"""vLLM users' code runs unchanged: output objects, prompt forms, SamplingParams, and clear errors."""
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts

from nanovllm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from nanovllm.config import ARCHITECTURES
from nanovllm.models import MODEL_REGISTRY


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
    path = tmp_path / "gpt2"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model: architectures=\['GPT2LMHeadModel'\], "
                                         r"model_type='gpt2'; supported: \['LlamaForCausalLM', 'Qwen2ForCausalLM', "
                                         r"'Qwen3ForCausalLM'"):
        LLM(str(path))
    assert os.path.isdir(path)


def test_the_architectures_config_accepts_are_those_models_implements():
    assert sorted(ARCHITECTURES) == sorted(MODEL_REGISTRY)


def greedy_with_penalties(hf_model, prompt: list[int], steps: int, presence: float, frequency: float,
                          repetition: float) -> list[int]:
    """vLLM's formulas on transformers' logits, one greedy token at a time: the plain reference."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            output = torch.tensor(tokens[len(prompt):], dtype=torch.long)
            counts = torch.zeros_like(logits).index_add_(0, output, torch.ones(len(output)))
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(tokens)] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
            logits = logits - frequency * counts - presence * (counts > 0)
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_penalties_on_greedy_paths_equal_the_reference(tiny_model, hf_model, async_scheduling):
    prompts = random_prompts([40, 300, 7], seed=54, vocab=50)  # a small alphabet: tokens repeat
    # a prompt holding the tokens its own continuation produces: one token in both prompt and output
    prompts[2] += hf_greedy(hf_model, prompts[2], 16)[4:12]
    # values that favour repetition, so each visibly changes what a random model generates; then a mix
    cases = [dict(repetition_penalty=0.5), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.0),
             dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)]
    # a small cache: preemption recomputes a request and rebuilds its history
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=30, async_scheduling=async_scheduling) as llm:
        for case in cases:
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **case)
            outputs = llm.generate(prompts + [prompts[0]], [params] * 3 + [SamplingParams(
                temperature=0, max_tokens=16, ignore_eos=True)], use_tqdm=False)
            for prompt, out in zip(prompts, outputs):
                expected = greedy_with_penalties(hf_model, prompt, 16, case.get("presence_penalty", 0.0),
                                                 case.get("frequency_penalty", 0.0),
                                                 case.get("repetition_penalty", 1.0))
                assert out.outputs[0].token_ids == expected, case
            # the unpenalised row in the same batch is untouched, and the penalty changed the penalised one
            assert outputs[3].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 16)
            if case is not cases[-1]:
                assert outputs[3].outputs[0].token_ids != outputs[0].outputs[0].token_ids, case
        assert_no_leaks(llm)


def test_repetition_penalty_equals_transformers(llm, hf_model):
    prompt = random_prompts([30], seed=55, vocab=40)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                repetition_penalty=1.3), use_tqdm=False)[0]
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        expected = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_n_samples_share_the_prompt_and_are_distinct_and_reproducible(llm):
    prompt = random_prompts([600], seed=56)[0]  # two full 256-token blocks and a partial one, all shared
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    step_tokens, copies = record_steps(llm)
    first = llm.generate([prompt], params, use_tqdm=False)
    again = llm.generate([prompt], params, use_tqdm=False)
    assert len(first) == 1 and [c.index for c in first[0].outputs] == [0, 1, 2, 3]
    samples = [tuple(c.token_ids) for c in first[0].outputs]
    assert len(set(samples)) == 4 and samples == [tuple(c.token_ids) for c in again[0].outputs]
    # the prompt is computed once per call (the second finds its two full blocks cached); three of the four
    # samples copy the shared partial block on their first write and the last one writes it in place
    assert [n for n in step_tokens if n > 0] == [600, 600 - 512] and len(copies) == 2 * 3
    assert_no_leaks(llm)


def test_n_greedy_samples_each_equal_transformers_through_fork_and_copy(tiny_model, hf_model):
    prompts = random_prompts([40, 16, 23], seed=58)  # a partial block, an exactly full one, another partial
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=60) as llm:
        step_tokens, copies = record_steps(llm)
        outputs = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                               use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            expected = hf_greedy(hf_model, prompt, 20)
            assert [c.token_ids for c in out.outputs] == [expected] * 3
        assert step_tokens[0] == sum(map(len, prompts)) and len(copies) == 2 * 2  # the full block needs none
        assert_no_leaks(llm)
    # an FP8 cache copies each row's scale with it: the samples still agree with each other
    with LLM(tiny_model, kvcache_block_size=16, num_kvcache_blocks=60, kv_cache_dtype="fp8") as llm:
        outputs = llm.generate(prompts, SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True),
                               use_tqdm=False)
        assert all(c.token_ids == out.outputs[0].token_ids for out in outputs for c in out.outputs)


def record_steps(llm: LLM) -> tuple[list[int], list[tuple[int, int]]]:
    """Spy on llm.step: each step's token count (negative for decode) and every block copy."""
    step_tokens, copies = [], []
    step, bm = llm.step, llm.scheduler.block_manager
    take_copies = bm.take_copies

    def recorded_take_copies():
        taken = take_copies()
        copies.extend(taken)
        return taken

    llm.step = lambda: (result := step(), step_tokens.append(result[1]))[0]
    bm.take_copies = recorded_take_copies
    return step_tokens, copies


def test_default_sampling_params_from_generation_config(tiny_model, tmp_path):
    path = tmp_path / "with-defaults"
    shutil.copytree(tiny_model, path)
    config_path = path / "generation_config.json"
    generation = json.loads(config_path.read_text()) if config_path.exists() else {}
    generation.update(temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=40)
    config_path.write_text(json.dumps(generation))
    with LLM(str(path), num_kvcache_blocks=8) as llm:
        defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.6, 20, 0.95, 40)


def test_a_stop_string_inside_min_tokens_does_not_stop_later(llm):
    """vLLM checks stop strings on new text once min_tokens is reached: an occurrence completed earlier neither
    stops the request later nor moves where its text is cut."""
    prompt = random_prompts([30], seed=57)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    first_two = llm.tokenizer.decode(free.outputs[0].token_ids[:2])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, min_tokens=4,
                                                stop=[first_two]), use_tqdm=False)[0].outputs[0]
    assert first_two not in llm.tokenizer.decode(free.outputs[0].token_ids[2:])  # no later occurrence
    assert out.finish_reason == "length" and out.token_ids == free.outputs[0].token_ids


def test_a_stop_string_met_inside_min_tokens_and_again_after_stops_there(llm):
    """The later occurrence of a stop string counts even while the one min_tokens let pass is still in view."""
    decode = llm.tokenizer.decode
    for seed in range(70, 90):  # a prompt whose greedy output repeats a token's text
        prompt = random_prompts([20], seed=seed)[0]
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
        texts = [decode([t]) for t in free]
        repeat = next((j for j, text in enumerate(texts) if text.strip() and text in texts[:j]), None)
        if repeat is not None:
            break
    assert repeat is not None, "no greedy output with a repeated token in 20 prompts"
    stop = texts[repeat]
    # as vLLM: stop strings are looked for once more than min_tokens tokens are out, so the first occurrence
    # (completed with min_tokens tokens out) passes
    min_tokens = texts.index(stop) + 1
    # the reference: the first token past min_tokens whose own text holds the end of an occurrence
    expected = next(k for k in range(min_tokens, len(free))
                    if decode(free[:k + 1]).rfind(stop) + len(stop) > len(decode(free[:k])))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free[:expected + 1] and out.text == decode(free[:expected + 1])[:-len(stop)]
    assert_no_leaks(llm)


@pytest.mark.parametrize("option, value", [
    ("num_kvcache_blocks", 2.5), ("num_kvcache_blocks", -0.5), ("kvcache_block_size", 16.0),
    ("kvcache_block_size", "256"), ("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", 1.5),
    ("enforce_eager", "no"), ("max_num_seqs", True), ("max_logprobs", 2.0),
])
def test_engine_options_of_the_wrong_type_are_named(tiny_model, option, value):
    with pytest.raises(ValueError, match=rf"^{option} must .*got {re.escape(repr(value))}"):
        LLM(tiny_model, **{option: value})
