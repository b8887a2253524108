from nanovllm.engine.prompts import TextPrompt, TokensPrompt
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "TextPrompt", "TokensPrompt"]
