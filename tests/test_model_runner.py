"""ModelRunner's decode inputs: the one flat int32 buffer a decode step reads, padded to the CUDA graph's size.

The CPU runs eagerly, so the graph path is exercised by pretending graphs exist (their input buffer on the CPU):
what prepare_decode writes there is exactly what a captured graph would read on the GPU.
"""
import pytest
import torch

from nanovllm import LLM
from nanovllm.engine.model_runner import LaunchedStep
from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.utils.context import get_context, reset_context


@pytest.fixture(scope="module")
def runner(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=12, max_model_len=1024) as engine:
        yield engine.model_runner


def decoding(tokens: list[int], block_table: list[int]) -> Sequence:
    seq = Sequence(tokens, block_size=256)
    seq.block_table = block_table
    seq.num_cached_tokens, seq.num_scheduled_tokens = len(tokens) - 1, 1
    return seq


def batch_with_a_pending_token() -> tuple[list[Sequence], LaunchedStep]:
    waiting_for_token = decoding(list(range(10)) + [PENDING], [7])
    previous = LaunchedStep([decoding([5, 6], [9]), waiting_for_token], torch.tensor([11, 22]))
    return [decoding(list(range(300)), [3, 5]), waiting_for_token, decoding(list(range(257)), [1, 2])], previous


EXPECTED = dict(input_ids=[299, 22, 256], positions=[299, 10, 256], slot_mapping=[5 * 256 + 43, 7 * 256 + 10, 512],
                context_lens=[300, 11, 257], block_tables=[[3, 5, 0, 0], [7, 0, 0, 0], [1, 2, 0, 0]])


def test_eager_decode_inputs(runner):
    seqs, previous = batch_with_a_pending_token()
    input_ids, positions = runner.prepare_decode(seqs, previous)
    context = get_context()
    reset_context()
    assert input_ids.tolist() == EXPECTED["input_ids"]  # the PENDING token came from the previous step's row 1
    assert positions.tolist() == EXPECTED["positions"]
    assert context.slot_mapping.tolist() == EXPECTED["slot_mapping"]
    assert context.context_lens.tolist() == EXPECTED["context_lens"]
    assert context.block_tables.tolist() == EXPECTED["block_tables"]


def test_graph_decode_inputs_land_in_the_graph_buffer_padded(runner, monkeypatch):
    width = runner.max_blocks_per_seq
    buffer = torch.full(((5 + width) * 8,), 77, dtype=torch.int32)  # stale values from a wider earlier step
    monkeypatch.setattr(runner, "enforce_eager", False)
    monkeypatch.setattr(runner, "graph_bs", [1, 2, 4, 8], raising=False)
    monkeypatch.setattr(runner, "graph_inputs", buffer, raising=False)
    seqs, previous = batch_with_a_pending_token()
    assert runner.decode_graph_size(3) == 4 and runner.decode_graph_size(9) is None
    input_ids, positions = runner.prepare_decode(seqs, previous)
    context = get_context()
    reset_context()
    inputs = runner.decode_inputs(buffer, 4)  # the views the 4-row graph was captured on
    assert input_ids.data_ptr() == inputs["input_ids"].data_ptr() and len(input_ids) == 3
    assert context.block_tables.data_ptr() == inputs["block_tables"].data_ptr()
    # the fourth row pads the batch: it writes no KV (slot -1) and attends to nothing (context 0)
    assert inputs["input_ids"].tolist() == EXPECTED["input_ids"] + [0]
    assert inputs["positions"].tolist() == EXPECTED["positions"] + [0]
    assert inputs["slot_mapping"].tolist() == EXPECTED["slot_mapping"] + [-1]
    assert inputs["context_lens"].tolist() == EXPECTED["context_lens"] + [0]
    assert inputs["block_tables"].tolist() == EXPECTED["block_tables"] + [[0] * width]
    assert positions.tolist() == EXPECTED["positions"]
