# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
"""CPU emulation of a constrained job's host work: 512 matchers, random allowed tokens; per-step accept and fill."""
import sys, time, random, statistics, threading
import numpy as np, torch, xgrammar as xgr
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1]); strings = sys.argv[2]; N = int(sys.argv[3]); threads = int(sys.argv[4])
V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
t = time.perf_counter()
g = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema(0, strings), any_whitespace=False, separators=(",", ":"))
print(f"compile {1000*(time.perf_counter()-t):.0f} ms")
rng = np.random.default_rng(0)
ms = [xgr.GrammarMatcher(g) for _ in range(N)]
bm = torch.zeros(N, (V + 31) // 32, dtype=torch.int32)
f = xgr.BatchGrammarMatcher(max_threads=threads)
acc, fill, lens = [], [], []
steps = 0
while True:
    live = [m for m in ms if not m.is_terminated()]
    if not live: break
    t = time.perf_counter(); f.batch_fill_next_token_bitmask(live, bm, list(range(len(live)))); fill.append(time.perf_counter() - t)
    bits = bm[:len(live)].numpy().view(np.uint32)
    toks = []
    for i in range(len(live)):
        allowed = np.flatnonzero(np.unpackbits(bits[i].view(np.uint8), bitorder="little")[:V])
        toks.append(int(allowed[rng.integers(len(allowed))]))
    t = time.perf_counter(); xgr.BatchGrammarMatcher.batch_accept_token(live, toks); acc.append(time.perf_counter() - t)
    steps += 1
    if steps == 5 or steps % 20 == 0: print(steps, len(live), f"fill {1000*fill[-1]:.2f} ms accept {1000*acc[-1]:.2f} ms", flush=True)
print(f"steps {steps}; fill mean {1000*statistics.mean(fill):.2f} ms, accept mean {1000*statistics.mean(acc):.2f} ms (rows {N}, threads {threads})")
