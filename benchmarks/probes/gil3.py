# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
import sys, time, threading
import torch, xgrammar as xgr
from xgrammar.base import _core
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
g = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema(0, "enum"), any_whitespace=False, separators=(",", ":"))
N = 512
digit = tok.convert_tokens_to_ids("2")
def fresh():
    ms = [xgr.GrammarMatcher(g) for _ in range(N)]
    for m in ms: m.accept_string('{"id":1')
    return [m._handle for m in ms]
def raw_call(hs): return _core.BatchGrammarMatcher.batch_accept_token(hs, [digit] * N, False)
def raw_list(hs): return list(raw_call(hs))
def raw_index(hs):
    r = raw_call(hs); return [bool(r[i]) for i in range(len(r))]
def timed(label, fn):
    hs = fresh(); t = time.perf_counter(); out = fn(hs); print(f"{label}: {1000*(time.perf_counter()-t):.2f} ms {type(out).__name__}")
stop = [False]
def spin():
    x = 0
    while not stop[0]: x += 1
for phase in ("alone", "beside a spinner"):
    if phase != "alone":
        th = threading.Thread(target=spin); th.start(); time.sleep(0.02)
    for label, fn in (("raw call only", raw_call), ("raw + list()", raw_list), ("raw + index", raw_index)):
        timed(f"{label} {phase}", fn)
r = raw_call(fresh()); print(type(r), [a for a in dir(r) if not a.startswith("__")][:20])
stop[0] = True; th.join()
