"""FP8 weights on CPU: published-layout checkpoints load (dequantized here) and match transformers on the
dequantized weights; scales follow packing and tensor parallelism; quantization='fp8' matches a plain torch
emulation of per-channel weight / per-token activation quantization; malformed inputs are clear errors."""
import json
import os
import shutil
from glob import glob

import pytest
import torch
from hf_reference import assert_teacher_forced_greedy
from safetensors.torch import load_file, save_file
from test_e2e_transformers import random_prompts
from transformers import AutoConfig, AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.layers.linear import RowParallelLinear
from nanovllm.models import model_class
from nanovllm.models.decoder import Qwen3ForCausalLM
from nanovllm.quantization.fp8_checkpoint import Fp8Settings, quantization_settings
from nanovllm.quantization.fp8_model import finish_fp8, prepare_fp8
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import TensorParallelGroup
from nanovllm.utils.random_checkpoint import write_random_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
FP8 = torch.float8_e4m3fn
# every tensor-parallel shard of this shape is a whole number of 128-row / 128-column blocks at TP=2
TP_SHAPE = dict(hidden_size=256, head_dim=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The published format's meaning, written out here independently: w8 * scale_inv of its 128x128 block."""
    rows, cols = w8.shape
    scale = scale_inv.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return w8.float() * scale


def write_dequantized(fp8_path: str, path: str, dtype: torch.dtype = torch.float32) -> str:
    """A plain `dtype` copy of an FP8 checkpoint, which transformers loads (it cannot run FP8 weights on CPU)."""
    shutil.copytree(fp8_path, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {}
    for file in glob(os.path.join(fp8_path, "*.safetensors")):  # one file or shards: written back as one
        tensors.update(load_file(file))
    plain = {name: (dequantize(t, tensors[name + "_scale_inv"]) if t.dtype == FP8 else t).to(dtype)
             for name, t in tensors.items() if not name.endswith("_scale_inv")}
    save_file(plain, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny-fp8")), "tiny-FP8", seed=3)


@pytest.fixture(scope="module")
def fp8_tp_model(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tp-fp8")), "tiny", seed=4, fp8=True, **TP_SHAPE)


def hf_dequantized(fp8_path: str, tmp_path) -> torch.nn.Module:
    path = write_dequantized(fp8_path, str(tmp_path / "dequantized"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check(hf_model, prompts, outputs, margin: float = 1e-3) -> None:
    near_ties = sum(assert_teacher_forced_greedy(hf_model, p, o["token_ids"], margin)
                    for p, o in zip(prompts, outputs))
    assert near_ties <= 1, f"{near_ties} near-ties: the random weights are not peaked enough for a stable test"


def test_published_layout(fp8_model):
    tensors = load_file(os.path.join(fp8_model, "model.safetensors"))
    q, q_scale = tensors["model.layers.0.self_attn.q_proj.weight"], tensors["model.layers.0.self_attn.q_proj"
                                                                            ".weight_scale_inv"]
    assert q.dtype == FP8 and q_scale.dtype == torch.float32 and list(q_scale.shape) == [1, 1]
    k_scale = tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    assert list(k_scale.shape) == [1, 1]  # 64 rows: one partial block
    assert list(tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape) == [1, 2]  # [128, 256]
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32
    assert not any("norm" in name and t.dtype == FP8 for name, t in tensors.items())
    with open(os.path.join(fp8_model, "config.json")) as f:
        assert json.load(f)["quantization_config"] == {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head"]}


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_model, tmp_path):
    hf = hf_dequantized(fp8_model, tmp_path)
    prompts = random_prompts([1, 9, 200, 300], seed=5)
    with LLM(fp8_model, num_kvcache_blocks=16) as llm:
        assert llm.model_runner.fp8 == Fp8Settings(checkpoint=True)
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(hf, prompts, outputs)


@pytest.mark.slow
def test_tensor_parallel_2_shards_scales_with_weights(fp8_tp_model, tmp_path):
    hf = hf_dequantized(fp8_tp_model, tmp_path)
    prompts = random_prompts([5, 120, 260], seed=6)
    with LLM(fp8_tp_model, num_kvcache_blocks=16, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(fp8_tp_model, num_kvcache_blocks=16) as llm:
        single = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [o["token_ids"] for o in single]
    check(hf, prompts, outputs)


@pytest.mark.parametrize("shape", ["Llama-3.2-1B-FP8", "Qwen2.5-0.5B-FP8", "Qwen3-30B-A3B-FP8"])
def test_other_families_in_the_fp8_layout(shape, tmp_path):
    """The same format on the other families: Qwen2's q/k/v biases stay as stored, Qwen3-MoE's experts each carry
    their own scales (the router stays unquantized) and load into the stacked expert weights."""
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, dtype="float32", moe_intermediate_size=32,
                 num_experts=8)
    path = write_random_checkpoint(str(tmp_path / shape), shape, std=0.1, seed=8, **small)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if "A3B" in shape:
        assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"].dtype == FP8
        assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32
    hf = hf_dequantized(path, tmp_path)
    prompts = random_prompts([4, 150], seed=9)
    with LLM(path, num_kvcache_blocks=8, kvcache_block_size=64) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(hf, prompts, outputs)


@pytest.mark.parametrize("rank", [0, 1])
def test_packed_and_sharded_weights_are_the_right_slices(fp8_tp_model, rank):
    """One rank of TP=2, built in this process: every packed part and every shard dequantizes with its own
    scales, element for element."""
    hf_config = AutoConfig.from_pretrained(fp8_tp_model)
    settings = quantization_settings(None, hf_config)
    model = Qwen3ForCausalLM(hf_config, TensorParallelGroup(rank=rank, size=2))
    prepare_fp8(model, settings)
    load_model(model, fp8_tp_model)
    summary = finish_fp8(model, settings, torch.float32)
    assert summary.layers == 4 * hf_config.num_hidden_layers and summary.modes == {"dequantized": summary.layers}
    tensors = load_file(os.path.join(fp8_tp_model, "model.safetensors"))

    def full(name: str) -> torch.Tensor:
        return dequantize(tensors[f"model.layers.1.{name}.weight"], tensors[f"model.layers.1.{name}.weight_scale_inv"])

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(2, 0)[rank]

    layer = model.model.layers[1]
    qkv = torch.cat([rows(full(f"self_attn.{p}_proj")) for p in "qkv"])
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, qkv, rtol=0, atol=0)
    gate_up = torch.cat([rows(full("mlp.gate_proj")), rows(full("mlp.up_proj"))])
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    for name, module in (("self_attn.o_proj", layer.self_attn.o_proj), ("mlp.down_proj", layer.mlp.down_proj)):
        torch.testing.assert_close(module.weight, full(name).chunk(2, 1)[rank], rtol=0, atol=0)


@pytest.mark.parametrize("rank", [0, 1])
def test_moe_experts_shard_their_scales(tmp_path, rank):
    """One rank of TP=2 on a Qwen3-MoE FP8 checkpoint: each expert's gate/up rows and down columns, dequantized
    with this rank's scale rows and columns, equal the expected slices of the dequantized checkpoint."""
    moe = dict(TP_SHAPE, num_hidden_layers=1, vocab_size=1024, dtype="float32", moe_intermediate_size=256,
               num_experts=4, num_experts_per_tok=2)
    path = write_random_checkpoint(str(tmp_path / "moe"), "Qwen3-30B-A3B-FP8", std=0.1, seed=10, **moe)
    hf_config = AutoConfig.from_pretrained(path)
    model = model_class(hf_config)(hf_config, TensorParallelGroup(rank=rank, size=2))
    settings = quantization_settings(None, hf_config)
    prepare_fp8(model, settings)
    load_model(model, path)
    assert finish_fp8(model, settings, torch.float32).modes["experts dequantized"] == 1
    tensors = load_file(os.path.join(path, "model.safetensors"))
    experts = model.model.layers[0].mlp.experts

    def full(e: int, proj: str) -> torch.Tensor:
        prefix = f"model.layers.0.mlp.experts.{e}.{proj}."
        return dequantize(tensors[prefix + "weight"], tensors[prefix + "weight_scale_inv"])

    for e in range(4):
        gate_up = torch.cat([full(e, "gate_proj").chunk(2, 0)[rank], full(e, "up_proj").chunk(2, 0)[rank]])
        torch.testing.assert_close(experts.gate_up_proj[e], gate_up, rtol=0, atol=0)
        torch.testing.assert_close(experts.down_proj[e], full(e, "down_proj").chunk(2, 1)[rank], rtol=0, atol=0)


def emulate_fp8(linear: torch.nn.Linear) -> None:
    """Replace a transformers Linear's forward by the quantization='fp8' arithmetic, written out plainly: weight
    rows and activation rows (tokens) each scaled by amax x (1 / 448) into e4m3, dequantized, multiplied in float32."""
    def quantized(x: torch.Tensor) -> torch.Tensor:
        amax = x.float().abs().amax(-1, keepdim=True)
        # times the float32 reciprocal, as the engine defines it (what CUDA makes of amax / 448 too)
        scale = torch.where(amax > 0, amax * (1 / 448), torch.ones_like(amax))
        return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale

    weight = quantized(linear.weight)
    linear.forward = lambda x: (quantized(x) @ weight.t()).to(x.dtype)


@torch.inference_mode()
def test_quantization_fp8_matches_a_plain_emulation(tiny_model, hf_model):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            emulate_fp8(module)
    prompts = random_prompts([3, 40, 270], seed=7)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    with LLM(tiny_model, num_kvcache_blocks=16, quantization="fp8") as llm:
        layer = llm.model_runner.model.model.layers[0]
        assert layer.self_attn.qkv_proj.weight.dtype == FP8 and layer.mlp.down_proj.fp8.mode == "channel"
        outputs = llm.generate(prompts, params, use_tqdm=False)
    # The emulation's logits are not continuous in float32 noise: an activation that a different summation order
    # (another attention kernel, or the CPU's GEMM kernel choice) moves across an e4m3 rounding boundary changes
    # by one FP8 step, so this reference is only defined to about a tenth of a logit where that happens, whatever
    # computes it. A margin of float noise (1e-3) would test which kernels ran; an unquantized model misses the
    # emulation's argmax by whole logits, so this margin still tells FP8 arithmetic from none.
    check(hf, prompts, outputs, margin=0.1)
    gaps = {"emulated": [], "plain": []}
    for prompt, output in zip(prompts, outputs):
        ids = torch.tensor([prompt + output["token_ids"][:-1]])
        chosen = torch.tensor(output["token_ids"]).unsqueeze(1)
        ours = torch.tensor([position[token] for position, token in zip(output["logprobs"], output["token_ids"])])
        for kind, model in (("emulated", hf), ("plain", hf_model)):
            logprobs = model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1).gather(1, chosen).squeeze(1)
            gaps[kind].append((ours - logprobs).abs())
    emulated, plain = torch.cat(gaps["emulated"]), torch.cat(gaps["plain"])
    # Most positions equal the emulation to float32 summation noise. Elsewhere an activation that float32 noise
    # (attention sums in another order) moves across an e4m3 rounding boundary changes by one FP8 step (6%) and
    # the logprob by up to ~0.1 on this peaked model; the unquantized model is off everywhere, by ~10x more.
    assert (emulated < 1e-4).float().mean() >= 0.5, emulated
    assert (plain < 1e-4).float().mean() <= 0.1, plain
    assert emulated.mean() * 5 < plain.mean(), (emulated.mean(), plain.mean())


def test_fp8_linear_is_the_emulation(tiny_model):
    """One layer, no upstream noise: the engine's FP8 matmul is the plain emulation to float32 rounding."""
    from nanovllm.quantization.fp8_linear import Fp8Weight, fp8_linear, quantize_per_channel

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 256, generator=g), torch.randn(7, 256, generator=g) * 3
    x[2] = 0  # an all-zero row (padding) must not divide by zero
    w8, scale = quantize_per_channel(weight)
    linear = torch.nn.Linear(256, 96, bias=False)
    linear.weight.data.copy_(weight)
    emulate_fp8(linear)
    bias = torch.randn(96, generator=g)
    torch.testing.assert_close(fp8_linear(x, Fp8Weight(w8, scale, "channel"), bias), linear(x) + bias,
                               rtol=1e-5, atol=1e-5)


def rewrite(path: str, tmp_path, tensors: dict | None = None, config: dict | None = None) -> str:
    out = str(tmp_path / "edited")
    shutil.copytree(path, out)
    if tensors is not None:
        weights = load_file(os.path.join(path, "model.safetensors"))
        weights.update(tensors)
        save_file({k: v for k, v in weights.items() if v is not None}, os.path.join(out, "model.safetensors"))
    if config is not None:
        with open(os.path.join(path, "config.json")) as f:
            full = json.load(f)
        full.update(config)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(full, f)
    return out


def test_bad_scale_shape_is_a_clear_error(fp8_model, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    bad = rewrite(fp8_model, tmp_path, tensors={name: torch.ones(3, 1)})
    with pytest.raises(ValueError, match=rf"{name}.*expected shape \[2, 1\].*found \[3, 1\]"):
        LLM(bad, num_kvcache_blocks=16)


def test_missing_scale_and_unquantized_weight_are_clear_errors(fp8_model, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    missing = rewrite(fp8_model, tmp_path, tensors={name + "_scale_inv": None})
    with pytest.raises(ValueError, match=rf"lacks tensor\(s\) '{name}_scale_inv'"):
        LLM(missing, num_kvcache_blocks=16)
    plain = rewrite(fp8_model, tmp_path / "b", tensors={name: torch.zeros(128, 128)})
    with pytest.raises(ValueError, match=rf"{name}.*expected a float8_e4m3fn weight.*found torch.float32"):
        LLM(plain, num_kvcache_blocks=16)


def test_shard_off_the_block_grid_is_a_clear_error(fp8_model):
    # tiny: 4 query heads of 32 -> 128 rows of q, 64 per rank: not whole 128-row blocks
    hf_config = AutoConfig.from_pretrained(fp8_model)
    model = Qwen3ForCausalLM(hf_config, TensorParallelGroup(rank=0, size=2))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.qkv_proj part 'q': 128 output rows split over 2 "
                                         r"ranks gives shards of 64 rows, not a multiple of the 128-row"):
        prepare_fp8(model, Fp8Settings(checkpoint=True))
    row = torch.nn.Module()
    row.down_proj = RowParallelLinear(384, 128, TensorParallelGroup(rank=1, size=2))
    with pytest.raises(ValueError, match=r"down_proj: 384 input columns split over 2 ranks gives shards of 192"):
        prepare_fp8(row, Fp8Settings(checkpoint=True))


@pytest.mark.parametrize("config, message", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}},
     r"quant_method='awq' is not supported; supported: \['fp8'\]"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}},
     r"activation_scheme='static' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": None}},
     r"weight_block_size=None is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     r"fmt='e5m2' is not supported"),
])
def test_unsupported_quantization_configs_are_clear_errors(tiny_model, tmp_path, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(rewrite(tiny_model, tmp_path, config=config))


def test_unknown_quantization_option_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match=r"quantization='int8' is not supported; supported: \['fp8'\] or None"):
        LLM(tiny_model, quantization="int8")
