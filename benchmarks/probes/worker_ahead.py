# ruff: noqa  (a one-off probe: run from the repository root with PYTHONPATH=. and a Qwen3-sized tokenizer in /tmp/emu/tok)
"""CPU probe: the mask worker's fill ahead of 512 enum-schema rows over a Qwen3-sized vocabulary (time per step)."""
import sys, time, statistics, cProfile, pstats
from multiprocessing.shared_memory import SharedMemory
import numpy as np
sys.path.insert(0, "benchmarks")
from structured_outputs import schema
from transformers import AutoTokenizer
from nanovllm import StructuredOutputsParams
from nanovllm.sampling import mask_worker as mw
from nanovllm.sampling.grammar import GrammarCompiler

shards = int(sys.argv[1]) if len(sys.argv) > 1 else 64
mw.SHARD_ROWS = shards
tok = AutoTokenizer.from_pretrained("/tmp/emu/tok"); V = 151936
compiler = GrammarCompiler(tok, V, [tok.eos_token_id])
info = compiler.info.serialize_json()
N = 512
worker = mw.MaskWorker(info, [tok.eos_token_id])
layout = mw.SharedLayout(N, -(-V // 32))
shm = SharedMemory(create=True, size=layout.nbytes)
worker.attach(layout, shm.buf, int(sys.argv[2]) if len(sys.argv) > 2 else 1)
rows_view, _, counters = layout.views(shm.buf)
counters[mw.COPY_DONE] = 1 << 40
spec = StructuredOutputsParams(json=schema(0, "enum"), disable_any_whitespace=True)
worker.add([(slot, spec) for slot in range(1, N + 1)])
rng = np.random.default_rng(0)
span = layout.span
lengths = [0] * N
ahead_at = {}
times, fills = [], []
turn, generation = 0, 0
prof = cProfile.Profile()
for step in range(40):
    work = []
    for row in range(N):
        slot = row + 1
        if slot in ahead_at:
            source, gen = turn * span + ahead_at[slot], generation
        else:
            source, gen = turn * span + row, -1
        work.append((row, slot, lengths[row], source, gen))
    t = time.perf_counter()
    if hasattr(mw, "StepWork"):
        w = mw.StepWork(*[list(c) for c in zip(*work)])
    else:
        w = work
    worker.fill(step + 1, w, N, (0, 0))
    fills.append(time.perf_counter() - t)
    sources = np.array([w[3] for w in work])
    bits = np.unpackbits(rows_view[sources].view(np.uint8), axis=1, bitorder="little")[:, :V]
    tokens = []
    for row in range(N):
        allowed = np.flatnonzero(bits[row])
        choice = allowed[allowed != tok.eos_token_id]
        tokens.append(int(rng.choice(choice)) if len(choice) else tok.eos_token_id)
        lengths[row] += 1
    turn ^= 1
    generation += 1
    ahead_at = {row + 1: row for row in range(N)}
    if step >= 10: prof.enable()
    t = time.perf_counter()
    worker.ahead(list(range(N)), list(range(1, N + 1)), turn, generation, tokens, 0)
    dt = time.perf_counter() - t
    if step >= 10: prof.disable()
    times.append(dt)
    assert not worker.errors, worker.errors
    if all(c.terminated for c in worker.constraints.values()): break
print(f"shard rows {shards}: ahead median {1e3*statistics.median(times[5:]):.2f} ms over {len(times)-5} steps; fill check median {1e3*statistics.median(fills[5:]):.3f} ms")
pstats.Stats(prof).sort_stats("tottime").print_stats(8)
worker.release(); compiler.close(); shm.close(); shm.unlink()
