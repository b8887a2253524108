# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
"""Where a constrained step's time goes with fill-ahead (probe, not committed)."""
import sys, time, statistics
sys.path.insert(0, "benchmarks")
from random import Random
from structured_outputs import schema, prompts
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine import model_runner as mr, llm_engine as le
from nanovllm.engine import step as st
from nanovllm.sampling import grammar_mask as gm
from nanovllm.utils.random_checkpoint import default_checkpoint
T = {}
def add(k, v): T.setdefault(k, []).append(v)
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); add(key, time.perf_counter() - t); return r
    setattr(cls, name, f)
wrap(gm.GrammarMasks, "_take", "w accept (take)")
ofr = gm.GrammarMasks._fill_rows
def fill_rows(self, host, states, first):
    t = time.perf_counter(); ofr(self, host, states, first); dt = time.perf_counter() - t
    add("w fill_rows ahead" if first == 0 else "w fill_rows at start", dt); add("rows " + ("ahead" if first == 0 else "at start") + " (x1000)", len(states) / 1000)
gm.GrammarMasks._fill_rows = fill_rows
wrap(gm.GrammarMasks, "_fill_ahead", "w fill_ahead total")
wrap(gm.GrammarMasks, "_fill", "w start-fill total")
wrap(gm.GrammarMasks, "start", "m start")
wrap(gm.GrammarMasks, "after_sample", "m after_sample")
wrap(gm.StepMask, "apply", "m mask apply")
of = gm.GrammarMasks.finish
def finish(self, filled):
    t0 = time.perf_counter(); r = filled.result(); t1 = time.perf_counter(); add("m wait for mask", t1 - t0)
    out = of(self, filled); add("m mask finish after wait", time.perf_counter() - t1); return out
gm.GrammarMasks.finish = finish
ostep = le.LLMEngine.step
def step_(self):
    t = time.perf_counter(); r = ostep(self); dt = time.perf_counter() - t
    add("m engine step", dt); add("m step " + ("prefill" if r[1] > 0 else "decode"), dt); return r
le.LLMEngine.step = step_
wrap(le.LLMEngine, "_complete", "m complete")
wrap(mr.ModelRunner, "launch", "m launch")
wrap(mr.ModelRunner, "finish", "m runner.finish (sample)")
wrap(st.Step, "result", "tokens result()")
shape, n = sys.argv[1], int(sys.argv[2])
llm = LLM(default_checkpoint(shape), max_num_seqs=512, max_model_len=1024)
rng = Random(0); max_id = llm.config.hf_config.vocab_size - 1000
lens = None
def run(label, strings, constrained=True):
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
strings = sys.argv[3]
run("warmup " + strings, strings)
run("constrained " + strings, strings)
run("unconstrained " + strings, strings, False)
for variant in sys.argv[4:]:
    runner = llm.model_runner if hasattr(llm, "model_runner") else llm.engine.model_runner
    runner.sampler.grammar_masks.close(); runner.sampler.grammar_masks = None
    if variant.startswith("threads"): gm.FILL_THREADS = int(variant[7:])
    if variant.startswith("split"): gm.SPLIT_FILLS = bool(int(variant[5:]))
    run(f"constrained {strings}, {variant}", strings)
