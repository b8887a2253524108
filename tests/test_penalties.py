"""Penalties (sampling/penalties.py): the device table of histories and both ways of applying them (torch ops, and
the GPU's Triton kernel, here in Triton's interpreter) against vLLM's formulas on the plain histories."""
from random import Random

import pytest
import torch

from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.sampling.penalties import PenaltyHistories
from nanovllm.sampling_params import SamplingParams


def reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's formulas, one row at a time."""
    out = logits.clone()
    for row, seq in enumerate(seqs):
        p = seq.params
        seen = torch.tensor(seq.token_ids)
        output = torch.tensor(seq.completion_token_ids, dtype=torch.long)
        counts = torch.zeros(logits.size(1)).index_add_(0, output, torch.ones(len(output)))
        value = out[row]
        value[seen] = torch.where(value[seen] > 0, value[seen] / p.repetition_penalty,
                                  value[seen] * p.repetition_penalty)
        out[row] = value - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return out


@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton-kernel"])
def test_penalties_follow_each_request_through_decode_eviction_and_recompute(use_kernel):
    rng = Random(3)
    vocab = 64  # small, so tokens repeat within and across prompt and output
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.7, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=0.6), SamplingParams(frequency_penalty=-0.4)]
    seqs = [Sequence([rng.randrange(vocab) for _ in range(rng.randint(1, 40))], params[i % 4]) for i in range(12)]
    histories = PenaltyHistories(torch.device("cpu"), use_kernel=use_kernel)
    for step in range(50):
        batch = rng.sample(seqs, rng.randint(1, 6))  # requests come and go, so rows are taken and given back
        if not any(s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0
                   for s in batch):
            continue
        prefill = rng.random() < 0.3  # as after a preemption: the whole history again from the host
        fed = None
        if not prefill:
            # decode: each feeds a new token the host does not have yet (async scheduling), from the device
            fed = torch.tensor([rng.randrange(vocab) for _ in batch])
            for seq in batch:
                seq.append_token(PENDING)
        tensors = histories.tensors(batch, fed)
        if not prefill:
            for seq, token in zip(batch, fed.tolist()):
                seq.token_ids[-1] = token  # read back later, as Step.result does
        logits = torch.randn(len(batch), vocab)
        torch.testing.assert_close(tensors.apply(logits), reference(logits, batch), rtol=1e-6, atol=1e-6,
                                   msg=f"step {step}")
    assert len(histories.owner) < len(seqs)  # rows were reused, not one per request
    assert not histories.use_kernel or not histories.marks(1, vocab).any()  # the scratch is left clear


def test_the_kernels_arguments_look_the_same_to_triton_at_every_batch_size():
    """Triton compiles a variant per pointer alignment (16 bytes) and per integer that is 1 or a multiple of 16:
    every pointer the kernel gets is 16-byte aligned and every integer that grows with the batch or the histories
    is of one kind at each size, so decode steps of any size run the variant start-up compiled."""
    histories = PenaltyHistories(torch.device("cpu"))
    for size in range(1, 40):
        seqs = [Sequence(list(range(1 + (i * 7 + size) % 50)), SamplingParams(repetition_penalty=1.2,
                                                                               presence_penalty=0.1))
                for i in range(size)]
        for fed in (None, torch.zeros(size, dtype=torch.int64)):
            tensors = histories.tensors(seqs, fed)
            for name in ("strengths", "lengths", "prompt_lengths", "table", "table_rows"):
                assert getattr(tensors, name).data_ptr() % 16 == 0, (size, name)
            assert tensors.table.stride(0) % 16 == 0, size
            assert tensors.strengths.stride(0) >= size  # the kernel's row stride (not specialised: it varies)


def test_the_table_grows_only_in_the_dimension_that_needs_it():
    histories = PenaltyHistories(torch.device("cpu"))
    penalised = SamplingParams(repetition_penalty=1.2)
    histories.tensors([Sequence([1, 2, 3], penalised)], None)
    rows, width = histories.table.shape
    assert width % 16 == 0
    histories.tensors([Sequence([1, 2, 3], penalised) for _ in range(3 * rows)], None)  # more rows, same lengths
    assert histories.table.size(0) > rows and histories.table.size(1) == width
    grown = histories.table.size(0)
    histories.tensors([Sequence(list(range(3 * width)), penalised)], None)  # a longer history, no more rows
    assert histories.table.size(0) == grown and histories.table.size(1) >= 3 * width + 1
    assert histories.table.size(1) % 16 == 0
