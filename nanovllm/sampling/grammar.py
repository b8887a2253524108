"""Structured outputs, compiling: a StructuredOutputsParams -> xgrammar's CompiledGrammar, once per distinct spec,
in a thread pool beside the engine's thread (xgrammar releases the GIL while it compiles), and the per-request
matcher that follows the tokens a request generates (sampling/grammar_mask.py turns matchers into masks).

xgrammar is imported on the first constrained request, so an engine that never sees one pays nothing for it."""
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from nanovllm.sampling_params import StructuredOutputsParams

# whitespace characters JSON may hold in a row between two tokens, unless disable_any_whitespace: enough for a
# newline and an indent, too few for a weak model to spend its max_tokens on blanks
JSON_WHITESPACE_LIMIT = 4
COMPILE_THREADS = 4
CACHE_SIZE = 1024  # compiled specs kept; a batch file of one schema compiles it once
# xgrammar's messages start with a timestamp and its C++ source line: users need what follows
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def import_xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as error:
        raise ImportError("structured outputs need xgrammar: pip install xgrammar (a dependency of nano-vllm: "
                          "reinstall the package)") from error
    return xgrammar


def spec_key(spec: StructuredOutputsParams) -> tuple:
    """What identifies a compiled grammar: the kind, the spec (a schema in one canonical spelling) and options."""
    value = getattr(spec, spec.kind)
    if spec.kind == "json" and isinstance(value, dict):
        value = json.dumps(value, sort_keys=True)
    elif spec.kind == "choice":
        value = tuple(value)
    return spec.kind, value, spec.disable_any_whitespace


class GrammarCompiler:
    """Compiles specs against one tokenizer. `vocab_size` is the model's (the logits' width, which may be padded past
    the tokenizer's); `stop_token_ids` end a constrained output where the grammar allows it to end."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        info = self.xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=self.stop_token_ids)
        self.compiler = self.xgr.GrammarCompiler(info, cache_enabled=False)  # the cache below keys by spec
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")
        self.compiled: OrderedDict[tuple, Future] = OrderedDict()

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The spec's compiled grammar, or a ValueError saying why it does not compile, as a future."""
        key = spec_key(spec)
        future = self.compiled.get(key)
        if future is None:
            future = self.compiled[key] = self.pool.submit(self._compile, spec)
            while len(self.compiled) > CACHE_SIZE:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(key)
        return future

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        kind = spec.kind
        try:
            if kind == "json" or kind == "json_object":
                compact = spec.disable_any_whitespace
                # json_object: any object, so its properties are whatever the model writes (no strict mode)
                schema = spec.json if kind == "json" else {"type": "object"}
                return self.compiler.compile_json_schema(
                    schema, any_whitespace=not compact, separators=(",", ":") if compact else None,
                    strict_mode=kind == "json", max_whitespace_cnt=None if compact else JSON_WHITESPACE_LIMIT)
            if kind == "regex":
                return self.compiler.compile_regex(spec.regex)
            if kind == "choice":  # EBNF string literals take JSON's escapes
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return self.compiler.compile_grammar(spec.grammar)
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types
            message = _XGRAMMAR_PREFIX.sub("", str(error).strip()).splitlines()[0]
            raise ValueError(f"structured_outputs {kind} does not compile: {message}") from None


@dataclass
class GrammarState:
    """One request's constraint: its compiled grammar (a future until compiled), then the matcher that has taken
    the first `num_accepted` generated tokens. Each of n samples has its own."""

    compiled: Future
    matcher: Any = None
    num_accepted: int = 0
    rejected: bool = False  # a token the grammar refused was sampled (every allowed one banned): end the output
    terminated: bool = False  # the matcher took a stop token: the output ends
    stop_token_ids: frozenset[int] = frozenset()  # the matcher's, read once: which tokens may terminate it
    # where the matcher's next mask was filled ahead (sampling/grammar_mask.py): (buffer, generation, row,
    # num_accepted then)
    filled: tuple[int, int, int, int] | None = None
    handle: Any = None  # the matcher's binding object (xgrammar's private _handle), for calls without wrappers

    def error(self) -> BaseException | None:
        """Why the grammar did not compile (ValueError), or None; waits for the compile."""
        return self.compiled.exception()

    def start(self, xgr: Any) -> Any:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
            self.stop_token_ids = frozenset(self.matcher.stop_token_ids)
            self.handle = getattr(self.matcher, "_handle", None)
        return self.matcher


def accept_binding(xgr: Any) -> Any:
    """xgrammar's binding under its public batch accept, if it takes a call that does not read the answers back
    (grammar_mask.py knows them already); else None, and the public call is used."""
    core = getattr(getattr(xgr, "base", None), "_core", None)
    try:
        core.BatchGrammarMatcher.batch_accept_token([], [], False)
    except Exception:  # noqa: BLE001 - another xgrammar version: any failure means "use the public call"
        return None
    return core


def fill_binding(filler: Any, bitmask: Any) -> Callable | None:
    """xgrammar's binding under its public batch fill (which makes a list of the matchers' handles first), if it
    takes the call grammar_mask.py makes (cached handles); else None."""
    try:
        binding = filler._handle.batch_fill_next_token_bitmask
        binding([], bitmask, [], False)
    except Exception:  # noqa: BLE001 - another xgrammar version: use the public call
        return None
    return binding
