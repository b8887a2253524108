"""One OpenAI batch request body -> a prompt and SamplingParams for the engine, or a LineError saying why not.

A body field that would change the result and that is not supported is an error for its line, never ignored.
"""
from nanovllm.batch.io import LineError
from nanovllm.engine.chat import normalize_message
from nanovllm.llm import LLM
from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# body field -> SamplingParams field, for fields both endpoints take as they are
SAMPLING_FIELDS = {name: name for name in (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "n",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens",
    "include_stop_str_in_output")}
IGNORED_FIELDS = {"model", "user"}  # they name things; the result does not depend on them
STRUCTURED_FIELDS = {"response_format", "structured_outputs"}  # OpenAI's and vLLM's extra body field
OWN_FIELDS = {COMPLETIONS: {"prompt", "max_tokens", "logprobs", *STRUCTURED_FIELDS},
              CHAT: {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                     "chat_template_kwargs", *STRUCTURED_FIELDS}}
# fields we do not support, accepted only at the value that changes nothing
NEUTRAL_VALUES = {"stream": (None, False), "stream_options": (None,), "echo": (None, False), "suffix": (None, ""),
                  "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none")}


def check_fields(body: dict, url: str) -> None:
    """Refuse a body field we do not support unless its value changes nothing: never ignore one silently."""
    # the body of the other endpoint: say what this one needs, not that the other's field is unsupported
    needed, other = ("messages", "prompt") if url == CHAT else ("prompt", "messages")
    if needed not in body:
        hint = f" ({other} is for {COMPLETIONS if url == CHAT else CHAT})" if other in body else ""
        raise LineError("invalid_request", f"{needed} is required for {url}{hint}")
    known = SAMPLING_FIELDS.keys() | IGNORED_FIELDS | OWN_FIELDS[url]
    for name, value in body.items():
        if name not in known and not (name in NEUTRAL_VALUES and value in NEUTRAL_VALUES[name]):
            raise LineError("unsupported_parameter", f"body field {name!r}={value!r} is not supported")


def sampling_params(body: dict, url: str, defaults: dict, max_model_len: int, prompt_len: int) -> SamplingParams:
    """The body's sampling fields as SamplingParams (LineError naming a bad one); `defaults` fill the gaps."""
    options = {**defaults, **{ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items()
                              if body.get(theirs) is not None}}
    max_tokens = body.get("max_completion_tokens") if url == CHAT else None
    max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
    # as OpenAI and vLLM: 16 for completions, the rest of the context for chat (the engine caps either there)
    options["max_tokens"] = max_tokens if max_tokens is not None else 16 if url == COMPLETIONS else \
        max_model_len - prompt_len
    logprobs = body.get("logprobs")
    if url == CHAT:
        if logprobs not in (None, True, False):
            raise LineError("invalid_request", f"logprobs must be true or false for chat, got {logprobs!r}")
        if body.get("top_logprobs") is not None and not logprobs:
            raise LineError("invalid_request", "top_logprobs needs logprobs: true")
        logprobs = (body.get("top_logprobs") or 0) if logprobs else None
    options["logprobs"] = logprobs
    options["structured_outputs"] = structured_outputs(body)
    try:
        return SamplingParams(**options)
    except (ValueError, TypeError) as error:
        raise LineError("invalid_request", str(error)) from None


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """OpenAI's response_format (json_schema, json_object; text: none) or vLLM's structured_outputs field."""
    response_format, fields = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and fields is not None:
        raise LineError("invalid_request", "give response_format or structured_outputs, not both")
    if fields is not None:
        if not isinstance(fields, dict):
            raise LineError("invalid_request", f"structured_outputs must be an object, got {fields!r}")
        unknown = sorted(set(fields) - set(StructuredOutputsParams.__dataclass_fields__))
        if unknown:
            raise LineError("unsupported_parameter", f"structured_outputs field {unknown[0]!r} is not supported")
        return _structured(**fields)
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _structured(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise LineError("invalid_request", "response_format json_schema needs a json_schema object with a "
                                               "schema object")
        return _structured(json=spec["schema"])
    raise LineError("invalid_request", f"response_format must have type text, json_object or json_schema, got "
                                       f"{response_format!r}")


def _structured(**fields) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as error:
        raise LineError("invalid_request", str(error)) from None


def prompt_of(body: dict, url: str, llm: LLM) -> tuple[str | None, list[int]]:
    """The prompt text (None for token ids) and its token ids; LineError where the body's prompt is unusable."""
    if url == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, prompt
        if not isinstance(prompt, str):
            raise LineError("invalid_request", "prompt must be a string or a list of token ids (one prompt per "
                                               f"line), got {type(prompt).__name__}")
        text = prompt
    else:
        messages, kwargs = body.get("messages"), body.get("chat_template_kwargs")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise LineError("invalid_request", "messages must be a non-empty list of message objects")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise LineError("invalid_request", "chat_template_kwargs must be an object")
        try:
            text = llm.chat_prompt([_message(m, i) for i, m in enumerate(messages)], kwargs)
        except LineError:
            raise
        except Exception as error:  # the template is user code: anything it raises is this line's error
            raise LineError("invalid_request", f"chat template failed: {type(error).__name__}: {error}") from None
    try:
        # a chat template writes its own special tokens (Llama 3's BOS): the tokenizer must not add them again
        return text, llm.tokenizer.encode(text, add_special_tokens=url == COMPLETIONS)
    except Exception as error:  # e.g. an unpaired surrogate (JSON's "\ud800") that no tokenizer can encode
        raise LineError("invalid_request", f"the prompt cannot be tokenized: {type(error).__name__}: {error}") \
            from None


def _message(message: dict, index: int) -> dict:
    """The chat path's own check (engine/chat.py), its errors as this line's."""
    try:
        return normalize_message(message, f"message {index}")
    except (TypeError, ValueError) as error:
        code = "unsupported_parameter" if "not supported" in str(error) else "invalid_request"
        raise LineError(code, str(error)) from None
