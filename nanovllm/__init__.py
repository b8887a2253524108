"""nano-vllm: `from nanovllm import LLM, SamplingParams`.

The names load on first use (PEP 562), so `import nanovllm` and the command line's --help need no torch."""
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names below resolve to, for type checkers and editors
    from nanovllm.engine.prompts import TextPrompt, TokensPrompt
    from nanovllm.llm import LLM
    from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
    from nanovllm.sampling_params import SamplingParams, StructuredOutputsParams

try:
    __version__ = version("nano-vllm")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# public name -> the module that defines it
_EXPORTS = {"LLM": "nanovllm.llm", "SamplingParams": "nanovllm.sampling_params",
            "StructuredOutputsParams": "nanovllm.sampling_params", "RequestOutput": "nanovllm.outputs",
            "CompletionOutput": "nanovllm.outputs", "Logprob": "nanovllm.outputs",
            "TextPrompt": "nanovllm.engine.prompts", "TokensPrompt": "nanovllm.engine.prompts"}
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TextPrompt", "TokensPrompt", "__version__"]


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'nanovllm' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
