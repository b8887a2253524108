import difflib
import functools
import json
import os
from dataclasses import dataclass, field, fields

# vLLM's bound on n (its VLLM_MAX_N_SEQUENCES default): each sample is a sequence made before any work, so an
# absurd n would stall the caller while it filled memory rather than fail
MAX_N = 16384
# StructuredOutputsParams' kinds: exactly one is set
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True, kw_only=True, frozen=True)
class StructuredOutputsParams:
    """Constrained decoding, vLLM's names: every generated token keeps the output a prefix of something the
    constraint accepts (compiled by xgrammar), and the output ends only where it may. Exactly one kind:

    json: a JSON schema (a dict, or its JSON text); regex: a regular expression the whole output matches;
    choice: the output is one of these strings; grammar: an EBNF grammar as xgrammar takes it (rule `root`);
    json_object: True for any JSON object.
    disable_any_whitespace: JSON without whitespace between tokens (`{"a":1,"b":2}`). Otherwise JSON may put
        whitespace between tokens, at most a few characters in a row, so no model can spend its tokens on it.
    disable_additional_properties: accepted for vLLM's code; xgrammar never admits properties a schema's
        object does not list unless its additionalProperties says so, whatever this says.
    whitespace_pattern: not supported (xgrammar has no such option): anything but None is refused.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams takes exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                             f"{' and '.join(given) if given else 'none'}")
        structured = "StructuredOutputsParams."
        _check(structured + "json", self.json, self.json is None or isinstance(self.json, (dict, str)),
               "a JSON schema: a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(structured + name, value, value is None or (isinstance(value, str) and value != ""),
                   "a non-empty string")
        _check(structured + "choice", self.choice, self.choice is None or (
            isinstance(self.choice, (list, tuple)) and self.choice and all(isinstance(c, str) and c
                                                                           for c in self.choice)),
               "a non-empty list of non-empty strings")
        _check(structured + "json_object", self.json_object, self.json_object in (None, True, False),
               "True, False or None")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            _check(structured + name, getattr(self, name), isinstance(getattr(self, name), bool), "True or False")
        _check(structured + "whitespace_pattern", self.whitespace_pattern, self.whitespace_pattern is None,
               "None: xgrammar has no whitespace pattern; disable_any_whitespace=True gives JSON without any")

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """How one request is sampled and when it stops: vLLM's SamplingParams, keyword-only, with vLLM's names and
    defaults for the fields it has. Every field is checked when set, at construction or later.

    n: how many completions to sample for the prompt, at most 16384 as in vLLM (they share its prefill).
    presence_penalty: subtracted from the logit of every token already in the output ([-2, 2], 0: off).
    frequency_penalty: subtracted once per occurrence of a token in the output ([-2, 2], 0: off).
    repetition_penalty: divides positive logits and multiplies negative ones of every token in the prompt or
        the output (> 0, 1: off). The penalties apply in that order (repetition first), before temperature.
    temperature: 0 is greedy (argmax); otherwise logits are divided by it before sampling.
    top_k: keep only the k most likely tokens (0 or -1: off; above the vocabulary: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1: off).
    min_p: drop tokens less likely than min_p times the most likely one (0: off).
        The filters apply in that order: temperature, top-k, top-p, min-p, each to what the last one left.
    seed: per-request seed; the same prompt and seed give the same tokens whatever else is in the batch.
    max_tokens: the most tokens to generate (generation also stops at the engine's max_model_len); None: up to
        max_model_len, that is max_model_len minus the prompt's length, as vLLM.
    min_tokens: end-of-sequence and stop tokens are suppressed until this many tokens are generated.
    stop: strings that end generation; the output text ends before the stop string (None: none).
    stop_token_ids: token ids that end generation, besides the model's end-of-sequence tokens.
    ignore_eos: keep generating past end-of-sequence tokens (for benchmarks).
    logprobs: None, or k: return the sampled token's log-probability and the k most likely at each step
        (k at most the engine's max_logprobs).
    prompt_logprobs: None, or k: return, for every prompt token after the first, its log-probability given the
        tokens before it and the k most likely tokens there (RequestOutput.prompt_logprobs; k at most
        max_logprobs). Such a request computes its whole prompt: it takes no prefix-cache hits.
    bad_words: words never to generate, as vLLM: each word's tokens, with and without a leading space, are
        banned as a sequence: its last token is masked when the tokens before it were just generated (a
        one-token word always is). A string is one word.
    structured_outputs: None, or a StructuredOutputsParams constraining the output (JSON schema, regex, choice,
        grammar); refused with ignore_eos or min_tokens, which would force tokens the constraint may not allow.
    skip_special_tokens: leave special tokens out of the output text.
    include_stop_str_in_output: keep the stop string at the end of the output text.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | str | None = field(default_factory=list)
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    _checked: bool = field(default=False, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value) -> None:
        if not getattr(self, "_checked", False):  # construction: __post_init__ checks everything at once
            object.__setattr__(self, name, value)
            return
        previous = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self._check()
        except ValueError:
            object.__setattr__(self, name, previous)
            raise

    def __post_init__(self) -> None:
        self._check()
        object.__setattr__(self, "_checked", True)

    def _check(self) -> None:
        if self.stop is None:
            object.__setattr__(self, "stop", [])
        elif isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", [])
        if self.bad_words is None:
            object.__setattr__(self, "bad_words", [])
        elif isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", [self.bad_words])
        _check("n", self.n, _integer(self.n) and 1 <= self.n <= MAX_N, f"an integer in [1, {MAX_N}]",
               kind="an integer")
        _check("presence_penalty", self.presence_penalty, -2.0 <= _number(self.presence_penalty) <= 2.0, "[-2, 2]",
               kind="a number")
        _check("frequency_penalty", self.frequency_penalty, -2.0 <= _number(self.frequency_penalty) <= 2.0,
               "[-2, 2]", kind="a number")
        _check("repetition_penalty", self.repetition_penalty, 0.0 < _number(self.repetition_penalty) <= 100.0,
               "(0, 100]", kind="a number")
        _check("temperature", self.temperature, 0.0 <= _number(self.temperature) <= 100.0, "[0, 100]",
               kind="a number")
        _check("top_k", self.top_k, _integer(self.top_k) and self.top_k >= -1,
               "-1, 0 (off) or a positive integer below 2**63", kind="an integer")
        _check("top_p", self.top_p, 0.0 < _number(self.top_p) <= 1.0, "(0, 1]", kind="a number")
        _check("min_p", self.min_p, 0.0 <= _number(self.min_p) <= 1.0, "[0, 1]", kind="a number")
        _check("seed", self.seed, self.seed is None or _integer(self.seed), "None or an integer in [-2**63, 2**63)",
               kind="an integer or None")
        unbounded = self.max_tokens is None  # up to max_model_len: resolved per request by the engine
        _check("max_tokens", self.max_tokens, unbounded or (_integer(self.max_tokens) and self.max_tokens >= 1),
               "None (up to max_model_len) or an integer >= 1", kind="an integer or None")
        most = 2**63 - 1 if unbounded else self.max_tokens
        _check("min_tokens", self.min_tokens, _integer(self.min_tokens) and 0 <= self.min_tokens <= most,
               f"[0, max_tokens={self.max_tokens}]", kind="an integer")
        _check("stop", self.stop, isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "a string, a list of non-empty strings, or None")
        _check("stop_token_ids", self.stop_token_ids, isinstance(self.stop_token_ids, list)
               and all(_integer(t) and t >= 0 for t in self.stop_token_ids),
               "non-negative integers below 2**63")
        _check("logprobs", self.logprobs, self.logprobs is None or (_integer(self.logprobs) and self.logprobs >= 0),
               "None or an integer >= 0", kind="an integer or None")
        _check("prompt_logprobs", self.prompt_logprobs, self.prompt_logprobs is None
               or (_integer(self.prompt_logprobs) and self.prompt_logprobs >= 0), "None or an integer >= 0",
               kind="an integer or None")
        # vLLM strips a word's leading spaces before tokenizing it (with and without one): nothing may be left
        _check("bad_words", self.bad_words, isinstance(self.bad_words, list)
               and all(isinstance(w, str) and w.lstrip() for w in self.bad_words),
               "a string, a list of strings with more than leading whitespace, or None")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check(name, getattr(self, name), isinstance(getattr(self, name), bool), "True or False")
        _check("structured_outputs", self.structured_outputs, self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputsParams), "None or a StructuredOutputsParams")
        if self.structured_outputs is not None:
            # either would make the sampler emit a token the constraint masked, or find every token masked
            for name, value, off in (("ignore_eos", self.ignore_eos, False), ("min_tokens", self.min_tokens, 0)):
                if value != off:
                    raise ValueError(f"SamplingParams.{name}={value!r} cannot be combined with structured_outputs "
                                     f"(the constraint decides where the output ends): leave it at {off!r}")

    @classmethod
    def from_generation_config(cls, model_dir: str) -> "SamplingParams":
        """The defaults a checkpoint's generation_config.json recommends, as vLLM reads them; vLLM's otherwise."""
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            generation = json.load(f)
        names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
        return cls(**{ours: generation[theirs] for theirs, ours in names.items() if theirs in generation})

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def _integer(value) -> bool:
    # 64-bit: these values become int64 tensors
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def _check(name: str, value, ok: bool, allowed: str, kind: str | None = None) -> None:
    """kind: the type the field takes ("an integer", "a number", "... or None"); a value of another type is named
    as such, not as out of range (max_tokens='10' is a str, not too big). A ValueError either way, as callers
    (and a failed assignment's undo) catch ValueError."""
    if ok:
        return
    owner = "" if "." in name else "SamplingParams."
    if kind is not None and not _of_kind(value, kind):
        raise ValueError(f"{owner}{name}={value!r} must be {kind}, got {type(value).__name__}: allowed {allowed}")
    raise ValueError(f"{owner}{name}={value!r} is out of range: allowed {allowed}")


def _of_kind(value: object, kind: str) -> bool:
    wanted = (int,) if kind.startswith("an integer") else (int, float)
    return (value is None and kind.endswith("or None")) or (isinstance(value, wanted) and not isinstance(value, bool))


def _suggest_keywords(cls: type) -> None:
    """A misspelt keyword (max_token=5) names the field meant. Wraps the dataclass's own __init__ (slots and
    kw_only need it generated), which still does all the work; only its TypeError gains the suggestion."""
    generated = cls.__init__
    names = [f.name for f in fields(cls) if f.init]

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs) -> None:
        for name in kwargs:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; the fields are {', '.join(names)}"
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}{hint}")
        generated(self, *args, **kwargs)

    cls.__init__ = __init__


_suggest_keywords(SamplingParams)
_suggest_keywords(StructuredOutputsParams)
