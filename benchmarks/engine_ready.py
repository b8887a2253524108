"""Process start to an engine ready to take requests, in fresh processes, each with empty compile caches unless
--warm-caches:

    python benchmarks/engine_ready.py [--model DIR] [--runs 3] [--warm-caches] [--requests N]
                                      [engine options as key=value]

Per run: the seconds from the process's start (imports included) to `LLM(...)` returning, the engine's start-up
phases, how many Triton kernels it compiled (entries in its fresh Triton cache) and how many kernel variants Triton
compiled before it was ready. With --requests N, N chat-like requests (prompts of 20-200 random token ids, 20-400
output tokens, temperature 0.6) unseeded, then N seeded, follow, and the variants compiled while they ran are
counted too: each of those held the engine up. To compare two trees, run the command in each in turn, on one GPU."""
import argparse
import ast
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import ast, json, random, sys, time
from nanovllm.engine.startup import process_started
origin = process_started()
compiled = []  # one entry per kernel variant Triton compiled in this process
try:
    from triton import knobs
    knobs.runtime.jit_post_compile_hook = lambda **hook_args: compiled.append(1)
except (ImportError, AttributeError):  # a Triton without hooks: no count
    compiled = None
from nanovllm import LLM, SamplingParams
llm = LLM(sys.argv[1], **ast.literal_eval(sys.argv[2]))
at_ready = None if compiled is None else len(compiled)
print(f"ready {time.time() - origin:.2f} s: {llm.describe_startup(origin)}", flush=True)
print(f"variants compiled by ready: {at_ready}", flush=True)
rng, requests = random.Random(0), int(sys.argv[3])
with open(sys.argv[1] + "/config.json") as f:
    vocab = json.load(f)["vocab_size"]
for seeded in (False, True) if requests else ():
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(20, 200))] for _ in range(requests)]
    params = [SamplingParams(temperature=0.6, max_tokens=rng.randint(20, 400), ignore_eos=True,
                             seed=i if seeded else None) for i in range(requests)]
    began = time.time()
    llm.generate(prompts, params, use_tqdm=False)
    after = None if compiled is None else len(compiled) - at_ready
    print(f"{requests} {'seeded' if seeded else 'unseeded'} requests: {time.time() - began:.2f} s, variants "
          f"compiled after ready so far: {after}", flush=True)
llm.exit()
'''


def engine_option(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: an engine option is name=value (e.g. max_num_seqs=256)")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint (default: Qwen3-0.6B-shaped random weights)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warm-caches", action="store_true", help="use the user's compile caches as they are")
    parser.add_argument("--requests", type=int, default=0, help="chat-like requests after ready, unseeded then "
                        "seeded, N of each (default 0)")
    parser.add_argument("options", nargs="*", type=engine_option, help="engine options, name=value")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: at least 1")
    if args.requests < 0:
        parser.error(f"--requests {args.requests}: 0 or more")
    sys.path.insert(0, ROOT)
    from nanovllm.utils.random_checkpoint import default_checkpoint

    model = args.model or default_checkpoint("Qwen3-0.6B")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    for run in range(1, args.runs + 1):
        caches = tempfile.mkdtemp(prefix="engine-ready-")
        triton_cache = os.path.join(caches, "triton")
        if not args.warm_caches:
            env.update(TRITON_CACHE_DIR=triton_cache, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                       CUDA_CACHE_PATH=os.path.join(caches, "cuda"))
        result = subprocess.run([sys.executable, "-c", CHILD, model, repr(dict(args.options)), str(args.requests)],
                                env=env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"run {run} failed:\n{result.stderr[-3000:]}")
        lines = result.stdout.splitlines()
        ready = next(line for line in lines if line.startswith("ready "))
        compiled = "" if args.warm_caches else \
            f"; Triton kernels compiled: {len(os.listdir(triton_cache)) if os.path.isdir(triton_cache) else 0}"
        print(f"run {run}: {ready}{compiled}", flush=True)
        for line in lines[lines.index(ready) + 1:]:
            print(f"run {run}: {line}", flush=True)


if __name__ == "__main__":
    main()
