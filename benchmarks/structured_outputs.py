"""What a JSON-schema job costs against the same job unconstrained, in output tokens per second:

    python benchmarks/structured_outputs.py [--shape Qwen3-0.6B] [--schemas 1] [--requests 4096] [--rounds 3]

Each round runs the chat workload's prompts (20-200 random tokens, fresh ids every run, so no run is served from
another's prefix cache) constrained by a schema of ten fields in compact JSON (disable_any_whitespace), T 0.6,
then the same number of requests unconstrained with each request's output length taken from the constrained run
(ignore_eos), so both runs generate the same tokens' worth of work. Round 1 is the process's first run (cold:
xgrammar's tokenizer tables, compiles and its mask kernel's first launch); the table gives it apart and the median
of the later rounds (warm). --schemas N gives request i schema i mod N (field names differ per schema). Also
reports each schema's compile time on its own. Writes the table to $OUT/structured_<shape>_<schemas>_<strings>.md
when OUT is set. Random weights (benchmarks never load a hub): the outputs are valid JSON of random content.
"""
import argparse
import json
import os
import statistics
import time
from random import Random

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.sampling.grammar import GrammarCompiler
from nanovllm.utils.random_checkpoint import default_checkpoint

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def schema(index: int, strings: str = "bounded") -> dict:
    """Ten fields of the kinds extraction jobs ask for, each bounded so a random model's answer ends. strings:
    "bounded" gives free-text fields a maxLength (xgrammar's costliest masks: each length left is a state of its
    own), "enum" makes them enums (closed sets, cheap masks)."""
    tag = f"_{index}" if index else ""

    def text(most: int) -> dict:
        return {"type": "string", "maxLength": most} if strings == "bounded" else {"enum": WORDS}

    fields = {
        f"id{tag}": {"type": "integer", "minimum": 0, "maximum": 999999},
        f"name{tag}": text(24),
        f"email{tag}": text(32),
        f"age{tag}": {"type": "integer", "minimum": 0, "maximum": 120},
        f"score{tag}": {"type": "number", "minimum": 0, "maximum": 100},
        f"active{tag}": {"type": "boolean"},
        f"country{tag}": {"enum": ["US", "DE", "FR", "JP", "CN", "IN", "BR", "GB"]},
        f"plan{tag}": {"enum": ["free", "pro", "team", "enterprise"]},
        f"tags{tag}": {"type": "array", "items": text(10), "maxItems": 3},
        f"note{tag}": text(40),
    }
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


def prompts(rng: Random, count: int, max_id: int) -> list[list[int]]:
    return [[rng.randint(0, max_id) for _ in range(rng.randint(20, 200))] for _ in range(count)]


def timed(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="Qwen3-0.6B")
    parser.add_argument("--schemas", type=int, default=1)
    parser.add_argument("--strings", choices=["bounded", "enum"], default="bounded",
                        help="free-text fields with a maxLength, or as enums (see schema())")
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=400, help="a bound; the schema ends answers sooner")
    args = parser.parse_args()
    llm = LLM(default_checkpoint(args.shape), max_num_seqs=args.max_num_seqs, max_model_len=1024)
    max_id = llm.config.hf_config.vocab_size - 1000  # ordinary tokens, below the specials
    specs = [StructuredOutputsParams(json=schema(i, args.strings), disable_any_whitespace=True)
             for i in range(args.schemas)]
    rng = Random(0)
    rows = []
    for round_number in range(args.rounds):
        constrained = [SamplingParams(temperature=0.6, max_tokens=args.max_tokens, structured_outputs=specs[i % len(
            specs)]) for i in range(args.requests)]
        seconds, outputs = timed(llm, prompts(rng, args.requests, max_id), constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        valid = sum(o.outputs[0].finish_reason == "stop" and _parses(o.outputs[0].text) for o in outputs)
        free = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True) for n in lengths]
        free_seconds, _ = timed(llm, prompts(rng, args.requests, max_id), free)
        tokens = sum(lengths)
        rows.append((tokens / seconds, tokens / free_seconds, valid, statistics.mean(lengths)))
        print(f"round {round_number + 1}: constrained {tokens / seconds:,.0f} tok/s ({seconds:.1f} s), "
              f"unconstrained {tokens / free_seconds:,.0f} tok/s ({free_seconds:.1f} s), {valid}/{args.requests} "
              f"valid, mean {statistics.mean(lengths):.1f} tokens", flush=True)
    compile_ms = []
    compiler = GrammarCompiler(llm.get_tokenizer(), llm.config.hf_config.vocab_size, list(llm.config.eos_token_ids))
    for spec in specs:
        start = time.perf_counter()
        compiler.submit(spec).result()
        compile_ms.append(1000 * (time.perf_counter() - start))
    compiler.close()
    llm.exit()
    warm = rows[1:] or rows
    ratio = statistics.median(c / u for c, u, _, _ in warm)
    lines = [f"{args.shape}, {args.requests} requests, {args.max_num_seqs} concurrent, {args.schemas} schema(s), "
             f"compact JSON, T 0.6", "",
             "| run | constrained tok/s | unconstrained tok/s | ratio | valid JSON | mean output tokens |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, (c, u, valid, mean) in [("cold (round 1)", rows[0])] + [(f"warm (round {i + 2})", r)
                                                                      for i, r in enumerate(rows[1:])]:
        lines.append(f"| {name} | {c:,.0f} | {u:,.0f} | {c / u:.3f} | {valid}/{args.requests} | {mean:.1f} |")
    lines += ["", f"warm median ratio: {ratio:.3f}; compile per schema: mean {statistics.mean(compile_ms):.1f} ms, "
                  f"max {max(compile_ms):.1f} ms ({len(compile_ms)} schema(s), one at a time)"]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        name = f"structured_{args.shape}_{args.schemas}_{args.strings}.md"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            f.write(text + "\n")


def _parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text, strict=False), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    main()
