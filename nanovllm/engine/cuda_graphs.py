"""Decode steps replayed as CUDA graphs: one captured graph per batch size, all reading one input buffer."""
from collections.abc import Callable

import torch
from torch import nn

from nanovllm.engine.model_inputs import decode_views
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.parallel_compile import KernelCompiles


class CUDAGraphs:
    """Graphs of the model's decode forward for batch sizes 1, 2, 4, 8, 16, 32, ... up to max_num_seqs (at most
    512). A batch replays the smallest graph that holds it, its rows padded (padding writes no KV and attends to
    nothing). Graphs read their inputs from `input_buffer` (see model_inputs.decode_views) and write `outputs`.
    `lap(phase)` is called as each phase of the capture ends (engine/startup.py)."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, lap: Callable[[str], None],
                 compiles: KernelCompiles) -> None:
        max_bs = min(max_num_seqs, 512)
        self.width = max_blocks_per_seq
        self.sizes = [bs for bs in sorted({1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}) if bs <= max_bs]
        self.input_buffer = torch.zeros((5 + self.width) * max_bs, dtype=torch.int32, device=device)
        self.outputs = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture_stream = torch.cuda.Stream(device)
        self.compiled = self._capture(model, lap, compiles)

    def size_for(self, batch: int) -> int | None:
        """The captured graph a decode batch of this size replays, or None: run eagerly."""
        if batch > self.sizes[-1]:
            return None
        return next(x for x in self.sizes if x >= batch)

    def replay(self, graph_size: int, batch: int) -> torch.Tensor:
        """The hidden states of the first `batch` rows; the inputs must already be in input_buffer."""
        self.graphs[graph_size].replay()
        return self.outputs[:batch]

    def _set_inputs(self, bs: int) -> dict[str, torch.Tensor]:
        inputs = decode_views(self.input_buffer, bs, self.width)
        self.input_buffer.zero_()  # every size views the buffer differently: start each from a clean one
        inputs["slot_mapping"].fill_(-1)  # capture runs the model: write no KV
        set_context(is_prefill=False, slot_mapping=inputs["slot_mapping"], context_lens=inputs["context_lens"],
                    block_tables=inputs["block_tables"])
        return inputs

    @torch.inference_mode()
    def _capture(self, model: nn.Module, lap: Callable[[str], None], compiles: KernelCompiles) -> str:
        """Returns the compiles' line for the log."""
        # the sizes whose views of the input buffer differ in what Triton specialises on (a pointer's alignment,
        # an integer of 1 or a multiple of 16): the largest, and those of up to 16 rows. Each runs once dry, then
        # for real before its capture. The sizes in between are multiples of 16: where the largest is not one,
        # they load their variants (compiled by then) inside their captures, which captures allow
        eager_sizes = [bs for bs in reversed(self.sizes) if bs <= 16 or bs == self.sizes[-1]]

        def eager_passes() -> None:
            for bs in eager_sizes:
                inputs = self._set_inputs(bs)
                self.outputs[:bs] = model(inputs["input_ids"], inputs["positions"])
                reset_context()

        compiles.dry_run(eager_passes)
        compiled = compiles.wait()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its pool
            graph = torch.cuda.CUDAGraph()
            inputs = self._set_inputs(bs)
            if bs in eager_sizes:
                self.outputs[:bs] = model(inputs["input_ids"], inputs["positions"])
            if bs == self.sizes[-1]:  # the first real decode forward, after every start-up compile
                torch.cuda.synchronize()
                lap("decode warmup and compile")
            # torch.cuda.graph would empty the allocator's cache before every capture (cudaFree, then the next size's
            # warmup cudaMalloc again): the cache is kept, as vLLM keeps it, so each size reuses the last one's memory
            torch.cuda.synchronize()  # as torch.cuda.graph does: nothing of any stream (NCCL's too) still running
            self.capture_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.capture_stream):
                graph.capture_begin(self.pool)
                try:
                    self.outputs[:bs] = model(inputs["input_ids"], inputs["positions"])
                finally:
                    graph.capture_end()
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
            reset_context()
        lap(f"CUDA graph capture ({len(self.sizes)} sizes)")
        # the LM head runs outside the graphs, and cuBLAS loads a kernel the first time it meets a batch size:
        # meet them all now rather than in the first run
        for bs in range(1, self.sizes[-1] + 1):
            model.compute_logits(self.outputs[:bs])
        torch.cuda.synchronize()
        lap("LM head warmup")
        return compiled
