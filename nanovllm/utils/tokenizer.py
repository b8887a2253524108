import os
import threading

from transformers import PreTrainedTokenizerBase

# the vocabularies AutoTokenizer can build a tokenizer from; tokenizer_config.json alone holds none
VOCABULARY_FILES: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),  # fast tokenizers (Qwen3 ships this)
    ("vocab.json", "merges.txt"),  # byte-level BPE, slow
    ("tokenizer.model",),  # sentencepiece
    ("vocab.txt",),  # wordpiece
)


def tokenizer_files(path: str) -> list[str]:
    """The vocabulary files of the checkpoint at `path`; an error naming what is missing when there are none.

    Without them transformers builds an empty tokenizer instead of failing, so a checkpoint copied without them
    would load and then call every prompt empty."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory {path!r} to load a tokenizer from")
    found = [f for files in VOCABULARY_FILES if all(os.path.isfile(os.path.join(path, f)) for f in files)
             for f in files]
    if not found:
        looked_for = " or ".join(" + ".join(files) for files in VOCABULARY_FILES)
        raise FileNotFoundError(f"no tokenizer files in {path}: looked for {looked_for}; copy them from the "
                                f"model's original repository")
    return found


class TokenizerLoad:
    """The tokenizer of the checkpoint at `path`, loaded in a thread of its own while its caller goes on.

    An engine builds its model meanwhile: that mostly waits on the device and on Triton's compiler, while the
    tokenizer's load (and, with some transformers versions, seconds of importing AutoTokenizer's module) is
    Python. The files are checked before the thread starts, so a checkpoint without them fails before any other
    work; result() joins the thread, so none outlives it (a process that forks replicas runs no other thread)."""

    def __init__(self, path: str) -> None:
        tokenizer_files(path)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, args=(path,), name="nanovllm-tokenizer", daemon=True)
        self._thread.start()

    def _load(self, path: str) -> None:
        try:
            self._tokenizer = load_tokenizer(path)
        except BaseException as error:  # raised again in the caller's thread, by result()
            self._error = error

    def result(self) -> PreTrainedTokenizerBase:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tokenizer


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the checkpoint at `path`, refused unless it is really there and encodes text."""
    from transformers import AutoTokenizer  # here, not at import: its module can take seconds (above)

    found = tokenizer_files(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # corrupt files raise anything from JSON to Rust-side errors
        raise ValueError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from e
    # special tokens (a BOS) would hide an empty vocabulary
    if not tokenizer.encode("hello", add_special_tokens=False):
        raise ValueError(f"the tokenizer in {path} encodes 'hello' to no tokens: its files {found} hold no usable "
                         f"vocabulary")
    return tokenizer
