"""Issue 59 probe (branch only): the FP8 decode-kernel variants in probe/variants/ against main's kernel, in one
process.

    python probe/time_variants.py [--variants a_asm_impure,c2_asm_v_only,...] [--shapes anchor,0.6B] [--out DIR]

For each shape (anchor: 512 x 32/8 heads x 1500-1700 tokens; 0.6B: 256 x 16/8 x 100-2048, both as
`benchmarks/microbench.py fp8-decode` builds them, seed 0) and each variant (main = main's paged_decode.py, copied to
probe/variants/main_paged_decode.py) over a grid of (BLOCK_N, warps, stages):
  - the output against a float32 reference on the dequantized cache (every batch/16-th sequence) and against main's
    kernel (max |diff|; bit-identical to main at the same setting?, and to main at its TUNED (64, 2, 2)),
  - the time per call replayed from a CUDA graph (median of 3 replays of `--repeat` calls),
and prints, per variant and shape, the best 3 settings with us, GB/s (bytes = sum(context_lens) * kv_heads *
head_dim * 2 (K+V) * bytes per element) and the fraction of the bf16 kernel's GB/s (main's kernel over a bf16 cache
at its TUNED setting). All compiles of a shape are done first, in parallel threads (triton.AsyncCompileMode).

--interpret-check: no GPU; under TRITON_INTERPRET=1 on a tiny shape, the outputs only (inline PTX replaced by
Triton's cast, which the interpreter can run): the variants' logic and this script's checks, not their speed.
"""
import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nanovllm.quantization.kv_quant import quantize  # noqa: E402

# by their SASS (probe/sass59_stats.md): the branch (a), its pure twin (b, hoisted again: a control), inline PTX on V
# only (c2), the integer decode (d, hoisted again: a control), the transposed wgmma forms (w, w2)
DEFAULT_VARIANTS = "a_asm_impure,b_asm_pure,c2_asm_v_only,d_int_trick,w_wgmma_v_asm,w2_wgmma_cast"
SHAPES = {"anchor": (512, 32, 8, 1500, 1700), "0.6B": (256, 16, 8, 100, 2048), "tiny": (5, 16, 8, 1, 300)}
PAGE, HEAD_DIM = 256, 128


def load_variant(name: str):
    path = os.path.join(HERE, "variants", name + ".py")
    spec = importlib.util.spec_from_file_location("variant59_" + name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def graph_time_us(call, repeat: int) -> float:
    """Device time per call, `repeat` calls replayed from one CUDA graph (as benchmarks/microbench.py's helper),
    the median of 3 replays."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeat)
    del graph
    return statistics.median(times)


def make_inputs(shape: str, device: str):
    """As microbench.py fp8-decode builds them (seed 0)."""
    batch, heads, kv_heads, lo, hi = SHAPES[shape]
    torch.manual_seed(0)
    page = PAGE if device == "cuda" else 16
    width = -(-max(hi, 4096 if device == "cuda" else hi) // page)
    num_blocks = batch * width + 16
    k = torch.randn(num_blocks, page, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    context_lens = torch.randint(lo, hi + 1, (batch,), dtype=torch.int32, device=device)
    block_tables = torch.randperm(num_blocks, device=device)[: batch * width].view(batch, width).int()
    k_scale, v_scale = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    return dict(q=q, k=k, v=v, k8=k8, v8=v8, k_scale=k_scale, v_scale=v_scale, context_lens=context_lens,
                block_tables=block_tables, counters=torch.zeros(batch * kv_heads, dtype=torch.int32, device=device),
                kv_heads=kv_heads, heads=heads, page=page)


def reference(x) -> dict[int, torch.Tensor]:
    """float32 attention over the dequantized FP8 cache for every batch/16-th sequence."""
    q, k8, v8, tables, lens = x["q"], x["k8"], x["v8"], x["block_tables"], x["context_lens"]
    batch, heads, _ = q.shape
    kv_heads, page = x["kv_heads"], x["page"]
    out = {}
    for i in range(0, batch, max(1, batch // 16)):
        n = lens[i].item()
        rows = tables[i, : -(-n // page)].long()
        kk = (k8[rows].float() * x["k_scale"]).reshape(-1, kv_heads, HEAD_DIM)[:n]
        vv = (v8[rows].float() * x["v_scale"]).reshape(-1, kv_heads, HEAD_DIM)[:n]
        kk, vv = kk.repeat_interleave(heads // kv_heads, 1), vv.repeat_interleave(heads // kv_heads, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * HEAD_DIM ** -0.5, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


def error_vs(ref: dict[int, torch.Tensor], out: torch.Tensor) -> float:
    return max((out[i].float() - r).abs().max().item() for i, r in ref.items())


def fp8_call(module, x, setting=None):
    kwargs = dict(k_scale=x["k_scale"], v_scale=x["v_scale"])
    if setting is not None:
        kwargs.update(block_n=setting[0], num_warps=setting[1], num_stages=setting[2])
    return lambda: module.paged_decode_attention(x["q"], x["k8"], x["v8"], x["block_tables"], x["context_lens"],
                                                 HEAD_DIM ** -0.5, x["counters"], **kwargs)


class _Warmup:
    """Stands in for a module's _decode_attention so that the module's own wrapper compiles instead of launching."""

    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit.warmup(*args, grid=grid, **kwargs)


def precompile(modules: dict, x, settings) -> None:
    """Every (module, setting) compiled in parallel threads before anything is timed (Triton's compile releases
    the GIL for most of its work); a failure here is left for the timed call to meet and report."""
    mode_cls = getattr(triton, "AsyncCompileMode", None)
    if mode_cls is None:
        print("  (no triton.AsyncCompileMode: compiling as the calls come)", flush=True)
        return
    t0 = time.time()
    real = {name: m._decode_attention for name, m in modules.items()}
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool, mode_cls(pool, ignore_errors=True):
            for name, m in modules.items():
                m._decode_attention = _Warmup(real[name])
                for setting in settings:
                    try:
                        fp8_call(m, x, setting)()
                    except Exception as error:  # noqa: BLE001
                        print(f"  precompile {name} {setting}: {type(error).__name__}: {str(error)[:100]}")
    except Exception as error:  # noqa: BLE001
        print(f"  precompile: {type(error).__name__}: {str(error)[:200]} (going on; the calls compile)")
    finally:
        for name, m in modules.items():
            m._decode_attention = real[name]
    print(f"  compiled {len(modules) * len(settings)} kernels in {time.time() - t0:.1f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help="comma-separated names in probe/variants/, or 'all' (main's kernel always runs)")
    parser.add_argument("--shapes", default="anchor,0.6B")
    parser.add_argument("--block-n", default="32,64,128")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--stages", default="1,2,3")
    parser.add_argument("--repeat", type=int, default=10, help="calls per CUDA graph")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="results.json and results.md go here")
    parser.add_argument("--interpret-check", action="store_true", help="CPU, TRITON_INTERPRET=1: outputs only")
    args = parser.parse_args()
    if args.variants == "all":
        files = os.listdir(os.path.join(HERE, "variants"))
        args.variants = ",".join(sorted(f[:-3] for f in files if f.endswith(".py")))
    names = ["main_paged_decode"] + [n for n in args.variants.split(",") if n and n != "main_paged_decode"]
    settings = list(itertools.product(*(tuple(int(s) for s in a.split(",")) for a in
                                        (args.block_n, args.warps, args.stages))))
    if args.interpret_check:
        return interpret_check(names)
    assert torch.cuda.is_available(), "needs a CUDA GPU (or --interpret-check)"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"variants {names}; {len(settings)} settings", flush=True)
    modules = {name: load_variant(name) for name in names}
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "shapes": {}}
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    for shape in args.shapes.split(","):
        run_shape(shape, modules, settings, args, results)
        torch.cuda.empty_cache()
        lines = table(results)
        with open(os.path.join(args.out, "results.md"), "w") as f:  # after each shape, in case of a timeout
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"total {time.time() - t_start:.0f} s")


def run_shape(shape: str, modules: dict, settings: list, args, results: dict) -> None:
    names = list(modules)
    x = make_inputs(shape, "cuda")
    tokens = x["context_lens"].sum().item() * x["kv_heads"]
    fp8_bytes, bf16_bytes = tokens * HEAD_DIM * 2, tokens * HEAD_DIM * 2 * 2
    ref = reference(x)
    print(f"[{shape}] batch {SHAPES[shape][0]}, heads {SHAPES[shape][1]}/{SHAPES[shape][2]}, contexts "
          f"{SHAPES[shape][3]}-{SHAPES[shape][4]}: FP8 {fp8_bytes / 1e6:.0f} MB per call", flush=True)
    main_module = modules["main_paged_decode"]

    def bf16():
        return main_module.paged_decode_attention(x["q"], x["k"], x["v"], x["block_tables"], x["context_lens"],
                                                  HEAD_DIM ** -0.5, x["counters"])

    bf16_us = graph_time_us(bf16, args.repeat)
    bf16_gbs = bf16_bytes / bf16_us / 1e3
    print(f"  bf16 (main, TUNED {main_module.TUNED[False]}): {bf16_us:.1f} us, {bf16_gbs:.0f} GB/s; FP8 at "
          f"that bandwidth: {fp8_bytes / bf16_gbs / 1e3:.1f} us", flush=True)
    shape_results = results["shapes"][shape] = {"bf16_us": bf16_us, "bf16_gbs": bf16_gbs,
                                                "fp8_bytes": fp8_bytes, "variants": {}}
    precompile(modules, x, settings)
    main_tuned_out = fp8_call(main_module, x)().clone()
    main_outs = {}
    for name in names:
        t0 = time.time()
        rows = shape_results["variants"][name] = {}
        for setting in settings:
            call = fp8_call(modules[name], x, setting)
            try:
                out = call().clone()
                torch.cuda.synchronize()
                us = graph_time_us(call, args.repeat)
            except Exception as error:  # noqa: BLE001 -- a setting past the shared memory or a failed compile
                rows[str(setting)] = {"error": f"{type(error).__name__}: {str(error)[:120]}"}
                continue
            if name == "main_paged_decode":
                main_outs[setting] = out
            same = main_outs.get(setting)
            rows[str(setting)] = {
                "us": us, "gbs": fp8_bytes / us / 1e3, "err_fp32": error_vs(ref, out),
                "diff_main_tuned": (out.float() - main_tuned_out.float()).abs().max().item(),
                "bit_identical_main_same_setting": None if same is None else bool(torch.equal(out, same)),
                "bit_identical_main_tuned": bool(torch.equal(out, main_tuned_out)),
                "finite": bool(torch.isfinite(out).all())}
        ok = {s: r for s, r in rows.items() if "us" in r}
        best = min(ok.items(), key=lambda item: item[1]["us"]) if ok else None
        print(f"  {name}: {len(ok)}/{len(settings)} settings in {time.time() - t0:.1f} s" +
              (f"; best {best[0]} {best[1]['us']:.1f} us" if best else ""), flush=True)
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        torch.cuda.empty_cache()  # the graphs' private pools


def table(results: dict) -> list[str]:
    lines = ["| shape | variant | BLOCK_N,warps,stages | us | GB/s | of bf16 GB/s | err vs fp32 | max diff vs main "
             "TUNED | bit-identical to main (same setting / TUNED) |", "|---" * 9 + "|"]
    for shape, s in results["shapes"].items():
        lines.append(f"| {shape} | bf16 (main, TUNED) | | {s['bf16_us']:.1f} | {s['bf16_gbs']:.0f} | 100% | | | |")
        for name, rows in s["variants"].items():
            ok = sorted(((r["us"], setting, r) for setting, r in rows.items() if "us" in r))
            picks = ok[:3]
            tuned = rows.get(str((64, 2, 2)))
            if tuned and "us" in tuned and all(p[1] != str((64, 2, 2)) for p in picks):
                picks.append((tuned["us"], str((64, 2, 2)) + " (TUNED)", tuned))
            for us, setting, r in picks:
                lines.append(f"| {shape} | {name} | {setting} | {us:.1f} | {r['gbs']:.0f} | "
                             f"{r['gbs'] / s['bf16_gbs']:.0%} | {r['err_fp32']:.1e} | {r['diff_main_tuned']:.1e} | "
                             f"{r['bit_identical_main_same_setting']} / {r['bit_identical_main_tuned']}"
                             + ("" if r["finite"] else " NOT FINITE") + " |")
            failed = [setting for setting, r in rows.items() if "error" in r]
            if failed:
                failed = " ".join(f.replace(" ", "") for f in failed)
                lines.append(f"| {shape} | {name} | failed: {failed} | | | | | | |")
    return lines


def interpret_check(names) -> None:
    """CPU: each variant's output on a tiny shape against the float32 reference and main's, with inline PTX
    replaced by Triton's cast (the interpreter cannot run PTX)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

    @triton.jit
    def cast_to_f16(x):
        return x.to(tl.float16)

    x = make_inputs("tiny", "cpu")
    ref = reference(x)
    outs = {}
    for name in names:
        module = load_variant(name)
        if hasattr(module, "_e4m3_to_f16"):
            module._e4m3_to_f16 = cast_to_f16
        for setting in ((16, 2, 2),):  # the interpreter ignores warps and stages
            out = fp8_call(module, x, setting)()
            outs.setdefault(setting, out)
            print(f"{name} {setting}: err vs fp32 {error_vs(ref, out):.1e}, max diff vs main "
                  f"{(out.float() - outs[setting].float()).abs().max().item():.1e}, bit-identical to main "
                  f"{torch.equal(out, outs[setting])}", flush=True)


if __name__ == "__main__":
    main()
