"""Issue 59 probe: main's decode kernel (FP8 and bf16) and the V^T variants (probe/vt_decode.py, VT_FORM 0-3 x
V_MASK 0-2) compiled for sm_90 without a GPU, their SASS summarized (bc1f41c's sass59.py, the kernels swapped).

    python probe/sass59vt.py [--kernels main-fp8 main-bf16 vt0m2 vt1m1 ...] [--group 4 2]
                             [--settings 64,2,2 128,4,3 ... | all] [--dump DIR] [--jobs N]

Reports per setting: registers, shared memory, total SASS instructions, the hot loop's length (the longest loop
holding HMMA or HGMMA) and, inside it, HMMA / HGMMA / LDS.U8 / other LDS / LDSM / STS / LDGSTS (cp.async) / LDG /
F2FP / BAR / PRMT / LOP3 / local-memory (spill) counts; the resident CTAs per SM that registers and shared memory allow.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import warnings
from collections import Counter

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
warnings.filterwarnings("ignore")
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def compile_kernel(kind: str, group=4, block_n=64, warps=2, stages=2, kv_heads=8):
    """kind: main-fp8 / main-bf16 (nanovllm/attention/paged_decode.py) or vtFmM (probe/vt_decode.py, VT_FORM F,
    V_MASK M; vtF alone: V_MASK 2)."""
    from nanovllm.attention.paged_decode import _decode_attention
    from probe.vt_decode import _decode_attention_vt
    fp8 = kind != "main-bf16"
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = dict(q_ptr="*bf16", k_cache_ptr=kv, v_cache_ptr=kv, block_tables_ptr="*i32", context_lens_ptr="*i32",
               out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32", counters_ptr="*i32", scale_log2="fp32",
               value_scale="fp32", split_len="i32", num_splits="i32", q_stride="i32", out_stride="i32",
               bt_stride="i32", cache_block_stride="i32", cache_token_stride="i32", cache_head_stride="i32")
    const = dict(NUM_KV_HEADS=kv_heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=128,
                 PAGE=256, BLOCK_N=block_n, MAX_SPLITS=16)
    if kind.startswith("vt"):
        fn = _decode_attention_vt
        sig["vt_cache_ptr"] = sig.pop("v_cache_ptr")
        sig.update(vt_block_stride="i32", vt_head_stride="i32")
        const["VT_FORM"] = int(kind[2])
        const["V_MASK"] = int(kind[4]) if len(kind) > 3 else 2
    else:
        fn = _decode_attention
        const["FP8_KV"] = fp8
    names = fn.arg_names
    sig = {n: sig.get(n, "constexpr") for n in names}
    div16 = [n for n in names if n.endswith("_ptr") or n in (
        "split_len", "q_stride", "out_stride", "bt_stride", "cache_block_stride", "cache_token_stride",
        "cache_head_stride", "vt_block_stride", "vt_head_stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def sass_of(kernel) -> tuple[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    sass = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                           text=True).stdout
    os.unlink(f.name)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def parse(sass: str) -> list[tuple[int, str, str]]:
    out = []
    for line in sass.splitlines():
        m = INSTR.match(line)
        if m:
            text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())
            out.append((int(m.group(1), 16), text.split()[0], text))
    return out


def hot_loop(instrs):
    """The longest [target, branch] range of a backward BRA that holds an HMMA or HGMMA."""
    best = None
    for addr, op, text in instrs:
        if op == "BRA":
            m = re.search(r"0x([0-9a-f]+)", text)
            if m and int(m.group(1), 16) < addr:
                target = int(m.group(1), 16)
                body = [x for x in instrs if target <= x[0] <= addr]
                if any(o.startswith(("HMMA", "HGMMA")) for _, o, _ in body) and (best is None or len(body) > len(best)):
                    best = body
    return best or []


KEYS = ("HMMA", "HGMMA", "LDS.U8", "LDS", "LDSM", "STS", "LDGSTS", "LDG", "F2FP", "BAR", "PRMT", "LOP3", "spill")


def classify(op: str) -> str | None:
    if op.startswith("HMMA"):
        return "HMMA"
    if op.startswith("HGMMA"):
        return "HGMMA"
    if op.startswith("LDS.U8") or op.startswith("LDS.S8"):
        return "LDS.U8"
    if op.startswith("LDSM"):
        return "LDSM"
    if op.startswith("LDS"):
        return "LDS"
    if op.startswith("STS"):
        return "STS"
    if op.startswith("LDGSTS"):
        return "LDGSTS"
    if op.startswith("LDG"):
        return "LDG"
    if op.startswith("F2FP") or op.startswith("HADD2.F32") or op.startswith("F2F"):
        return "F2FP"
    if op.startswith("BAR"):
        return "BAR"
    if op.startswith("PRMT"):
        return "PRMT"
    if op.startswith("LOP3"):
        return "LOP3"
    if op.startswith("LDL") or op.startswith("STL"):
        return "spill"
    return None


def stats(kernel) -> dict:
    sass, regs = sass_of(kernel)
    instrs = parse(sass)
    loop = hot_loop(instrs)
    c = Counter(classify(op) for _, op, _ in loop)
    total = Counter(classify(op) for _, op, _ in instrs)
    return dict(regs=regs, shared=kernel.metadata.shared, total=len(instrs), loop=len(loop),
                **{k: c[k] for k in KEYS}, lds_u8_total=total["LDS.U8"], ldgsts_total=total["LDGSTS"],
                sass=sass)


def ctas_per_sm(regs: int, shared: int, warps: int) -> int:
    """Resident CTAs on one H100/H200 SM: 64K registers (a warp's taken in 256s), 228 KB of shared memory (1 KB
    reserved per CTA), 64 warps, 32 CTAs."""
    by_regs = 65536 // (warps * -(-regs * 32 // 256) * 256)
    return min(by_regs, 228 * 1024 // (shared + 1024), 64 // warps, 32)


def row(name, setting, s) -> str:
    n, w, _ = map(int, setting.split(","))
    return (f"| {name} | {setting} | {s['regs']} | {s['shared'] // 1024}K | {ctas_per_sm(s['regs'], s['shared'], w)} | "
            f"{s['total']} | {s['loop']} | {s['loop'] * w * 64 // n} | "
            + " | ".join(str(s[k]) for k in KEYS) + f" | {s['ldgsts_total']} |")


HEADER = ("| variant | N,w,s | regs | smem | CTA/SM | SASS | loop | warp-instr per 64 tokens | " + " | ".join(KEYS)
          + " | LDGSTS all |\n" + "|---" * (9 + len(KEYS)) + "|")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", nargs="+", default=["main-fp8", "vt0"])
    p.add_argument("--group", type=int, nargs="+", default=[4])
    p.add_argument("--settings", nargs="+", default=["64,2,2"],
                   help="BLOCK_N,warps,stages; 'all': the 18 of 32/64/128 x 2/4 x 1/2/3")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="compiles in parallel threads")
    p.add_argument("--dump", help="directory for .sass / .ttgir / .ptx of each compile")
    a = p.parse_args()
    if a.settings == ["all"]:
        a.settings = [f"{n},{w},{s}" for n in (32, 64, 128) for w in (2, 4) for s in (1, 2, 3)]
    jobs = [(kind, g, setting) for kind in a.kernels for g in a.group for setting in a.settings]

    def run(job):
        kind, g, setting = job
        n, w, s = map(int, setting.split(","))
        name = f"{kind} g{g}"
        try:
            k = compile_kernel(kind, group=g, block_n=n, warps=w, stages=s)
            st = stats(k)
        except Exception as e:  # noqa: BLE001
            return f"| {name} | {setting} | failed: {type(e).__name__}: {str(e)[:120]} |"
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            base = os.path.join(a.dump, name.replace(" ", "_") + "_" + setting.replace(",", "-"))
            open(base + ".sass", "w").write(st["sass"])
            open(base + ".ttgir", "w").write(k.asm["ttgir"])
            open(base + ".ptx", "w").write(k.asm["ptx"])
        return row(name, setting, st)

    print(HEADER, flush=True)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(a.jobs) as pool:
        for line in pool.map(run, jobs):
            print(line, flush=True)


if __name__ == "__main__":
    main()
