"""Write checkpoints with random weights in real shapes (Qwen3, Qwen3-MoE, Qwen2.5, Llama 3.x), so the engine
runs, and is tested and benchmarked, without a model hub.

The result (config.json, generation_config.json, safetensors, tokenizer files) loads in this package and in
transformers' AutoModelForCausalLM / AutoTokenizer. Speed does not depend on weight values, so benchmarks on these
checkpoints measure what real ones would (a MoE router of random weights spreads tokens evenly over the experts,
as a trained, load-balanced one roughly does).

Its command line (`python -m nanovllm.utils.random_checkpoint DIR`) answers --help without torch: torch and the
writers load once there is something to write.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from nanovllm.utils.random_tokenizer import num_regular_tokens, write_tokenizer

if TYPE_CHECKING:
    import torch

FP8_SUFFIX = "-FP8"  # shape names: "Qwen3-8B-FP8" is Qwen3-8B in the published FP8 layout
CHECKPOINT_MARKERS = ("config.json", "*.safetensors", "*.bin", "*.pth", "model.safetensors.index.json")

COMMON = dict(hidden_act="silu", attention_dropout=0.0, initializer_range=0.02, use_cache=True, dtype="bfloat16")
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
             max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
             use_sliding_window=False, sliding_window=None, max_window_layers=28)
FAMILIES: dict[str, dict] = {
    "qwen3": QWEN3,
    "qwen3_moe": {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                  "output_router_logits": False, "router_aux_loss_coef": 0.001},
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_position_embeddings=32768,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, use_sliding_window=False,
                  sliding_window=None, max_window_layers=28),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False, mlp_bias=False,
                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, pretraining_tp=1,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)),
}
LLAMA32_ROPE = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
# the published shapes; "tiny" is ours, for CPU tests
SHAPES: dict[str, dict] = {
    "tiny": dict(family="qwen3", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=True, dtype="float32"),
    "Qwen3-0.6B": dict(family="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "Qwen3-1.7B": dict(family="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       tie_word_embeddings=True),
    "Qwen3-4B": dict(family="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True),
    "Qwen3-8B": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(family="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "Qwen2.5-0.5B": dict(family="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen2.5-7B": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Llama-3.2-1B": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, rope_scaling=LLAMA32_ROPE),
    "Llama-3.1-8B": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False),
}
# every name --shape takes: the shapes, and each in the published FP8 layout (Qwen3-8B-FP8)
SHAPE_NAMES = sorted(SHAPES) + sorted(name + FP8_SUFFIX for name in SHAPES)
SHARD_BYTES = 4 << 30  # large checkpoints are written in shards of about this size, with an index


def model_config(shape: str, vocab_padding: int = 0, **overrides) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
    dims = dict(SHAPES[shape])
    config = dict(**FAMILIES[dims.pop("family")], **COMMON)
    config.update(dims)
    config.update(overrides)
    # the specials sit above the regular tokens; a padded vocabulary's last rows are no token at all
    num_regular = num_regular_tokens(config["vocab_size"] - vocab_padding)
    return {"bos_token_id": num_regular, "eos_token_id": num_regular + 2, "pad_token_id": num_regular, **config}


def split_fp8_shape(shape: str) -> tuple[str, bool]:
    """'Qwen3-8B-FP8' -> ('Qwen3-8B', True); other names are returned as they are, with False."""
    return (shape.removesuffix(FP8_SUFFIX), True) if shape.endswith(FP8_SUFFIX) else (shape, False)


def random_weights(config: dict, std: float, seed: int):
    """(name, tensor) for every weight of the checkpoint, made one at a time (a 30B model does not fit twice)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["dtype"])
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    family = config["model_type"]

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm_weight(size: int) -> torch.Tensor:  # near 1, but not 1, so a norm loaded wrongly shows
        return (1.0 + 0.1 * torch.randn(size, generator=gen)).to(dtype)

    def mlp(prefix: str, size: int):
        yield prefix + "gate_proj.weight", normal(size, hidden)
        yield prefix + "up_proj.weight", normal(size, hidden)
        yield prefix + "down_proj.weight", normal(hidden, size)

    yield "model.embed_tokens.weight", normal(config["vocab_size"], hidden)
    yield "model.norm.weight", norm_weight(hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            yield p + f"self_attn.{proj}.weight", normal(size, hidden)
            if family == "qwen2":  # Qwen2's q, k and v carry a bias
                yield p + f"self_attn.{proj}.bias", normal(size)
        yield p + "self_attn.o_proj.weight", normal(hidden, q_size)
        if family in ("qwen3", "qwen3_moe"):
            yield p + "self_attn.q_norm.weight", norm_weight(head_dim)
            yield p + "self_attn.k_norm.weight", norm_weight(head_dim)
        sparse = family == "qwen3_moe" and i not in config["mlp_only_layers"] and \
            (i + 1) % config["decoder_sparse_step"] == 0
        if sparse:
            yield p + "mlp.gate.weight", normal(config["num_experts"], hidden)
            for e in range(config["num_experts"]):
                yield from mlp(p + f"mlp.experts.{e}.", config["moe_intermediate_size"])
        else:
            yield from mlp(p + "mlp.", inter)
        yield p + "input_layernorm.weight", norm_weight(hidden)
        yield p + "post_attention_layernorm.weight", norm_weight(hidden)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", normal(config["vocab_size"], hidden)


def save_sharded(weights, path: str) -> None:
    """model.safetensors, or shards of about SHARD_BYTES and model.safetensors.index.json when it is larger."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights:
        if size + tensor.nbytes > SHARD_BYTES and shards[-1]:
            save_file(shards[-1], os.path.join(path, f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            shards[-1] = {name: None for name in shards[-1]}  # only the names are kept, for the index
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    save_file(shards[-1], os.path.join(path, f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    weight_map = {name: f"model-{i + 1:05d}.safetensors" for i, shard in enumerate(shards) for name in shard}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def write_random_checkpoint(path: str, shape: str = "tiny", std: float | None = None, seed: int = 0,
                            fp8: bool = False, overwrite: bool = False, vocab_padding: int = 0,
                            **config_overrides) -> str:
    """Write a random-weight checkpoint of `shape` to `path` (created if needed) and return the path.
    config.json is written last: its presence means the checkpoint is complete. If writing fails, a folder this
    call created is removed again.

    fp8=True, or a shape name ending in -FP8 (Qwen3-8B-FP8), writes the same weights in the published FP8 layout
    (nanovllm/quantization/fp8_checkpoint.py): block-quantized e4m3 linear weights with their weight_scale_inv.

    A folder that already holds a checkpoint (config.json or weight files) is refused with FileExistsError, so a
    real model's folder given by mistake keeps its weights; overwrite=True first removes its config and weight
    files. The files written get the umask's mode; other files in the folder are left as they are.

    vocab_padding: the model's vocabulary has this many rows past the tokenizer's last token, as real checkpoints
    pad theirs (Qwen3: 151,936 rows for 151,669 tokens)."""
    from nanovllm.utils.quantized_checkpoint import fp8_quantization_config, to_fp8_checkpoint

    shape, fp8_shape = split_fp8_shape(shape)
    # an unknown shape fails here, before anything is created
    config = model_config(shape, vocab_padding, **config_overrides)
    existing = existing_checkpoint_files(path)
    if existing and not overwrite:
        raise FileExistsError(f"{path} already holds a checkpoint ({', '.join(existing[:3])}"
                              f"{', ...' if len(existing) > 3 else ''}); not writing over it. Choose another folder, "
                              f"or pass overwrite=True (--overwrite) to replace it")
    for name in existing:  # stale shards of another shape would otherwise stay beside the new ones
        os.remove(os.path.join(path, name))
    others = set(os.listdir(path)) if os.path.isdir(path) else set()  # the user's files: their modes stay
    with _removed_on_failure(path):
        # tiny models get a wider spread, so greedy tokens are separated by clear logit margins
        std = std if std is not None else (0.1 if shape == "tiny" else 0.02)
        weights = random_weights(config, std, seed)
        if fp8 or fp8_shape:
            weights = to_fp8_checkpoint(weights)
            config["quantization_config"] = fp8_quantization_config()
        save_sharded(weights, path)
        eos = [config["eos_token_id"], config["bos_token_id"]]
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": eos, "do_sample": False}, f, indent=2)
        write_tokenizer(path, config["vocab_size"] - vocab_padding)
        _readable_like_other_files(path, skip=others)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    return path


def existing_checkpoint_files(path: str) -> list[str]:
    """The names of the files in `path` that make it a checkpoint folder (empty when it is not one)."""
    return sorted({os.path.basename(found) for pattern in CHECKPOINT_MARKERS
                   for found in glob.glob(os.path.join(glob.escape(path), pattern))})


def _readable_like_other_files(path: str, skip: set[str]) -> None:
    """Give every written file the mode a plain open() gives under the umask (the weight writer makes them
    owner-only), so a checkpoint shared with other users or containers can be read by them."""
    umask = os.umask(0)
    os.umask(umask)
    for name in set(os.listdir(path)) - skip:
        full = os.path.join(path, name)
        if os.path.isfile(full):
            os.chmod(full, 0o666 & ~umask)


@contextmanager
def _removed_on_failure(path: str) -> Iterator[None]:
    """Create `path` and its missing parents; if the block fails (Ctrl-C too), remove the ones it created, so a
    failed write leaves no half-written checkpoint or empty cache folder behind."""
    created = []
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    os.makedirs(path, exist_ok=True)
    try:
        yield
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)  # the outermost folder this call created
        raise


def cache_root() -> str:
    """Where default_checkpoint writes: $NANOVLLM_CACHE, else ~/.cache/nanovllm."""
    return os.environ.get("NANOVLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "nanovllm")


def default_checkpoint(shape: str) -> str:
    """A random-weight checkpoint of `shape` in the user's cache (cache_root()), written on first use."""
    model_config(split_fp8_shape(shape)[0])  # an unknown shape is refused before anything is printed or created
    path = os.path.join(cache_root(), f"{shape}-random")
    if not os.path.exists(os.path.join(path, "config.json")):
        print(f"writing a {shape}-shaped checkpoint with RANDOM weights to {path} (no model hub is used)")
        write_random_checkpoint(path, shape, overwrite=True)  # no config.json: an unfinished write
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="folder to write the checkpoint to (created if needed)")
    parser.add_argument("--shape", default="Qwen3-0.6B", choices=SHAPE_NAMES, metavar="SHAPE",
                        help=f"the model's shape, one of: {', '.join(SHAPE_NAMES)}; tiny is a 2-layer model of "
                             f"about 2 MB for tests and CPU runs; -FP8: the published FP8 layout (default: "
                             f"Qwen3-0.6B, about 1.2 GB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--fp8", action="store_true", help="the published FP8 layout (as a -FP8 shape name does)")
    parser.add_argument("--layers", type=int, default=None,
                        help="only the first N decoder layers (a large shape that must fit a smaller disk)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a checkpoint already in the folder (refused without it)")
    args = parser.parse_args()
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: a model needs at least 1 layer")
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    if existing_checkpoint_files(args.path) and not args.overwrite:  # before torch is imported: an instant answer
        parser.error(f"{args.path} already holds a checkpoint ({', '.join(existing_checkpoint_files(args.path))}); "
                     f"pass --overwrite to replace it")
    write_random_checkpoint(args.path, args.shape, seed=args.seed, fp8=args.fp8, overwrite=args.overwrite,
                            **overrides)
    print(f"wrote a random-weight {args.shape} checkpoint to {args.path}")


if __name__ == "__main__":
    main()
