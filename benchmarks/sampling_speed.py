"""Output tokens per second of each model family's published sampling defaults on the chat workload, in one engine:

    python benchmarks/sampling_speed.py [--rounds 2] [--modes plain,qwen3,llama3.1,qwen2.5,min_p,seeded]

The chat workload: 4,096 requests, prompts of 20-200 random tokens, 20-400 generated (ignore_eos), Qwen3-0.6B shape
with random weights, through LLM.generate. Every run has fresh token ids of the same lengths, so no run is served
from another's prefix cache. After one untimed run per mode (compilation; --warmup-requests of them), the modes
alternate for --rounds rounds; the table gives each mode's median and its ratio to plain sampling. Writes the table
to $OUT/sampling_speed.md too when OUT is set.

    plain           temperature 0.6 only
    qwen3           top_k=20, top_p=0.95, T 0.6 (Qwen3's generation_config, which run-batch applies by default)
    llama3.1        top_p=0.9 alone, T 0.6 (Llama 3.1 Instruct's: no top-k bounds the candidates)
    qwen2.5         top_k=20, top_p=0.8, T 0.7, repetition_penalty=1.05 (Qwen2.5 Instruct's)
    min_p           min_p=0.05, T 0.6
    seeded          seed=i for request i, T 0.6
    llama3.1-sort   llama3.1 with top-p's floor from a sort of each row (the path before the search; A/B only)
"""
import argparse
import os
import statistics
import time
from random import Random

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint

MODES = {
    "plain": ("temperature 0.6", dict(temperature=0.6)),
    "qwen3": ("Qwen3: top_k 20, top_p 0.95, T 0.6", dict(temperature=0.6, top_k=20, top_p=0.95)),
    "llama3.1": ("Llama 3.1: top_p 0.9, T 0.6", dict(temperature=0.6, top_p=0.9)),
    "qwen2.5": ("Qwen2.5: top_k 20, top_p 0.8, T 0.7, repetition 1.05",
                dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)),
    "min_p": ("min_p 0.05, T 0.6", dict(temperature=0.6, min_p=0.05)),
    "seeded": ("a seed per request, T 0.6", dict(temperature=0.6, seed=0)),
    "llama3.1-sort": ("Llama 3.1, floor by sorting each row", dict(temperature=0.6, top_p=0.9)),
}
DEFAULT_MODES = "plain,qwen3,llama3.1,qwen2.5,min_p,seeded"


def chat_workload(rng: Random, num_requests: int, max_id: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(20, 200))] for _ in range(num_requests)]
    return prompts, [rng.randint(20, 400) for _ in range(num_requests)]


def run(llm: LLM, rng: Random, mode: str, num_requests: int, max_id: int) -> float:
    prompts, lengths = chat_workload(rng, num_requests, max_id)
    options = MODES[mode][1]
    params = [SamplingParams(ignore_eos=True, max_tokens=n, **({**options, "seed": i} if "seed" in options
                                                                else options)) for i, n in enumerate(lengths)]
    llm.model_runner.sampler.top_p_by_sort = mode.endswith("-sort")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-0.6B", help="random-checkpoint shape (default: Qwen3-0.6B)")
    parser.add_argument("--requests", type=int, default=4096, help="requests per run (default: 4096)")
    parser.add_argument("--warmup-requests", type=int, default=None,
                        help="requests in each mode's untimed run (default: --requests)")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each mode (default: 2)")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    for name in ("requests", "warmup_requests", "rounds"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    llm = LLM(default_checkpoint(args.shape), max_model_len=4096)
    max_id = min(10000, llm.vocab_size - 1)
    rng = Random(0)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode in modes:
        start = time.perf_counter()
        run(llm, rng, mode, args.warmup_requests or args.requests, max_id)  # untimed: compiles what it needs
        print(f"{mode}: untimed run {time.perf_counter() - start:.1f} s", flush=True)
    for round_ in range(args.rounds):
        for mode in modes:
            rates[mode].append(run(llm, rng, mode, args.requests, max_id))
            # as it goes, so a run cut short still leaves its figures
            print(f"{mode}: round {round_ + 1}: {rates[mode][-1]:,.0f} output tok/s", flush=True)
    llm.exit()
    plain = statistics.median(rates["plain"]) if "plain" in rates else None
    lines = ["| sampling | output tok/s (median) | runs | vs plain |", "| --- | --- | --- | --- |"]
    for mode, values in rates.items():
        median = statistics.median(values)
        ratio = f"{median / plain:.2f}x" if plain else "-"
        lines.append(f"| {MODES[mode][0]} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {ratio} |")
    print("\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sampling_speed.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
