"""The device table of penalty histories (layers/penalties.py) against the plain truth: each row's tokens."""
from random import Random

import torch

from nanovllm.engine.sequence import PENDING, Sequence
from nanovllm.layers.penalties import PenaltyHistories
from nanovllm.sampling_params import SamplingParams


def test_histories_follow_each_request_through_decode_eviction_and_recompute():
    rng = Random(3)
    penalised = SamplingParams(presence_penalty=0.5)
    seqs = [Sequence([rng.randrange(100) for _ in range(rng.randint(1, 40))],
                    penalised if i % 3 else SamplingParams()) for i in range(12)]
    histories = PenaltyHistories(torch.device("cpu"))
    checked_rows = 0
    for step in range(60):
        batch = rng.sample(seqs, rng.randint(1, 6))  # requests come and go, so rows are taken and given back
        prefill = rng.random() < 0.3  # as after a preemption: the whole history again from the host
        fed = None
        if not prefill:
            # decode: each feeds a new token the host does not have yet (async scheduling), from the device
            fed = torch.tensor([rng.randrange(100) for _ in batch])
            for seq in batch:
                seq.append_token(PENDING)
        tensors = histories.tensors(batch, fed)
        if not prefill:
            for seq, token in zip(batch, fed.tolist()):
                seq.token_ids[-1] = token  # read back later, as Step.result does
        for row, seq in enumerate(batch):
            length = int(tensors.lengths[row])
            if seq.params.presence_penalty:
                assert length == len(seq), step
                assert tensors.histories[row, :length].tolist() == seq.token_ids, step
                assert int(tensors.prompt_lengths[row]) == seq.num_prompt_tokens
                checked_rows += 1
            else:
                assert length == 0  # rows without penalties list nothing
        assert torch.equal(tensors.strengths[1], torch.tensor([s.params.presence_penalty for s in batch]))
    assert checked_rows > 100
    assert len(histories.owner) < len(seqs)  # rows were reused, not one per request
