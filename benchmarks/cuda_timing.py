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


def loop_time_us(fn: Callable[[], object], iters: int = 30) -> float:
    """Time per call of `fn` called back to back, launches included (after one untimed call): for calls that
    cannot be captured in a graph or whose host work is part of what is measured."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters
