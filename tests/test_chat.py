"""Conversations through a chat template as vLLM renders them: tool calls in the history (engine/chat.py), through
LLM.chat and run-batch's chat lines alike."""
import json

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.batch.io import LineError
from nanovllm.batch.requests import CHAT, prompt_of

# the tool-call part of Qwen2.5's template, which writes the arguments with tojson (as Llama 3.1's does)
TOOL_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{% endfor %}"
)


def weather_call(arguments: object) -> dict:
    return {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}


def conversation(calls: object, role: str = "assistant") -> list[dict]:
    return [{"role": "user", "content": "weather?"}, {"role": role, "content": None, "tool_calls": calls}]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=8, max_model_len=256) as engine:
        yield engine


def chat_prompt(llm: LLM, messages: list[dict]) -> str:
    return llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TOOL_TEMPLATE)[0].prompt


def batch_prompt(llm: LLM, messages: list[dict]) -> str:
    body = {"messages": messages, "chat_template_kwargs": {"chat_template": TOOL_TEMPLATE}}
    return prompt_of(body, CHAT, llm)[0]


@pytest.mark.parametrize("render", [chat_prompt, batch_prompt])
def test_tool_call_arguments_reach_the_template_as_objects(llm, render):
    messages = conversation([weather_call('{"city": "Paris", "days": 2}')])
    expected = ('<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n'
                '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call><|im_end|>\n')
    assert render(llm, messages) == expected
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # untouched
    # an object, and no arguments at all, render as vLLM renders them
    assert render(llm, conversation([weather_call({"city": "Paris", "days": 2})])) == expected
    for empty in (None, "", "null"):
        assert '"arguments": {}}' in render(llm, conversation([weather_call(empty)]))


@pytest.mark.parametrize("render", [chat_prompt, batch_prompt])
def test_tool_calls_of_other_roles_and_empty_lists_are_dropped_as_vllm_drops_them(llm, render):
    plain = render(llm, [{"role": "user", "content": "weather?"}, {"role": "user", "content": ""}])
    assert render(llm, conversation([weather_call("{}")], role="user")) == plain
    assert render(llm, conversation("not even a list", role="user")) == plain
    assert render(llm, [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "",
                                                                   "tool_calls": []}]) == \
        "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"


@pytest.mark.parametrize("calls, start", [
    ([weather_call('{"city": "Paris"')], "tool call 0 of {where} has arguments that are not valid JSON"),
    (json.dumps([weather_call("{}")]), "{where} has tool_calls '[{{"),
    (["weather"], "tool call 0 of {where} is 'weather', not"),
    ([{"type": "code", "function": {"name": "x"}}], "tool call 0 of {where} has type 'code'"),
])
def test_bad_tool_calls_are_refused_naming_the_message(llm, calls, start):
    with pytest.raises(ValueError) as caught:
        chat_prompt(llm, conversation(calls))
    assert str(caught.value).startswith(start.format(where="message 1 of conversation 0")), caught.value
    with pytest.raises(LineError) as line_error:  # run-batch: that line's error record
        batch_prompt(llm, conversation(calls))
    assert line_error.value.message.startswith(start.format(where="message 1")), line_error.value.message
    assert line_error.value.code == ("unsupported_parameter" if "'code'" in start else "invalid_request")


def test_arguments_that_are_not_json_are_named_with_the_parse_error(llm):
    with pytest.raises(ValueError) as caught:
        chat_prompt(llm, conversation([weather_call('{"city": "Paris"')]))
    assert str(caught.value) == ("tool call 0 of message 1 of conversation 0 has arguments that are not valid JSON "
                                 "(Expecting ',' delimiter: line 1 column 17 (char 16)): '{\"city\": \"Paris\"'")
