"""The sampler against plain-torch references on the same logits."""
import math

import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors, filter_logits


def reference_keep(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Which tokens survive temperature-scaled logits `row`, written the slow obvious way."""
    keep = set(range(row.numel()))
    order = sorted(range(row.numel()), key=lambda i: -row[i].item())
    if top_k > 0:
        keep = set(order[:top_k])
    if top_p < 1.0:
        kept = [i for i in order if i in keep]
        probs = torch.softmax(torch.tensor([row[i].item() for i in kept], dtype=torch.float64), 0).tolist()
        total, chosen = 0.0, set()
        for i, p in zip(kept, probs):
            if total >= top_p:
                break
            chosen.add(i)
            total += p
        keep = chosen
    if min_p > 0.0:
        kept = sorted(keep)
        probs = torch.softmax(torch.tensor([row[i].item() for i in kept], dtype=torch.float64), 0)
        keep = {i for i, p in zip(kept, probs.tolist()) if p >= min_p * probs.max().item()}
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.05),
                                               (1, 0.5, 0.0), (0, 0.3, 0.3)])
def test_filters_match_reference(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    n = logits.size(0)
    out = filter_logits(logits, torch.full((n,), top_k), torch.full((n,), top_p), torch.full((n,), min_p))
    for row in range(n):
        kept = {i for i in range(50) if math.isfinite(out[row, i].item())}
        assert kept == reference_keep(logits[row], top_k, top_p, min_p)
        assert torch.equal(out[row][list(kept)], logits[row][list(kept)])


def test_rows_mix_settings_and_off_values():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    out = filter_logits(logits, torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]), None)
    assert torch.isfinite(out[0]).all()  # every filter off
    assert torch.isfinite(out[1]).sum() == 3
    assert {i for i in range(40) if math.isfinite(out[2, i].item())} == reference_keep(logits[2], 0, 0.5, 0.0)


def test_greedy_is_argmax_and_respects_bans():
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    sampler = Sampler()
    out = sampler(logits, SamplingTensors(torch.zeros(4)))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    best = logits.argmax(-1)
    banned = (torch.arange(4), best)
    out = sampler(logits, SamplingTensors(torch.zeros(4), banned=banned))
    assert out.token_ids.tolist() == logits.scatter(1, best[:, None], float("-inf")).argmax(-1).tolist()


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    draws = 40_000
    torch.manual_seed(3)
    out = Sampler()(logits.repeat(draws, 1), SamplingTensors(torch.full((draws,), temperature)))
    counts = torch.bincount(out.token_ids, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, 0) * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25.0, (counts, expected)  # 5 degrees of freedom: p < 1e-4 by chance


def test_filtered_sampling_never_leaves_the_kept_set():
    torch.manual_seed(4)
    logits = torch.randn(1, 50).repeat(2000, 1)
    params = SamplingTensors(torch.ones(2000), top_k=torch.full((2000,), 7), top_p=torch.full((2000,), 0.9))
    out = Sampler()(logits, params)
    allowed = reference_keep(logits[0], 7, 0.9, 0.0)
    assert set(out.token_ids.tolist()) <= allowed and len(set(out.token_ids.tolist())) > 1


def test_seeded_rows_ignore_the_rest_of_the_batch():
    torch.manual_seed(5)
    logits = torch.randn(5, 100)
    sampler = Sampler()
    alone = sampler(logits[2:3], SamplingTensors(torch.ones(1), seeds=[(0, 42)])).token_ids[0].item()
    for _ in range(5):
        mixed = sampler(logits, SamplingTensors(torch.ones(5), seeds=[(2, 42)])).token_ids[2].item()
        assert mixed == alone
    draws = {sampler(logits[2:3], SamplingTensors(torch.ones(1), seeds=[(0, s)])).token_ids[0].item()
             for s in range(40)}
    assert len(draws) > 1  # different seeds, different draws


def test_logprobs_are_the_models_log_softmax():
    torch.manual_seed(6)
    logits = torch.randn(3, 20)
    out = Sampler()(logits, SamplingTensors(torch.tensor([0.0, 1.0, 0.5]), num_logprobs=4))
    expected = logits.log_softmax(-1)
    for row, (token, entry) in enumerate(zip(out.token_ids.tolist(), out.logprobs)):
        top = expected[row].topk(4)
        assert set(top.indices.tolist()) | {token} == set(entry)
        for token_id, value in entry.items():
            assert value == pytest.approx(expected[row, token_id].item(), abs=1e-5)
