"""Decode inputs: the one flat int32 buffer a decode step reads, padded to the CUDA graph's size.

The CPU runs eagerly, so the graph path is exercised by handing InputBuilder.decode a buffer on the CPU, as the
graph runner does on the GPU: what it writes there is exactly what a captured graph would read.
"""
import torch

from nanovllm.engine.cuda_graphs import CUDAGraphs
from nanovllm.engine.model_inputs import InputBuilder, decode_views
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.engine.step import Step
from nanovllm.utils.context import get_context, reset_context

WIDTH = 4  # max_model_len 1024 in blocks of 256
builder = InputBuilder(256, WIDTH, torch.device("cpu"))


def decoding(tokens: list[int], block_table: list[int]) -> Sequence:
    seq = Sequence(tokens, block_size=256)
    seq.block_table = block_table
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(tokens) - 1, 1
    return seq


def batch_with_a_pending_token() -> tuple[list[Sequence], Step]:
    waiting_for_token = decoding(list(range(10)) + [PENDING], [7])
    previous = Step([decoding([5, 6], [9]), waiting_for_token], False, token_ids=torch.tensor([11, 22]))
    return [decoding(list(range(300)), [3, 5]), waiting_for_token, decoding(list(range(257)), [1, 2])], previous


EXPECTED = dict(input_ids=[299, 22, 256], positions=[299, 10, 256], slot_mapping=[5 * 256 + 43, 7 * 256 + 10, 512],
                context_lens=[300, 11, 257], block_tables=[[3, 5, 0, 0], [7, 0, 0, 0], [1, 2, 0, 0]])


def test_eager_decode_inputs():
    seqs, previous = batch_with_a_pending_token()
    input_ids, positions = builder.decode(seqs, previous, rows=len(seqs))
    context = get_context()
    reset_context()
    assert input_ids.tolist() == EXPECTED["input_ids"]  # the PENDING token came from the previous step's row 1
    assert positions.tolist() == EXPECTED["positions"]
    assert context.slot_mapping.tolist() == EXPECTED["slot_mapping"]
    assert context.context_lens.tolist() == EXPECTED["context_lens"]
    assert context.block_tables.tolist() == EXPECTED["block_tables"]


def test_graph_decode_inputs_land_in_the_graph_buffer_padded():
    buffer = torch.full(((5 + WIDTH) * 8,), 77, dtype=torch.int32)  # stale values from a wider earlier step
    graphs = CUDAGraphs.__new__(CUDAGraphs)  # its size rule, without capturing (no GPU here)
    graphs.sizes = [1, 2, 4, 8]
    assert graphs.size_for(3) == 4 and graphs.size_for(9) is None
    seqs, previous = batch_with_a_pending_token()
    input_ids, positions = builder.decode(seqs, previous, rows=4, graph_buffer=buffer)
    context = get_context()
    reset_context()
    inputs = decode_views(buffer, 4, WIDTH)  # the views the 4-row graph was captured on
    assert input_ids.data_ptr() == inputs["input_ids"].data_ptr() and len(input_ids) == 3
    assert context.block_tables.data_ptr() == inputs["block_tables"].data_ptr()
    # the fourth row pads the batch: it writes no KV (slot -1) and attends to nothing (context 0)
    assert inputs["input_ids"].tolist() == EXPECTED["input_ids"] + [0]
    assert inputs["positions"].tolist() == EXPECTED["positions"] + [0]
    assert inputs["slot_mapping"].tolist() == EXPECTED["slot_mapping"] + [-1]
    assert inputs["context_lens"].tolist() == EXPECTED["context_lens"] + [0]
    assert inputs["block_tables"].tolist() == EXPECTED["block_tables"] + [[0] * WIDTH]
    assert positions.tolist() == EXPECTED["positions"]
