"""Output tokens per second of each sampling option on the chat workload, in one engine:

    python benchmarks/sampling_speed.py [--rounds 2] [--modes plain,top_k_top_p,seeded,min_p,top_p]

The chat workload: 4,096 requests, prompts of 20-200 random tokens, 20-400 generated (ignore_eos), temperature 0.6,
Qwen3-0.6B shape with random weights, through LLM.generate. Every run has fresh token ids of the same lengths, so
no run is served from another's prefix cache. After one untimed run per mode (compilation), the modes alternate
for --rounds rounds; the table gives each mode's median and its ratio to plain sampling.

    plain         temperature only
    top_k_top_p   + top_k=20, top_p=0.95 (Qwen3's generation_config, which run-batch applies by default)
    seeded        + seed=i for request i
    min_p         + min_p=0.05
    top_p         + top_p=0.9 alone (Llama 3's generation_config: no top-k bounds the candidates)
"""
import argparse
import statistics
import time
from random import Random

from nanovllm import LLM, SamplingParams
from nanovllm.utils.random_checkpoint import default_checkpoint

MODES = {"plain": {}, "top_k_top_p": dict(top_k=20, top_p=0.95), "seeded": dict(seed=0), "min_p": dict(min_p=0.05),
         "top_p": dict(top_p=0.9)}


def chat_workload(rng: Random, num_requests: int, max_id: int) -> tuple[list[list[int]], list[int]]:
    prompts = [[rng.randint(0, max_id) for _ in range(rng.randint(20, 200))] for _ in range(num_requests)]
    return prompts, [rng.randint(20, 400) for _ in range(num_requests)]


def run(llm: LLM, rng: Random, mode: str, num_requests: int, max_id: int) -> float:
    prompts, lengths = chat_workload(rng, num_requests, max_id)
    extra = MODES[mode]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n,
                             **({**extra, "seed": i} if "seed" in extra else extra)) for i, n in enumerate(lengths)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="Qwen3-0.6B", help="random-checkpoint shape (default: Qwen3-0.6B)")
    parser.add_argument("--requests", type=int, default=4096, help="requests per run (default: 4096)")
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each mode (default: 2)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    llm = LLM(default_checkpoint(args.shape), max_model_len=4096)
    max_id = min(10000, llm.vocab_size - 1)
    rng = Random(0)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for mode in modes:
        run(llm, rng, mode, args.requests, max_id)  # untimed: compiles what this mode needs
    for _ in range(args.rounds):
        for mode in modes:
            rates[mode].append(run(llm, rng, mode, args.requests, max_id))
    plain = statistics.median(rates["plain"]) if "plain" in rates else None
    print("| sampling | output tok/s (median) | runs | vs plain |")
    print("| --- | --- | --- | --- |")
    for mode, values in rates.items():
        median = statistics.median(values)
        ratio = f"{median / plain:.2f}x" if plain else "-"
        print(f"| {mode} | {median:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} | {ratio} |")
    llm.exit()


if __name__ == "__main__":
    main()
