"""Conversations -> prompt text through the tokenizer's chat template, as vLLM's LLM.chat; misuse is refused here,
by index, before any work (transformers would iterate a string's characters, or render a message without a role)."""
from transformers import PreTrainedTokenizerBase

Conversation = list[dict]


def parse_conversations(messages: Conversation | list[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of them, each message checked for a role and content."""
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
        for m, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise TypeError(f"message {m} of conversation {c} is a {type(message).__name__}, not a dict with "
                                f"'role' and 'content'")
            missing = [key for key in ("role", "content") if key not in message]
            if missing:
                raise ValueError(f"message {m} of conversation {c} has no {' and no '.join(map(repr, missing))}: "
                                 f"keys {sorted(message)}")
            if not isinstance(message["role"], str):
                raise TypeError(f"message {m} of conversation {c} has role {message['role']!r}, not a string")
    return [list(conversation) for conversation in messages]


def render(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, chat_template: str | None = None,
           add_generation_prompt: bool = True, continue_final_message: bool = False,
           chat_template_kwargs: dict | None = None, model: str = "the model") -> str:
    """The prompt text of one conversation: `chat_template` (else the tokenizer's) with the generation prompt,
    or with the final message left open for the model to continue."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message=True continues the final message and add_generation_prompt=True "
                         "starts a new one: pass add_generation_prompt=False with continue_final_message=True")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {model} has no chat template: pass chat_template=, or use generate() "
                         f"with prompts formatted by hand")
    return tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         **(chat_template_kwargs or {}))
