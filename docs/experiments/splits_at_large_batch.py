"""Decode attention at 1, 2, 4 and 8 context slices for large batches: what the grid's empty programs cost.

The script that ran on an H200 (2026-11-22, at fc2f1d7's tree; imports and one line re-laid out for the
linter) for docs/PERFORMANCE.md, session 5, "Empty programs":
`PYTHONPATH=.:tests python docs/experiments/splits_at_large_batch.py`.
"""
import functools
import sys

import torch

sys.path.insert(0, "tests")
from cuda_timing import graph_time_us  # noqa: E402

from nanovllm.layers.paged_decode import paged_decode_attention  # noqa: E402

torch.manual_seed(0)
for batch, lo, hi in ((256, 200, 1100), (256, 400, 1500), (128, 600, 1500)):
    page, hd, width, kvh = 256, 128, 16, 8
    nb = batch * width + 100
    k = torch.randn(nb, page, kvh, hd, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    q = torch.randn(batch, 16, hd, dtype=torch.bfloat16, device="cuda")
    cl = torch.randint(lo, hi + 1, (batch,), dtype=torch.int32, device="cuda")
    bt = torch.randperm(nb, device="cuda")[: batch * width].view(batch, width).int()
    gb = cl.sum().item() * kvh * hd * 4 / 1e9
    cnt = torch.zeros(batch * kvh, dtype=torch.int32, device="cuda")
    for splits in (1, 2, 4, 8):
        f = functools.partial(paged_decode_attention, q, k, v, bt, cl, hd ** -0.5, cnt, max_splits=splits)
        us = graph_time_us([f], repeat=50)
        print(f"batch {batch} ctx {lo}-{hi} splits {splits}: {us:.1f} us {gb / us * 1e6:.0f} GB/s")
