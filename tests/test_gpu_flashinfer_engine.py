"""The engine on FlashInfer's paths, on the GPU (skipped, saying so, where FlashInfer is not installed).

1. Long contexts (6k-14k-token prompts) with the FP8 KV cache, on the flashinfer and the triton backends, with CUDA
   graphs and eager with chunked prefill (each prompt then reads its own FP8 prefix back): each greedy token scored
   teacher-forced against transformers in float32. The bar is the acceptance bar of tests/test_gpu_fp8_kv.py on the
   benchmark's checkpoint (std 0.02): at least 99% of the tokens within 0.25 logits of the float32 argmax; and
   flashinfer at least as often the float32 argmax as triton, less 3 points.
2. A published-layout FP8 checkpoint with the matmuls of batches up to 31 rows routed to FlashInfer, and as the
   built-in table routes them (64 sequences: decode steps past 31 rows too), against the same engine on cuBLAS:
   all scored teacher-forced against transformers in float32 on the dequantized weights; FlashInfer's routes may
   not score worse (argmax share within 3 points, mean gap within 1.25x + 0.005).
3. The default backend: with the switch on, an FP8 cache on Hopper gets flashinfer.
"""
import pytest
import torch
from hf_reference import assert_no_leaks
from test_fp8_weights import write_dequantized

import nanovllm.attention as attention
from nanovllm import LLM, SamplingParams
from nanovllm.quantization.fp8_routes import FLASHINFER, MEASURED_ROUTES, ROUTES_ENV, describe_routes
from nanovllm.utils.flashinfer import INSTALL, flashinfer_installed
from nanovllm.utils.random_checkpoint import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not flashinfer_installed(), reason=f"FlashInfer is not installed ({INSTALL})")]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
MARGIN = 0.25
BUILT_IN = "built-in"  # routes: the engine's own table, no environment override
LONG_MODES = {"graph": {}, "eager+chunked": dict(enforce_eager=True, max_num_batched_tokens=4096)}


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def score(hf_model, prompts, outputs) -> dict:
    """Float32 logit gap of each of our tokens to the float32 argmax, teacher-forced on our own history; only the
    completion's logits are computed (a 14k-token prompt's full logits would not fit)."""
    gaps = []
    for prompt, output in zip(prompts, outputs):
        completion = output["token_ids"]
        ids = torch.tensor([prompt + completion[:-1]], device="cuda")
        logits = hf_model(ids, logits_to_keep=len(completion)).logits[0].float()
        chosen = logits.gather(1, torch.tensor(completion, device="cuda").unsqueeze(1)).squeeze(1)
        gaps.append(logits.max(1).values - chosen)
    gaps = torch.cat(gaps)
    return dict(tokens=len(gaps), exact=(gaps == 0).float().mean().item(), mean_gap=gaps.mean().item(),
                worst_gap=gaps.max().item(), within_margin=(gaps <= MARGIN).float().mean().item())


@pytest.fixture(scope="module")
def bench_checkpoint(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "Qwen3-0.6B", std=0.02, seed=1)


@pytest.fixture(scope="module")
def long_results(bench_checkpoint) -> dict:
    from transformers import AutoModelForCausalLM

    prompts = prompts_of([6000, 7500, 9000, 10500, 12000, 13000, 14000, 8000], seed=11)
    table = {}
    for backend in ("flashinfer", "triton"):
        for mode, options in LONG_MODES.items():
            with LLM(bench_checkpoint, kv_cache_dtype="fp8", attention_backend=backend, max_model_len=16384,
                     gpu_memory_utilization=0.5, **options) as llm:
                assert llm.model_runner.backend.name == backend
                table[backend, mode] = llm.generate(prompts, GREEDY, use_tqdm=False)
                assert_no_leaks(llm)
    hf = AutoModelForCausalLM.from_pretrained(bench_checkpoint, dtype=torch.float32).cuda().eval()
    table = {key: score(hf, prompts, outputs) for key, outputs in table.items()}
    print(f"\nFP8 KV cache, prompts of 6k-14k tokens, {GREEDY.max_tokens} greedy tokens each")
    print(f"| backend | mode | tokens | float32 argmax | within {MARGIN} | mean gap | worst gap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (backend, mode), r in table.items():
        print(f"| {backend} | {mode} | {r['tokens']} | {r['exact']:.1%} | {r['within_margin']:.1%} | "
              f"{r['mean_gap']:.4f} | {r['worst_gap']:.3f} |")
    return table


@pytest.mark.parametrize("mode", list(LONG_MODES))
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_long_context_fp8_cache_acceptance(long_results, backend, mode):
    assert long_results[backend, mode]["within_margin"] >= 0.99, long_results[backend, mode]


@pytest.mark.parametrize("mode", list(LONG_MODES))
def test_long_context_flashinfer_as_exact_as_triton(long_results, mode):
    """The gate for making flashinfer the default with an FP8 cache: while the switch is off, a shortfall is an
    expected failure that prints both shares; with the switch on it fails."""
    ours, triton = long_results["flashinfer", mode], long_results["triton", mode]
    as_exact = ours["exact"] >= triton["exact"] - 0.03
    if not as_exact and not attention.FLASHINFER_FOR_FP8_KV_ON_HOPPER:
        pytest.xfail(f"XQA's FP8 decode (query and probabilities in e4m3) is the float32 argmax for "
                     f"{ours['exact']:.1%} of the tokens, triton's for {triton['exact']:.1%}: the default stays "
                     f"triton")
    assert as_exact, (ours, triton)


@pytest.fixture(scope="module")
def routed_results(tmp_path_factory) -> dict:
    from transformers import AutoModelForCausalLM

    fp8_path = write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b-fp8")), "Qwen3-0.6B-FP8", std=0.02,
                                       seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = prompts_of(torch.randint(100, 1001, (64,), generator=g).tolist(), seed=1)
    outputs, calls = {}, {}
    with pytest.MonkeyPatch.context() as patch:
        from nanovllm.quantization import fp8_linear

        real = fp8_linear.flashinfer_block_mm
        for routes in ("", "31:flashinfer", BUILT_IN):
            if routes == BUILT_IN:  # the table the engine ships (fp8_routes.MEASURED_ROUTES)
                patch.delenv(ROUTES_ENV, raising=False)
            else:
                patch.setenv(ROUTES_ENV, routes)
            seen = calls.setdefault(routes, set())
            patch.setattr(fp8_linear, "flashinfer_block_mm",
                          lambda x, w, seen=seen: (seen.add(x.rows if hasattr(x, "rows") else x.size(0)),
                                                   real(x, w))[1])
            # eager: the count of FlashInfer calls is seen from Python (graphs replay without it)
            for eager in (False, True):
                with LLM(fp8_path, gpu_memory_utilization=0.45, max_model_len=4096, enforce_eager=eager,
                         max_num_seqs=64) as llm:
                    outputs[routes or "cublas", "eager" if eager else "graph"] = llm.generate(prompts, GREEDY,
                                                                                            use_tqdm=False)
    reference = AutoModelForCausalLM.from_pretrained(
        write_dequantized(fp8_path, str(tmp_path_factory.mktemp("dq") / "f32")), dtype=torch.float32).cuda().eval()
    table = {key: score(reference, prompts, out) for key, out in outputs.items()}
    print(f"\nFP8 checkpoint, matmuls on cuBLAS, up to 31 rows on FlashInfer, or as the built-in table says "
          f"({describe_routes(MEASURED_ROUTES)})")
    print("| matmuls | mode | tokens | float32 argmax | mean gap | worst gap |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (routes, mode), r in table.items():
        print(f"| {routes} | {mode} | {r['tokens']} | {r['exact']:.1%} | {r['mean_gap']:.4f} | {r['worst_gap']:.3f} |")
    return dict(table=table, calls=calls)


def test_routed_matmuls_run_flashinfer_below_32_rows_only(routed_results):
    assert not routed_results["calls"][""]
    seen = routed_results["calls"]["31:flashinfer"]
    assert seen and max(seen) <= 31, sorted(seen)


def test_the_built_in_routes_run_flashinfer_up_to_their_bound(routed_results):
    """64 sequences: with a bound past 31, decode steps of 32-64 rows run FlashInfer's normal (not swapped-operand)
    kernel, which this run then scores against cuBLAS."""
    bound = max(rows for rows, kernel in MEASURED_ROUTES if kernel == FLASHINFER)
    seen = routed_results["calls"][BUILT_IN]
    assert seen and max(seen) <= bound, sorted(seen)
    if bound > 31:
        assert any(rows > 31 for rows in seen), sorted(seen)


@pytest.mark.parametrize("routes", ["31:flashinfer", BUILT_IN])
@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_routed_matmuls_score_like_cublas(routed_results, mode, routes):
    ours, cublas = routed_results["table"][routes, mode], routed_results["table"]["cublas", mode]
    assert ours["exact"] >= cublas["exact"] - 0.03, (ours, cublas)
    assert ours["mean_gap"] <= 1.25 * cublas["mean_gap"] + 0.005, (ours, cublas)


def test_the_switch_makes_flashinfer_the_default_for_an_fp8_cache_on_hopper(monkeypatch):
    hopper = torch.cuda.get_device_capability()[0] == 9
    monkeypatch.setattr(attention, "FLASHINFER_FOR_FP8_KV_ON_HOPPER", True)
    assert attention.default_backend(True, True) == ("flashinfer" if hopper else "triton")
    assert attention.default_backend(True, False) == "triton"
    monkeypatch.setattr(attention, "FLASHINFER_FOR_FP8_KV_ON_HOPPER", False)
    assert attention.default_backend(True, True) == "triton"
