"""Structured outputs, compiling: a StructuredOutputsParams -> xgrammar's CompiledGrammar, once per distinct spec,
in a thread pool beside the engine's thread (xgrammar releases the GIL while it compiles), so that a spec that
does not compile fails its request before any work; and the per-request state the engine keeps (the matchers live
in the mask worker's process, sampling/mask_worker.py, which compiles each spec too).

xgrammar is imported on the first constrained request, so an engine that never sees one pays nothing for it."""
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanovllm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # not imported at run time: the mask worker's process starts without transformers
    from transformers import PreTrainedTokenizerBase

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

    def __init__(self, tokenizer: "PreTrainedTokenizerBase | None", vocab_size: int, stop_token_ids: list[int],
                 tokenizer_info: Any = None) -> None:
        """tokenizer_info: xgrammar's tables of the tokenizer, when already built (the mask worker's copy)."""
        self.xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.info = tokenizer_info or self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids)
        self.compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)  # the cache below keys by spec
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")
        self.compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.worker: Future | None = None  # the engine's mask worker (MaskProcess), once start_worker() is called
        self.worker_lock = threading.Lock()
        self.unsent: list[StructuredOutputsParams] = []  # specs taken while the worker starts

    def start_worker(self, launch: Callable[[Any, list[int]], Any]) -> Future:
        """Start the mask worker (launch(tokenizer info, stop tokens): sampling/mask_process.py's MaskProcess)
        beside the engine's thread; the specs compiled here are compiled there too as they come, so each is ready
        there when its request first runs."""
        if self.worker is None:
            self.worker = self.pool.submit(self._start_worker, launch)
        return self.worker

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The spec's compiled grammar, or a ValueError saying why it does not compile, as a future."""
        key = spec_key(spec)
        future = self.compiled.get(key)
        if future is None:
            future = self.compiled[key] = self.pool.submit(self._compile, spec)
            while len(self.compiled) > CACHE_SIZE:
                self.compiled.popitem(last=False)
            if self.worker is not None:
                with self.worker_lock:
                    if not self.worker.done():
                        self.unsent.append(spec)
                    elif self.worker.exception() is None:  # a worker that failed to start gets no hints
                        self.worker.result().send("compile", spec)
        else:
            self.compiled.move_to_end(key)
        return future

    def close(self) -> None:
        if self.worker is not None:
            wait([self.worker])
            if not self.worker.cancelled() and self.worker.exception() is None:
                self.worker.result().close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _start_worker(self, launch: Callable[[Any, list[int]], Any]) -> Any:
        process = launch(self.info, self.stop_token_ids)
        with self.worker_lock:
            for spec in self.unsent:
                process.send("compile", spec)
            self.unsent = []
        return process

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
    """One request's constraint (each of n samples has its own): its spec, compiled here (a future, for the
    errors), and the mask worker that keeps its matcher (sampling/mask_worker.py), where it is `slot` once the
    engine has run it."""

    compiled: Future
    spec: StructuredOutputsParams
    worker: Future | None = None  # of a MaskProcess
    slot: int | None = None

    def error(self) -> BaseException | None:
        """Why the grammar did not compile (ValueError), or None; waits for the compile."""
        return self.compiled.exception()
