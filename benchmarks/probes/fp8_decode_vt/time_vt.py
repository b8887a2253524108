"""Issue 59 probe (branch only): the V^T decode kernel (probe/vt_decode.py) against main's FP8 and bf16 kernels.

    python probe/time_vt.py [--shapes anchor,0.6B] [--out DIR] [--repeat 20]
    TRITON_INTERPRET=1 python probe/time_vt.py --interpret-check      # CPU: outputs only, tiny shape

For each shape (anchor: 512 x 32/8 heads x 1500-1700 tokens; 0.6B: 256 x 16/8 x 100-2048, both as
`benchmarks/microbench.py fp8-decode` builds them, seed 0) one random FP8 cache is built, V both as main lays it out
and transposed (vt_decode.transpose_v, the same bytes). The cache slots past each sequence's end in its last page
are then set to NaN (0x7F) in K, V and V^T, as a stale or never-written slot may be: every kernel must ignore them
(all but vt0m1, the unmasked bound, which is expected to give NaN and is timed only).

Kernels timed (vtFmM = vt_decode's VT_FORM F, V_MASK M): main-fp8 (main's kernel, FP8 cache), vt0m2 (the candidate:
dot(p, trans(vt)), whole chunks unmasked, the last partial chunk peeled), vt1m2 / vt2m2 (other forms of the same),
vt3m2 (the control: main's V layout with vt0m2's loop, to tell the layout's gain from the loop's); vt0m1 (V^T read
unmasked, wrong on stale NaNs) only in the interpreter check. Each over its grid of (BLOCK_N, warps, stages):
  - max |out - float32 reference| on the dequantized cache (every batch/16-th sequence), max |out - main-fp8| at
    its TUNED setting and at the same setting, finite?, ok = finite and within 1.1x main-fp8's worst error vs
    float32 over its grid,
  - the time per call in a CUDA graph (benchmarks/microbench.py graph_time_us, `--repeat` calls; median of 3),
  - GB/s of the bytes read (sum(context_lens) * kv_heads * head_dim * 2 (K+V) * bytes per element), its fraction
    of the bf16 kernel's GB/s (main's kernel on a bf16 cache at its TUNED setting) and the speed-up over main-fp8
    at its TUNED setting.
Writes DIR/results.md (per kernel and shape: the best 3 settings and (64, 2, 2)) and DIR/results.json (everything)
after each shape.
"""
import argparse
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

import nanovllm.attention.paged_decode as main_decode  # noqa: E402
import probe.vt_decode as vt_decode  # noqa: E402
from nanovllm.quantization.kv_quant import quantize  # noqa: E402

SHAPES = {"anchor": (512, 32, 8, 1500, 1700), "0.6B": (256, 16, 8, 100, 2048), "tiny": (5, 16, 8, 1, 300)}
HEAD_DIM = 128
FULL = list(itertools.product((32, 64, 128), (2, 4), (1, 2, 3)))
SMALL = list(itertools.product((32, 64, 128), (2, 4), (2,)))
# kernel -> (form, v_mask, grid); main-fp8 is main's kernel
KERNELS = {"main-fp8": (None, None, FULL), "vt0m2": (0, 2, FULL), "vt1m2": (1, 2, SMALL), "vt2m2": (2, 2, SMALL),
           "vt3m2": (3, 2, SMALL), "vt0m1": (0, 1, SMALL)}
BOUND = "vt0m1"  # V^T unmasked with K masked: the interpreter check shows it turning NaN; more instructions per chunk
# than vt0m2 (probe/sass_cpu.md), so not timed on the GPU
TIMED = [kernel for kernel in KERNELS if kernel != BOUND]


def make_inputs(shape: str, device: str) -> dict:
    """As microbench.py fp8-decode builds them (seed 0); PAGE 16 on the CPU; then the NaN past each end."""
    batch, heads, kv_heads, lo, hi = SHAPES[shape]
    torch.manual_seed(0)
    page = 256 if device == "cuda" else 16
    width = -(-max(hi, 4096 if device == "cuda" else hi) // page)
    num_blocks = batch * width + 16
    k = torch.randn(num_blocks, page, kv_heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device=device)
    context_lens = torch.randint(lo, hi + 1, (batch,), dtype=torch.int32, device=device)
    block_tables = torch.randperm(num_blocks, device=device)[: batch * width].view(batch, width).int()
    k_scale, v_scale = k.abs().amax().item() / 200, v.abs().amax().item() / 100
    k8, v8 = quantize(k, k_scale), quantize(v, v_scale)
    poisoned = 0
    for i, n in enumerate(context_lens.tolist()):
        if n % page:
            last = block_tables[i, (n - 1) // page].item()
            for cache in (k, v):  # bf16: NaN too, for main's bf16 kernel
                cache[last, n % page:] = float("nan")
            for cache in (k8, v8):
                cache.view(torch.uint8)[last, n % page:] = 0x7F
            poisoned += page - n % page
    vt8 = vt_decode.transpose_v(v8)
    return dict(q=q, k=k, v=v, k8=k8, v8=v8, vt8=vt8, k_scale=k_scale, v_scale=v_scale, context_lens=context_lens,
                block_tables=block_tables, counters=torch.zeros(batch * kv_heads, dtype=torch.int32, device=device),
                kv_heads=kv_heads, heads=heads, page=page, poisoned=poisoned)


def reference(x) -> dict[int, torch.Tensor]:
    """float32 attention over the dequantized FP8 cache (main's layout) for every batch/16-th sequence."""
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


def call_of(kernel: str, x, setting=None):
    kwargs = dict(k_scale=x["k_scale"], v_scale=x["v_scale"])
    if setting is not None:
        kwargs.update(block_n=setting[0], num_warps=setting[1], num_stages=setting[2])
    args = (x["q"], x["k8"])
    rest = (x["block_tables"], x["context_lens"], HEAD_DIM ** -0.5, x["counters"])
    if kernel == "main-fp8":
        return lambda: main_decode.paged_decode_attention(*args, x["v8"], *rest, **kwargs)
    form, v_mask, _ = KERNELS[kernel]
    v = x["v8"] if form == 3 else x["vt8"]
    return lambda: vt_decode.paged_decode_attention_vt(*args, v, *rest, form=form, v_mask=v_mask, **kwargs)


class _Warmup:
    """Stands in for a module's jitted kernel so that its wrapper compiles instead of launching."""

    def __init__(self, jit):
        self.jit = jit

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit.warmup(*args, grid=grid, **kwargs)


def precompile(x) -> None:
    """Every (kernel, setting) compiled in parallel threads before anything is timed; a failure is left for
    the timed call to meet and report."""
    mode_cls = getattr(triton, "AsyncCompileMode", None)
    if mode_cls is None:
        print("  (no triton.AsyncCompileMode: compiling as the calls come)", flush=True)
        return
    t0 = time.time()
    patched = [(main_decode, "_decode_attention"), (vt_decode, "_decode_attention_vt")]
    real = [getattr(m, name) for m, name in patched]
    count = 0
    try:
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 8) as pool, mode_cls(pool, ignore_errors=True):
            for (m, name), jit in zip(patched, real):
                setattr(m, name, _Warmup(jit))
            for kernel, (_, _, grid) in KERNELS.items():
                for setting in grid:
                    count += 1
                    try:
                        call_of(kernel, x, setting)()
                    except Exception as error:  # noqa: BLE001
                        print(f"  precompile {kernel} {setting}: {type(error).__name__}: {str(error)[:100]}")
    except Exception as error:  # noqa: BLE001
        print(f"  precompile: {type(error).__name__}: {str(error)[:200]} (going on; the calls compile)")
    finally:
        for (m, name), jit in zip(patched, real):
            setattr(m, name, jit)
    print(f"  compiled {count} kernels in {time.time() - t0:.1f} s", flush=True)


def timed(call, repeat: int) -> float:
    from benchmarks.microbench import graph_time_us
    return statistics.median(graph_time_us([call], repeat=repeat) for _ in range(3))


def run_shape(shape: str, args, results: dict, device: str = "cuda", timer=None, grid=None) -> None:
    """One shape into results; device/timer/grid: --cpu-plumbing's stand-ins (cpu, wall clock, a 2-setting grid)."""
    timer = timer or timed
    x = make_inputs(shape, device)
    tokens = x["context_lens"].sum().item() * x["kv_heads"]
    fp8_bytes, bf16_bytes = tokens * HEAD_DIM * 2, tokens * HEAD_DIM * 2 * 2
    ref = reference(x)
    print(f"[{shape}] batch {SHAPES[shape][0]}, heads {SHAPES[shape][1]}/{SHAPES[shape][2]}, contexts "
          f"{SHAPES[shape][3]}-{SHAPES[shape][4]}: FP8 {fp8_bytes / 1e6:.0f} MB per call; {x['poisoned']} NaN "
          f"slots past the ends", flush=True)

    def bf16():
        return main_decode.paged_decode_attention(x["q"], x["k"], x["v"], x["block_tables"], x["context_lens"],
                                                  HEAD_DIM ** -0.5, x["counters"])

    bf16_out = bf16()
    bf16_us = timer(bf16, args.repeat)
    bf16_gbs = bf16_bytes / bf16_us / 1e3
    print(f"  bf16 (main, TUNED {main_decode.TUNED[False]}): {bf16_us:.1f} us, {bf16_gbs:.0f} GB/s (finite: "
          f"{bool(torch.isfinite(bf16_out).all())}); FP8 at that bandwidth: {fp8_bytes / bf16_gbs / 1e3:.1f} us",
          flush=True)
    s = results["shapes"][shape] = {"bf16_us": bf16_us, "bf16_gbs": bf16_gbs, "fp8_bytes": fp8_bytes, "kernels": {}}
    if device == "cuda":
        precompile(x)
    main_tuned = call_of("main-fp8", x)().clone()
    main_tuned_us = timer(call_of("main-fp8", x), args.repeat)
    s["main_tuned_us"] = main_tuned_us
    main_outs = {}  # main-fp8's output per setting (it runs first)
    for kernel in TIMED:
        t0 = time.time()
        rows = s["kernels"][kernel] = {}
        settings = grid or KERNELS[kernel][2]
        for setting in settings:
            call = call_of(kernel, x, setting)
            try:
                out = call().clone()
                if device == "cuda":
                    torch.cuda.synchronize()
                us = timer(call, args.repeat)
            except Exception as error:  # noqa: BLE001 -- past the shared memory, or a failed compile
                rows[str(setting)] = {"error": f"{type(error).__name__}: {str(error)[:120]}"}
                continue
            if kernel == "main-fp8":
                main_outs[setting] = out
            same = main_outs.get(setting)
            rows[str(setting)] = {"us": us, "gbs": fp8_bytes / us / 1e3, "err_fp32": error_vs(ref, out),
                                  "diff_main_tuned": (out.float() - main_tuned.float()).abs().max().item(),
                                  "diff_main_same": None if same is None else
                                  (out.float() - same.float()).abs().max().item(),
                                  "finite": bool(torch.isfinite(out).all())}
        ok = {k: r for k, r in rows.items() if "us" in r}
        best = min(ok.items(), key=lambda item: item[1]["us"]) if ok else None
        print(f"  {kernel}: {len(ok)}/{len(settings)} settings in {time.time() - t0:.1f} s"
              + (f"; best {best[0]} {best[1]['us']:.1f} us" if best else ""), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    main_errs = [r["err_fp32"] for r in s["kernels"]["main-fp8"].values() if "us" in r]
    s["err_bound"] = 1.1 * max(main_errs) if main_errs else float("nan")
    for rows in s["kernels"].values():
        for r in rows.values():
            if "us" in r:
                r["ok"] = r["finite"] and r["err_fp32"] <= s["err_bound"]


def fmt(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def table(results: dict) -> list[str]:
    lines = ["| shape | kernel | BLOCK_N,warps,stages | us | GB/s | of bf16 GB/s | vs main-fp8 TUNED | err vs fp32 | "
             "diff vs main-fp8 TUNED / same setting | ok |", "|---" * 10 + "|"]
    for shape, s in results["shapes"].items():
        lines.append(f"| {shape} | bf16 (main, TUNED {main_decode.TUNED[False]}) | | {s['bf16_us']:.1f} | "
                     f"{s['bf16_gbs']:.0f} | 100% | | | | |")
        for kernel, rows in s["kernels"].items():
            ok = sorted((r["us"], setting, r) for setting, r in rows.items() if "us" in r)
            picks = ok[:3]
            if all(p[1] != str((64, 2, 2)) for p in picks) and "us" in rows.get(str((64, 2, 2)), {}):
                picks.append((rows[str((64, 2, 2))]["us"], str((64, 2, 2)), rows[str((64, 2, 2))]))
            for us, setting, r in picks:
                tag = " (TUNED)" if kernel == "main-fp8" and setting == str(main_decode.TUNED[True]) else ""
                verdict = "yes" if r["ok"] else ("no (bound: NaN expected)" if kernel == BOUND else "NO")
                lines.append(f"| {shape} | {kernel} | {setting}{tag} | {us:.1f} | {r['gbs']:.0f} | "
                             f"{r['gbs'] / s['bf16_gbs']:.0%} | {s['main_tuned_us'] / us:.2f}x | {r['err_fp32']:.1e} | "
                             f"{r['diff_main_tuned']:.1e} / {fmt(r['diff_main_same'])} | {verdict} |")
            failed = [setting.replace(" ", "") for setting, r in rows.items() if "error" in r]
            if failed:
                lines.append(f"| {shape} | {kernel} | failed: {' '.join(failed)} | | | | | | | |")
            bad = [setting.replace(" ", "") for setting, r in rows.items()
                   if "us" in r and not r["ok"] and kernel != BOUND]
            if bad:
                lines.append(f"| {shape} | {kernel} | NOT ok: {' '.join(bad)} | | | | | | | |")
        lines.append(f"| {shape} | (ok: finite and err vs fp32 <= {s['err_bound']:.1e}, 1.1x main-fp8's worst) "
                     "| | | | | | | | |")
    return lines


def interpret_check() -> None:
    """CPU, TRITON_INTERPRET=1, the tiny shape (PAGE 16): (a) every kernel on the FP8 cache against the float32
    reference and main's kernel, at BLOCK_N 16 (a chunk per page) and 8 (two per page). The interpreter's e4m3 ->
    float16 cast turns NaN (0x7F) into 480, so (a) cannot see the stale NaNs; (b) runs the V^T kernels on float16
    copies of the same caches (every e4m3 value is exact in float16, NaN stays NaN; main's kernel takes no float16
    cache), against main's FP8 output: the unmasked bound vt0m1 must turn NaN there, the others not."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    x = make_inputs("tiny", "cpu")
    ref = reference(x)
    print(f"tiny: batch {SHAPES['tiny'][0]}, heads 16/8, contexts {x['context_lens'].tolist()}, page {x['page']}, "
          f"{x['poisoned']} NaN slots past the ends; reference on {len(ref)} sequences", flush=True)
    half = dict(x, k8=x["k8"].float().half(), v8=x["v8"].float().half(), vt8=x["vt8"].float().half())
    print(f"(b)'s float16 caches hold {int(half['vt8'].isnan().sum())} NaN in V^T", flush=True)
    for block_n in (16, 8):
        main_out = call_of("main-fp8", x, (block_n, 2, 2))()
        print(f"BLOCK_N {block_n}: main-fp8 err vs fp32 {error_vs(ref, main_out):.1e}, finite "
              f"{bool(torch.isfinite(main_out).all())}", flush=True)
        for part, cache in (("a fp8", x), ("b f16", half)):
            for kernel in KERNELS:
                if kernel == "main-fp8":
                    continue
                if part == "b f16" and block_n == 16 and kernel not in ("vt0m2", "vt0m1"):
                    continue  # the interpreter is slow; BLOCK_N 8 runs them all
                out = call_of(kernel, cache, (block_n, 2, 2))()
                finite = torch.isfinite(out)
                print(f"  ({part}) {kernel}: err vs fp32 {error_vs(ref, out):.1e}, max diff vs main "
                      f"{(out.float() - main_out.float()).abs().max().item():.1e}, bit-identical to main "
                      f"{torch.equal(out, main_out)}, finite {bool(finite.all())}"
                      + ("" if finite.all() else
                         f" (NaN in sequences {(~finite).any(-1).any(-1).nonzero().flatten().tolist()})"),
                      flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="anchor,0.6B")
    parser.add_argument("--repeat", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--interpret-check", action="store_true")
    parser.add_argument("--cpu-plumbing", action="store_true",
                        help="TRITON_INTERPRET=1: this script's GPU path on the tiny shape on the CPU (wall-clock "
                             "'times', BLOCK_N 16 and 8 only): its checks and table, not the kernels' speed")
    args = parser.parse_args()
    if args.interpret_check:
        return interpret_check()
    if args.cpu_plumbing:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

        def wall_us(call, repeat):
            start = time.perf_counter()
            call()
            return (time.perf_counter() - start) * 1e6

        results = {"device": "cpu (interpreter)", "triton": triton.__version__, "shapes": {}}
        run_shape("tiny", args, results, "cpu", wall_us, [(16, 2, 2), (8, 2, 2)])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write("\n".join(table(results)) + "\n")
        print("\n".join(table(results)))
        return
    assert torch.cuda.is_available(), "needs a CUDA GPU (or --interpret-check)"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "shapes": {}}
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    for shape in args.shapes.split(","):
        run_shape(shape, args, results)
        torch.cuda.empty_cache()  # the shape's caches (about 15 GB at the anchor shape)
        lines = table(results)
        with open(os.path.join(args.out, "results.md"), "w") as f:  # after each shape, in case of a timeout
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n".join(lines))
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
