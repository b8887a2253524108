"""A vLLM user's first script runs unchanged: the engine options, SamplingParams fields, prompt types and LLM
methods of vLLM that test_vllm_api.py does not cover, with the project's own errors for their misuse."""
import json
import re
import shutil

import pytest
import torch
from hf_reference import assert_no_leaks
from test_e2e_transformers import random_prompts
from test_vllm_api import record_steps

from nanovllm import LLM, SamplingParams, TextPrompt, TokensPrompt
from nanovllm.config import Config


@pytest.fixture(scope="module")
def llm(tiny_model):
    # vLLM's spellings of what this engine does anyway: the checkpoint's dtype, a seeded stream, no remote code
    with LLM(tiny_model, dtype="auto", seed=0, trust_remote_code=True, num_kvcache_blocks=32) as engine:
        yield engine


# --- engine options --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, expected", [
    ("auto", torch.float32), ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
    ("half", torch.float16), ("float32", torch.float32), ("float", torch.float32), (torch.bfloat16, torch.bfloat16),
])
def test_dtype_names_as_vllm(tiny_model, value, expected):
    assert Config(tiny_model, dtype=value).dtype == expected  # the tiny checkpoint is float32


@pytest.mark.parametrize("option, value, message", [
    ("dtype", "int8", r"dtype='int8' is not supported: choose 'auto' \(the checkpoint's dtype\), one of \["),
    ("dtype", torch.int8, r"dtype=torch.int8 is not supported"),
    ("seed", "0", r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\) \(what torch.Generator takes\), "
                  r"got '0'$"),
    ("seed", 2**64, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\) \(what torch.Generator takes\), "
                    r"got 18446744073709551616$"),
    ("seed", -2**63 - 1, r"seed must be None or an integer in \[-2\*\*63, 2\*\*64\) .*, got -9223372036854775809$"),
    ("trust_remote_code", "yes", r"trust_remote_code must be True or False, got 'yes'"),
])
def test_bad_engine_option_values_are_named(tiny_model, option, value, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, **{option: value})


def test_every_seed_torch_takes_starts_an_engine(tiny_model):
    for seed in (-2**63, 2**64 - 1):  # the ends of torch.Generator.manual_seed's range
        with LLM(tiny_model, seed=seed, num_kvcache_blocks=8) as engine:
            assert engine.model_runner.sampler.generator.initial_seed() == seed % 2**64


def test_dtype_bfloat16_runs_the_model_in_bfloat16(tiny_model, hf_model, llm):
    prompt = random_prompts([30], seed=90)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    exact = prompt_logprob_values(llm.generate([prompt], params, use_tqdm=False)[0], prompt)
    with LLM(tiny_model, dtype="bfloat16", num_kvcache_blocks=8) as bf16:
        assert {p.dtype for p in bf16.model_runner.model.parameters()} == {torch.bfloat16}
        assert bf16.model_runner.kv_layout.dtype == torch.bfloat16  # kv_cache_dtype "auto" follows it
        rounded = prompt_logprob_values(bf16.generate([prompt], params, use_tqdm=False)[0], prompt)
    reference = hf_prompt_logprobs(hf_model, prompt)
    expected = torch.tensor([reference[i - 1, prompt[i]] for i in range(1, len(prompt))])
    assert torch.allclose(exact, expected, atol=1e-4)
    # bfloat16's 8-bit mantissa: close to float32's values, and visibly not them
    assert torch.allclose(rounded, expected, atol=0.15) and not torch.allclose(rounded, expected, atol=1e-3)


def test_engine_seed_repeats_a_script_and_n_samples_still_differ(tiny_model):
    prompt = random_prompts([20], seed=91)[0]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True)  # no per-request seed

    def run(seed: int | None) -> list[tuple[int, ...]]:
        with LLM(tiny_model, seed=seed, num_kvcache_blocks=8) as engine:
            return [tuple(c.token_ids) for c in engine.generate([prompt], params, use_tqdm=False)[0].outputs]

    first = run(0)
    assert run(0) == first and len(set(first)) == 3
    assert run(1) != first


def test_remote_code_is_refused_by_name_only_for_an_architecture_we_lack(tiny_model, tmp_path):
    for name, architecture in (("fancy", "FancyForCausalLM"), ("qwen3-with-auto-map", "Qwen3ForCausalLM")):
        path = tmp_path / name
        shutil.copytree(tiny_model, path)
        config = json.loads((path / "config.json").read_text())
        config.update(architectures=[architecture], auto_map={"AutoConfig": "configuration_fancy.FancyConfig",
                                                              "AutoModelForCausalLM": "modeling_fancy.FancyModel"})
        if architecture == "FancyForCausalLM":
            config["model_type"] = "fancy"
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"needs its own code \(auto_map .*configuration_fancy.* for "
                                         r"architectures=\['FancyForCausalLM'\], which this engine does not implement "
                                         r"and will not run, trust_remote_code or not; supported: \["):
        LLM(str(tmp_path / "fancy"), trust_remote_code=True)
    with LLM(str(tmp_path / "qwen3-with-auto-map"), trust_remote_code=True, num_kvcache_blocks=4) as engine:
        assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


# --- requests ----------------------------------------------------------------------------------------------------
def test_max_tokens_none_generates_up_to_max_model_len(tiny_model):
    prompt = random_prompts([40], seed=92)[0]
    with LLM(tiny_model, max_model_len=48, num_kvcache_blocks=4) as engine:
        out = engine.generate([prompt], SamplingParams(max_tokens=None, min_tokens=3, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 48 - 40 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"SamplingParams.max_tokens=0 is out of range: allowed None"):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize("field, value, allowed", [
    ("prompt_logprobs", -1, "None or an integer >= 0"), ("bad_words", [""], "a string, a list of strings"),
    ("bad_words", ["  "], "a string, a list of strings"), ("bad_words", [3], "a string, a list of strings"),
])
def test_new_sampling_params_are_checked(field, value, allowed):
    message = f"SamplingParams.{field}={value!r} is out of range: allowed {allowed}"
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**{field: value})


def test_get_tokenizer_and_vllm_prompt_types(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = tokenizer.encode("hello there")
    by_tokens, by_text = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="hello there")], params,
                                      use_tqdm=False)
    assert by_tokens.prompt_token_ids == by_text.prompt_token_ids == ids and by_text.prompt == "hello there"
    assert by_tokens.outputs[0].token_ids == by_text.outputs[0].token_ids


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


@pytest.mark.slow
def test_prompt_logprobs_under_tensor_parallelism(tiny_model, hf_model):
    prompt = random_prompts([70], seed=95)[0]
    with LLM(tiny_model, tensor_parallel_size=2, num_kvcache_blocks=8) as engine:
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                              use_tqdm=False)[0]
    assert_prompt_logprobs_equal_transformers(hf_model, out, prompt, 2)


# --- bad_words ---------------------------------------------------------------------------------------------------
def vllm_bad_word_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: the word, and with a leading space when that is other tokens of the same count."""
    ids = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        ids.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return ids


@torch.inference_mode()
def greedy_with_bad_words(hf_model, prompt: list[int], steps: int, bad: list[list[int]]) -> list[int]:
    """One greedy token at a time on transformers' logits, masking each word's last token after its prefix."""
    output: list[int] = []
    for _ in range(steps):
        logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
        for word in bad:
            if len(word) - 1 <= len(output) and output[len(output) - len(word) + 1:] == word[:-1]:
                logits[word[-1]] = float("-inf")
        output.append(int(logits.argmax()))
    return output


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_bad_words_equal_the_reference(tiny_model, hf_model, async_scheduling):
    with LLM(tiny_model, num_kvcache_blocks=8, async_scheduling=async_scheduling) as engine:
        tokenizer = engine.get_tokenizer()
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts = random_prompts([20, 25], seed=96)
        free = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, use_tqdm=False)]
        text = [tokenizer.decode([t]) for t in free[0]]
        # a one-token word the free run generates, and a two-token one: both tokens letters, spelt back the same
        single = next(t for t in text[1:] if t.isalpha() and tokenizer.encode(t) == tokenizer.encode(t.lstrip()))
        pair = next(text[j] + text[j + 1] for j in range(len(text) - 1)
                    if (text[j] + text[j + 1]).isalpha() and not text[j].startswith(" ")
                    and tokenizer.encode(text[j] + text[j + 1]) == free[0][j: j + 2] and text[j] != single)
        for words in ([single], [pair], [pair, single]):
            params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, bad_words=words), greedy]
            outs = engine.generate(prompts, params, use_tqdm=False)
            expected = greedy_with_bad_words(hf_model, prompts[0], 12, vllm_bad_word_ids(tokenizer, words))
            assert outs[0].outputs[0].token_ids == expected != free[0], words
            assert outs[1].outputs[0].token_ids == free[1]  # the row beside it is untouched
        assert_no_leaks(engine)


# --- chat ---------------------------------------------------------------------------------------------------------
def test_chat_options_as_vllm(llm):
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello th"}]
    opened = llm.chat(conversation, greedy, use_tqdm=False, add_generation_prompt=False,
                      continue_final_message=True)[0]
    assert tokenizer.decode(opened.prompt_token_ids).endswith("<|im_start|>assistant\nhello th")
    closed = llm.chat(conversation, greedy, use_tqdm=False, add_generation_prompt=False)[0]
    assert tokenizer.decode(closed.prompt_token_ids).endswith("hello th<|im_end|>\n")
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}[assistant] {% endif %}"
    custom = llm.chat(conversation, greedy, use_tqdm=False, chat_template=template)[0]
    assert custom.prompt == "[user] hi\n[assistant] hello th\n[assistant] "
    with pytest.raises(ValueError, match="continue_final_message=True continues the final message and "
                                         "add_generation_prompt=True starts a new one"):
        llm.chat(conversation, greedy, continue_final_message=True)


@pytest.mark.parametrize("messages, error, message", [
    ("hello", TypeError, r"messages must be a conversation \(a list of \{'role': ..., 'content': ...\} dicts\) or a "
                         r"list of conversations, not str"),
    (["hello"], TypeError, r"conversation 0 is a str, not a list of message dicts"),
    ([{"role": "user", "content": "hi"}, "there"], TypeError, r"message 1 of conversation 0 is a str, not a dict"),
    ([[{"role": "user", "content": "hi"}], [{"content": "no role"}]], ValueError,
     r"message 0 of conversation 1 has no 'role': keys \['content'\]"),
    ([{"role": "user"}], ValueError, r"message 0 of conversation 0 has no 'content': keys \['role'\]"),
    ([{"text": "x"}], ValueError, r"message 0 of conversation 0 has no 'role' and no 'content'"),
    ([[{"role": "user", "content": "hi"}], []], ValueError, r"conversation 1 holds no message"),
    ([{"role": None, "content": "hi"}], TypeError, r"message 0 of conversation 0 has role None, not a string"),
])
def test_chat_misuse_is_our_error_before_any_work(llm, messages, error, message):
    step_tokens, _ = record_steps(llm)
    with pytest.raises(error, match=message):
        llm.chat(messages, SamplingParams(max_tokens=2))
    assert not step_tokens
    del llm.step  # record_steps' spy
    assert_no_leaks(llm)
