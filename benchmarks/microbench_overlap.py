"""Would two half-batches on two streams hide the decode matmuls behind attention? The decoder stack alone.

    python benchmarks/microbench_overlap.py [--batch 256 --min-context 200 --max-context 1100]

Decode attention is bound by HBM bandwidth while the matmuls are bound by a fixed cost per kernel (about 5-8 us
whatever the batch; docs/PERFORMANCE.md), so one half-batch's matmuls might run beside the other half's
attention. This captures the Qwen3-0.6B-shaped decoder stack (random weights, no LM head) three ways and times
each replay: the whole batch, the two halves one after the other, and the two halves on two streams joined in
one graph. Only if the last is clearly faster than the first is the split worth building into the engine.
"""
import argparse

import torch
from cuda_timing import graph_time_us
from transformers import Qwen3Config

from nanovllm.models.qwen3 import Qwen3ForCausalLM
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.random_checkpoint import qwen3_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--min-context", type=int, default=200)
    parser.add_argument("--max-context", type=int, default=1100)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = Qwen3Config(**qwen3_config("Qwen3-0.6B"))
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cuda")
    model = Qwen3ForCausalLM(config)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    torch.set_default_device("cpu")
    torch.set_default_dtype(torch.float32)

    page, n, kv_heads, head_dim = 256, args.batch, config.num_key_value_heads, config.head_dim
    contexts = torch.randint(args.min_context, args.max_context + 1, (n,), dtype=torch.int32)
    width = -(-args.max_context // page)
    num_blocks = n * width
    layers = [m for m in model.modules() if hasattr(m, "k_cache")]
    cache = torch.randn(2, len(layers), num_blocks, page, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    counters = [torch.zeros(n * kv_heads, dtype=torch.int32, device="cuda") for _ in range(2)]
    tables = torch.randperm(num_blocks, device="cuda")[: n * width].view(n, width).int()
    contexts = contexts.cuda()
    positions = (contexts - 1).long()
    slots = (tables[torch.arange(n, device="cuda"), positions // page].long() * page + positions % page).int()
    input_ids = torch.randint(0, 10000, (n,), device="cuda")
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = cache[0, i], cache[1, i]

    def forward(rows: slice, half: int):
        """The decoder stack for `rows`, with its own split counters (two halves may run at once)."""
        for layer in layers:
            layer.split_counters = counters[half]
        set_context(is_prefill=False, slot_mapping=slots[rows], context_lens=contexts[rows],
                    block_tables=tables[rows])
        out = model(input_ids[rows], positions[rows])
        reset_context()
        return out

    whole, first, second = slice(0, n), slice(0, n // 2), slice(n // 2, n)
    with torch.inference_mode():
        for rows, half in ((whole, 0), (first, 0), (second, 1)):  # compile outside the captures
            forward(rows, half)
        torch.cuda.synchronize()
        sequential_us = graph_time_us([lambda: forward(whole, 0)], repeat=3)
        halves_us = graph_time_us([lambda: (forward(first, 0), forward(second, 1))], repeat=3)

        def two_streams():
            main_stream = torch.cuda.current_stream()
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
            for stream, (rows, half) in zip(streams, ((first, 0), (second, 1))):
                stream.wait_stream(main_stream)
                with torch.cuda.stream(stream):
                    forward(rows, half)
            for stream in streams:
                main_stream.wait_stream(stream)

        overlap_us = graph_time_us([two_streams], repeat=3)
    kv_bytes = contexts.sum().item() * kv_heads * head_dim * 2 * 2 * len(layers)
    print(f"batch {n}, contexts {args.min_context}-{args.max_context}, KV read {kv_bytes / 1e9:.2f} GB per step")
    print("| decoder stack, one decode step | us | KV TB/s |")
    print("| --- | --- | --- |")
    for name, us in (("whole batch", sequential_us), ("two halves, one stream", halves_us),
                     ("two halves, two streams", overlap_us)):
        print(f"| {name} | {us:.0f} | {kv_bytes / us / 1e6:.2f} |")


if __name__ == "__main__":
    main()
