"""FP8 KV cache on the GPU, side by side with the bf16 cache: teacher-forced acceptance against transformers in
float32 (as tests/test_gpu.py scores the engine) in the eager, CUDA-graph, prefix-cache, tiny-KV (preemption)
and chunked-prefill modes, and the capacity the FP8 cache gains.

Each mode runs the same prompts with kv_cache_dtype 'auto' (bf16) and 'fp8' on each backend that reads an FP8
cache (triton; flashinfer where installed) and prints one table per backend: tokens, share that are the float32
argmax, mean and worst float32 logit gap.

FP8 rows carry 3 mantissa bits against bf16's 7, and this random 28-layer network is chaotic, so how far FP8
may fall behind bf16 is not a number to guess: the bar comes from transformers in float32 with the same
quantisation emulated (each post-RoPE key and value rounded to e4m3 with the engine's own per-layer scales). On
our FP8 engine's own history, the emulation's argmax is scored like ours, and ours must take the float32 argmax
at least as often (less 3 points) with a mean gap at most 1.5x the emulation's, the test tests/test_gpu.py
applies to bf16 against transformers' bf16. So what remains beyond the bar is a bug, not the format. Every
mode must also keep 99% of its tokens within 0.25 logits of the float32 argmax.
"""
import pytest
import torch
from hf_reference import assert_no_leaks

from nanovllm import LLM, SamplingParams
from nanovllm.quantization.kv_quant import dequantize, quantize
from nanovllm.utils.flashinfer import INSTALL, flashinfer_installed
from nanovllm.utils.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LONGER = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
ENGINE = dict(gpu_memory_utilization=0.45, max_model_len=4096)
KV_DTYPES = ("auto", "fp8")
MODES = ("graph", "eager", "prefix-cache", "tiny-KV", "chunked-prefill")
MARGIN = 0.25  # logits: a token this close to the float32 argmax is a near-tie, not an error


# 0.05: the checkpoint tests/test_gpu.py uses, logits peaked enough to compare, and chaotic (near-ties
# everywhere); 0.02: the default random checkpoint, which bench.py runs
CHECKPOINT_STDS = (0.05, 0.02)


@pytest.fixture(scope="module", params=CHECKPOINT_STDS, ids=[f"std{std}" for std in CHECKPOINT_STDS])
def checkpoint_std(request) -> float:
    return request.param


@pytest.fixture(scope="module", params=["triton", pytest.param("flashinfer", marks=pytest.mark.skipif(
    not flashinfer_installed(), reason=f"FlashInfer is not installed ({INSTALL})"))])
def backend(request) -> str:
    """The backends that read an FP8 cache: each runs every mode, bf16 and FP8."""
    return request.param


@pytest.fixture(scope="module")
def model_path(checkpoint_std, tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "Qwen3-0.6B", std=checkpoint_std,
                                   seed=1)


@pytest.fixture(scope="module")
def hf_float32(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).cuda().eval()


def fake_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x rounded to e4m3 with the layer's scale, as the FP8 cache stores it, back in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


@pytest.fixture(scope="module")
def hf_fp8_emulated(model_path):
    """transformers in float32 with every key and value quantised as the FP8 cache stores them: with the
    per-layer scales in `model.kv_scales` (set to each engine's before scoring it)."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = model.kv_scales[module.layer_idx]
        return sdpa_attention_forward(module, query, fake_fp8(key, k_scale), fake_fp8(value, v_scale), *args,
                                      **kwargs)

    AttentionInterface.register("fp8_kv_emulated", attention)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="fp8_kv_emulated").cuda().eval()
    return model


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]


def mixed_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return prompts_of(torch.randint(100, 1501, (64,), generator=g).tolist(), seed=1)


@torch.inference_mode()
def score(hf_float32, prompts, outputs, emulated=None) -> dict:
    """Float32 logit gaps to the float32 argmax on our history: of our tokens, and (with `emulated`) of that
    model's argmax at the same positions."""
    gaps, emulated_gaps = [], []
    for prompt, output in zip(prompts, outputs):
        completion = output["token_ids"]
        ids = torch.tensor([prompt + completion[:-1]], device="cuda")
        exact = hf_float32(ids).logits[0, len(prompt) - 1:].float()
        chosen = exact.gather(1, torch.tensor(completion, device="cuda").unsqueeze(1)).squeeze(1)
        gaps.append(exact.max(1).values - chosen)
        if emulated is not None:
            choice = emulated(ids).logits[0, len(prompt) - 1:].argmax(1)
            emulated_gaps.append(exact.max(1).values - exact.gather(1, choice.unsqueeze(1)).squeeze(1))
    gaps = torch.cat(gaps)
    tokens = len(gaps)
    # whole-token counts for the bars (a share exactly on a bar is one in float32 only by luck of rounding), their
    # shares for the tables
    exact_count, within_count = int((gaps == 0).sum()), int((gaps <= MARGIN).sum())
    result = dict(tokens=tokens, exact_count=exact_count, within_count=within_count, exact=exact_count / tokens,
                  within_margin=within_count / tokens, mean_gap=gaps.mean().item(), worst_gap=gaps.max().item())
    if emulated is not None:
        emulated_gaps = torch.cat(emulated_gaps)
        exact_count, within_count = int((emulated_gaps == 0).sum()), int((emulated_gaps <= MARGIN).sum())
        result.update(emulated_exact_count=exact_count, emulated_within_count=within_count,
                      emulated_exact=exact_count / tokens, emulated_within_margin=within_count / tokens,
                      emulated_mean_gap=emulated_gaps.mean().item())
    return result


def run_modes(model_path: str, kv_cache_dtype: str, backend: str) -> tuple[dict, dict]:
    """Each mode's (prompts, outputs, the engine's FP8 scales) with this KV cache dtype, and the KV block count
    at ENGINE's budget."""
    runs = {}
    engine = dict(ENGINE, attention_backend=backend)
    with LLM(model_path, kv_cache_dtype=kv_cache_dtype, **engine) as llm:
        blocks = llm.model_runner.num_kvcache_blocks
        scales = llm.model_runner.kv_scales
        prompts = mixed_prompts()
        runs["graph"] = (prompts, llm.generate(prompts, GREEDY, use_tqdm=False), scales)
        prefix = prompts_of([1100], seed=2)[0]
        shared = [prefix + s for s in prompts_of([5, 200, 300, 1], seed=3)]
        first = llm.generate(shared[:1], LONGER, use_tqdm=False)
        cached_before = llm.scheduler.block_manager.allocate
        hits = []

        def allocate(seq):
            cached_before(seq)
            hits.append(seq.num_cached_tokens)

        llm.scheduler.block_manager.allocate = allocate
        second = llm.generate(shared[1:], LONGER, use_tqdm=False)  # hits the blocks the first call registered
        assert all(n >= 1024 for n in hits), hits
        runs["prefix-cache"] = (shared, first + second, scales)
        assert_no_leaks(llm)
    with LLM(model_path, kv_cache_dtype=kv_cache_dtype, enforce_eager=True, **engine) as llm:
        runs["eager"] = (prompts, llm.generate(prompts, GREEDY, use_tqdm=False), llm.model_runner.kv_scales)
    tiny = dict(engine, gpu_memory_utilization=0.9)
    with LLM(model_path, kv_cache_dtype=kv_cache_dtype, num_kvcache_blocks=24, **tiny) as llm:
        preempted = []
        preempt = llm.scheduler._preempt
        llm.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
        runs["tiny-KV"] = (prompts[:24], llm.generate(prompts[:24], LONGER, use_tqdm=False),
                           llm.model_runner.kv_scales)
        assert preempted, "24 blocks were meant to be too few for 24 sequences"
        assert_no_leaks(llm)
    with LLM(model_path, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=512, **engine) as llm:
        runs["chunked-prefill"] = (prompts[:24], llm.generate(prompts[:24], LONGER, use_tqdm=False),
                                   llm.model_runner.kv_scales)
    return runs, blocks


@pytest.fixture(scope="module")
def results(checkpoint_std, backend, model_path, hf_float32, hf_fp8_emulated) -> dict:
    table, blocks = {}, {}
    for dtype in KV_DTYPES:
        runs, blocks[dtype] = run_modes(model_path, dtype, backend)
        for mode, (prompts, outputs, scales) in runs.items():
            hf_fp8_emulated.kv_scales = scales
            table[mode, dtype] = score(hf_float32, prompts, outputs, hf_fp8_emulated if dtype == "fp8" else None)
    print(f"\ncheckpoint std {checkpoint_std}, {backend} backend")
    print(f"| mode | KV cache | tokens | float32 argmax | within {MARGIN} | mean gap | worst gap | "
          f"emulated FP8: argmax, mean gap |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in MODES:
        for dtype in KV_DTYPES:
            r = table[mode, dtype]
            emulated = f"{r['emulated_exact']:.1%}, {r['emulated_mean_gap']:.4f}" if "emulated_exact" in r else ""
            print(f"| {mode} | {'bf16' if dtype == 'auto' else dtype} | {r['tokens']} | {r['exact']:.1%} | "
                  f"{r['within_margin']:.1%} | {r['mean_gap']:.4f} | {r['worst_gap']:.3f} | {emulated} |")
    print(f"KV blocks at gpu_memory_utilization={ENGINE['gpu_memory_utilization']}: bf16 {blocks['auto']}, "
          f"fp8 {blocks['fp8']} ({blocks['fp8'] / blocks['auto']:.2f}x)")
    return dict(table=table, blocks=blocks, std=checkpoint_std, backend=backend)


def expect_xqa_rounding(results: dict, request) -> None:
    """XQA's FP8 kernel (the flashinfer backend) rounds the query and the softmax probabilities to e4m3 as well: on
    the peaked checkpoint that error is larger than the FP8 cache's own (on an H100, graph mode: 49.8% of the tokens
    the float32 argmax against the emulation's 62.3%, 66.4% within the margin), so these bars are expected to fail
    there, and must (strict): a pass means the kernel changed."""
    if results["backend"] == "flashinfer" and results["std"] == 0.05:
        request.applymarker(pytest.mark.xfail(strict=True, reason="XQA's FP8 kernel rounds the query and the "
                                              "probabilities to e4m3 (docs/flashinfer.md)"))


@pytest.mark.parametrize("mode", MODES)
def test_fp8_as_good_as_the_emulated_quantisation(results, mode, request):
    expect_xqa_rounding(results, request)
    fp8 = results["table"][mode, "fp8"]
    # 3 points, in whole tokens: 100 * ours >= 100 * emulation's - 3 * tokens
    assert 100 * fp8["exact_count"] >= 100 * fp8["emulated_exact_count"] - 3 * fp8["tokens"], fp8
    assert fp8["mean_gap"] <= 1.5 * fp8["emulated_mean_gap"] + 1e-3, fp8
    assert fp8["worst_gap"] == fp8["worst_gap"]  # not NaN


@pytest.mark.parametrize("mode", MODES)
def test_fp8_tokens_within_the_margin(results, mode, request):
    """On the bench checkpoint 99% of FP8's tokens are within MARGIN of the float32 argmax; on the chaotic one,
    where the format itself moves a fifth of them further, as many as the emulation's (less 3 points)."""
    expect_xqa_rounding(results, request)
    fp8 = results["table"][mode, "fp8"]
    if results["std"] == 0.02:
        assert 100 * fp8["within_count"] >= 99 * fp8["tokens"], fp8
    else:
        assert 100 * fp8["within_count"] >= 100 * fp8["emulated_within_count"] - 3 * fp8["tokens"], fp8


def test_fp8_cache_holds_about_twice_the_blocks(results):
    # 128 bytes a row against 256: 2x for the same budget, less what the budget's rounding costs
    assert results["blocks"]["fp8"] >= 1.95 * results["blocks"]["auto"], results["blocks"]
