# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
import sys, time, threading
import torch, xgrammar as xgr
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
g = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema(0, "enum"), any_whitespace=False, separators=(",", ":"))
N = 512
def fresh():
    ms = [xgr.GrammarMatcher(g) for _ in range(N)]
    for m in ms: m.accept_string('{"id":1')
    return ms
digit = tok.convert_tokens_to_ids("2")
bm = torch.zeros(N, (V + 31) // 32, dtype=torch.int32)
f = xgr.BatchGrammarMatcher(max_threads=1)
def timed(label, fn):
    ms = fresh(); t = time.perf_counter(); fn(ms); print(f"{label}: {1000*(time.perf_counter()-t):.2f} ms")
def batch_accept(ms): xgr.BatchGrammarMatcher.batch_accept_token(ms, [digit] * N)
def loop_accept(ms): [m.accept_token(digit) for m in ms]
def fill(ms): f.batch_fill_next_token_bitmask(ms, bm)
for label, fn in (("batch accept", batch_accept), ("loop accept", loop_accept), ("batch fill", fill)):
    timed(label + " alone", fn)
stop = [False]
def spin():
    x = 0
    while not stop[0]: x += 1
th = threading.Thread(target=spin); th.start(); time.sleep(0.02)
for label, fn in (("batch accept", batch_accept), ("loop accept", loop_accept), ("batch fill", fill)):
    timed(label + " beside a spinning thread", fn)
sys.setswitchinterval(0.0001)
for label, fn in (("batch accept", batch_accept), ("loop accept", loop_accept), ("batch fill", fill)):
    timed(label + " beside a spinning thread, switch 0.1 ms", fn)
stop[0] = True; th.join()
