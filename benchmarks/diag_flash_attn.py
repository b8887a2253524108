"""flash-attn as the engine calls it, per family's head shape, against a float32 reference (issue 33).

    python benchmarks/diag_flash_attn.py [--parts 1234]   (5: the identity check, not run by default)

1. accuracy: flash_attn_varlen_func (prefill, without and with a block table), flash_attn_with_kvcache (decode;
   flash-attn's own split count, 1 and 4) and our Triton decode kernel, on bf16 inputs laid out as the engine
   hands them over (q, k contiguous after RoPE, v a view into the packed qkv row; caches [blocks, 256, kv_heads,
   head_dim]; int32 tables and lengths): max |error| / max |reference|, ~1e-2 from bf16, O(1) from a bug
   (WRONG). `splits`: what flash-attn 2.8.3's heuristic picks for the call (flash_splits).
2. batch invariance: decode of b rows against the same rows padded to the CUDA-graph batch (context 0, table of
   zeros), repeated, and replayed from a CUDA graph: "=" bitwise equal, "~" not.
3. decode time (us) with flash-attn's split count against num_splits=1 (what the flash_attn backend passes).
4. the engine, Qwen2.5-0.5B shape, eager: each layer's attention output on the flash_attn backend (as it is
   now, and with flash-attn's own split count as before) against the triton backend, per step.
5. Qwen3-0.6B on flash_attn as tests/test_gpu.py runs it: tokens of CUDA graphs, eager, CUDA graphs again.
A part that fails prints its traceback and the next one runs.
"""
import argparse
import functools
import math
import tempfile
import traceback

import torch
from cuda_timing import graph_time_us
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nanovllm.attention.flash_attn_backend import store_kvcache
from nanovllm.attention.kv_cache import LayerKV
from nanovllm.attention.paged_decode import paged_decode_attention

SHAPES = {"Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-7B": (28, 4, 128), "Llama-3.2-1B": (32, 8, 64),
          "Qwen3-0.6B": (16, 8, 128)}  # q heads, KV heads, head_dim
PAGE, WIDTH = 256, 16  # kvcache_block_size, and a table's width at max_model_len 4096
GRAPH_SIZES = [1, 2, 4, 8, *range(16, 513, 16)]  # CUDAGraphs.sizes at max_num_seqs 512
SHARP = 4.0  # queries scaled up so attention is peaked and outputs are O(1): a wrong row shows
DEVICE = "cuda"


def packed_qkv(tokens: int, shape: tuple[int, int, int], gen: torch.Generator):
    """q, k, v of `tokens` as the flash_attn backend hands them to flash-attn: views into one [tokens, (q + 2 kv)
    * head_dim] row, q and k copied out by RoPE, v left a strided view."""
    hq, hk, d = shape
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=gen, device=DEVICE).bfloat16()
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(tokens, hk, d)
    return (q * SHARP).contiguous(), k.contiguous(), qkv[:, (hq + hk) * d:].view(tokens, hk, d)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 attention of q (the last q.size(0) positions) over keys [L, kv_heads, d], causal."""
    group = q.size(1) // keys.size(1)
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    mask = torch.ones(q.size(0), k.size(0), dtype=torch.bool, device=q.device).tril(k.size(0) - q.size(0))
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def flash_splits(batch: int, shape: tuple[int, int, int], max_q: int, max_k: int) -> int:
    """flash-attn 2.8.3's num_splits_heuristic as flash_api.cpp calls it (q heads folded into rows at max_q 1)."""
    hq, hk, d = shape
    heads, rows = (hk, hq // hk) if max_q == 1 and hq > hk else (hq, max_q)
    work, sms = batch * heads * math.ceil(rows / 64), 2 * torch.cuda.get_device_properties(0).multi_processor_count
    if work >= 0.8 * sms:
        return 1
    n_blocks = math.ceil(max_k / (256 if d <= 64 else 128))
    eligible = [s for s in range(1, min(128, sms, n_blocks) + 1)
                if s == 1 or math.ceil(n_blocks / s) != math.ceil(n_blocks / (s - 1))]
    efficiency = {s: work * s / sms / math.ceil(work * s / sms) for s in eligible}
    return next(s for s in eligible if efficiency[s] >= 0.85 * max(efficiency.values()))


def varlen_splits(batch: int, shape: tuple[int, int, int], max_q: int, max_k: int) -> int:
    return flash_splits(batch, shape, max_q, max_k) if max_q == 1 and shape[0] > shape[1] else 1


def paged_cache(shape, num_blocks: int, gen: torch.Generator) -> LayerKV:
    _, hk, d = shape
    # random, not zero: a kernel that reads past a sequence's length would show
    return LayerKV(*(torch.randn(num_blocks, PAGE, hk, d, generator=gen, device=DEVICE).bfloat16() for _ in "kv"))


def tables(lengths: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Full-width int32 block tables of distinct scattered blocks; the unused tail stays 0, as the engine's."""
    table = torch.zeros(len(lengths), WIDTH, dtype=torch.int32, device=DEVICE)
    free = torch.randperm(num_blocks, generator=gen, device=DEVICE).int()
    for i, n in enumerate(lengths):
        table[i, : -(-n // PAGE)] = free[i * WIDTH: i * WIDTH + -(-n // PAGE)]
    return table


def cached_rows(cache: LayerKV, table: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = table[: -(-n // PAGE)].long()
    return cache.k[blocks].flatten(0, 1)[:n], cache.v[blocks].flatten(0, 1)[:n]


def cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def row(label: str, case: str, out: torch.Tensor, expected: torch.Tensor, splits: int | str = "") -> None:
    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
    print(f"| {label} | {case} | {splits} | {error:.2e} | {'ok' if error < 0.03 else 'WRONG'} |")


def prefill_cases(label: str, shape, gen: torch.Generator) -> None:
    scale = shape[2] ** -0.5
    # (full lengths, new tokens each): no cache; a cached prefix, at a batch that fills the GPU and at one that
    # does not; one new token each over a cache. flash-attn splits a varlen call only when every sequence has one
    # query token (it folds the q heads of a KV head into rows, as for decode)
    cases = {"prefill": ([1, 7, 300, 1000], None),
             "prefill over cache, 4 seqs": ([600, 1000, 1500, 900], [88, 488, 3, 300]),
             "prefill over cache, 1 seq x 20": ([700], [20]), "prefill over cache, 1 token each": ([513, 300], [1, 1])}
    for case, (lengths, new) in cases.items():
        q, k, v = packed_qkv(sum(lengths), shape, gen)
        starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        if new is None:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(lengths), cu_seqlens_k=cu(lengths),
                                         max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), softmax_scale=scale,
                                         causal=True)
            expected = torch.cat([reference(q[a:b], k[a:b], v[a:b], scale) for a, b in zip(starts, starts[1:])])
            row(label, case, out, expected, varlen_splits(len(lengths), shape, max(lengths), max(lengths)))
            continue
        num_blocks = len(lengths) * WIDTH + 3
        cache, table = paged_cache(shape, num_blocks, gen), tables(lengths, num_blocks, gen)
        slots = torch.cat([(table[i, torch.arange(n, device=DEVICE) // PAGE].long() * PAGE
                            + torch.arange(n, device=DEVICE) % PAGE) for i, n in enumerate(lengths)])
        store_kvcache(k, v, cache, slots)  # the engine's write, from the strided views
        rows = torch.cat([torch.arange(b - m, b, device=DEVICE) for b, m in zip(starts[1:], new)])
        out = flash_attn_varlen_func(q[rows], cache.k, cache.v, cu_seqlens_q=cu(new), cu_seqlens_k=cu(lengths),
                                     max_seqlen_q=max(new), max_seqlen_k=max(lengths), softmax_scale=scale,
                                     causal=True, block_table=table)
        expected = torch.cat([reference(q[b - m: b], k[a:b], v[a:b], scale)
                              for a, b, m in zip(starts, starts[1:], new)])
        row(label, case, out, expected, varlen_splits(len(lengths), shape, max(new), max(lengths)))


def decode_case(shape, batch: int, gen: torch.Generator, padded: int | None = None):
    """q [padded, heads, d], cache, tables and int32 lengths; rows past `batch` are CUDA-graph padding."""
    padded = padded or batch
    lengths = torch.randint(1, WIDTH * PAGE + 1, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
    num_blocks = batch * WIDTH + 3
    q = packed_qkv(padded, shape, gen)[0]
    table = torch.zeros(padded, WIDTH, dtype=torch.int32, device=DEVICE)
    table[:batch] = tables(lengths, num_blocks, gen)
    context = torch.zeros(padded, dtype=torch.int32, device=DEVICE)
    context[:batch] = torch.tensor(lengths, dtype=torch.int32)
    return q, paged_cache(shape, num_blocks, gen), table, context


def flash_decode(q, cache: LayerKV, table, context, splits: int) -> torch.Tensor:
    return flash_attn_with_kvcache(q.unsqueeze(1), cache.k, cache.v, cache_seqlens=context, block_table=table,
                                   softmax_scale=q.size(-1) ** -0.5, causal=True, num_splits=splits).squeeze(1)


def triton_decode(q, cache: LayerKV, table, context, _splits: int = 0) -> torch.Tensor:
    return paged_decode_attention(q, cache.k, cache.v, table, context, q.size(-1) ** -0.5)


def decode_cases(label: str, shape, gen: torch.Generator) -> None:
    scale = shape[2] ** -0.5
    for batch in (3, 64):
        q, cache, table, context = decode_case(shape, batch, gen)
        expected = torch.cat([reference(q[i: i + 1], *cached_rows(cache, table[i], n), scale)
                              for i, n in enumerate(context.tolist())])
        row(label, f"decode, {batch} seqs, our Triton kernel", triton_decode(q, cache, table, context), expected)
        # split calls last: where flash-attn's split path is broken it also writes past its buffers
        for splits in (1, 0, 4):
            row(label, f"decode, {batch} seqs, num_splits={splits}", flash_decode(q, cache, table, context, splits),
                expected, flash_splits(batch, shape, 1, WIDTH * PAGE) if splits == 0 else splits)


def graph_replay(call) -> torch.Tensor:
    call()  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def batch_invariance(label: str, shape, gen: torch.Generator) -> None:
    for batch in (3, 17, 64, 100):
        padded = next(s for s in GRAPH_SIZES if s >= batch)
        q, cache, table, context = decode_case(shape, batch, gen, padded)
        for name, kernel, splits in (("triton", triton_decode, 0), ("flash", flash_decode, 1),
                                     ("flash", flash_decode, 0), ("flash", flash_decode, 4)):
            alone = kernel(q[:batch], cache, table[:batch], context[:batch], splits)
            again = kernel(q[:batch], cache, table[:batch], context[:batch], splits)
            with_padding = kernel(q, cache, table, context, splits)[:batch]
            replayed = graph_replay(functools.partial(kernel, q, cache, table, context, splits))[:batch]
            chosen = (f"{flash_splits(batch, shape, 1, WIDTH * PAGE)} / {flash_splits(padded, shape, 1, WIDTH * PAGE)}"
                      if name == "flash" and splits == 0 else str(splits) if name == "flash" else "ours")
            print(f"| {label} | {batch} -> {padded} | {name} | {chosen} | {'=' if torch.equal(alone, again) else '~'} "
                  f"| {'=' if torch.equal(alone, with_padding) else '~'} | "
                  f"{'=' if torch.equal(with_padding, replayed) else '~'} |")


def decode_times(label: str, shape, gen: torch.Generator) -> None:
    for batch in (1, 4, 16, 64, 256):
        q, cache, table, context = decode_case(shape, batch, gen)
        for length in (1024, 4000):
            context.fill_(length)
            times = [graph_time_us([functools.partial(kernel, q, cache, table, context, splits)], repeat=20)
                     for kernel, splits in ((flash_decode, 0), (flash_decode, 1), (triton_decode, 0))]
            print(f"| {label} | {batch} | {length} | {flash_splits(batch, shape, 1, WIDTH * PAGE)} | {times[0]:.1f} | "
                  f"{times[1]:.1f} | {times[2]:.1f} |")


def engine_attention(path: str, backend: str, prompts: list[list[int]], heuristic_splits: bool = False):
    """Greedy tokens and every attention layer's output per call, eager, on `backend`; with heuristic_splits the
    flash_attn backend's decode leaves num_splits to flash-attn (as before issue 33)."""
    from nanovllm import LLM, SamplingParams
    from nanovllm.attention.flash_attn_backend import FlashAttnBackend
    from nanovllm.layers.attention import Attention
    from nanovllm.utils.context import get_context

    fixed = FlashAttnBackend.decode
    if heuristic_splits:
        FlashAttnBackend.decode = lambda self, q, cache, context, scale: flash_attn_with_kvcache(
            q.unsqueeze(1), cache.k, cache.v, cache_seqlens=context.context_lens, block_table=context.block_tables,
            softmax_scale=scale, causal=True).squeeze(1)
    records = []
    try:
        torch.cuda.empty_cache()
        with LLM(path, attention_backend=backend, enforce_eager=True, gpu_memory_utilization=0.3,
                 max_model_len=4096) as llm:
            layers = [m for m in llm.model_runner.model.modules() if isinstance(m, Attention)]
            for layer in layers:
                layer.register_forward_hook(lambda m, args, out: records.append(
                    (get_context().is_prefill, out.float().cpu())))
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            tokens = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        FlashAttnBackend.decode = fixed
    return tokens, [records[i: i + len(layers)] for i in range(0, len(records), len(layers))]


def engine_check() -> None:
    from nanovllm.utils.random_checkpoint import write_random_checkpoint

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in (300, 37, 900, 5)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(tmp, "Qwen2.5-0.5B", std=0.05, seed=1)
        base_tokens, base = engine_attention(path, "triton", prompts)
        for name, heuristic in (("flash_attn", False), ("flash_attn, flash-attn's splits", True)):
            tokens, steps = engine_attention(path, "flash_attn", prompts, heuristic)
            print(f"\n{name} against triton, tokens {'equal' if tokens == base_tokens else 'differ'}: "
                  f"{tokens} vs {base_tokens}")
            print("| step | inputs equal | layer 0 error | largest error | first layer over 0.1 |\n"
                  + "| --- " * 5 + "|")
            for i, (ours, theirs) in enumerate(zip(steps, base)):
                errors = [((a - b).abs().max() / b.abs().max()).item() for (_, a), (_, b) in zip(ours, theirs)]
                same_inputs = all(t[:i] == s[:i] for t, s in zip(tokens, base_tokens))
                first = next((j for j, e in enumerate(errors) if e > 0.1), "-")
                kind = "prefill" if ours[0][0] else f"decode {i}"
                print(f"| {kind} | {same_inputs} | {errors[0]:.2e} | {max(errors):.2e} | {first} |")


def identity_check() -> None:
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.random_checkpoint import write_random_checkpoint

    g = torch.Generator().manual_seed(0)  # tests/test_gpu.py's mixed_prompts()
    lengths = torch.randint(100, 1501, (64,), generator=g).tolist()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(tmp, "Qwen3-0.6B", std=0.05, seed=1)
        for name, eager in (("graphs", False), ("eager", True), ("graphs again", False)):
            torch.cuda.empty_cache()
            with LLM(path, attention_backend="flash_attn", enforce_eager=eager, gpu_memory_utilization=0.45,
                     max_model_len=4096) as llm:
                runs[name] = [o["token_ids"] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    for name in ("eager", "graphs again"):
        differ = [(i, next(j for j, (a, b) in enumerate(zip(x, y)) if a != b))
                  for i, (x, y) in enumerate(zip(runs["graphs"], runs[name])) if x != y]
        print(f"graphs vs {name}: {len(differ)} of 64 prompts differ (prompt, first position): {differ[:8]}")


def part(title: str, header: str, bodies: list) -> None:
    print(f"\n## {title}", flush=True)
    if header:
        print(f"{header}\n|{' --- |' * (header.count('|') - 1)}")
    for body in bodies:
        try:
            body()
            torch.cuda.synchronize()
        except Exception:
            traceback.print_exc()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="1234", help="which parts to run (5: three Qwen3-0.6B engines)")
    parts = parser.parse_args().parts
    import flash_attn
    print(f"{torch.cuda.get_device_name()}, flash-attn {flash_attn.__version__}, torch {torch.__version__}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    two = [(label, SHAPES[label]) for label in ("Qwen2.5-0.5B", "Qwen3-0.6B")]
    every = {
        "1": ("1. accuracy against float32", "| shape | case | splits | error | |",
              [functools.partial(f, *x, gen) for x in SHAPES.items() for f in (prefill_cases, decode_cases)]),
        "2": ("2. decode batch invariance",
              "| shape | batch -> graph batch | kernel | splits (batch / graph) | repeat | padded | graph |",
              [functools.partial(batch_invariance, *x, gen) for x in two]),
        "3": ("3. decode us", "| shape | batch | context | flash-attn's splits | default | num_splits=1 | ours |",
              [functools.partial(decode_times, *x, gen) for x in two]),
        "4": ("4. engine, Qwen2.5-0.5B shape: attention outputs against the triton backend", "", [engine_check]),
        "5": ("5. Qwen3-0.6B on flash_attn: CUDA graphs against eager", "", [identity_check]),
    }
    for key in parts:
        part(*every[key])


if __name__ == "__main__":
    main()
