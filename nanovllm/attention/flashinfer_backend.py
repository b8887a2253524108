"""The `flashinfer` attention backend (vLLM's name for it): decode through FlashInfer's XQA kernel (TensorRT-LLM's),
prefill and the KV write as the triton backend does them.

XQA reads the paged cache in our layout (NHD: [pages, tokens per page, KV heads, head_dim], addressed by its
strides) in pages of 16-128 tokens. A cache block of 256 tokens is therefore two 128-token pages, consecutive in
memory: page 2b + i is half i of block b, and the page table is each block table entry b expanded to 2b, 2b + 1.
An FP8 (e4m3) cache runs Hopper's FP8 kernel, which rounds the query to e4m3 itself and multiplies on FP8 tensor
cores; the layer's key scale goes into the logits' scale (bmm1_scale) and its value scale into the output's
(bmm2_scale). A bf16 cache runs XQA's generic kernel.

Nothing here reads a device value on the host: the page table and the sequence lengths are derived on the device
once per forward pass (begin_forward), so decode runs inside CUDA graphs. XQA is compiled (or loaded from
FlashInfer's cache) at start-up by warm_up.
"""
import time

import torch

from nanovllm.attention.kv_cache import KVCacheLayout
from nanovllm.attention.triton_backend import TritonBackend
from nanovllm.utils.context import Context
from nanovllm.utils.flashinfer import require_flashinfer

PAGE = 128  # tokens per XQA page: its largest (16, 32, 64 or 128), the fewest page-table reads
# xqa_batch_decode_with_kv_cache takes the first 8 MiB of its workspace for semaphores (zero before first use, left
# zero by the kernel) and the rest as scratch for merging a sequence's split-context partials: one (query-head
# group x head_dim) float32 partial per split, about two splits per SM at most, a few MiB. 56 MiB leaves room.
SEMAPHORE_BYTES = 8 << 20
WORKSPACE_BYTES = 64 << 20


def paged_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, pages_per_block: int,
                 page_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """XQA's page table [rows, width * pages_per_block] (block b -> pages b * pages_per_block + 0, 1, ...) and
    sequence lengths. A CUDA-graph padding row (context 0) gets length 1: it reads one token of its table's
    first block (block 0, a real block) and its output is dropped; XQA is not asked what it makes of no keys."""
    rows = block_tables.size(0)
    pages = torch.add(page_offsets, block_tables.unsqueeze(-1), alpha=pages_per_block).view(rows, -1)
    return pages, context_lens.clamp(min=1)


class FlashInferBackend(TritonBackend):
    name = "flashinfer"

    def __init__(self) -> None:
        self.xqa = require_flashinfer("attention_backend='flashinfer'", "decode").xqa_batch_decode_with_kv_cache
        self.workspace: torch.Tensor | None = None
        self.pages_per_block = 0
        self.page_offsets: torch.Tensor | None = None
        self.pages: torch.Tensor | None = None  # this forward pass's (begin_forward)
        self.seq_lens: torch.Tensor | None = None

    def bind(self, num_kv_heads: int, max_num_seqs: int, device: torch.device) -> None:
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def warm_up(self, layout: KVCacheLayout, num_heads: int, dtype: torch.dtype) -> float:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend='flashinfer' needs a bfloat16 or float16 model; dtype={dtype} "
                             f"(use attention_backend='triton')")
        if layout.block_size % PAGE:
            raise ValueError(f"kvcache_block_size={layout.block_size}: attention_backend='flashinfer' pages the "
                             f"cache in {PAGE}-token pages, so it needs a multiple of {PAGE}")
        device = self.workspace.device
        self.pages_per_block = layout.block_size // PAGE
        self.page_offsets = torch.arange(self.pages_per_block, dtype=torch.int32, device=device)
        start = time.perf_counter()
        # one block of cache and one query of this model's shapes: XQA is built per (query dtype, cache dtype, page
        # size, head_dim, heads per KV head), so this builds or loads the one module the engine will use
        cache = torch.zeros(1, layout.block_size, layout.num_kv_heads, layout.head_dim, dtype=layout.dtype,
                            device=device)
        q = torch.zeros(1, num_heads, layout.head_dim, dtype=dtype, device=device)
        tables = torch.zeros(1, 1, dtype=torch.int32, device=device)
        pages, seq_lens = paged_tables(tables, torch.ones(1, dtype=torch.int32, device=device),
                                       self.pages_per_block, self.page_offsets)
        self._attend(q, cache, cache, pages, seq_lens, 1.0, 1.0, 1.0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def begin_forward(self, context: Context) -> None:
        self.pages = self.seq_lens = None
        if not context.is_prefill and context.block_tables is not None:
            self.pages, self.seq_lens = paged_tables(context.block_tables, context.context_lens,
                                                     self.pages_per_block, self.page_offsets)

    def decode(self, q: torch.Tensor, cache, context: Context, scale: float) -> torch.Tensor:
        assert self.pages is not None, "begin_forward derives the page table before the layers run"
        return self._attend(q, cache.k, cache.v, self.pages, self.seq_lens, scale, cache.k_scale, cache.v_scale)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, seq_lens: torch.Tensor,
                scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
        """q [rows, heads, head_dim]; k and v [blocks, block_size, kv_heads, head_dim], seen as 128-token pages."""
        k, v = k.view(-1, PAGE, *k.shape[2:]), v.view(-1, PAGE, *v.shape[2:])
        out = torch.empty_like(q)
        # an FP8 cache holds K / k_scale and V / v_scale: logits are (q . K) * scale * k_scale, the output v_scale
        # times the probabilities' V
        self.xqa(q.contiguous(), (k, v), self.workspace, pages, seq_lens, pages.size(1) * PAGE,
                 bmm1_scale=scale * k_scale, bmm2_scale=v_scale, out=out)
        return out
