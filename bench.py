"""Throughput on the reference workload: random prompts and output lengths, temperature 0.6, ignore_eos.

    python bench.py                      # Qwen3-0.6B shape with random weights, written on first use
    python bench.py --runs 4             # first run is "cold", the median of the others "warm"
    python bench.py --workload long-context --kv-cache-dtype fp8   # 64 requests of 6k-14k prompt tokens
    python bench.py --workload capacity --kv-cache-dtype fp8       # more context than a bf16 cache holds
    python bench.py --shape Qwen3-30B-A3B  # any shape of nanovllm/utils/random_checkpoint.py (Llama, Qwen2.5, MoE)
    python bench.py --shape Qwen3-8B --quantization fp8            # FP8 weights quantized at load
    python bench.py --shape Qwen3-8B-FP8                           # a checkpoint in the published FP8 layout

Every run after the first (the profiled one included) gets new random token ids of the same prompt lengths and
the same output lengths: the same work, and nothing for the prefix cache to find from an earlier run.
"""
import argparse
import statistics
import time
from datetime import date
from random import Random, randint, seed

import torch

from nanovllm import LLM, SamplingParams
from nanovllm.attention import BACKEND_NAMES
from nanovllm.utils.random_checkpoint import SHAPE_NAMES, default_checkpoint

# prompt lengths uniform in [min_input_len, max_input_len], output lengths likewise
WORKLOADS: dict[str, dict] = {
    "default": dict(num_seqs=256, min_input_len=100, max_input_len=1024, min_output_len=100, max_output_len=1024,
                    max_model_len=4096),
    # decode over long contexts, where reading the KV cache is most of the run (what an FP8 KV cache halves)
    "long-context": dict(num_seqs=64, min_input_len=6000, max_input_len=14000, min_output_len=200,
                         max_output_len=800, max_model_len=16384),
    # more context than a bf16 cache holds at once (about 1.15M tokens for the 0.6B shape on a 141 GB GPU): bf16
    # must queue and preempt, an FP8 cache (twice the tokens) runs them together
    "capacity": dict(num_seqs=512, min_input_len=1000, max_input_len=4000, min_output_len=200,
                     max_output_len=800, max_model_len=8192),
    # TensorRT-LLM's published throughput workload: 1,000 tokens in, 1,000 out, enough requests to fill the GPU
    "1000-1000": dict(num_seqs=512, min_input_len=1000, max_input_len=1000, min_output_len=1000,
                      max_output_len=1000, max_model_len=4096),
    # prefill is most of the run, where FP8 matmuls gain most
    "prefill-heavy": dict(num_seqs=512, min_input_len=1024, max_input_len=3072, min_output_len=16,
                          max_output_len=64, max_model_len=4096),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: random weights of --shape)")
    parser.add_argument("--shape", default="Qwen3-0.6B",
                        choices=SHAPE_NAMES,
                        help="shape of the random checkpoint when --model is unset (-FP8: the published FP8 layout)")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--min-input-len", type=int, default=None)
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--min-output-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--attention-backend", default=None, choices=BACKEND_NAMES,
                        help="default: the fastest for the device")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="FP8 linear weights quantized at load (FP8 checkpoints, e.g. --shape Qwen3-8B-FP8, "
                             "are FP8 without it)")
    parser.add_argument("--workload", default="default", choices=sorted(WORKLOADS),
                        help="preset prompt/output lengths; the explicit length flags override it")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="profile one more run: CPU phases, GPU kernel classes")
    args = parser.parse_args()
    for name, value in WORKLOADS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    path = args.model or default_checkpoint(args.shape)
    start = time.perf_counter()
    llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    startup = time.perf_counter() - start
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)

    seed(0)
    max_id = min(10000, llm.vocab_size - 1)
    prompts = [[randint(0, max_id) for _ in range(randint(min(args.min_input_len, args.max_input_len),
                                                          args.max_input_len))]
               for _ in range(args.num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True,
                             max_tokens=randint(min(args.min_output_len, args.max_output_len), args.max_output_len))
              for _ in range(args.num_seqs)]

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}, date: {date.today()}, model: {path}, startup: {startup:.1f} s, "
          f"KV blocks: {llm.model_runner.num_kvcache_blocks} ({args.kv_cache_dtype}), "
          f"attention: {llm.model_runner.backend.name}, workload: {args.workload}, "
          f"weights: {'fp8' if llm.model_runner.fp8 else 'model dtype'}")
    if args.runs > 1 or args.profile:
        print("runs after the first use fresh random token ids (same prompt and output lengths), "
              "so they get no prefix-cache hits from earlier runs")
    preemptions = []
    preempt = llm.scheduler._preempt
    llm.scheduler._preempt = lambda seq: (preemptions.append(seq.seq_id), preempt(seq))[1]
    times = []
    for run in range(args.runs):
        batch = prompts if run == 0 else fresh_token_ids(prompts, max_id, run)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        total = sum(len(o.outputs[0].token_ids) for o in outputs)
        times.append(elapsed)
        print(f"run {run + 1}: Total: {total} tok, Time: {elapsed:.2f} s, Throughput: {total / elapsed:.0f} tok/s, "
              f"preemptions: {len(preemptions)}")
        preemptions.clear()
    if args.profile:
        profile_run(llm, fresh_token_ids(prompts, max_id, args.runs), params)
    if torch.cuda.is_available():
        print(f"peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    cold = times[0]
    print(f"Total: {total} tok, Time: {cold:.2f} s, Throughput: {total / cold:.0f} tok/s  (cold: first run)")
    if len(times) > 1:
        warm = statistics.median(times[1:])
        print(f"Total: {total} tok, Time: {warm:.2f} s, Throughput: {total / warm:.0f} tok/s  "
              f"(warm: median of runs 2..{len(times)})")
    llm.exit()


def fresh_token_ids(prompts: list[list[int]], max_id: int, run: int) -> list[list[int]]:
    """New random token ids of the same lengths as `prompts`, drawn from a generator seeded by the run index."""
    rng = Random(1000 + run)
    return [[rng.randint(0, max_id) for _ in prompt] for prompt in prompts]


KERNEL_CLASSES = [("prefill attention", ("flash",)), ("decode attention", ("decode_attention", "paged_decode")),
                  ("kv-store", ("store_kvcache",)), ("fp8 input quantization", ("quantize_activations",)),
                  ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "cublas")), ("fused-elementwise", ("triton_",))]


def profile_run(llm: LLM, prompts, params) -> None:
    """One run under torch.profiler: wall time split into engine phases (CPU) and kernel classes (GPU)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(obj, name: str, label: str) -> None:
        method = getattr(obj, name)

        def wrapper(*args, **kwargs):
            with record_function(label):
                return method(*args, **kwargs)

        setattr(obj, name, wrapper)

    runner, scheduler = llm.model_runner, llm.scheduler
    for obj, name in [(scheduler, "schedule"), (scheduler, "postprocess"), (runner.inputs, "prefill"),
                      (runner.inputs, "decode"), (runner.sampler, "prepare"), (runner, "launch"),
                      (runner.sampler, "forward")]:
        labelled(obj, name, f"phase:{type(obj).__name__}.{name}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(f"profile: wall {wall:.2f} s (includes profiler overhead)")
    for e in sorted((e for e in events if e.key.startswith("phase:")), key=lambda e: -e.cpu_time_total):
        print(f"  cpu  {e.key[6:]:<32} {e.cpu_time_total / 1e6:7.2f} s  calls {e.count}")
    kernels = [e for e in events if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith("phase:")]
    by_class: dict[str, float] = {}
    for e in kernels:
        name = e.key.lower()
        cls = next((c for c, keys in KERNEL_CLASSES if any(k in name for k in keys)), "other")
        by_class[cls] = by_class.get(cls, 0.0) + e.device_time_total / 1e6
    busy = sum(by_class.values())
    for cls, seconds in sorted(by_class.items(), key=lambda kv: -kv[1]):
        print(f"  gpu  {cls:<32} {seconds:7.2f} s")
    print(f"  gpu  busy {busy:.2f} s, idle {max(wall - busy, 0):.2f} s of {wall:.2f} s")
    # idle time by the length of the gap before each kernel: ~1 us gaps are launch latency between kernels of
    # a graph; long ones are the GPU waiting for the host
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    gaps = [(b[0] - a[1], a, b) for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    for low, high in ((0, 2), (2, 5), (5, 20), (20, 100), (100, float("inf"))):
        inside = [g for g, _, _ in gaps if low <= g < high]
        print(f"  idle gaps {low:>3}-{high:<4} us: {len(inside):7d} gaps, {sum(inside) / 1e6:5.2f} s")
    for gap, before, after in sorted(gaps, key=lambda g: -g[0])[:10]:
        print(f"  long gap {gap / 1e3:6.2f} ms at {(before[1] - spans[0][0]) / 1e6:5.2f} s: "
              f"{before[2][:30]} -> {after[2][:30]}")
    top = sorted(kernels, key=lambda e: -e.device_time_total)[:24]
    for e in top:
        print(f"  top  {e.key[:70]:<70} {e.device_time_total / 1e6:6.2f} s  x{e.count}")


if __name__ == "__main__":
    main()
