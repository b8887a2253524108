"""The prompt forms generate() accepts, as vLLM's LLM.generate does."""
from collections.abc import Iterable
from dataclasses import replace
from typing import TypedDict

import numpy as np
from typing_extensions import NotRequired  # in typing from Python 3.11; torch depends on typing_extensions

from nanovllm.sampling_params import SamplingParams


class TextPrompt(TypedDict):
    """vLLM's text prompt: {"prompt": text}, tokenized by the checkpoint's tokenizer."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt: {"prompt_token_ids": ids}, used as they are; "prompt" (its text) is only reported."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PROMPT_KEYS = {"prompt", "prompt_token_ids"}
# one prompt: text, token ids, a TextPrompt or a TokensPrompt
Prompt = str | list[int] | TextPrompt | TokensPrompt | dict


def parse_prompts(prompts: Prompt | Iterable[Prompt]) -> list[tuple[str | None, str | list[int]]]:
    """(the prompt's text or None, what to tokenize or the token ids) per prompt. One string or one dict is one
    prompt; any other iterable (a list, a generator) holds prompts. Anything else is a TypeError naming it."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif not isinstance(prompts, Iterable) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"prompts must be a string, a prompt dict, or an iterable of prompts, "
                        f"not {type(prompts).__name__}")
    return [parse_prompt(i, prompt) for i, prompt in enumerate(prompts)]


def parse_prompt(index: int, prompt) -> tuple[str | None, str | list[int]]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS, key=str)
        if unknown and PROMPT_KEYS & set(prompt):  # multi_modal_data and the like change the answer: never drop them
            raise ValueError(f"prompt {index} has keys {unknown} this engine does not support (text-only models); "
                             f"a prompt dict takes {sorted(PROMPT_KEYS)}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), _token_ids(index, prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], prompt["prompt"]
        raise TypeError(f"prompt {index} is a dict without a 'prompt' string or 'prompt_token_ids': "
                        f"keys {sorted(prompt)}")
    if isinstance(prompt, (list, tuple, np.ndarray)):
        return None, _token_ids(index, prompt)
    hint = " (a token-id prompt is a list of ints: pass [[...]] for one)" if _is_token_id(prompt) else ""
    raise TypeError(f"prompt {index} is a {type(prompt).__name__}; expected a string, a list of token ids, or "
                    f"a dict with 'prompt' or 'prompt_token_ids'{hint}")


def _is_token_id(value) -> bool:
    # bools are ints to Python, and floats or bytes are never token ids; numpy integers are
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _token_ids(index: int, ids) -> list[int]:
    ids = list(ids)
    bad = next((t for t in ids if not _is_token_id(t)), None)
    if bad is not None:
        raise TypeError(f"prompt {index} holds {bad!r} ({type(bad).__name__}), which is not a token id")
    return [int(t) for t in ids]


def broadcast_params(params: SamplingParams | list[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from one (or None: the defaults) or a list of `count`."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)):
        raise TypeError(f"sampling_params must be a SamplingParams, a list of them, or None, "
                        f"not {type(params).__name__}")
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts; pass one, or one per prompt")
    bad = next((i for i, p in enumerate(params) if not isinstance(p, SamplingParams)), None)
    if bad is not None:
        raise TypeError(f"sampling_params[{bad}] is a {type(params[bad]).__name__}, not a SamplingParams")
    return list(params)


def samples_of(params: SamplingParams) -> list[SamplingParams]:
    """The n requests behind params.n: each samples once; with a seed, each from its own derived stream, so the
    samples differ from each other and repeat from run to run."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else (params.seed * 1_000_033 + i) % 2**63)
            for i in range(params.n)]
