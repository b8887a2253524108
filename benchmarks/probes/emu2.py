# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
import sys, time, numpy as np, torch, xgrammar as xgr
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1]); strings = sys.argv[2]; N = int(sys.argv[3])
V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
g = xgr.GrammarCompiler(info, cache_enabled=False).compile_json_schema(schema(0, strings), any_whitespace=False, separators=(",", ":"))
rng = np.random.default_rng(0)
ms = [xgr.GrammarMatcher(g) for _ in range(N)]; out = [[] for _ in range(N)]
bm = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
while not ms[0].is_terminated():
    t = time.perf_counter(); ms[0].fill_next_token_bitmask(bm, 0); dt = time.perf_counter() - t
    bits = bm[0].numpy().view(np.uint32)
    allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:V])
    tk = int(allowed[rng.integers(len(allowed))])
    print(f"{1e6*dt:8.0f} us  allowed {len(allowed):6d}  after {tok.decode(out[0])[-30:]!r}")
    ms[0].accept_token(tk); out[0].append(tk)
