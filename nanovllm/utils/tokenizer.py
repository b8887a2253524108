import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# the vocabularies AutoTokenizer can build a tokenizer from; tokenizer_config.json alone holds none
VOCABULARY_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),  # fast tokenizers (Qwen3 ships this)
    ("vocab.json", "merges.txt"),  # byte-level BPE, slow
    ("tokenizer.model",),  # sentencepiece
    ("vocab.txt",),  # wordpiece
)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint at `path`, refused unless it is really there and encodes text.

    Without vocabulary files transformers builds an empty tokenizer instead of failing, so a checkpoint copied
    without them would load and then call every prompt empty."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path!r} to load a tokenizer from")
    found = [f for files in VOCABULARY_FILES if all(os.path.isfile(os.path.join(path, f)) for f in files)
             for f in files]
    if not found:
        looked_for = " or ".join(" + ".join(files) for files in VOCABULARY_FILES)
        raise FileNotFoundError(f"no tokenizer files in {path}: looked for {looked_for}; copy them from the "
                                f"model's original repository")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # corrupt files raise anything from JSON to Rust-side errors
        raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e
    # special tokens (a BOS) would hide an empty vocabulary
    if not tokenizer.encode("hello", add_special_tokens=False):
        raise ValueError(f"the tokenizer in {path} encodes 'hello' to no tokens: its files {found} hold no usable "
                         f"vocabulary")
    return tokenizer
