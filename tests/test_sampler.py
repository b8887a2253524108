"""The sampler against plain-torch references on the same logits."""
import math

import pytest
import torch

from nanovllm.layers.gumbel_max import gumbel_max_sample
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
            assert value.logprob == pytest.approx(expected[row, token_id].item(), abs=1e-5)
            assert value.rank == 1 + (expected[row] > expected[row, token_id]).sum().item()


# --- the Triton Gumbel-max kernel (CPU: Triton's interpreter, small; GPU: a real vocabulary) ---------------

def test_gumbel_kernel_greedy_rows_take_the_first_maximum_across_chunks():
    vocab = 2500  # three 1024-wide chunks, the last one partial
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(7))
    logits[0, [100, 1500, 2400]] = 9.0  # a tie in three chunks: torch.argmax's first index
    logits[1, 2499] = 9.0  # the very last position
    logits[2, :] = float("-inf")
    logits[2, 1030] = 0.0
    temperatures = torch.tensor([0.0, 0.0, 0.0, 1.0])
    out = gumbel_max_sample(logits, temperatures, seed=1, chunk=1024)
    assert out.dtype == torch.int64
    assert out[:3].tolist() == [100, 2499, 1030]
    assert 0 <= out[3].item() < vocab


def test_gumbel_kernel_follows_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draws = 400  # the interpreter runs one program at a time: a small sample, so a loose bound
    logits = (probs.log() * 0.7).repeat(draws, 1)  # at temperature 0.7, exactly `probs`
    out = gumbel_max_sample(logits, torch.full((draws,), 0.7), seed=3, chunk=1024)
    counts = torch.bincount(out, minlength=6).double()
    chi2 = ((counts - probs * draws) ** 2 / (probs * draws)).sum().item()
    assert chi2 < 25.0, counts  # 5 degrees of freedom: p < 1e-4 by chance


@pytest.mark.gpu
def test_gumbel_kernel_on_a_full_vocabulary():
    vocab, draws, temperature = 151936, 20_000, 0.6
    gen = torch.Generator().manual_seed(8)
    row = torch.randn(vocab, generator=gen) * 2
    logits = row.to("cuda", torch.bfloat16).repeat(draws, 1)
    temperatures = torch.full((draws,), temperature, device="cuda")
    out = gumbel_max_sample(logits, temperatures, seed=11)
    assert torch.equal(out, gumbel_max_sample(logits, temperatures, seed=11))  # same seed, same draws
    assert not torch.equal(out, gumbel_max_sample(logits, temperatures, seed=12))
    probs = torch.softmax(logits[0].double().cpu() / temperature, 0)
    top = probs.topk(15).indices
    expected = torch.cat([probs[top], (1 - probs[top].sum()).view(1)]) * draws
    hits = torch.bincount(out.cpu(), minlength=vocab).double()
    counts = torch.cat([hits[top], (draws - hits[top].sum()).view(1)])
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 45.0, (counts, expected)  # 15 degrees of freedom: p < 1e-4 by chance
    greedy = gumbel_max_sample(logits[:64], torch.zeros(64, device="cuda"), seed=0)
    assert torch.equal(greedy, logits[:64].float().argmax(-1))
