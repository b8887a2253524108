"""Llama 3.x, Qwen2 (2.5) and Qwen3-MoE against transformers, greedy, token for token, on CPU.

Each checkpoint is written by transformers itself (its config class, its save_pretrained) with random weights wide
enough that greedy tokens are separated by clear logit margins; only the tokenizer is ours."""
import json
import os
import shutil

import pytest
import torch
from hf_reference import assert_no_leaks, hf_greedy
from test_e2e_transformers import random_prompts
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import write_tokenizer

TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, bos_token_id=1021, eos_token_id=1023,
            pad_token_id=1021, dtype="float32")
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256)  # below the test's lengths, so the scaling matters
FAMILIES = {
    "llama-tied-llama3-rope": lambda: LlamaConfig(**TINY, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                                  rope_parameters=LLAMA3_ROPE),
    "llama-untied-biases": lambda: LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                                               rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    "qwen2-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2-untied": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    # 8 experts, 2 per token; layer 1 dense (mlp_only_layers)
    "qwen3-moe": lambda: Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1],
                                        tie_word_embeddings=False),
    # every other layer sparse (decoder_sparse_step), weights not renormalised, tied
    "qwen3-moe-step2-tied": lambda: Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 4}, num_experts=6,
                                                   num_experts_per_tok=3, moe_intermediate_size=32,
                                                   norm_topk_prob=False, decoder_sparse_step=2,
                                                   tie_word_embeddings=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 7, 100, 255, 257, 513]


@torch.no_grad()
def write_hf_checkpoint(config, path: str, seed: int = 0, std: float = 0.1) -> str:
    """A checkpoint saved by transformers: every weight random (norms near 1, biases not zero, so a weight loaded
    into the wrong place or not at all shows), plus our tokenizer for the config's vocabulary."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1.0 + 0.1 * torch.randn_like(param))
        else:
            param.copy_(std * torch.randn_like(param))
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(checkpoint path, transformers' model loaded from it)."""
    path = write_hf_checkpoint(FAMILIES[request.param](), str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path).eval()


def test_greedy_identical_to_transformers(family):
    path, hf_model = family
    prompts = random_prompts(LENGTHS, seed=11)
    with LLM(path, num_kvcache_blocks=16, kvcache_block_size=64) as llm:
        assert type(llm.model_runner.model).__name__ == hf_model.config.architectures[0]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_no_leaks(llm)
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(hf_model, prompt, 24)


@pytest.mark.slow
def test_tensor_parallel_2_identical_to_transformers(tmp_path):
    # Qwen2's q/k/v biases are split with their heads; the Llama biases on o and down are added once; each
    # expert's intermediate dimension is split
    prompts = random_prompts([300, 40, 90], seed=12)
    for name in ("qwen2-untied", "llama-untied-biases", "qwen3-moe"):
        path = write_hf_checkpoint(FAMILIES[name](), str(tmp_path / name), seed=1)
        hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
        with LLM(path, num_kvcache_blocks=16, kvcache_block_size=64, tensor_parallel_size=2) as llm:
            outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output["token_ids"] == hf_greedy(hf_model, prompt, 24), name


def edited_copy(src: str, dst: str, **fields) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_unsupported_config_features_are_refused_by_name(tiny_model, tmp_path):
    with pytest.raises(ValueError, match=r"architectures=\['MistralForCausalLM'\].*supported: \['LlamaForCausalLM', "
                                         r"'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        LLM(edited_copy(tiny_model, str(tmp_path / "mistral"), architectures=["MistralForCausalLM"],
                        model_type="mistral"))
    with pytest.raises(ValueError, match=r"rope scaling of type 'yarn' is not supported; supported: "
                                         r"\['default', 'llama3'\]"):
        LLM(edited_copy(tiny_model, str(tmp_path / "yarn"), rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                              original_max_position_embeddings=1024)))
    with pytest.raises(ValueError, match="sliding-window attention"):
        LLM(edited_copy(tiny_model, str(tmp_path / "window"), use_sliding_window=True, sliding_window=64))


def test_moe_layers_follow_the_config(tmp_path):
    from nanovllm.models.decoder import DenseMLP
    from nanovllm.models.qwen3_moe import Qwen3MoeForCausalLM, SparseMoeBlock

    for name, sparse in (("qwen3-moe", [True, False, True]), ("qwen3-moe-step2-tied", [False, True, False, True])):
        model = Qwen3MoeForCausalLM(FAMILIES[name]())
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == sparse
        assert all(isinstance(layer.mlp, DenseMLP) for layer, s in zip(model.model.layers, sparse) if not s)


@pytest.mark.parametrize("shape", ["Qwen3-30B-A3B", "Qwen2.5-7B", "Llama-3.2-1B", "Llama-3.1-8B"])
def test_random_checkpoints_of_each_family_load_in_transformers_and_here(shape, tmp_path, monkeypatch):
    """The benchmark checkpoints (bench.py --shape) of each family, shrunk, and sharded with an index as a large
    one is: transformers reads them as the family they claim, and we generate what transformers does."""
    from nanovllm.utils import random_checkpoint

    monkeypatch.setattr(random_checkpoint, "SHARD_BYTES", 200_000)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, dtype="float32", moe_intermediate_size=32,
                 num_experts=8)
    path = random_checkpoint.write_random_checkpoint(str(tmp_path / shape), shape, std=0.1, **small)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    hf_model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(hf_model).__name__ == random_checkpoint.model_config(shape)["architectures"][0]
    prompts = random_prompts([5, 300], seed=13)
    with LLM(path, num_kvcache_blocks=8, kvcache_block_size=64) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output["token_ids"] == hf_greedy(hf_model, prompt, 24)
