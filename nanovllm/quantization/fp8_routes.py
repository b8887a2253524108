"""Which matmul multiplies a block-scaled FP8 linear layer, per number of rows (tokens) in the batch.

Two kernels read the published checkpoints' layout (e4m3 weights with 128x128 scales, activations quantized by
the engine in 1x128 groups, the same codes for both):
- "cublas": torch's F.scaled_mm, BlockWise1x128 x BlockWise128x128 (fp8_linear.py);
- "flashinfer": FlashInfer's fp8_blockscale_gemm_sm90 (TensorRT-LLM's DeepGEMM kernels, operands swapped below
  32 rows), Hopper only, for layers with out % 64 == 0 and in % 128 == 0 (quantization/fp8_flashinfer.py).
Weights with one scale per output channel (row-wise) have one kernel, torch._scaled_mm; a block-scaled weight
cannot take it without a second rounding, so it is measured beside these (`benchmarks/microbench.py fp8-gemm`) but
not routed to.
"""
import os

CUBLAS, FLASHINFER = "cublas", "flashinfer"
KERNELS = (CUBLAS, FLASHINFER)
Routes = tuple[tuple[int, str], ...]

# (max_rows, kernel) by increasing max_rows: a batch of n rows runs the kernel of the first entry with
# n <= max_rows, and cuBLAS past the last one. Source: `benchmarks/flashinfer_ab.py gemm-qwen3 gemm-llama`
# (`microbench.py fp8-gemm` on Qwen3-8B's and Llama-3.1-8B's layers, errors equal to cuBLAS's at every row count):
# FlashInfer is the faster kernel for both models at every measured count up to 128 rows (at 192 it is 1.3x
# slower). The engine has run this table end to end against cuBLAS (tests/test_gpu_flashinfer_engine.py: decode
# steps of 1-64 rows, both kernels FlashInfer switches between at 32, the same tokens' scores as cuBLAS).
MEASURED_ROUTES: Routes = ((128, FLASHINFER),)
# Set, it replaces MEASURED_ROUTES for the process: "31:flashinfer" or "31:flashinfer,64:cublas,256:flashinfer"
ROUTES_ENV = "NANOVLLM_FP8_GEMM_ROUTES"


def parse_routes(text: str) -> Routes:
    """"max_rows:kernel,..." (ROUTES_ENV's format) as routes, checked."""
    routes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        rows, _, kernel = item.partition(":")
        if not rows.strip().isdigit() or kernel.strip() not in KERNELS:
            raise ValueError(f"{ROUTES_ENV}={text!r}: {item!r} is not max_rows:kernel with a positive max_rows "
                             f"and a kernel of {KERNELS}")
        routes.append((int(rows), kernel.strip()))
    return check_routes(tuple(routes))


def check_routes(routes: Routes) -> Routes:
    bounds = [rows for rows, _ in routes]
    if any(rows < 1 for rows in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(f"FP8 matmul routes {routes}: max_rows must be positive and increasing")
    if any(kernel not in KERNELS for _, kernel in routes):
        raise ValueError(f"FP8 matmul routes {routes}: each kernel must be one of {KERNELS}")
    return routes


def active_routes() -> Routes:
    """The routes this process uses: ROUTES_ENV where set, else MEASURED_ROUTES."""
    text = os.environ.get(ROUTES_ENV)
    return parse_routes(text) if text is not None else check_routes(MEASURED_ROUTES)


def describe_routes(routes: Routes | None = None) -> str:
    routes = active_routes() if routes is None else routes
    parts, low = [], 1
    for rows, kernel in routes:
        parts.append(f"{low}-{rows} rows: {kernel}")
        low = rows + 1
    return ", ".join(parts + [f"{low}+ rows: {CUBLAS}"])


def kernel_for(rows: int, routes: Routes) -> str:
    """The kernel a batch of `rows` rows runs."""
    for max_rows, kernel in routes:
        if rows <= max_rows:
            return kernel
    return CUBLAS


def routed_rows(routes: Routes, kernel: str, max_rows: int) -> list[int]:
    """Every row count from 1 to max_rows that `routes` sends to `kernel`."""
    return [rows for rows in range(1, max_rows + 1) if kernel_for(rows, routes) == kernel]
