"""Write Qwen3 checkpoints with random weights in real shapes, since no model hub is reachable.

The result (config.json, generation_config.json, model.safetensors, tokenizer files) loads in this package and in
transformers' AutoModelForCausalLM / AutoTokenizer. Speed does not depend on weight values, so benchmarks on these
checkpoints measure what real ones would.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

from nanovllm.utils.fp8_checkpoint import FP8_SUFFIX, fp8_quantization_config, split_fp8_shape, to_fp8_checkpoint

# the published Qwen3 shapes; "tiny" is ours, for CPU tests
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=True, dtype="float32"),
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_config(shape: str, **overrides) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    num_regular = _num_regular_tokens(SHAPES[shape]["vocab_size"])
    config = dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", attention_bias=False,
        attention_dropout=0.0, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_scaling=None, use_sliding_window=False, sliding_window=None, max_window_layers=28,
        initializer_range=0.02, use_cache=True, dtype="bfloat16",
        bos_token_id=num_regular, eos_token_id=num_regular + 2, pad_token_id=num_regular,
    )
    config.update(SHAPES[shape])
    config.update(overrides)
    return config


def _num_regular_tokens(vocab_size: int) -> int:
    # Qwen3 keeps its specials at 151643..; a smaller vocabulary keeps them at its top
    return min(vocab_size - len(SPECIAL_TOKENS), 151643)


def random_weights(config: dict, std: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["dtype"])
    hidden, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(size: int) -> torch.Tensor:  # near 1, but not 1, so a norm loaded wrongly shows
        return (1.0 + 0.1 * torch.randn(size, generator=gen)).to(dtype)

    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": norm_weight(hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(q_size, hidden),
            p + "self_attn.k_proj.weight": normal(kv_size, hidden),
            p + "self_attn.v_proj.weight": normal(kv_size, hidden),
            p + "self_attn.o_proj.weight": normal(hidden, q_size),
            p + "self_attn.q_norm.weight": norm_weight(head_dim),
            p + "self_attn.k_norm.weight": norm_weight(head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
            p + "input_layernorm.weight": norm_weight(hidden),
            p + "post_attention_layernorm.weight": norm_weight(hidden),
        })
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(config["vocab_size"], hidden)
    return weights


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

    num_regular = _num_regular_tokens(vocab_size)
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


def write_random_checkpoint(path: str, shape: str = "tiny", std: float | None = None, seed: int = 0,
                            fp8: bool = False, **config_overrides) -> str:
    """Write a random-weight Qwen3 checkpoint of `shape` to `path` (created if needed) and return the path.

    fp8=True, or a shape name ending in -FP8 (Qwen3-8B-FP8), writes the same weights in the published FP8 layout
    (nanovllm/utils/fp8_checkpoint.py): block-quantized e4m3 linear weights with their weight_scale_inv."""
    os.makedirs(path, exist_ok=True)
    shape, fp8_shape = split_fp8_shape(shape)
    config = qwen3_config(shape, **config_overrides)
    # tiny models get a wider spread, so greedy tokens are separated by clear logit margins
    std = std if std is not None else (0.1 if shape == "tiny" else 0.02)
    weights = random_weights(config, std, seed)
    if fp8 or fp8_shape:
        weights = to_fp8_checkpoint(weights)
        config["quantization_config"] = fp8_quantization_config()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    eos = [config["eos_token_id"], config["bos_token_id"]]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}, f, indent=2)
    write_tokenizer(path, config["vocab_size"])
    return path


def default_checkpoint(shape: str) -> str:
    """A random-weight checkpoint of `shape` in the user's cache, written on first use."""
    root = os.environ.get("NANOVLLM_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "nanovllm"))
    path = os.path.join(root, f"{shape}-random")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        print(f"writing a {shape}-shaped checkpoint with RANDOM weights to {path} (no model hub is used)")
        write_random_checkpoint(path, shape)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--shape", default="Qwen3-0.6B",
                        choices=sorted(SHAPES) + sorted(name + FP8_SUFFIX for name in SHAPES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp8", action="store_true", help="the published FP8 layout (as a -FP8 shape name does)")
    args = parser.parse_args()
    write_random_checkpoint(args.path, args.shape, seed=args.seed, fp8=args.fp8)
    print(f"wrote a random-weight {args.shape} checkpoint to {args.path}")


if __name__ == "__main__":
    main()
