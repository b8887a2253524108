# ruff: noqa  (a one-off probe, committed as it ran and removed in the next commit)
# setup: python -c 'from nanovllm.utils.random_tokenizer import write_tokenizer as w; w("/tmp/emu/tok", 151669)'
# (contention.py's first argument: a grammar_mask.py to load, e.g. git show 0ba7ffd:nanovllm/sampling/grammar_mask.py > /tmp/gm_old.py)
import sys, re, json, time, numpy as np, torch, xgrammar as xgr
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V, stop_token_ids=[tok.eos_token_id])
comp = xgr.GrammarCompiler(info, cache_enabled=False)
ebnf = str(xgr.Grammar.from_json_schema(json.dumps(schema(0, "bounded")), any_whitespace=False, separators=(",", ":")))
extra = []
def expand(m):
    name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
    base = f"{name}_upto"
    for k in range(1, hi - lo + 1):
        if f"{base}{k} ::=" not in "\n".join(extra):
            extra.append(f"{base}{k} ::= \"\" | ({name} {base}{k-1})" if k > 1 else f"{base}1 ::= \"\" | {name}")
    req = " ".join([name] * lo)
    if hi == lo: return f"({req})"
    return f"({req} {base}{hi - lo})" if lo else f"{base}{hi - lo}"
new = re.sub(r"(\w+)\{(\d+), (\d+)\}", expand, ebnf)
new += "\n" + "\n".join(extra)
for label, text in (("as is", ebnf), ("expanded", new)):
    t = time.perf_counter(); g = comp.compile_grammar(text); ct = time.perf_counter() - t
    ms = [xgr.GrammarMatcher(g) for _ in range(64)]
    for m in ms: assert m.accept_string('{"id":1,"name":"abcdefghijklmnopqrstuv')
    bm = torch.zeros(64, (V + 31) // 32, dtype=torch.int32)
    f = xgr.BatchGrammarMatcher(max_threads=1)
    t = time.perf_counter(); f.batch_fill_next_token_bitmask(ms, bm); ft = time.perf_counter() - t
    print(f"{label}: compile {ct*1000:.0f} ms, 64 rows 2 chars left: {ft*1000:.1f} ms, allowed {int(np.unpackbits(bm[0].numpy().view(np.uint8)).sum())}")
