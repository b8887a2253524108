"""A broken checkpoint or model config is refused at load with an error naming the tensor, file or field.

Each case copies the tiny checkpoint to a temporary directory, breaks one thing, and loads it: most through
load_model on a freshly built model (no engine), a few through LLM() to show the error reaches the user."""
import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.models.decoder import Qwen3ForCausalLM
from nanovllm.utils.loader import INDEX_FILE, load_model
from nanovllm.utils.parallel import TensorParallelGroup
from nanovllm.utils.random_checkpoint import write_random_checkpoint
from nanovllm.utils.tokenizer import load_tokenizer

ENGINE = dict(num_kvcache_blocks=8, max_model_len=512)
# one tensor of each kind; layer 1 so a mistake confined to layer 0 would not hide it
KINDS = {
    "embed_tokens": "model.embed_tokens.weight",
    **{proj: f"model.layers.1.self_attn.{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{proj: f"model.layers.1.mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")},
    **{norm: f"model.layers.1.self_attn.{norm}.weight" for norm in ("q_norm", "k_norm")},
    **{norm: f"model.layers.1.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")},
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",  # only in the untied checkpoint
}
MUTATIONS = {
    "missing": lambda t: None,
    "one_row_short": lambda t: t[:-1].clone(),
    "one_column_more": lambda t: torch.cat([t, t[..., :1]], dim=-1),
}


def read_tensors(path: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(path, "model.safetensors"), "pt", "cpu") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def variant(src: str, dst: str, tensors: dict[str, torch.Tensor] | None = None, shards: list[list[str]] | None = None,
            index: bool = True, **config_overrides) -> str:
    """A copy of the checkpoint at src with other tensors (split into `shards` of names) or config fields."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != INDEX_FILE:
            shutil.copy(os.path.join(src, name), dst)
    if config_overrides:
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**config, **config_overrides}, f)
    tensors = read_tensors(src) if tensors is None else tensors
    if shards is None:
        save_file(tensors, os.path.join(dst, "model.safetensors"))
        return dst
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, names in zip(files, shards):
        save_file({name: tensors[name] for name in names}, os.path.join(dst, file))
    if index:
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        with open(os.path.join(dst, INDEX_FILE), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def load(path: str, tp: TensorParallelGroup | None = None) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(AutoConfig.from_pretrained(path), tp)
    load_model(model, path)
    return model


def halves(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    names = sorted(tensors)
    return [names[: len(names) // 2], names[len(names) // 2:]]


@pytest.fixture(scope="module")
def untied_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-tiny-untied")), "tiny", seed=1,
                                   tie_word_embeddings=False)


@pytest.mark.parametrize("mutation", MUTATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_each_tensor_kind(tiny_model, untied_model, tmp_path, kind, mutation):
    src = untied_model if kind == "lm_head" else tiny_model
    tensors, name = read_tensors(src), KINDS[kind]
    expected = list(tensors[name].shape)
    broken = MUTATIONS[mutation](tensors[name])
    if broken is None:
        del tensors[name]
    else:
        tensors[name] = broken
    path = variant(src, str(tmp_path / "ckpt"), tensors)
    with pytest.raises(ValueError, match=re.escape(repr(name))) as error:
        load(path)
    if broken is not None:  # the full checkpoint shapes, as the config implies them and as found
        assert f"expected shape {expected}" in str(error.value) and f"found {list(broken.shape)}" in str(error.value)
        if kind in ("embed_tokens", "lm_head"):
            assert "vocab_size=1024" in str(error.value)


def test_missing_packed_part_through_llm(tiny_model, tmp_path):
    tensors = read_tensors(tiny_model)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks tensor\(s\) 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        LLM(variant(tiny_model, str(tmp_path / "ckpt"), tensors), **ENGINE)


def test_vocab_size_disagreeing_with_weights(tiny_model, tmp_path):
    path = variant(tiny_model, str(tmp_path / "ckpt"), vocab_size=2048)
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight'.*\[2048, 128\].*vocab_size=2048.*"
                                         r"found \[1024, 128\]"):
        LLM(path, **ENGINE)


def test_tied_lm_head_is_optional_and_ignored(tiny_model, tmp_path):
    tensors = read_tensors(tiny_model)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = torch.zeros(3, 3)  # ignored, as transformers does for a tied head
    model = load(variant(tiny_model, str(tmp_path / "ckpt"), tensors))
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_unknown_tensor_is_named(tiny_model, tmp_path):
    tensors = read_tensors(tiny_model)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.extra_proj\.weight'.*match no model parameter"):
        load(variant(tiny_model, str(tmp_path / "ckpt"), tensors))


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_ranks_keep_their_slices(tiny_model, tmp_path, rank):
    # each rank gets the full tensors and checks their full shapes; no process group is needed to load
    full = read_tensors(tiny_model)
    model = load(tiny_model, TensorParallelGroup(rank, 2))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    q, k = full["model.layers.1.self_attn.q_proj.weight"], full["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(qkv[:64], q[rank * 64:(rank + 1) * 64]) and torch.equal(qkv[64:96], k[rank * 32:(rank + 1) * 32])
    down = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(down, full["model.layers.1.mlp.down_proj.weight"][:, rank * 128:(rank + 1) * 128])
    full["model.layers.1.self_attn.k_proj.weight"] = k[:-1].clone()
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight'.*expected shape \[64, 128\], "
                                         r"found \[63, 128\]"):
        load(variant(tiny_model, str(tmp_path / "ckpt"), full), TensorParallelGroup(rank, 2))


def test_sharded_with_index_generates_identically(tiny_model, tmp_path):
    tensors = read_tensors(tiny_model)
    path = variant(tiny_model, str(tmp_path / "sharded"), tensors, halves(tensors))
    # repositories may ship a consolidated copy beside the shards: the index says it is not to be read
    with open(os.path.join(path, "consolidated.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    prompts = [[5, 17, 300, 42], "hello world"]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = []
    for checkpoint in (tiny_model, path):
        with LLM(checkpoint, **ENGINE) as llm:
            outputs.append([o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_shard_named_by_index_missing(tiny_model, tmp_path):
    path = variant(tiny_model, str(tmp_path / "ckpt"), shards=halves(read_tensors(tiny_model)))
    shard = os.path.join(path, "model-00002-of-00002.safetensors")
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=re.escape(shard)):
        load(path)


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors"])
def test_unreadable_shard_is_named(tiny_model, tmp_path, damage):
    path = variant(tiny_model, str(tmp_path / "ckpt"))
    file = os.path.join(path, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2] if damage == "truncated" else b"<html>404</html>")
    with pytest.raises(ValueError, match=f"cannot read checkpoint file {re.escape(file)}"):
        load(path)


@pytest.mark.parametrize("index", [True, False])
def test_tensor_in_two_shards(tiny_model, tmp_path, index):
    tensors = read_tensors(tiny_model)
    first, second = halves(tensors)
    name = first[0]
    path = variant(tiny_model, str(tmp_path / "ckpt"), tensors, [first, [name, *second]], index=index)
    if index:  # the index maps the name to the second shard, so the first shard's copy is not where it says
        pattern = rf"{re.escape(repr(name))} is in .*model-00001-of-00002.*names .*model-00002-of-00002"
    else:
        pattern = rf"{re.escape(repr(name))} appears twice"
    with pytest.raises(ValueError, match=pattern):
        load(path)


def test_tensor_listed_by_index_absent_from_its_shard(tiny_model, tmp_path):
    tensors = read_tensors(tiny_model)
    first, second = halves(tensors)
    path = variant(tiny_model, str(tmp_path / "ckpt"), tensors, [first, second])
    name = second[0]
    save_file({n: tensors[n] for n in second[1:]}, os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=rf"lists tensor\(s\) {re.escape(repr(name))} in shards that do not hold"):
        load(path)


@pytest.mark.parametrize("field, value", [
    ("hidden_size", 0), ("num_attention_heads", 0), ("num_key_value_heads", 0), ("num_key_value_heads", -2),
    ("num_hidden_layers", 0), ("intermediate_size", -1), ("vocab_size", 0), ("max_position_embeddings", 0),
    ("head_dim", 0), ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-6),
])
def test_impossible_config_field_is_named(tiny_model, tmp_path, field, value):
    path = variant(tiny_model, str(tmp_path / "ckpt"), **{field: value})
    with pytest.raises(ValueError, match=rf"model config {field}={re.escape(repr(value))} is impossible"):
        LLM(path, **ENGINE)


def test_heads_not_a_multiple_of_kv_heads(tiny_model, tmp_path):
    path = variant(tiny_model, str(tmp_path / "ckpt"), num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_attention_heads=4 must be a multiple of num_key_value_heads=3"):
        LLM(path, **ENGINE)


def test_tokenizer_files_missing_or_broken(tiny_model, tmp_path):
    assert load_tokenizer(tiny_model).encode("hello")
    path = variant(tiny_model, str(tmp_path / "ckpt"))
    tokenizer_json = os.path.join(path, "tokenizer.json")
    with open(tokenizer_json) as f:
        spec = json.load(f)
    with open(tokenizer_json, "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=f"cannot load the tokenizer in {re.escape(path)}"):
        load_tokenizer(path)
    spec["model"]["vocab"], spec["model"]["merges"] = {}, []
    with open(tokenizer_json, "w") as f:
        json.dump(spec, f)
    with pytest.raises(ValueError, match="encodes 'hello' to no tokens"):
        load_tokenizer(path)
    for name in os.listdir(path):
        if name.startswith("tokenizer"):
            os.remove(os.path.join(path, name))
    looked_for = rf"no tokenizer files in {re.escape(path)}: looked for tokenizer\.json"
    with pytest.raises(FileNotFoundError, match=looked_for):
        load_tokenizer(path)
