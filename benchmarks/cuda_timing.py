"""Timing for the microbenchmarks in this folder (imported as `cuda_timing` by the scripts next to it)."""
from collections.abc import Callable

import torch


def graph_time_us(calls: list[Callable[[], object]], repeat: int = 1) -> float:
    """Device time per call of `calls` (run in order, `repeat` times), replayed from one CUDA graph as the
    engine replays decode steps, so no Python launch cost is in the figure."""
    for call in calls:  # compile and warm up outside the capture
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeat * len(calls))
