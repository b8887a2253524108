# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
"""Per-step Python vs xgrammar time of the mask path, 512 enum rows, everything on one thread (probe)."""
import sys, time, importlib.util, cProfile, pstats
import torch
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
from nanovllm import StructuredOutputsParams
from nanovllm.sampling.grammar import GrammarCompiler, GrammarState
path = sys.argv[1] if len(sys.argv) > 1 else "nanovllm/sampling/grammar_mask.py"
spec = importlib.util.spec_from_file_location("gm", path); gm = importlib.util.module_from_spec(spec); spec.loader.exec_module(gm)
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
so = StructuredOutputsParams(json=schema(0, "enum"), disable_any_whitespace=True)
class Row:
    def __init__(self, i): self.seq_id, self.grammar, self.token_ids, self.num_prompt_tokens = i, GrammarState(compiler.submit(so)), [], 0
    @property
    def num_completion_tokens(self): return len(self.token_ids)
    @property
    def completion_token_ids(self): return self.token_ids
N = 512
rows = [Row(i) for i in range(N)]
masks = gm.GrammarMasks(V, N, torch.device("cpu"), [tok.eos_token_id])
class Inline:  # the worker's calls on this thread
    def submit(self, f, *a):
        from concurrent.futures import Future
        fut = Future(); fut.set_result(f(*a)); return fut
masks.worker = Inline()
xt = [0.0]
class F:
    def __init__(self, f): self.f = f
    def batch_fill_next_token_bitmask(self, *a, **k):
        t = time.perf_counter(); self.f.batch_fill_next_token_bitmask(*a, **k); xt[0] += time.perf_counter() - t
masks.filler = F(masks.filler)
if getattr(masks, "fill_binding", None) is not None:
    fb = masks.fill_binding
    def timed(*a):
        t = time.perf_counter(); fb(*a); xt[0] += time.perf_counter() - t
    masks.fill_binding = timed
if getattr(masks, "core", None) is not None:
    core = masks.core
    class C:
        class BatchGrammarMatcher:
            @staticmethod
            def batch_accept_token(*a):
                t = time.perf_counter(); r = core.BatchGrammarMatcher.batch_accept_token(*a); xt[0] += time.perf_counter() - t; return r
    masks.core = C
gen = torch.Generator().manual_seed(0)
P = {"start+finish": 0.0, "after_sample(+fill ahead)": 0.0}
X = dict.fromkeys(P, 0.0)
prof = cProfile.Profile()
steps = 60
for step in range(steps):
    if step == 20: ("-v" in sys.argv and prof.enable()); P = dict.fromkeys(P, 0.0); X = dict.fromkeys(X, 0.0)
    xt[0] = 0; t = time.perf_counter()
    mask = masks.finish(masks.start(rows, lambda: {}))
    P["start+finish"] += time.perf_counter() - t; X["start+finish"] += xt[0]
    prof.disable()
    logits = torch.rand(len(rows), V, generator=gen)
    mask.apply(logits)
    logits[:, tok.eos_token_id] = -1
    chosen = logits.argmax(1).tolist()
    for r, c in zip(rows, chosen): r.token_ids.append(c)
    if step >= 20 and "-v" in sys.argv: prof.enable()
    xt[0] = 0; t = time.perf_counter()
    masks.after_sample(rows, [True] * len(rows), lambda chosen=chosen: chosen)
    P["after_sample(+fill ahead)"] += time.perf_counter() - t; X["after_sample(+fill ahead)"] += xt[0]
prof.disable()
n = steps - 20
for k in P:
    print(f"{k:28s} total {1000*P[k]/n:6.2f} ms/step, xgrammar C++ {1000*X[k]/n:6.2f}, rest (Python, torch) {1000*(P[k]-X[k])/n:6.2f}")
print("rejected", sum(r.grammar.rejected for r in rows))
if "-v" in sys.argv:
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)
