"""FlashInfer against the engine's own kernels on one GPU, in parts that each end within about nine minutes:

    source .device/setup.sh && source .device-fi/setup.sh      # flash-attn, then FlashInfer
    python benchmarks/flashinfer_ab.py PART [PART ...] [--runs 2] [--routes 128:flashinfer] [--only NAME,...]

Parts (minutes: measured on one H100 where given as one figure, else estimated; the 8B parts after `checkpoints`,
everything after `jit`, which fills FlashInfer's cache for the rest):
  jit              FlashInfer's compile at first use, cold (an empty cache) then cached: the XQA modules the A/B
                   parts use (FP8 and bf16 caches at 2 query heads per KV head, FP8 at 4) and the routed matmuls of
                   Qwen3-8B's layers (~3-8: XQA's nvcc builds, not measured yet)
  tests-kernels    tests/test_gpu_flashinfer.py: XQA over 6k-14k contexts, the matmuls at 1-4096 rows (~2-4)
  tests-engine     tests/test_gpu_flashinfer_engine.py: long-context acceptance, routed FP8 checkpoint (~4-6)
  tests-gpu        tests/test_gpu.py on the flashinfer backend (the families included) (~3)
  tests-fp8kv      tests/test_gpu_fp8_kv.py on the flashinfer backend (~3)
  gemm-qwen3       benchmarks/microbench.py fp8-gemm, Qwen3-8B layers, 1-8192 rows, with the routing table (~3-6)
  gemm-llama       the same for Llama-3.1-8B (~3-6)
  kv-default       bench.py default workload (Qwen3-0.6B): bf16 and FP8 KV cache, triton against flashinfer (~5)
  kv-long          bench.py long-context workload: the same, FP8 on both backends and bf16 on triton (~6)
  checkpoints      writes the random Qwen3-8B, Qwen3-8B-FP8 and Llama-3.1-8B-FP8 checkpoints (~4)
  weights-default  Qwen3-8B on the default workload: bf16, FP8 checkpoint on cuBLAS, and with --routes (~4.5, with
                   FlashInfer's matmul compile)
  weights-prefill  the same on the prefill-heavy workload (~3.5)
  anchor           Llama-3.1-8B FP8 checkpoint + FP8 KV cache, --workload 1000-1000: triton + cuBLAS (today's),
                   flashinfer + --routes (~7, with FlashInfer's compile); anchor-parts: flashinfer alone, --routes
                   alone (~3.5)
  anchor-rows      Llama-3.1-8B bf16 and FP8 weights with a bf16 cache, for the README's rows beside it (~6;
                   writes the bf16 checkpoint on first use)

Every bench.py run prints its line as it finishes; a part ends with one table (warm tok/s, against the part's first
row, KV blocks, start-up seconds, the start-up's FlashInfer compile/load seconds as the engine logs them), also
written to $OUT/flashinfer_ab_<part>.md with each run's log beside it. FlashInfer's JIT cache goes to
FLASHINFER_WORKSPACE_BASE (set here to /tmp/nanovllm-flashinfer unless set), which lasts as long as the machine.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT") or "/tmp"
ROUTES_ENV = "NANOVLLM_FP8_GEMM_ROUTES"
BUILT_IN_ROUTES = "128:flashinfer"  # fp8_routes.MEASURED_ROUTES, in ROUTES_ENV's format (test_flashinfer_dispatch)
# bench.py with the engine's INFO log on, so the start-up's FlashInfer lines reach the log
BENCH = ("import logging, runpy, sys; logging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s'); "
         "sys.argv = ['bench.py'] + sys.argv[1:]; runpy.run_path('bench.py', run_name='__main__')")
KV = ["--kv-cache-dtype", "fp8"]
# part -> [(name, bench.py arguments, extra environment)], the first row the part's baseline; "ROUTES" stands for
# --routes
PARTS: dict[str, list[tuple[str, list[str], dict]]] = {
    "kv-default": [("bf16 KV, triton", ["--attention-backend", "triton"], {}),
                   ("FP8 KV, triton", ["--attention-backend", "triton", *KV], {}),
                   ("FP8 KV, flashinfer", ["--attention-backend", "flashinfer", *KV], {}),
                   ("bf16 KV, flashinfer", ["--attention-backend", "flashinfer"], {})],
    "kv-long": [("bf16 KV, triton", ["--workload", "long-context", "--attention-backend", "triton"], {}),
                ("FP8 KV, triton", ["--workload", "long-context", "--attention-backend", "triton", *KV], {}),
                ("FP8 KV, flashinfer", ["--workload", "long-context", "--attention-backend", "flashinfer", *KV], {})],
    "weights-default": [("bf16", ["--shape", "Qwen3-8B"], {}),
                        ("FP8 checkpoint, cuBLAS", ["--shape", "Qwen3-8B-FP8"], {ROUTES_ENV: ""}),
                        ("FP8 checkpoint, routes", ["--shape", "Qwen3-8B-FP8"], {ROUTES_ENV: "ROUTES"})],
    "weights-prefill": [("bf16", ["--shape", "Qwen3-8B", "--workload", "prefill-heavy"], {}),
                        ("FP8 checkpoint, cuBLAS", ["--shape", "Qwen3-8B-FP8", "--workload", "prefill-heavy"],
                         {ROUTES_ENV: ""}),
                        ("FP8 checkpoint, routes", ["--shape", "Qwen3-8B-FP8", "--workload", "prefill-heavy"],
                         {ROUTES_ENV: "ROUTES"})],
    "anchor": [("FP8 + FP8 KV, triton, cuBLAS", ["--shape", "Llama-3.1-8B-FP8", "--workload", "1000-1000", *KV,
                                                 "--attention-backend", "triton"], {ROUTES_ENV: ""}),
               ("FP8 + FP8 KV, flashinfer, routes", ["--shape", "Llama-3.1-8B-FP8", "--workload", "1000-1000", *KV,
                                                     "--attention-backend", "flashinfer"], {ROUTES_ENV: "ROUTES"})],
    "anchor-parts": [("FP8 + FP8 KV, flashinfer, cuBLAS", ["--shape", "Llama-3.1-8B-FP8", "--workload", "1000-1000",
                                                           *KV, "--attention-backend", "flashinfer"], {ROUTES_ENV: ""}),
                     ("FP8 + FP8 KV, triton, routes", ["--shape", "Llama-3.1-8B-FP8", "--workload", "1000-1000", *KV,
                                                       "--attention-backend", "triton"], {ROUTES_ENV: "ROUTES"})],
    "anchor-rows": [("bf16 + bf16 KV", ["--shape", "Llama-3.1-8B", "--workload", "1000-1000"], {}),
                    ("FP8 + bf16 KV, routes", ["--shape", "Llama-3.1-8B-FP8", "--workload", "1000-1000"],
                     {ROUTES_ENV: "ROUTES"})],
}
TESTS = {"tests-kernels": ["tests/test_gpu_flashinfer.py"], "tests-engine": ["tests/test_gpu_flashinfer_engine.py"],
         "tests-gpu": ["tests/test_gpu.py", "-k", "flashinfer"],
         "tests-fp8kv": ["tests/test_gpu_fp8_kv.py", "-k", "flashinfer"]}
GEMM = {"gemm-qwen3": "Qwen3-8B", "gemm-llama": "Llama-3.1-8B"}
CHECKPOINTS = ("Qwen3-8B", "Qwen3-8B-FP8", "Llama-3.1-8B-FP8")


def run(command: list[str], log: str, env: dict | None = None) -> tuple[int, str]:
    """Run a command from the repository root, its output to `log`; returns (exit status, output). A failure
    prints the output's last lines."""
    with open(log, "w") as f:
        rc = subprocess.run(command, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    with open(log) as f:
        text = f.read()
    if rc:
        print(f"exit status {rc}, {log}:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
    return rc, text


def last(pattern: str, text: str) -> str:
    found = re.findall(pattern, text)
    return found[-1] if found else "?"


def bench_part(part: str, args: argparse.Namespace) -> list[str]:
    rows, base, device = [], None, "?"
    for name, bench_args, env in PARTS[part]:
        if args.only and name not in args.only:
            continue
        env = {key: args.routes if value == "ROUTES" else value for key, value in env.items()}
        log = os.path.join(OUT, f"ab_{part}_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.log")
        rc, text = run([sys.executable, "-c", BENCH, "--runs", str(args.runs), *bench_args], log, env)
        warm, cold = last(r"Throughput: (\d+) tok/s\s+\(warm", text), last(r"Throughput: (\d+) tok/s\s+\(cold", text)
        blocks, startup = last(r"KV blocks: (\d+)", text), last(r"startup: ([\d.]+) s", text)
        attention, device = last(r"attention: (\w+)", text), last(r"device: ([^,]+)", text)
        compiles = [f"{what} attention {seconds} s" for what, seconds in
                    re.findall(r"(\w+) attention kernels compiled or loaded in ([\d.]+) s", text)]
        compiles += [f"matmuls {seconds} s" for seconds in
                     re.findall(r"FP8 matmuls routed to FlashInfer .*: kernels compiled or loaded in ([\d.]+) s", text)]
        base = base or (float(warm) if warm != "?" else None)
        ratio = f"{float(warm) / base:.2f}x" if warm != "?" and base else "?"
        routes = (env[ROUTES_ENV] or "cuBLAS") if ROUTES_ENV in env else ""
        row = (f"| {name} | {cold} | {warm} | {ratio} | {blocks} | {startup} | {attention} | {routes} | "
               f"{'; '.join(compiles)} |" + ("" if rc == 0 else f" failed (rc {rc}, {log})"))
        print(row, flush=True)
        rows.append(row)
    return [f"{part}, bench.py --runs {args.runs}, {device}, {time.strftime('%Y-%m-%d')}",
            "| run | cold tok/s | warm tok/s | warm vs first | KV blocks | startup s | attention | FP8 routes | "
            "FlashInfer compile/load at start-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows]


JIT_PROBE = r"""
import sys, time, torch
from torch import nn
from nanovllm.attention import KVCacheLayout
from nanovllm.attention.flashinfer_backend import FlashInferBackend
from nanovllm.quantization import fp8_linear as fp8
from nanovllm.quantization.fp8_flashinfer import prepare_flashinfer_gemm
from nanovllm.quantization.fp8_linear import quantize_blockwise
# the modules the A/B parts use: Qwen3-0.6B (16 query heads on 8 KV heads) with an FP8 and a bf16 cache, and the 8B
# models (32 on 8) with an FP8 cache
for dtype, heads in ((torch.float8_e4m3fn, 16), (torch.bfloat16, 16), (torch.float8_e4m3fn, 32)):
    backend = FlashInferBackend()
    backend.bind(8, 256, torch.device("cuda"))
    seconds = backend.warm_up(KVCacheLayout(1, 256, 8, 128, dtype), heads, torch.bfloat16)
    print(f"| XQA decode, {str(dtype).removeprefix('torch.')} cache, {heads // 8} query heads per KV head "
          f"| {seconds:.1f} |", flush=True)
model = nn.Module()
model.layers = nn.ModuleList(nn.Module() for _ in range(4))
for layer, (n, k) in zip(model.layers, [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]):
    w8, scale = quantize_blockwise(torch.randn(n, k, device="cuda") * 0.02)
    layer.fp8 = fp8.Fp8Weight(w8, scale, "block", fp8.block_kernel_scale(scale))
seconds = prepare_flashinfer_gemm(model, 16384)
print(f"| FP8 matmuls, Qwen3-8B's 4 layer shapes, routes {sys.argv[1]} | "
      f"{'not routed' if seconds is None else f'{seconds:.1f}'} |", flush=True)
"""


def jit_part(args: argparse.Namespace) -> list[str]:
    """The same start-up compiles twice in one FlashInfer cache: empty (cold), then filled (cached). The matmuls are
    DeepGEMM kernels compiled through NVRTC and kept in memory only, so they compile in every process."""
    shared = os.environ["FLASHINFER_WORKSPACE_BASE"]
    cold_base = shared if not os.path.isdir(os.path.join(shared, ".cache", "flashinfer")) else \
        tempfile.mkdtemp(prefix="flashinfer-cold-")
    lines = [f"FlashInfer compile/load at first use, seconds (cache in {cold_base})", "| kernel | cold | cached |",
             "| --- | --- | --- |"]
    results = []
    for label in ("cold", "cached"):
        rc, text = run([sys.executable, "-c", JIT_PROBE, args.routes], os.path.join(OUT, f"ab_jit_{label}.log"),
                       {"FLASHINFER_WORKSPACE_BASE": cold_base, ROUTES_ENV: args.routes})
        print(f"{label}: rc {rc}\n" + "\n".join(line for line in text.splitlines() if line.startswith("|")))
        results.append({m[0]: m[1] for m in re.findall(r"^\| (.+?) \| ([^|]+) \|$", text, re.M)})
    for kernel in results[0]:
        lines.append(f"| {kernel} | {results[0][kernel]} | {results[1].get(kernel, '?')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("parts", nargs="+", choices=["jit", *TESTS, *GEMM, *PARTS, "checkpoints"])
    parser.add_argument("--runs", type=int, default=2, help="bench.py --runs (warm: the median of runs 2..N)")
    parser.add_argument("--routes", default=BUILT_IN_ROUTES,
                        help=f"{ROUTES_ENV} for the rows marked routes (default: the engine's, {BUILT_IN_ROUTES})")
    parser.add_argument("--only", type=lambda s: s.split(","), default=None, help="run only these rows of a part")
    args = parser.parse_args()
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/nanovllm-flashinfer")
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.makedirs(OUT, exist_ok=True)
    for part in args.parts:
        start = time.perf_counter()
        print(f"\n== {part}", flush=True)
        if part == "jit":
            lines = jit_part(args)
        elif part in TESTS:
            rc, text = run([sys.executable, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:logging", "-m", "gpu",
                            *TESTS[part]], os.path.join(OUT, f"ab_{part}.log"))
            tables = [line for line in text.splitlines() if line.startswith(("|", "FAILED", "SKIPPED", "ERROR"))]
            lines = [*tables, f"{part}: {text.strip().splitlines()[-1] if text.strip() else '?'} (rc {rc})"]
        elif part in GEMM:
            rc, text = run([sys.executable, "benchmarks/microbench.py", "fp8-gemm", "--shape", GEMM[part], "--out",
                            os.path.join(OUT, part)], os.path.join(OUT, f"ab_{part}.log"))
            lines = [line for line in text.splitlines() if "| layer |" in line or line.startswith(
                ("device", "suggested", "| rows", "| ---")) or ("/" in line and line.count("|") == 4)] + [f"rc {rc}"]
        elif part == "checkpoints":
            sys.path.insert(0, ROOT)
            from nanovllm.utils.random_checkpoint import default_checkpoint

            lines = [f"{shape}: {default_checkpoint(shape)}" for shape in CHECKPOINTS]
        else:
            lines = bench_part(part, args)
        lines.append(f"({part}: {time.perf_counter() - start:.0f} s)")
        print("\n" + "\n".join(lines), flush=True)
        with open(os.path.join(OUT, f"flashinfer_ab_{part}.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
