"""run-batch against LLM.generate on one engine, and run-batch's host memory against the size of its input:

    python benchmarks/batch_runner.py throughput [--requests 4096 --rounds 2]
    python benchmarks/batch_runner.py memory --requests 10000   # one fresh process per size: peak RSS

throughput: the chat workload (prompts of 20-200 tokens, 20-400 generated, ignore_eos so both paths generate the
same number of tokens) written as an OpenAI batch file, then run through `nanovllm run-batch` (in-process, on the
engine already loaded) and, with the same request shapes but fresh token ids, through LLM.chat-equivalent
generate calls, alternating, after one warmup round of each.

memory: run-batch over N one-token requests on the model given (default: the tiny test shape, so it is quick on
a CPU); prints the process's peak RSS. Run it for 10k and 100k requests and compare. With --instant the requests
go to one replica process whose engine answers at once (benchmarks/data_parallel.py's InstantEngine), so the
figure is the runner's own memory (reading, ids, writing) without the engine's tensors in the same heap.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from random import Random

from nanovllm import LLM, SamplingParams
from nanovllm.batch.run import run
from nanovllm.cli import build_parser
from nanovllm.utils.random_checkpoint import default_checkpoint


def chat_workload(llm: LLM, rng: Random, requests: int, prompt_range=(20, 200), output_range=(20, 400)):
    """(messages, max_tokens) per request; each message's text decodes random token ids, so its templated prompt
    is about its drawn length (the template adds a few tokens)."""
    max_id = min(10000, llm.vocab_size - 1)
    work = []
    for _ in range(requests):
        text = llm.tokenizer.decode([rng.randint(100, max_id) for _ in range(rng.randint(*prompt_range))])
        work.append(([{"role": "user", "content": text}], rng.randint(*output_range)))
    return work


def write_batch(path: str, work) -> None:
    with open(path, "w") as f:
        for i, (messages, max_tokens) in enumerate(work):
            body = {"model": "m", "messages": messages, "max_completion_tokens": max_tokens, "temperature": 0.6,
                    "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")


def time_run_batch(llm: LLM, model: str, work, folder: str) -> tuple[float, int]:
    source, output = os.path.join(folder, "in.jsonl"), os.path.join(folder, "out.jsonl")
    write_batch(source, work)
    if os.path.exists(output):
        os.remove(output)
    start = time.perf_counter()
    assert run(build_parser().parse_args(["run-batch", "-i", source, "-o", output, "--model", model]), llm) == 0
    seconds = time.perf_counter() - start
    with open(output) as f:
        tokens = sum(json.loads(line)["response"]["body"]["usage"]["completion_tokens"] for line in f)
    return seconds, tokens


def time_generate(llm: LLM, work) -> tuple[float, int]:
    start = time.perf_counter()  # the chat template is part of the work, as in run-batch
    prompts = [llm.chat_prompt(messages) for messages, _ in work]
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for _, n in work]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def throughput(args: argparse.Namespace) -> None:
    model = args.model or default_checkpoint(args.shape)
    llm = LLM(model)
    rng = Random(0)
    rates: dict[str, list[float]] = {"run-batch": [], "generate": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds + 1):  # round 0 warms up (compiles) both paths
            for name in rates:
                # fresh token ids every run: no prefix-cache reuse; the warmup round is shorter
                work = chat_workload(llm, rng, args.requests if round_ else args.requests // 8)
                seconds, tokens = (time_run_batch(llm, model, work, folder) if name == "run-batch"
                                   else time_generate(llm, work))
                print(f"round {round_} {name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:,.0f} tok/s",
                      flush=True)
                if round_:
                    rates[name].append(tokens / seconds)
    ratio = statistics.mean(rates["run-batch"]) / statistics.mean(rates["generate"])
    print(f"run-batch / generate: {ratio:.3f} (mean of {args.rounds} rounds each)")
    llm.exit()


def memory(args: argparse.Namespace) -> None:
    model = args.model or default_checkpoint(args.shape)
    with tempfile.TemporaryDirectory() as folder:
        source, output = os.path.join(folder, "in.jsonl"), os.path.join(folder, "out.jsonl")
        rng = Random(1)
        with open(source, "w") as f:
            for i in range(args.requests):
                body = {"prompt": [rng.randint(100, 1000) for _ in range(rng.randint(20, 200))], "max_tokens": 1}
                f.write(json.dumps({"custom_id": f"request-{i:08d}", "url": "/v1/completions", "body": body}) + "\n")
        start = time.perf_counter()
        options = {}
        if args.instant:
            from data_parallel import InstantEngine  # benchmarks/data_parallel.py, beside this file
            options["engine_class"] = InstantEngine
        code = run(build_parser().parse_args(["run-batch", "-i", source, "-o", output, "--model", model,
                                              "--max-model-len", "512"]), **options)
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{args.requests} requests: exit {code}, {time.perf_counter() - start:.0f} s, peak RSS {peak_mib:,.0f} "
              f"MiB, input {os.path.getsize(source) / 2**20:,.0f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["throughput", "memory"])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: a random --shape one)")
    parser.add_argument("--shape", default=None, help="default: Qwen3-0.6B for throughput, tiny for memory")
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--instant", action="store_true", help="memory: an engine that answers at once")
    args = parser.parse_args()
    args.shape = args.shape or ("Qwen3-0.6B" if args.mode == "throughput" else "tiny")
    throughput(args) if args.mode == "throughput" else memory(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
