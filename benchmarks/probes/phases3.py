# ruff: noqa  (a one-off probe)
"""Where a constrained step's time goes with the mask worker in its own process (engine's side only)."""
import sys, time, statistics
sys.path.insert(0, "benchmarks")
from random import Random
from structured_outputs import schema, prompts
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine import model_runner as mr, llm_engine as le
from nanovllm.sampling import grammar_mask as gm, mask_process as mp, mask_kernel as mk
from nanovllm.utils.random_checkpoint import default_checkpoint
T = {}
def add(k, v): T.setdefault(k, []).append(v)
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); add(key, time.perf_counter() - t); return r
    setattr(cls, name, f)
wrap(gm.GrammarMasks, "start", "m start")
wrap(gm.GrammarMasks, "finish", "m finish (incl wait)")
wrap(gm.GrammarMasks, "after_sample", "m after_sample")
wrap(mp.MaskProcess, "receive", "m wait for answer")
if hasattr(gm.GrammarMasks, "confirm"): wrap(gm.GrammarMasks, "confirm", "m confirm")
wrap(mk.StepMask, "apply", "m mask apply")
ostep = le.LLMEngine.step
def step_(self):
    t = time.perf_counter(); r = ostep(self); dt = time.perf_counter() - t
    add("m step " + ("prefill" if r[1] > 0 else "decode"), dt); return r
le.LLMEngine.step = step_
wrap(le.LLMEngine, "_complete", "m complete")
wrap(mr.ModelRunner, "launch", "m launch")
wrap(mr.ModelRunner, "finish", "m runner.finish (sample)")
shape, n, strings = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(default_checkpoint(shape), max_num_seqs=512, max_model_len=1024)
rng = Random(0); max_id = llm.config.hf_config.vocab_size - 1000
lens = None
def run(label, constrained=True):
    global lens
    T.clear()
    spec = StructuredOutputsParams(json=schema(0, strings), disable_any_whitespace=True)
    params = [SamplingParams(temperature=0.6, max_tokens=400, structured_outputs=spec) for _ in range(n)]
    if not constrained:
        params = [SamplingParams(temperature=0.6, max_tokens=lens[i], ignore_eos=True) for i in range(n)]
    t = time.perf_counter(); outs = llm.generate([{"prompt_token_ids": p} for p in prompts(rng, n, max_id)], params, use_tqdm=False)
    wall = time.perf_counter() - t
    if constrained: lens = [len(o.outputs[0].token_ids) for o in outs]
    print(f"== {label}: {wall:.2f} s, {sum(lens) / wall:,.0f} tok/s, mean len {statistics.mean(lens):.1f}", flush=True)
    for k, v in sorted(T.items()):
        print(f"  {k:26s} n={len(v):5d} mean {1000 * statistics.mean(v):7.3f} ms  median {1000 * statistics.median(v):7.3f} ms  p90 {1000 * sorted(v)[int(0.9*len(v))]:7.3f}  total {sum(v):6.2f} s")
run("cold constrained " + strings)
run("constrained " + strings)
run("unconstrained " + strings, False)
run("constrained again " + strings)
run("unconstrained again " + strings, False)
run("constrained again " + strings)
