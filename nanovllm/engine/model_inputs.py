"""Scheduled sequences -> the tensors of one forward pass, and the attention Context it runs under."""
import numpy as np
import torch

from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.step import Step
from nanovllm.utils.context import set_context
from nanovllm.utils.device import pinned, to_device


def decode_views(buffer: torch.Tensor, rows: int, width: int) -> dict[str, torch.Tensor]:
    """Views of one flat int32 buffer, as the host fills it and a decode step (or its CUDA graph) reads it:
    five vectors of `rows` then a row-major [rows, width] block table."""
    vectors = buffer[: 5 * rows].view(5, rows)
    return dict(input_ids=vectors[0], positions=vectors[1], slot_mapping=vectors[2], context_lens=vectors[3],
                source=vectors[4], block_tables=buffer[5 * rows: (5 + width) * rows].view(rows, width))


class InputBuilder:
    def __init__(self, block_size: int, max_blocks_per_seq: int, device: torch.device,
                 quantized_cache: bool = False) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.quantized_cache = quantized_cache

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

    def prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
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
        block_tables = used_blocks = used_block_tables = None
        if prefix_cached:
            width = max(len(seq.block_table) for seq in seqs)
            table = self._fill_block_tables(np.zeros((len(seqs), width), np.int32), seqs)
            block_tables = to_device(table, self.device)
            if self.quantized_cache:  # flash-attn reads dequantised copies of these blocks
                blocks = np.unique(np.concatenate([seq.block_table for seq in seqs]))
                # padding entries (block 0) land on some used block: past a sequence's length, never read
                renumbered = np.searchsorted(blocks, table).clip(max=len(blocks) - 1).astype(np.int32)
                used_blocks = to_device(blocks.astype(np.int64), self.device)
                used_block_tables = to_device(renumbered, self.device)
        set_context(
            is_prefill=True,
            cu_seqlens_q=to_device(np.array(cu_seqlens_q, dtype=np.int32), self.device),
            cu_seqlens_k=to_device(np.array(cu_seqlens_k, dtype=np.int32), self.device),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
            slot_mapping=to_device(np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64), self.device),
            block_tables=block_tables, used_blocks=used_blocks,
            used_block_tables=used_block_tables,
        )
        return (to_device(np.array(input_ids, dtype=np.int64), self.device),
                to_device(np.concatenate(positions).astype(np.int64), self.device))

    def decode(self, seqs: list[Sequence], previous: Step | None, rows: int,
               graph_buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One int32 host buffer, one copy: decode runs every few milliseconds, so per-tensor transfers add up.
        With `graph_buffer` (a CUDA graph of `rows` rows replays this step) the copy lands in the graphs' own
        input buffer, padded to `rows`, so nothing else is launched before the replay.

        A token still PENDING is the previous step's sample, which never left the device: it is gathered there.
        """
        n, width = len(seqs), self.max_blocks_per_seq
        host = np.zeros((5 + width) * rows, dtype=np.int32)
        vectors = host[: 5 * rows].reshape(5, rows)  # the layout of decode_views
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
        if graph_buffer is None:
            device = to_device(host, self.device)
        else:
            device = graph_buffer[: host.size]
            device.copy_(pinned(host, self.device), non_blocking=True)
        inputs = decode_views(device, rows, width)
        input_ids = inputs["input_ids"]
        if len(pending):
            source = inputs["source"]
            torch.where(source >= 0, previous.token_ids[source.clamp(min=0)].int(), input_ids, out=input_ids)
        set_context(is_prefill=False, slot_mapping=inputs["slot_mapping"], context_lens=inputs["context_lens"],
                    block_tables=inputs["block_tables"])
        return input_ids[:n], inputs["positions"][:n]
