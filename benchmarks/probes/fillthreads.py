# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
"""xgrammar fill / accept of 512 rows: xgrammar's pool at several sizes vs K Python threads on shards (probe).
Each method has its own copies of the matchers (a matcher keeps what its last fill found)."""
import sys, time, json, os
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
import xgrammar as xgr
from nanovllm.utils.random_tokenizer import write_tokenizer
if not os.path.exists("/tmp/emu/tok/tokenizer.json"): write_tokenizer("/tmp/emu/tok", 151669)
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
strings = sys.argv[1] if len(sys.argv) > 1 else "enum"
cg = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema(0, strings)), any_whitespace=False, strict_mode=True)
N = 512
core = xgr.base._core
pools = {k: ThreadPoolExecutor(k) for k in (2, 4, 8)}
singles = [xgr.BatchGrammarMatcher(1) for _ in range(8)]
def xpool(k):
    f = xgr.BatchGrammarMatcher(k)
    return lambda hs, bm: f._handle.batch_fill_next_token_bitmask(hs, bm, None, False)
def pyshards(k):
    pool, shard = pools[k], -(-N // k)
    def run(hs, bm):
        futs = [pool.submit(singles[i]._handle.batch_fill_next_token_bitmask, hs[i*shard:(i+1)*shard], bm,
                            list(range(i*shard, min(N, (i+1)*shard))), False) for i in range(k)]
        for fu in futs: fu.result()
    return run
def accept_one(hs, toks): core.BatchGrammarMatcher.batch_accept_token(hs, toks, False)
def accept_shards(k):
    pool, shard = pools[k], -(-N // k)
    def run(hs, toks):
        for fu in [pool.submit(core.BatchGrammarMatcher.batch_accept_token, hs[i*shard:(i+1)*shard], toks[i*shard:(i+1)*shard], False) for i in range(k)]: fu.result()
    return run
methods = [(f"xgrammar pool {k:2d}", xpool(k), accept_one) for k in (1, 2, 4, 8, 15)]
methods += [(f"{k} Python threads", pyshards(k), accept_shards(k)) for k in (2, 4, 8)]
sets = [[xgr.GrammarMatcher(cg) for _ in range(N)] for _ in methods]
bms = [xgr.allocate_token_bitmask(N, V) for _ in methods]
gen = torch.Generator().manual_seed(0)
res = {}
for step in range(60):
    order = list(range(len(methods))); order = order[step % len(order):] + order[:step % len(order)]
    for i in order:
        hs = [m._handle for m in sets[i]]
        t = time.perf_counter(); methods[i][1](hs, bms[i]); res.setdefault(("fill", i), []).append(time.perf_counter() - t)
    assert all(torch.equal(bms[0], b) for b in bms)
    logits = torch.rand(N, V, generator=gen); xgr.apply_token_bitmask_inplace(logits, bms[0])
    toks = logits.argmax(1).tolist()
    for i in order:
        hs = [m._handle for m in sets[i]]
        t = time.perf_counter(); methods[i][2](hs, toks); res.setdefault(("accept", i), []).append(time.perf_counter() - t)
    for s in sets:
        for m in s:
            if m.is_terminated(): m.reset()
for (what, i), v in sorted(res.items()):
    v = sorted(v[5:]); print(f"{strings} {what} {methods[i][0]:20s} median {1000*v[len(v)//2]:6.2f} ms  mean {1000*sum(v)/len(v):6.2f}  p90 {1000*v[int(.9*len(v))]:6.2f}")
