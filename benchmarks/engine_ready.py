"""Process start to an engine ready to take requests, in fresh processes, each with empty compile caches unless
--warm-caches:

    python benchmarks/engine_ready.py [--model DIR] [--runs 3] [--warm-caches] [engine options as key=value]

Per run: the seconds from the process's start (imports included) to `LLM(...)` returning, the engine's start-up
phases, and how many Triton kernels it compiled (entries in its fresh Triton cache). To compare two trees, run the
command in each in turn, on one GPU."""
import argparse
import ast
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = r'''
import ast, sys, time
from nanovllm.engine.startup import process_started
origin = process_started()
from nanovllm import LLM
llm = LLM(sys.argv[1], **ast.literal_eval(sys.argv[2]))
print(f"ready {time.time() - origin:.2f} s: {llm.describe_startup(origin)}", flush=True)
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
    parser.add_argument("options", nargs="*", type=engine_option, help="engine options, name=value")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: at least 1")
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
        result = subprocess.run([sys.executable, "-c", CHILD, model, repr(dict(args.options))], env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"run {run} failed:\n{result.stderr[-3000:]}")
        ready = next(line for line in result.stdout.splitlines() if line.startswith("ready "))
        compiled = "" if args.warm_caches else \
            f"; Triton kernels compiled: {len(os.listdir(triton_cache)) if os.path.isdir(triton_cache) else 0}"
        print(f"run {run}: {ready}{compiled}", flush=True)


if __name__ == "__main__":
    main()
