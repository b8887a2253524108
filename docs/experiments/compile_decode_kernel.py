"""Compile the decode-attention kernel for sm_90 on any machine and report what the compiler made of its loop.

    PYTHONPATH=. python docs/experiments/compile_decode_kernel.py [--warps 4] [--stages 2 3 4] [--block-n 64]

Tensors are marked 16-byte aligned, as the runtime does (without that the compiler neither vectorises nor
pipelines the loads). Prints, per pipeline depth: shared memory, registers per thread (from cuobjdump), how many
K/V buffers the loop got and how many cp.async instructions there are. Session 5 (docs/PERFORMANCE.md) found one
buffer at every depth for the kernel as committed: the page-table load in the loop keeps the K/V loads from
being multi-buffered.
"""
import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanovllm.layers.paged_decode import _decode_attention

POINTERS = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "counters_ptr": "*i32"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--block-n", type=int, default=64)
    args = parser.parse_args()
    constexprs = dict(NUM_KV_HEADS=8, GROUP=2, BLOCK_H=16, HEAD_DIM=128, PAGE=256, BLOCK_N=args.block_n,
                      MAX_SPLITS=4)
    types = {}
    for name in _decode_attention.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = POINTERS.get(name, "*bf16")
        else:
            types[name] = "fp32" if name == "scale_log2" else "i32"
    names = list(types)
    # pointers and strides 16-aligned: what the runtime's specialisation passes for these arguments
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if types[name].startswith("*") or name.endswith("_stride")}
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for stages in args.stages:
        source = ASTSource(_decode_attention, types, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                           attrs=aligned)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=args.warps, num_stages=stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True,
                                   text=True).stdout
        registers = re.search(r"REG:(\d+)", usage)
        buffers = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x128xbf16", kernel.asm["ttgir"])
        print(f"num_stages={stages}: shared {kernel.metadata.shared} B, registers "
              f"{registers.group(1) if registers else '?'}, K/V buffers {buffers}, "
              f"cp.async {len(re.findall(r'cp[.]async[.]', kernel.asm['ptx']))}")


if __name__ == "__main__":
    main()
