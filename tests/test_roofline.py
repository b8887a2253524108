"""benchmarks/roofline.py: the floor's parts from a shape's sizes and bench.py's lengths, checked by hand."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import roofline  # noqa: E402

from bench import WORKLOADS  # noqa: E402


def test_sizes_of_known_shapes():
    dense, _ = roofline.model_bytes("Qwen3-0.6B", None, fp8_weights=False, fp8_kv=False)
    assert dense.kv_bytes_per_token == 28 * 8 * 128 * 2 * 2 == 114_688
    # 28 x (q, k, v, o: 1024 x 128 x (2 x 16 + 2 x 8) + MLP: 3 x 1024 x 3072)
    assert dense.linear_params == 28 * (1024 * 128 * 48 + 3 * 1024 * 3072) and dense.router_params == 0
    moe, _ = roofline.model_bytes("Qwen3-30B-A3B", 24, fp8_weights=True, fp8_kv=True)
    assert (moe.moe_layers, moe.experts, moe.experts_per_token) == (24, 128, 8)
    assert moe.kv_bytes_per_token == 24 * 4 * 128 * 2
    assert moe.expected_experts(1) == pytest.approx(8)
    assert moe.expected_experts(256) == pytest.approx(128, abs=1e-3)
    assert moe.router_params == 24 * 128 * 2048 and moe.expert_params == 3 * 2048 * 768
    # FP8 halves attention's bytes, not the LM head's, the routers' or the experts' (bf16 in this engine)
    assert moe.step_weight_bytes(1) == pytest.approx(
        moe.linear_params + 2 * (moe.router_params + 24 * 8 * moe.expert_params + moe.head_params))


def test_kv_reads_of_the_default_workload():
    model, max_id = roofline.model_bytes("Qwen3-0.6B", None, fp8_weights=False, fp8_kv=False)
    parts = roofline.floor_seconds(model, WORKLOADS["default"], 1e12, 1e15, max_id)
    assert parts["tokens"] == 133_966  # bench.py's output tokens for this workload
    assert parts["decode KV reads"] * 1e12 == pytest.approx(13.85e12, rel=1e-3)  # bytes, at 1 TB/s
