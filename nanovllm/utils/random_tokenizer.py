"""The tokenizer of a random-weight checkpoint: byte-level BPE over the model's vocabulary size, with a chat
template, so prompts, chat and detokenization run as with a real one."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def num_regular_tokens(vocab_size: int) -> int:
    # Qwen3 keeps its specials at 151643..; a smaller vocabulary keeps them at its top
    return min(vocab_size - len(SPECIAL_TOKENS), 151643)


def _byte_to_unicode() -> list[str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer whose merges spell letter strings, so every regular id decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    num_regular = num_regular_tokens(vocab_size)
    byte_chars = _byte_to_unicode()
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    merges: list[tuple[str, str]] = []
    letters = [byte_chars[ord(" ")]] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
              [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    level = letters
    while len(vocab) < num_regular:
        next_level = []
        for prefix in level:
            for ch in letters:
                if len(vocab) >= num_regular:
                    break
                token = prefix + ch
                vocab[token] = len(vocab)
                merges.append((prefix, ch))
                next_level.append(token)
        level = next_level
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
