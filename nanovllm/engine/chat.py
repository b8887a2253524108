"""Conversations -> prompt text through the tokenizer's chat template, as vLLM's LLM.chat; misuse is refused here,
by index, before any work (transformers would iterate a string's characters, or render a message without a role)."""
import json

from transformers import PreTrainedTokenizerBase

Conversation = list[dict]


MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls"}  # the rest would be dropped silently


def parse_conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them, each message checked and its content made a
    string (normalize_message)."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"messages must be a conversation (a list of {{'role': ..., 'content': ...}} dicts) or a "
                        f"list of conversations, not {type(messages).__name__}")
    if messages and isinstance(messages[0], dict):
        messages = [messages]
    for c, conversation in enumerate(messages):
        if not isinstance(conversation, (list, tuple)):
            raise TypeError(f"conversation {c} is a {type(conversation).__name__}, not a list of message dicts")
        if not conversation:
            raise ValueError(f"conversation {c} holds no message")
    return [[normalize_message(message, f"message {m} of conversation {c}") for m, message in enumerate(conversation)]
            for c, conversation in enumerate(messages)]


def normalize_message(message: object, where: str = "message") -> dict:
    """A message as the chat template takes it: a string role, and content as one string. OpenAI's content parts
    are joined as vLLM joins them for a text-only model (newline-separated text parts); any other part, or any
    other content, is refused by name. ValueError/TypeError name `where`."""
    if not isinstance(message, dict):
        raise TypeError(f"{where} is a {type(message).__name__}, not a dict with 'role' and 'content'")
    missing = [key for key in ("role", "content") if key not in message]
    if missing and not (missing == ["content"] and message.get("tool_calls")):
        raise ValueError(f"{where} has no {' and no '.join(map(repr, missing))}: keys {sorted(message, key=str)}")
    unknown = sorted(set(message) - MESSAGE_KEYS, key=str)
    if unknown:
        raise ValueError(f"{where} has fields {unknown} that are not supported; a message takes "
                         f"{sorted(MESSAGE_KEYS)}")
    if not isinstance(message["role"], str):
        raise TypeError(f"{where} has role {message['role']!r}, not a string")
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(_text_part(part, f"content part {p} of {where}") for p, part in enumerate(content))
    elif content is None and message.get("tool_calls"):  # an assistant turn that only calls tools
        content = ""
    elif not isinstance(content, str):
        raise TypeError(f"{where} has content {content!r}: content is a string or a list of text parts "
                        f"({{'type': 'text', 'text': ...}})")
    normalized = {**message, "content": content}
    normalized.pop("tool_calls", None)
    calls = message.get("tool_calls")
    # as vLLM: only an assistant's calls reach the template, and an empty list is no calls
    if message["role"] == "assistant" and calls is not None and calls != []:
        normalized["tool_calls"] = _tool_calls(calls, where)
    return normalized


def _tool_calls(calls: object, where: str) -> list[dict]:
    """OpenAI's tool calls as vLLM hands them to the template: each function's `arguments`, a JSON string in
    OpenAI's format, parsed into its object, so a template that writes it with `tojson` (Qwen2.5's, Llama 3.1's)
    writes the object rather than a string of escaped JSON. The caller's dicts are left as they were."""
    if not isinstance(calls, list):
        raise ValueError(f"{where} has tool_calls {calls!r}: tool_calls is a list of {{'type': 'function', "
                         f"'function': {{'name': ..., 'arguments': ...}}}} objects")
    parsed = []
    for c, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError(f"tool call {c} of {where} is {call!r}, not a {{'type': 'function', 'function': "
                             f"{{'name': ..., 'arguments': ...}}}} object")
        if call.get("type", "function") != "function":
            raise ValueError(f"tool call {c} of {where} has type {call['type']!r}, which is not supported: "
                             f"only 'function' calls are")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError as error:
                raise ValueError(f"tool call {c} of {where} has arguments that are not valid JSON ({error}): "
                                 f"{arguments!r}") from None
        elif arguments not in (None, "") and not isinstance(arguments, (dict, list)):
            raise TypeError(f"tool call {c} of {where} has arguments {arguments!r}: a JSON string or an object")
        # None, "" and JSON's null are no arguments, as vLLM reads them
        parsed.append({**call, "function": {**function, "arguments": {} if arguments in (None, "") else arguments}})
    return parsed


TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal"}  # part type -> its text's key, as vLLM


def _text_part(part: object, where: str) -> str:
    if isinstance(part, str):  # vLLM takes a bare string as a text part
        return part
    if not isinstance(part, dict) or "type" not in part:
        raise TypeError(f"{where} is {part!r}, not a {{'type': 'text', 'text': ...}} part")
    if part["type"] not in TEXT_PARTS:
        raise ValueError(f"{where} has type {part['type']!r}: this engine runs text-only models, so only text "
                         f"parts ({sorted(TEXT_PARTS)}) are supported")
    text = part.get(TEXT_PARTS[part["type"]])
    if not isinstance(text, str):
        raise TypeError(f"{where} has {TEXT_PARTS[part['type']]} {text!r}, not a string")
    return text


def render(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           chat_template_kwargs: dict | None = None, model: str = "the model") -> str:
    """The prompt text of one conversation: `chat_template` (else the tokenizer's) with the generation prompt,
    or with the final message left open for the model to continue. chat_template_kwargs override the keyword
    arguments (add_generation_prompt too), as vLLM's."""
    options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
               **(chat_template_kwargs or {})}
    if "tokenize" in options or "conversation" in options:
        raise ValueError(f"chat_template_kwargs may not set 'tokenize' or 'conversation': got "
                         f"{sorted(chat_template_kwargs)}")
    chat_template = options.pop("chat_template", None) if chat_template is None else chat_template
    options.pop("chat_template", None)
    if options["add_generation_prompt"] and options["continue_final_message"]:
        raise ValueError("continue_final_message=True continues the final message and add_generation_prompt=True "
                         "starts a new one: pass add_generation_prompt=False with continue_final_message=True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template: pass chat_template=, or use generate() "
                         f"with prompts formatted by hand")
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False, **options)
