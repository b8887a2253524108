import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.tp_workers import WorkerChannel
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.models.qwen3 import Qwen3ForCausalLM, head_dim
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import TensorParallelGroup


def model_dtype(hf_config) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class LaunchedStep:
    """A step whose sampled tokens may still be on their way back from the device."""

    seqs: list[Sequence]
    token_ids: torch.Tensor | None = None  # on the device, row i for seqs[i] (workers: broadcast from rank 0)
    host_token_ids: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprobs: list[dict[int, float]] | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)  # filled in by Scheduler.advance

    @classmethod
    def start_copy(cls, seqs: list[Sequence], token_ids: torch.Tensor, logprobs) -> "LaunchedStep":
        if not token_ids.is_cuda:
            return cls(seqs, token_ids, token_ids, None, logprobs)
        host = torch.empty(token_ids.shape, dtype=token_ids.dtype, device="cpu", pin_memory=True)
        host.copy_(token_ids, non_blocking=True)  # queued right behind the sampler, ahead of the next step
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, token_ids, host, ready, logprobs)

    def result(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_token_ids.tolist()


class ModelRunner:
    """One per rank: owns the model and the KV cache, turns scheduled sequences into tensors and tensors into tokens."""

    def __init__(self, config: Config, rank: int = 0, store: dist.Store | None = None, shm_name: str = "",
                 events: list[Event] | Event = (), reach: Callable[[str], None] = lambda stage: None) -> None:
        """`reach(stage)` marks the start-up stages of tensor-parallel ranks: workers announce each one and rank 0
        waits for all of them before the stage's collectives, so a worker that died is an error, not a hang."""
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.world_size = config.tensor_parallel_size
        self.rank = rank
        self.events = events
        self.use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", rank) if self.use_cuda else torch.device("cpu")
        self.enforce_eager = config.enforce_eager or not self.use_cuda
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        if self.use_cuda and self.block_size % 256 != 0:
            raise ValueError(f"kvcache_block_size={self.block_size}: flash-attn's paged KV needs a multiple of 256")
        if self.use_cuda:
            torch.cuda.set_device(self.device)
        self.tp = TensorParallelGroup.connect(store, rank, self.world_size, self.use_cuda)
        self.dtype = model_dtype(hf_config)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        torch.set_default_device(self.device)
        try:
            self.model = Qwen3ForCausalLM(hf_config, self.tp)
        finally:
            # restored before anything is compiled: torch.compile guards on the default dtype, so kernels
            # compiled under another one than generate() runs with would all be recompiled in the first run
            torch.set_default_device("cpu")
            torch.set_default_dtype(default_dtype)
        load_model(self.model, config.model)
        self.sampler = Sampler()
        self.last_step: LaunchedStep | None = None  # its tokens feed the next decode step on the device
        reach("loaded")
        self.warmup_model()
        reach("warmed up")
        self.allocate_kv_cache()
        reach("allocated")
        if not self.enforce_eager:
            self.capture_cudagraph()
        self.channel = None
        if self.world_size > 1:
            # workers attach to the segment only after rank 0 has created it
            if rank == 0:
                self.channel = WorkerChannel(shm_name, create=True)
                store.set(shm_name, "ready")
            else:
                store.wait([shm_name])
                self.channel = WorkerChannel(shm_name, create=False)
                self.loop()

    # --- tensor-parallel plumbing -------------------------------------------------------------------------
    def loop(self) -> None:
        while True:
            method, args = self.channel.receive(self.events)
            self.call(method, *args)
            if method == "exit":
                break

    def call(self, method: str, *args):
        if self.world_size > 1 and self.rank == 0:
            self.channel.send(self.events, method, *args)
        return getattr(self, method)(*args)

    def exit(self) -> None:
        self.last_step = None
        if self.channel is not None:
            self.channel.close()
        if not self.enforce_eager:
            del self.graphs, self.graph_pool
        if self.use_cuda:
            torch.cuda.synchronize()
        self.tp = None

    # --- startup -----------------------------------------------------------------------------------------
    def warmup_model(self) -> None:
        """Run the largest prefill once so the peak memory of activations is known before sizing the KV cache."""
        if not self.use_cuda:
            return
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seq_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs))
        seqs = [Sequence([0] * seq_len, block_size=self.block_size) for _ in range(num_seqs)]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        self.launch(seqs, True)  # on every rank; only rank 0 samples, so nothing is read back here
        # compiled layers specialise size 1 apart from other sizes: compile that case now, not in a timed run
        one = Sequence([0], block_size=self.block_size)
        one.num_scheduled_tokens = 1
        self.launch([one], True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """[K and V, layers, blocks, tokens per block, this rank's KV heads, head_dim]."""
        hf = self.config.hf_config
        return (2, hf.num_hidden_layers, num_blocks, self.block_size, hf.num_key_value_heads // self.world_size,
                head_dim(hf))

    def kv_block_bytes(self) -> int:
        return math.prod(self.kv_cache_shape(1)) * self.dtype.itemsize

    def num_blocks_from_memory(self, block_bytes: int) -> int:
        config = self.config
        if self.use_cuda:
            free, total = torch.cuda.mem_get_info()
            used = total - free
            stats = torch.cuda.memory_stats()
            peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
            budget = int(total * config.gpu_memory_utilization) - used - peak + current
            where = (f"GPU total {total / 2**30:.2f} GiB x gpu_memory_utilization {config.gpu_memory_utilization}"
                     f" - used {used / 2**30:.2f} GiB - activation peak {(peak - current) / 2**30:.2f} GiB")
        else:
            available = available_cpu_memory()
            budget = int(available * config.gpu_memory_utilization) // 4
            where = f"a quarter of available CPU memory {available / 2**30:.2f} GiB x {config.gpu_memory_utilization}"
            # more blocks than every sequence at max_model_len could use would only cost memory
            max_useful = config.max_num_seqs * -(-config.max_model_len // self.block_size)
            budget = min(budget, max_useful * block_bytes)
        num_blocks = budget // block_bytes
        if num_blocks <= 0:
            raise RuntimeError(f"KV cache budget of {budget / 2**20:.1f} MiB ({where}) holds no block of "
                               f"{block_bytes / 2**20:.1f} MiB; raise gpu_memory_utilization or lower "
                               f"kvcache_block_size/max_num_batched_tokens")
        return num_blocks

    def allocate_kv_cache(self) -> None:
        block_bytes = self.kv_block_bytes()
        if self.config.num_kvcache_blocks > 0:
            self.num_kvcache_blocks = self.config.num_kvcache_blocks
        else:
            self.num_kvcache_blocks = self.num_blocks_from_memory(block_bytes)
        # every rank must agree, or block ids would mean different slots
        n = self.tp.all_reduce(torch.tensor([self.num_kvcache_blocks], device=self.device), dist.ReduceOp.MIN)
        self.num_kvcache_blocks = int(n.item())
        self.kv_cache = torch.empty(self.kv_cache_shape(self.num_kvcache_blocks), dtype=self.dtype, device=self.device)
        # layers run one after another and the decode kernel leaves its counters at zero: one buffer serves all
        counters = torch.zeros(self.config.max_num_seqs * self.kv_cache.size(4), dtype=torch.int32, device=self.device)
        layers = [m for m in self.model.modules() if hasattr(m, "k_cache")]
        for i, module in enumerate(layers):
            module.k_cache, module.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
            module.split_counters = counters

    # --- per-step input preparation ----------------------------------------------------------------------
    def _pinned(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if self.use_cuda else tensor

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return self._pinned(array).to(self.device, non_blocking=True)

    @staticmethod
    def _fill_block_tables(table: np.ndarray, seqs: list[Sequence]) -> np.ndarray:
        # the rest stays at block 0: attention never reads past a sequence's length, so padding is never used
        for i, seq in enumerate(seqs):
            table[i, : len(seq.block_table)] = seq.block_table
        return table

    def _slots(self, seq: Sequence, start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(seq.block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids: list[int] = []
        positions, slots = [], []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        prefix_cached = False
        for seq in seqs:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.scheduled_token_ids)
            positions.append(np.arange(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            max_seqlen_q, max_seqlen_k = max(max_seqlen_q, end - start), max(max_seqlen_k, end)
            prefix_cached |= start > 0
            if seq.block_table:  # the warmup pass has no cache to write to
                slots.append(self._slots(seq, start, end))
        block_tables = None
        if prefix_cached:
            width = max(len(seq.block_table) for seq in seqs)
            block_tables = self._to_device(self._fill_block_tables(np.zeros((len(seqs), width), np.int32), seqs))
        set_context(
            is_prefill=True,
            cu_seqlens_q=self._to_device(np.array(cu_seqlens_q, dtype=np.int32)),
            cu_seqlens_k=self._to_device(np.array(cu_seqlens_k, dtype=np.int32)),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=self._to_device(np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)),
            block_tables=block_tables,
        )
        return (self._to_device(np.array(input_ids, dtype=np.int64)),
                self._to_device(np.concatenate(positions).astype(np.int64)))

    def decode_graph_size(self, batch: int) -> int | None:
        """The captured graph a decode batch of this size replays (its rows padded), or None: run eagerly."""
        if self.enforce_eager or batch > self.graph_bs[-1]:
            return None
        return next(x for x in self.graph_bs if x >= batch)

    def decode_inputs(self, buffer: torch.Tensor, rows: int) -> dict[str, torch.Tensor]:
        """Views of one flat int32 buffer, as the host fills it and the decode step (or its graph) reads it."""
        vectors = buffer[: 5 * rows].view(5, rows)
        return dict(input_ids=vectors[0], positions=vectors[1], slot_mapping=vectors[2], context_lens=vectors[3],
                    source=vectors[4], block_tables=buffer[5 * rows: (5 + self.max_blocks_per_seq) * rows]
                    .view(rows, self.max_blocks_per_seq))

    def prepare_decode(self, seqs: list[Sequence],
                       previous: "LaunchedStep | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One int32 host buffer, one copy: decode runs every few milliseconds, so per-tensor transfers add up.
        Under CUDA graphs the copy lands in the graphs' own input buffer, padded to the graph's size, so
        nothing else is launched before the replay.

        A token still PENDING is the previous step's sample, which never left the GPU: it is gathered there.
        """
        n, width = len(seqs), self.max_blocks_per_seq
        graph_bs = self.decode_graph_size(n)
        rows = graph_bs or n
        host = np.zeros((5 + width) * rows, dtype=np.int32)
        vectors = host[: 5 * rows].reshape(5, rows)  # the layout of decode_inputs
        context_lens = np.fromiter((seq.num_tokens for seq in seqs), np.int32, n)
        last_blocks = np.fromiter((seq.block_table[-1] for seq in seqs), np.int32, n)
        vectors[0, :n] = [seq.scheduled_token_ids[0] for seq in seqs]
        vectors[1, :n] = context_lens - 1  # the position of the token being fed
        vectors[2] = -1  # padding rows write no KV and (context 0) attend to nothing
        vectors[2, :n] = last_blocks * self.block_size + (context_lens - 1) % self.block_size
        vectors[3, :n] = context_lens
        vectors[4] = -1
        pending = np.flatnonzero(vectors[0, :n] == PENDING)
        if len(pending):
            rows_before = {seq.seq_id: i for i, seq in enumerate(previous.seqs)}
            vectors[4, pending] = [rows_before[seqs[i].seq_id] for i in pending]
        # full width every step, so a CUDA graph's block-table buffer never keeps a wider step's entries
        self._fill_block_tables(host[5 * rows:].reshape(rows, width), seqs)
        if graph_bs is None:
            device = self._to_device(host)
        else:
            device = self.graph_inputs[: host.size]
            device.copy_(self._pinned(host), non_blocking=True)
        inputs = self.decode_inputs(device, rows)
        input_ids = inputs["input_ids"]
        if len(pending):
            source = inputs["source"]
            torch.where(source >= 0, previous.token_ids[source.clamp(min=0)].int(), input_ids, out=input_ids)
        set_context(is_prefill=False, slot_mapping=inputs["slot_mapping"], context_lens=inputs["context_lens"],
                    block_tables=inputs["block_tables"])
        return input_ids[:n], inputs["positions"][:n]

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [seq.params for seq in seqs]
        as_tensor = lambda values, dtype: self._to_device(np.array(values, dtype=dtype))  # noqa: E731
        tensors = SamplingTensors(as_tensor([p.temperature for p in params], np.float32))
        if all(p.is_plain for p in params):  # the per-step common case: temperature only
            return tensors
        if any(p.top_k > 0 for p in params):
            tensors.top_k = as_tensor([max(p.top_k, 0) for p in params], np.int64)
        if any(p.top_p < 1.0 for p in params):
            tensors.top_p = as_tensor([p.top_p for p in params], np.float32)
        if any(p.min_p > 0.0 for p in params):
            tensors.min_p = as_tensor([p.min_p for p in params], np.float32)
        # the step's seed mixes in how many tokens the request has so far, so a replay after preemption matches
        tensors.seeds = [(i, (p.seed * 1_000_003 + seq.num_completion_tokens) % (1 << 63))
                         for i, (p, seq) in enumerate(zip(params, seqs)) if p.seed is not None and p.temperature]
        banned = [(i, t) for i, (p, seq) in enumerate(zip(params, seqs)) if seq.num_completion_tokens < p.min_tokens
                  for t in (*p.stop_token_ids, *self.config.eos_token_ids)]
        if banned:
            rows, ids = zip(*banned)
            tensors.banned = (as_tensor(rows, np.int64), as_tensor(ids, np.int64))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        tensors.num_logprobs = max(wanted) if wanted else None
        return tensors

    # --- forward -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        graph_bs = None if is_prefill else self.decode_graph_size(input_ids.size(0))
        if graph_bs is None:
            return self.model.compute_logits(self.model(input_ids, positions))
        self.graphs[graph_bs].replay()  # its inputs are in place: prepare_decode copied them there
        return self.model.compute_logits(self.graph_outputs[: input_ids.size(0)])

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool) -> LaunchedStep:
        """Queue one step on the device and return at once; the sampled tokens are read back later.

        A sequence may feed the previous step's token before the host has it (PENDING): every rank holds that
        step's tokens on the device, rank 0 from its sampler and the others from a broadcast, so no rank
        waits for the host between steps."""
        if is_prefill:
            input_ids, positions = self.prepare_prefill(seqs)
        else:
            input_ids, positions = self.prepare_decode(seqs, self.last_step)
        sampling = self.prepare_sampling(seqs) if self.rank == 0 else None
        try:
            logits = self.run_model(input_ids, positions, is_prefill)
            if self.rank == 0:
                output = self.sampler(logits, sampling)
                token_ids, logprobs = output.token_ids, output.logprobs
            else:
                token_ids, logprobs = torch.empty(len(seqs), dtype=torch.int64, device=self.device), None
            self.tp.broadcast_from_first(token_ids)
        finally:
            reset_context()
        if self.rank == 0:
            self.last_step = LaunchedStep.start_copy(seqs, token_ids, logprobs)
        else:
            self.last_step = LaunchedStep(seqs, token_ids)
        return self.last_step

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        hf = self.config.hf_config
        max_bs = min(self.config.max_num_seqs, 512)
        self.graph_inputs = torch.zeros((5 + self.max_blocks_per_seq) * max_bs, dtype=torch.int32, device=self.device)
        self.graph_outputs = torch.zeros(max_bs, hf.hidden_size, dtype=self.dtype, device=self.device)
        self.graph_bs = sorted({1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs})
        self.graph_bs = [bs for bs in self.graph_bs if bs <= max_bs]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        for bs in reversed(self.graph_bs):  # largest first, so smaller graphs fit in its pool
            graph = torch.cuda.CUDAGraph()
            inputs = self.decode_inputs(self.graph_inputs, bs)
            self.graph_inputs.zero_()  # every size views the buffer differently: start each from a clean one
            inputs["slot_mapping"].fill_(-1)  # capture runs the model: write no KV
            set_context(is_prefill=False, slot_mapping=inputs["slot_mapping"], context_lens=inputs["context_lens"],
                        block_tables=inputs["block_tables"])
            self.graph_outputs[:bs] = self.model(inputs["input_ids"], inputs["positions"])  # warm up kernels
            with torch.cuda.graph(graph, self.graph_pool):
                self.graph_outputs[:bs] = self.model(inputs["input_ids"], inputs["positions"])
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
            reset_context()
        # the LM head runs outside the graphs, and cuBLAS loads a kernel the first time it meets a batch size:
        # meet them all now rather than in the first run
        for bs in range(1, max_bs + 1):
            self.model.compute_logits(self.graph_outputs[:bs])
        torch.cuda.synchronize()
