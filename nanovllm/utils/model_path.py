"""`model` as vLLM takes it: a local checkpoint folder, or a Hugging Face hub id ("Qwen/Qwen3-0.6B").

A hub id resolves through huggingface_hub (which transformers already needs): the local cache when offline
(HF_HUB_OFFLINE=1, or the hub unreachable), a download of the files the engine reads when online.
"""
import os

# what the engine reads of a checkpoint; other formats (*.bin, *.pth, ONNX) are skipped by a download
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*"]


def looks_like_hub_id(model: str) -> bool:
    """"org/name" or "name": no path syntax and at most one slash, so "./ckpt" and "/data/m" stay local paths."""
    return (bool(model) and model.count("/") <= 1 and "\\" not in model
            and not model.startswith((".", "/", "~")) and not model.endswith("/"))


def hub_cache_dir() -> str:
    """The Hugging Face hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return os.path.expanduser(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    home = os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def resolve_model(model: str) -> str:
    """The local folder holding `model`'s checkpoint; a ValueError naming `model` when there is none."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a checkpoint folder or a hub id (a string), got {type(model).__name__}")
    model = os.fspath(model)
    if os.path.isdir(model):
        return model
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return expanded
    if not looks_like_hub_id(model):
        raise ValueError(f"model {model!r} is not a folder: give a local checkpoint folder or a Hugging Face hub "
                         f"id such as 'Qwen/Qwen3-0.6B'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        # offline, or online with the hub unreachable, huggingface_hub answers from its cache
        return snapshot_download(model, allow_patterns=CHECKPOINT_FILES, local_files_only=offline,
                                 cache_dir=hub_cache_dir())
    except HFValidationError as error:
        raise ValueError(f"model {model!r} is neither a local folder nor a valid hub id: {error}") from None
    except Exception as error:  # not cached and no download: missing, private, gated or no network
        where = "in the Hugging Face cache (HF_HUB_OFFLINE is set)" if offline else \
            "in the Hugging Face cache, and the hub did not provide it"
        raise ValueError(f"model {model!r} is not a local folder, nor {where}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0].rstrip('.') if str(error) else ''}. Download it first "
                         f"(`hf download {model}`) or pass a checkpoint folder") from None
