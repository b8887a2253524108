"""The structured-output mask kernel (nanovllm/sampling/mask_kernel.py), on CPU in Triton's interpreter and
compiled on the GPU, against xgrammar's own apply of the same bitmask rows."""
import pytest
import torch
import xgrammar as xgr

from nanovllm.sampling.mask_kernel import mask_logits

VOCAB, PADDED = 5000, 5120  # a padded logits width past the tokenizer's vocabulary, as a model's


def _case(device: str):
    generator = torch.Generator().manual_seed(0)
    width = -(-PADDED // 32)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (12, width), generator=generator, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[3] = -1  # every id allowed
    bitmask[4] = 0  # none allowed
    logits = torch.randn(6, PADDED, generator=generator)
    return logits.to(device), bitmask.to(device)


def _expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], sources: list[int]) -> torch.Tensor:
    expected = logits.cpu().clone()
    picked = expected[rows].clone()
    xgr.apply_token_bitmask_inplace(picked, bitmask.cpu()[sources].contiguous(), vocab_size=VOCAB)
    expected[rows] = picked
    return expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_row_is_masked_by_its_source_row_and_other_rows_are_left_alone(device):
    logits, bitmask = _case(device)
    rows, sources = [4, 0, 2, 5], [11, 3, 4, 7]  # rows 1 and 3 are free rows
    expected = _expected(logits, bitmask, rows, sources)
    as_index = [torch.tensor(x, dtype=torch.int64, device=device) for x in (rows, sources)]
    mask_logits(logits, bitmask, VOCAB, *as_index)
    assert torch.equal(logits.cpu(), expected)
    assert torch.isinf(logits[2, :VOCAB]).all() and torch.isfinite(logits[0]).all()
    assert torch.equal(logits[:, VOCAB:].cpu(), expected[:, VOCAB:])  # past the vocabulary: untouched


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_without_indices_row_i_takes_bitmask_row_i(device):
    logits, bitmask = _case(device)
    expected = _expected(logits, bitmask, list(range(6)), list(range(6)))
    mask_logits(logits, bitmask, VOCAB)
    assert torch.equal(logits.cpu(), expected)
