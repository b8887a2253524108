from transformers import PreTrainedTokenizerBase

from nanovllm.engine.chat import Conversation, parse_conversations
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """The public entry point: `LLM(path, **engine_options).generate(prompts, sampling_params)`.

    Engine options are the fields of nanovllm.config.Config (max_num_seqs, max_model_len, dtype, seed, ...);
    an unknown option is a TypeError. Use it as a context manager to release workers and memory early.
    """

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.exit()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, which encodes string prompts (as vLLM's LLM.get_tokenizer)."""
        return self.tokenizer

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = True, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """generate() over conversations (one, or a list of them), as vLLM's LLM.chat.

        chat_template: a Jinja template to use instead of the tokenizer's. add_generation_prompt: end with the
        assistant's turn opened; continue_final_message (with add_generation_prompt=False): leave the final
        message open for the model to continue. chat_template_kwargs (such as enable_thinking) go to the template.
        Every conversation is checked and rendered before any work."""
        conversations = parse_conversations(messages)
        texts = [self.chat_prompt(conversation, chat_template_kwargs, chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message) for conversation in conversations]
        # the template writes its own special tokens (Llama 3's BOS): the tokenizer must not add them again
        prompts = [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)
