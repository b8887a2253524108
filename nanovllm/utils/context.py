from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    """What the attention layers of one forward pass need to know about the batch. The one global, on purpose."""

    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    # a prefill over an FP8 cache's prefix: the distinct blocks block_tables use, and the tables renumbered to
    # index into them (flash_attn_backend.dequantized_blocks)
    used_blocks: torch.Tensor | None = None
    used_block_tables: torch.Tensor | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(**fields) -> None:
    global _CONTEXT
    _CONTEXT = Context(**fields)


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
