"""Every Triton kernel compiled for an H100/H200 (sm_90), on any machine: Triton's CPU interpreter, which the
other CPU tests use, accepts some programs the real compiler rejects (e.g. a variable of two shapes in the two
branches of an if), so this catches them before a GPU run does. It runs in a fresh interpreter because the
test run has switched Triton to interpreting."""
import os
import subprocess
import sys

import pytest

COMPILE_ALL = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.layers.activation import _silu_and_mul_kernel
from nanovllm.layers.layernorm import _rms_norm_kernel
from nanovllm.quantization.fp8_activation import _quantize_activations_kernel
from nanovllm.quantization.fp8_fused import _rms_norm_quantize_kernel, _silu_and_mul_quantize_kernel
from nanovllm.attention.flash_attn_backend import (_dequantize_blocks_kernel, _store_kvcache_fp8_kernel,
                                                   _store_kvcache_kernel)
from nanovllm.layers.fused_moe import _grouped_matmul
from nanovllm.sampling.gumbel_max import _gumbel_max
from nanovllm.sampling.mask_kernel import _mask_rows
from nanovllm.sampling.floors import _chunk_maxima, _floors, _recount
from nanovllm.attention.paged_decode import _decode_attention
from nanovllm.attention.qk_norm_rope import _qk_norm_rope_kernel
from nanovllm.sampling.top_p_floor import ScratchLayout, _decide, _finish, _plan
from nanovllm.sampling.top_p_passes import _count, _gather, _scan

# argument types by name (other names are i32); constexprs as the engine passes them for Qwen3-0.6B
POINTERS = {"positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_mapping_ptr": "*i32", "block_tables_ptr": "*i32",
            "context_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32",
            "temperatures_ptr": "*fp32", "part_score_ptr": "*fp32", "part_index_ptr": "*i32", "weights_ptr": "*fp32",
            "sorted_pairs_ptr": "*i32", "tile_experts_ptr": "*i32", "floors_ptr": "*fp32", "row_seeds_ptr": "*i64",
            "values_ptr": "*fp32", "counts_ptr": "*i32", "recount_ptr": "*i32", "top_k_ptr": "*i64",
            "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "blocks_ptr": "*i64", "rows_ptr": "*i64",
            "scratch_ptr": "*fp32"}
# an FP8 KV cache: float8 e4m3 rows (its per-layer scales are float arguments)
FP8 = {"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"}
DECODE = dict(NUM_KV_HEADS=8, GROUP=2, BLOCK_H=16, HEAD_DIM=128, PAGE=256, BLOCK_N=64, MAX_SPLITS=16)
NORM_ROPE = dict(NUM_Q_HEADS=16, NUM_K_HEADS=8, BLOCK_Q=16, BLOCK_K=8, HALF=64)
# top-p's floor over Qwen3's 151,936 bf16 logits, as top_p_floors launches it
TOP_P = ScratchLayout(4096, 8192, 256)
TILES = dict(ROW=TOP_P.row, CHUNK=6144, TILE_R=256, TILE_C=8)
AT = dict(STATE_AT=TOP_P.state_at, PART_AT=TOP_P.part_at)
SEARCH = dict(NS=4096, STRIDE=40, MAX_CHUNKS=32, MIN_SAMPLE=16, SHIFT=16)
KERNELS = [
    (_qk_norm_rope_kernel, dict(NORM_ROPE, STORE_KV=True, FP8_KV=False, NORM=True), {}),
    (_qk_norm_rope_kernel, dict(NORM_ROPE, STORE_KV=False, FP8_KV=False, NORM=True), {}),
    (_qk_norm_rope_kernel, dict(NORM_ROPE, STORE_KV=True, FP8_KV=True, NORM=True), FP8),
    # Llama-3.2-1B (no q/k norm, head_dim 64)
    (_qk_norm_rope_kernel, dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, BLOCK_Q=32, BLOCK_K=8, HALF=32, STORE_KV=True,
                                FP8_KV=False, NORM=False), {}),
    (_decode_attention, dict(DECODE, FP8_KV=False), {}),
    (_decode_attention, dict(DECODE, FP8_KV=True), FP8),
    *((_gumbel_max, dict(CHUNK=4096, QUARTER=256, MAX_CHUNKS=64, HARDWARE_LOG=True, HAS_FLOOR=floor,
                         HAS_ROW_SEEDS=seeds), {}) for floor in (False, True) for seeds in (False, True)),
    # structured outputs' mask over float32 logits, rows by source row or in place
    *((_mask_rows, dict(INDEXED=indexed, BLOCK=4096), {"logits_ptr": "*fp32", "bitmask_ptr": "*i32",
                                                       "rows_ptr": "*i64", "sources_ptr": "*i64"})
      for indexed in (True, False)),
    (_chunk_maxima, dict(CHUNK=128, GROUP=16), {}),
    (_recount, dict(BLOCK=4096), {}),
    *((_floors, dict(KP=32, HAS_TOP_K=k, HAS_TOP_P=p, HAS_MIN_P=m), {})
      for k, p, m in ((True, True, True), (True, False, False), (False, False, True))),
    (_scan, dict(TILES, PART_AT=TOP_P.part_at, GROUPS_AT=TOP_P.groups_at, STRIDE=40), {}),
    (_plan, dict(AT, **SEARCH, ROW=TOP_P.row, CHUNK=6144, TILE_R=256, GROUPS_AT=TOP_P.groups_at), {}),
    *((_count, dict(TILES, **AT, HAS_HI=has_hi), {}) for has_hi in (False, True)),
    *((_decide, dict(TILES, **AT, **SEARCH, C=8192, FIRST=first, LAST=not first, MAX_ROUNDS=64), {})
      for first in (True, False)),
    (_gather, dict(TILES, **AT, CANDIDATES_AT=4096), {}),
    *((_finish, dict(ROW=TOP_P.row, CANDIDATES_AT=4096, STATE_AT=TOP_P.state_at, C=8192, SHIFT=shift), {})
      for shift in (16, 0)),  # float32 logits (after penalties) bisect 32-bit keys
    (_store_kvcache_kernel, dict(D=1024, BLOCK_D=1024), {}),
    (_store_kvcache_fp8_kernel, dict(D=1024, BLOCK_D=1024), FP8),
    (_dequantize_blocks_kernel, dict(BLOCK_ELEMENTS=262144, CHUNK=4096), FP8),
    (_silu_and_mul_kernel, dict(BLOCK=1024), {}),
    # RMSNorm: Qwen3-0.6B's hidden size in bf16, with and without the residual; Llama's q/k-norm-free heads never
    # reach it, but a 128-wide per-head norm (the torch backend's) does
    *((_rms_norm_kernel, dict(COLS=cols, BLOCK=cols, HAS_RESIDUAL=residual, BF16=True, FP16=False, OUT_BF16=True,
                              OUT_FP16=False), {}) for cols, residual in ((1024, False), (1024, True), (128, False))),
    # an FP8 linear's input: per 128 columns (block checkpoints), per row (quantization="fp8", Qwen3-8B's down_proj)
    *((_quantize_activations_kernel, dict(COLS=cols, GROUP=group, GROUPS=4, PER_ROW=per_row),
       {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}) for cols, group, per_row in ((4096, 128, False),
                                                                                  (12288, 1024, True))),
    # the ops before a block-scaled FP8 linear, writing its input (Qwen3-8B's hidden and intermediate sizes)
    *((_rms_norm_quantize_kernel, dict(COLS=4096, GROUPS=32, HAS_RESIDUAL=residual),
       {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}) for residual in (False, True)),
    (_silu_and_mul_quantize_kernel, dict(WIDTH=12288, GROUPS=4), {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}),
    # Qwen3-30B-A3B's experts: gate/up (rows of pair // top_k, no weights), down (weights applied), each tile shape
    *((_grouped_matmul, dict(A_ROW_DIVISOR=divisor, MUL_WEIGHTS=divisor == 1, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k), {})
      for divisor in (8, 1) for m, n, k in ((16, 64, 128), (32, 64, 128), (64, 128, 64), (128, 128, 64))),
]
failed = 0
for kernel, constexprs, overrides in KERNELS:
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in overrides:
            types[name] = overrides[name]
        elif name == "out_ptr" and kernel is _gumbel_max:
            types[name] = "*i64"
        elif name in POINTERS:
            types[name] = POINTERS[name]
        elif name.endswith("_ptr"):
            types[name] = "*bf16"
        else:
            floats = ("eps", "scale_log2", "value_scale", "k_inverse_scale", "v_inverse_scale", "k_scale", "v_scale")
            types[name] = "fp32" if name in floats else "i32"
    names = list(types)
    try:
        # as the runtime specialises them: tensors 16-byte aligned (without it the compiler neither vectorises
        # loads nor pipelines them, so the code checked here would not be the code that runs)
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if types[name].startswith("*")}
        source = ASTSource(kernel, types, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                           attrs=aligned)
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print("compiled", kernel.__name__, constexprs)
    except Exception as error:
        failed += 1
        print("FAILED", kernel.__name__, constexprs, type(error).__name__, error)
print("kernels:", len(KERNELS))
sys.exit(1 if failed else 0)
'''


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_ALL], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "compiled" in result.stdout and result.stdout.count("compiled ") == int(
        result.stdout.rsplit("kernels:", 1)[1]), result.stdout
