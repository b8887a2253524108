# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
"""Per-step time of the mask path for 512 enum-schema rows, with a Python thread spinning beside it (probe)."""
import sys, time, threading, importlib.util
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "tests")
from structured_outputs import schema
from transformers import AutoTokenizer
from nanovllm import StructuredOutputsParams
from nanovllm.sampling.grammar import GrammarCompiler, GrammarState
spec = importlib.util.spec_from_file_location("gm", sys.argv[1]); gm = importlib.util.module_from_spec(spec); spec.loader.exec_module(gm)
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
so = StructuredOutputsParams(json=schema(0, "enum"), disable_any_whitespace=True)
class Row:
    def __init__(self, i): self.seq_id, self.grammar, self.token_ids, self.num_prompt_tokens = i, GrammarState(compiler.submit(so)), [], 0
    @property
    def num_completion_tokens(self): return len(self.token_ids)
    @property
    def completion_token_ids(self): return self.token_ids
rows = [Row(i) for i in range(512)]
masks = gm.GrammarMasks(V, 512, torch.device("cpu"), [tok.eos_token_id])
T = {}
def wrap(obj, name):
    orig = getattr(obj, name)
    def f(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k); T.setdefault(name, []).append(time.perf_counter() - t); return r
    setattr(obj, name, f)
for name in ("_take", "_fill_rows", "_allowed", "_accept_unread", "_fill"):
    if hasattr(masks, name): wrap(masks, name)
class F:
    def __init__(self, f): self.f = f
    def batch_fill_next_token_bitmask(self, *a, **k):
        t = time.perf_counter(); self.f.batch_fill_next_token_bitmask(*a, **k); T.setdefault("xgr fill", []).append(time.perf_counter() - t)
masks.filler = F(masks.filler)
stop = [False]
def spin():
    x = 0
    while not stop[0]: x += 1
def burst():  # an engine-like thread: 3 ms of Python, then 1.5 ms waiting on the device
    while not stop[0]:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.003: pass
        time.sleep(0.0015)
if sys.argv[2] == "spin":
    threading.Thread(target=spin, daemon=True).start()
if sys.argv[2] == "burst":
    threading.Thread(target=burst, daemon=True).start()
gen = torch.Generator().manual_seed(0)
times = []
for step in range(40):
    t = time.perf_counter()
    mask = masks.finish(masks.start(rows, lambda: {}))
    times.append(time.perf_counter() - t)
    logits = torch.rand(len(rows), V, generator=gen)
    mask.apply(logits)
    logits[:, tok.eos_token_id] = -1  # keep going
    chosen = logits.argmax(1).tolist()
    for r, c in zip(rows, chosen): r.token_ids.append(c)
    masks.after_sample(rows, [True] * len(rows), lambda chosen=chosen: chosen)
stop[0] = True
print({k: round(1000 * sum(v) / len(v), 1) for k, v in T.items()})
print(f"{sys.argv[1]} {sys.argv[2]}: mask wait per step median {1000*sorted(times)[len(times)//2]:.1f} ms, mean {1000*sum(times)/len(times):.1f} ms; rejected {sum(r.grammar.rejected for r in rows)}")
