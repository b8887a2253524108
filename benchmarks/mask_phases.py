# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
"""Where a constrained step's time goes: timers around the mask's phases (monkeypatched), constrained and unconstrained
runs of the chat workload in one engine, with variants (GIL switch interval 0.2 ms, the fill in line).

    python benchmarks/mask_phases.py Qwen3-0.6B 2048 enum

Ran as it is at this commit to measure docs/structured_outputs.md's "where a 0.6B step goes"; removed after."""
import statistics
import sys
import time
from random import Random

sys.path.insert(0, "benchmarks")
from structured_outputs import prompts, schema

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine import llm_engine as le
from nanovllm.engine import model_runner as mr
from nanovllm.sampling import grammar_mask as gm
from nanovllm.utils.random_checkpoint import default_checkpoint

T = {}
def add(k, v): T.setdefault(k, []).append(v)
def wrap(cls, name, key):
    orig = getattr(cls, name)
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); add(key, time.perf_counter() - t); return r
    setattr(cls, name, f)
wrap(gm.GrammarMasks, "_accept", "worker accept")
orig_fill = gm.GrammarMasks._fill
def fill(self, work, batch, turn, pending):
    t0 = time.perf_counter(); r = orig_fill(self, work, batch, turn, pending); add("worker _fill total", time.perf_counter() - t0); return r
gm.GrammarMasks._fill = fill
f_orig = gm.GrammarMasks.finish
def finish(self, filled):
    t0 = time.perf_counter(); filled.result(); add("main wait for fill", time.perf_counter() - t0)
    t1 = time.perf_counter(); r = f_orig(self, filled); add("main finish copy", time.perf_counter() - t1); return r
gm.GrammarMasks.finish = finish
wrap(gm.StepMask, "apply", "main apply")
wrap(le.LLMEngine, "step", "engine step")
wrap(le.LLMEngine, "_complete", "main _complete")
wrap(mr.ModelRunner, "launch", "main launch")
wrap(mr.ModelRunner, "finish", "main runner.finish")
bf = gm.GrammarMasks.__init__
def init(self, *a, **k):
    bf(self, *a, **k)
    of = self.filler.batch_fill_next_token_bitmask
    class F:
        def batch_fill_next_token_bitmask(s, *aa, **kk):
            t = time.perf_counter(); of(*aa, **kk); add("worker xgrammar fill", time.perf_counter() - t)
    self.filler = F()
gm.GrammarMasks.__init__ = init
shape, n, strings = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(default_checkpoint(shape), max_num_seqs=512, max_model_len=1024)
rng = Random(0); max_id = llm.config.hf_config.vocab_size - 1000
spec = StructuredOutputsParams(json=schema(0, strings), disable_any_whitespace=True)
class Inline:
    def submit(self, fn, *a):
        from concurrent.futures import Future
        f = Future(); f.set_result(fn(*a)); return f
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
    print(f"== {label}: {wall:.2f} s, {sum(lens) / wall:,.0f} tok/s", flush=True)
    for k, v in sorted(T.items()):
        print(f"  {k:24s} n={len(v):5d} mean {1000 * statistics.mean(v):7.3f} ms  median {1000 * statistics.median(v):7.3f} ms  total {sum(v):6.2f} s")
run("warmup " + strings, strings)
run("constrained " + strings, strings)
run("unconstrained", strings, False)
sys.setswitchinterval(0.0002)
run("constrained, switchinterval 0.2 ms", strings)
sys.setswitchinterval(0.005)
masks = llm.model_runner.sampler.grammar_masks
worker = masks.worker
masks.worker = Inline()
run("constrained, fill inline (no worker thread)", strings)
masks.worker = worker
run("constrained bounded", "bounded")
run("unconstrained (bounded lengths)", "bounded", False)
sys.setswitchinterval(0.0002)
run("constrained bounded, switchinterval 0.2 ms", "bounded")
