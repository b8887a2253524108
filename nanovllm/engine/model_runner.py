import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from nanovllm.attention import KVCacheLayout, make_attention_backend
from nanovllm.config import Config
from nanovllm.engine.cuda_graphs import CUDAGraphs
from nanovllm.engine.first_requests import first_request_settings, prefill_sequence, sample_decode_steps
from nanovllm.engine.kv_budget import blocks_that_fit
from nanovllm.engine.model_inputs import InputBuilder
from nanovllm.engine.prompt_logprobs import score_prompts
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.startup import StartupTimes
from nanovllm.engine.step import Step
from nanovllm.layers.attention import Attention
from nanovllm.models import model_class
from nanovllm.models.decoder import head_dim
from nanovllm.quantization import (
    checkpoint_kv_scales,
    describe_routes,
    finish_fp8,
    is_kv_scale,
    kv_cache_dtype,
    measured_kv_scales,
    prepare_flashinfer_gemm,
    prepare_fp8,
    quantization_settings,
)
from nanovllm.sampling.sampler import Sampler, SamplingTensors
from nanovllm.utils.context import reset_context
from nanovllm.utils.device import available_cpu_memory, cap_cpu_threads
from nanovllm.utils.loader import load_model
from nanovllm.utils.parallel import TensorParallelGroup
from nanovllm.utils.parallel_compile import KernelCompiles

logger = logging.getLogger(__name__)


class ModelRunner:
    """One per rank: owns the model and the KV cache, turns a Step's sequences into tensors and tensors into tokens.

    Rank 0 samples; tensor-parallel ranks 1..N-1 run the same calls in worker processes (engine/tp_workers.py)."""

    def __init__(self, config: Config, rank: int = 0, store: dist.Store | None = None,
                 reach: Callable[[str], None] = lambda stage: None, startup: StartupTimes | None = None) -> None:
        """`reach(stage)` marks the start-up stages of tensor-parallel ranks: workers announce each one and rank 0
        waits for all of them before the stage's collectives, so a worker that died is an error, not a hang.
        `startup` (rank 0's engine) gets a lap per phase."""
        lap = startup.lap if startup is not None else lambda phase: None
        self.config = config
        hf_config = config.hf_config
        self.block_size = config.kvcache_block_size
        self.rank = rank
        self.use_cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", rank) if self.use_cuda else torch.device("cpu")
        self.backend = make_attention_backend(config.attention_backend, self.use_cuda, config.kv_cache_dtype != "auto")
        if rank == 0:
            logger.info("attention backend: %s (%s)", self.backend.name, "attention_backend" if
                        config.attention_backend else "the default for this device and KV cache dtype")
        if self.use_cuda:
            torch.cuda.set_device(self.device)
        else:
            threads = cap_cpu_threads(config.tensor_parallel_size)
            logger.info("CPU: %d torch thread(s) (the free cores; OMP_NUM_THREADS sets another number)", threads)
        self.tp = TensorParallelGroup.connect(store, rank, config.tensor_parallel_size, self.use_cuda)
        if self.use_cuda:
            lap("CUDA init")
        self.dtype = config.dtype  # the engine option, resolved by Config ("auto": the checkpoint's)
        self.fp8 = quantization_settings(config.quantization, hf_config)  # None: weights in the model dtype
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        torch.set_default_device(self.device)
        try:
            self.model = model_class(hf_config)(hf_config, self.tp, self.backend)
            if self.fp8 is not None and self.fp8.checkpoint:
                prepare_fp8(self.model, self.fp8)  # e4m3 weights and their scales, as the checkpoint has them
        finally:
            # restored before anything is compiled: torch.compile guards on the default dtype, so kernels
            # compiled under another one than generate() runs with would all be recompiled in the first run
            torch.set_default_device("cpu")
            torch.set_default_dtype(default_dtype)
        checkpoint_scales = load_model(self.model, config.model, is_kv_scale)
        self.fp8_summary = None
        if self.fp8 is not None:
            # the KV cache is sized from the memory left after this, so it gets whatever FP8 saves
            self.fp8_summary = finish_fp8(self.model, self.fp8, self.dtype)
            if rank == 0:
                logger.info("FP8 weights: %s", self.fp8_summary.describe())
            # FlashInfer's matmuls compile per shape at first use: now, before any timed or captured pass
            seconds = prepare_flashinfer_gemm(self.model, max(config.max_num_batched_tokens, config.max_num_seqs))
            if seconds is not None and rank == 0:
                logger.info("FP8 matmuls routed to FlashInfer below some batch sizes (%s): kernels compiled or "
                            "loaded in %.1f s", describe_routes(), seconds)
        self.sampler = Sampler(config.eos_token_ids, self.device, max_rows=config.max_num_seqs)
        self.kv_layout = KVCacheLayout(hf_config.num_hidden_layers, self.block_size,
                                       hf_config.num_key_value_heads // self.tp.size, head_dim(hf_config),
                                       kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device))
        self.inputs = InputBuilder(self.block_size, -(-config.max_model_len // self.block_size), self.device,
                                   self.kv_layout.quantized)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # an FP8 cache's (key, value) scales per layer: the checkpoint's, or measured by the start-up pass
        self.kv_scales = None
        if self.kv_layout.quantized:
            self.kv_scales = checkpoint_kv_scales(checkpoint_scales, len(self.attention_layers))
        measure = self.kv_layout.quantized and self.kv_scales is None
        reach("loaded")
        lap("model and weights")
        # Triton kernels met by start-up's passes compile side by side while start-up goes on (until the capture)
        compiles = KernelCompiles(self.device, self.tp.size) if self.use_cuda else None
        if self.use_cuda or measure:
            self.warmup_model(compiles, measure)
        if measure:
            amax = torch.stack([layer.kv_amax for layer in self.attention_layers]).tolist()
            for layer in self.attention_layers:
                layer.kv_amax = None
            self.kv_scales = measured_kv_scales(amax)
        if self.kv_scales is not None and rank == 0:
            logger.info("FP8 KV cache scales %s: keys %.3g-%.3g, values %.3g-%.3g",
                        "measured at start-up" if measure else "from the checkpoint",
                        *(f(scale[i] for scale in self.kv_scales) for i in (0, 1) for f in (min, max)))
        reach("warmed up")
        lap("warmup")
        self.allocate_kv_cache()
        seconds = self.backend.warm_up(self.kv_layout, hf_config.num_attention_heads // self.tp.size, self.dtype)
        if seconds and rank == 0:
            logger.info("%s attention kernels compiled or loaded in %.1f s", self.backend.name, seconds)
        reach("allocated")
        lap("KV cache")
        self.graphs = None
        if compiles is not None:
            compiles.dry_run(self.first_serving_passes)
            if config.enforce_eager:
                self.log_compiles(compiles.wait())
                lap("compile")
            else:
                self.graphs = CUDAGraphs(self.model, self.max_batch, self.inputs.max_blocks_per_seq,
                                         hf_config.hidden_size, self.dtype, self.device, lap, compiles)
                self.log_compiles(self.graphs.compiled)

    def exit(self) -> None:
        self.graphs = None
        self.sampler.close()  # first: it lets the device go past any wait for a structured-output mask
        if self.use_cuda:
            torch.cuda.synchronize()
        self.tp.close()
        # the cache and the model go with the engine even while something still holds this runner or the model (a
        # caller's variable, a traceback): the next engine in the process sizes its cache from what is free
        for layer in self.attention_layers:
            layer.cache = None
        self.kv_cache = self.model = None

    # --- startup -----------------------------------------------------------------------------------------
    def warmup_model(self, compiles: KernelCompiles | None, measure_kv: bool) -> None:
        """The largest prefill, so that the peak memory of activations is known before sizing the KV cache, then
        one of a single token. On CUDA they run dry (utils/parallel_compile.py): the dry passes allocate what the
        real ones would, and only an FP8 cache's scales need a real pass (measure_kv; on CPU only that, on a shorter
        pass), which waits for the compiles."""
        seq_len = min(self.config.max_model_len, self.config.max_num_batched_tokens)
        if not self.use_cuda:
            seq_len = min(seq_len, 512)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // seq_len, self.config.max_num_seqs))
        # varied token ids, not one repeated: the pass measures the keys and values an FP8 cache must hold
        token_ids = np.random.default_rng(0).integers(0, self.config.hf_config.vocab_size, (num_seqs, seq_len))
        seqs = [Sequence(ids.tolist(), block_size=self.block_size) for ids in token_ids]
        for seq in seqs:
            seq.num_scheduled_tokens = seq_len
        one = Sequence([0], block_size=self.block_size)
        one.num_scheduled_tokens = 1

        def passes() -> None:
            self.launch(Step.of(seqs, True))  # on every rank; only rank 0 samples, so nothing is read back here
            if self.use_cuda:  # compiled layers specialise size 1 apart from other sizes
                self.launch(Step.of([one], True))

        try:
            if self.use_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                compiles.dry_run(passes)
            if measure_kv:
                for layer in self.attention_layers:  # fresh, after the dry pass
                    layer.kv_amax = torch.zeros(2, device=self.device)
                if compiles is not None:
                    self.log_compiles(compiles.wait())
                passes()
        except torch.OutOfMemoryError as error:
            raise ValueError(f"a prefill of max_num_batched_tokens={self.config.max_num_batched_tokens} tokens "
                             f"({num_seqs} x {seq_len}) does not fit in GPU memory: lower max_num_batched_tokens "
                             f"or max_model_len") from error
        if self.use_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def first_serving_passes(self) -> None:
        """What the first requests meet that the warmups did not (engine/first_requests.py): a prefill, then a
        decode step's sampling, where a penalty also counts the token fed."""
        settings = first_request_settings(self.config.model)
        for params in settings:
            self.launch(Step.of([prefill_sequence(params, self.block_size)], True))
        if self.rank == 0:  # the decode's forward is the graphs' warmup
            sample_decode_steps(self.sampler, settings, self.config.hf_config.vocab_size, self.dtype, self.block_size)

    def log_compiles(self, line: str) -> None:
        if self.rank == 0:
            logger.info(line)

    def allocate_kv_cache(self) -> None:
        block_bytes = self.kv_layout.block_bytes
        if self.config.num_kvcache_blocks > 0:
            self.num_kvcache_blocks = self.config.num_kvcache_blocks
            free = torch.cuda.mem_get_info()[0] if self.use_cuda else available_cpu_memory()
            if self.num_kvcache_blocks * block_bytes > free:
                raise ValueError(f"num_kvcache_blocks={self.num_kvcache_blocks} needs "
                                 f"{self.num_kvcache_blocks * block_bytes / 2**30:.2f} GiB of KV cache but "
                                 f"{free / 2**30:.2f} GiB of {self.device.type} memory is free: at most "
                                 f"{free // block_bytes} blocks of {block_bytes / 2**20:.1f} MiB fit")
        else:
            self.num_kvcache_blocks = blocks_that_fit(self.config, self.use_cuda, block_bytes)
        # every rank must agree, or block ids would mean different slots
        n = self.tp.all_reduce(torch.tensor([self.num_kvcache_blocks], device=self.device), dist.ReduceOp.MIN)
        self.num_kvcache_blocks = int(n.item())
        if self.rank == 0:
            logger.info("KV cache: %d blocks of %d tokens (%.2f MiB each), %s (kv_cache_dtype=%r)",
                        self.num_kvcache_blocks, self.block_size, block_bytes / 2**20,
                        str(self.kv_layout.dtype).removeprefix("torch."), self.config.kv_cache_dtype)
        self.kv_cache, layer_caches = self.kv_layout.allocate(self.num_kvcache_blocks, self.device, self.kv_scales)
        for layer, cache in zip(self.attention_layers, layer_caches, strict=True):
            layer.cache = cache
        # a running request holds at least one block, so no batch is larger than the cache has blocks
        self.max_batch = min(self.config.max_num_seqs, self.num_kvcache_blocks)
        self.backend.bind(self.kv_layout.num_kv_heads, self.max_batch, self.device)

    # --- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, step: Step, previous: Step | None = None) -> Step:
        """Queue one step on the device and return at once; its sampled tokens are read back later (Step.result).

        A sequence may feed `previous`'s token before the host has it (PENDING): every rank holds that step's
        tokens on the device, rank 0 from its sampler and the others from a broadcast, so no rank waits for the
        host between steps."""
        seqs = step.seqs
        if step.block_copies:
            self.kv_layout.copy_blocks(self.kv_cache, step.block_copies)
        graph_size = None
        if step.is_prefill:
            input_ids, positions = self.inputs.prefill(seqs)
        else:
            graph_size = self.graphs.size_for(len(seqs)) if self.graphs is not None else None
            buffer = self.graphs.input_buffer if graph_size is not None else None
            input_ids, positions = self.inputs.decode(seqs, previous, graph_size or len(seqs), buffer)
        sampling = self.sampler.prepare(seqs, None if step.is_prefill else input_ids) if self.rank == 0 else None
        try:
            if graph_size is not None:
                hidden_states = self.graphs.replay(graph_size, len(seqs))
            else:
                hidden_states = self.model(input_ids, positions)
            logits = self.model.compute_logits(hidden_states)
            if step.prompt_rows:  # requests that asked for prompt_logprobs: their prompt rows are scored too
                step.prompt_logprobs = score_prompts(self.model, hidden_states, seqs, step.prompt_rows, self.rank)
            # structured outputs: the mask is filled by the mask worker's process while the device runs the
            # forward and the engine completes the step before; the device waits for it before sampling
            fill = self.sampler.grammar_mask(seqs, logits) if self.rank == 0 else None
        finally:
            reset_context()
        # which rows' tokens are kept (a prefill chunk short of its prompt's end samples a token that is dropped)
        kept = [end == len(seq) for seq, (_, end) in zip(seqs, step.spans)] if fill is not None else None
        step.sample = lambda: self._sample(step, logits, sampling, fill, kept)
        if fill is None:
            self.finish(step)
        return step

    @torch.inference_mode()
    def finish(self, step: Step) -> None:
        """Sample a launched step whose sampling waits for its structured-output mask, if it does."""
        if step.sample is not None:
            sample, step.sample = step.sample, None
            sample()

    def _sample(self, step: Step, logits: torch.Tensor, sampling: SamplingTensors | None, fill: int | None,
                kept: list[bool] | None) -> None:
        if self.rank == 0:
            if fill is not None:
                sampling.grammar = self.sampler.finish_grammar_mask(fill)
            output = self.sampler(logits, sampling)
            token_ids, logprobs = output.token_ids, output.logprobs
        else:
            token_ids, logprobs = torch.empty(len(step.seqs), dtype=torch.int64, device=self.device), None
        self.tp.broadcast_from_first(token_ids)
        if self.rank == 0:
            step.copy_to_host(token_ids, logprobs)
            if fill is not None:
                self.sampler.grammar_after_sample(step.seqs, kept, token_ids)
                step.confirm = lambda: self.sampler.grammar_confirm(fill)
        else:
            step.token_ids = token_ids
