"""The sampler against plain-torch references on the same logits."""
import math

import numpy as np
import pytest
import torch

from nanovllm.sampling.floors import CHUNK, LargestLogits, logit_floors
from nanovllm.sampling.gumbel_max import gumbel_max_sample
from nanovllm.sampling.sampler import Sampler, SamplingTensors, step_keys


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


def kept_by_floors(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> list[set[int]]:
    rows = logits.size(0)
    unbounded = torch.arange(rows) if top_p < 1.0 and top_k <= 0 else None
    floors = logit_floors(logits, torch.full((rows,), temperature), torch.full((rows,), max(top_k, 0)),
                          torch.full((rows,), top_p), torch.full((rows,), min_p), max(top_k, 1), unbounded)
    return [{i for i in range(logits.size(1)) if logits[row, i] >= floors[row]} for row in range(rows)]


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.05),
                                               (1, 0.5, 0.0), (0, 0.3, 0.3), (60, 0.95, 0.0), (7, 1.0, 0.2)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_floors_keep_what_the_filters_keep(top_k, top_p, min_p, temperature):
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    for row, kept in enumerate(kept_by_floors(logits, temperature, top_k, top_p, min_p)):
        assert kept == reference_keep(logits[row] / temperature, top_k, top_p, min_p)


def reference_keep_with_ties(row: list[float], top_k: int, top_p: float) -> set[int]:
    """The definitions of sampling/floors.py, for logits with ties: top-k keeps what is at least the k-th
    largest; top-p keeps a token when the kept tokens strictly more likely than it hold less than top_p."""
    keep = set(range(len(row)))
    if top_k > 0:
        kth = sorted(row, reverse=True)[top_k - 1]
        keep = {i for i in keep if row[i] >= kth}
    total = sum(math.exp(row[i]) for i in keep)
    return {i for i in keep if sum(math.exp(row[j]) for j in keep if row[j] > row[i]) < top_p * total}


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (4, 0.7), (9, 0.5), (0, 0.6), (2, 0.99)])
def test_ties_are_kept_or_dropped_together(top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 5, (8, 30), generator=gen).float()  # five values over 30 tokens: ties everywhere
    for row, kept in enumerate(kept_by_floors(logits, 1.0, top_k, top_p, 0.0)):
        assert kept == reference_keep_with_ties(logits[row].tolist(), top_k, top_p)


@pytest.mark.parametrize("k", [2, 5, 11])
def test_largest_logits_chunk_wise_are_the_largest_logits_and_count_every_tie(k):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(0, 6, (5, CHUNK * 12), generator=gen).to(torch.bfloat16)  # ties within and across chunks
    logits[1] = torch.randn(CHUNK * 12, generator=gen)  # no ties
    logits[2, :] = 0.0
    logits[2, ::CHUNK] = 5.0  # every chunk's maximum ties: the pool of k chunks misses most of them
    logits[3, 7] = 9.0  # one chunk holds the two largest
    logits[3, 8] = 8.0
    chunked, whole = LargestLogits(logits, k, chunked=True), LargestLogits(logits, k, chunked=False)
    assert chunked.pool.shape == (5, k * CHUNK) and whole.pool is logits
    assert torch.equal(chunked.values, logits.float().sort(dim=-1, descending=True).values[:, :k])
    assert torch.equal(chunked.values, whole.values)
    kth = chunked.values[:, -1]
    expected = (logits.float() >= kth.unsqueeze(1)).sum(dim=-1)
    assert chunked.count_at_least(kth).tolist() == expected.tolist() == whole.count_at_least(kth).tolist()
    assert expected[2] == 12


@pytest.mark.parametrize("ties", [False, True])
def test_fused_floors_equal_the_torch_floors(ties):
    """The GPU's path (chunk-wise candidates, one Triton kernel) against the torch ops, row settings mixed."""
    gen = torch.Generator().manual_seed(3)
    rows = 8
    logits = (torch.randint(0, 6, (rows, CHUNK * 12), generator=gen).float() if ties
              else torch.randn(rows, CHUNK * 12, generator=gen) * 2).to(torch.bfloat16)
    temperatures = torch.tensor([1.0, 0.6, 0.0, 1.3, 0.8, 1.0, 0.5, 2.0])
    top_k = torch.tensor([20, 5, 3, 0, 11, 1, 20, 0])
    top_p = torch.tensor([0.95, 1.0, 0.5, 0.9, 0.3, 0.8, 0.99, 1.0])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.05, 0.0, 0.0, 0.2, 0.3])
    unbounded = torch.tensor([3])
    for parts in ((top_k, top_p, min_p), (top_k, top_p, None), (top_k, None, None), (None, None, min_p),
                  (top_k, None, min_p)):
        arguments = (logits, temperatures, *parts, 20, unbounded if parts[1] is not None else None)
        fused, plain = logit_floors(*arguments, fused=True), logit_floors(*arguments, fused=False)
        assert torch.equal(fused, plain), (parts, fused, plain)
    assert fused[2] == float("-inf")  # greedy


def test_rows_mix_settings_and_off_values():
    torch.manual_seed(1)
    logits = torch.randn(4, 40)
    floors = logit_floors(logits, torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([0, 3, 0, 3]),
                          torch.tensor([1.0, 1.0, 0.5, 0.5]), None, 3, torch.tensor([2]))
    assert floors[0] == float("-inf") and floors[3] == float("-inf")  # every filter off; a greedy row
    assert (logits[1] >= floors[1]).sum() == 3
    assert {i for i in range(40) if logits[2, i] >= floors[2]} == reference_keep(logits[2], 0, 0.5, 0.0)


def test_step_keys_are_non_negative_and_differ_by_seed_and_step():
    seeds = np.array([0, 0, 1, -5, 2**63 - 1], dtype=np.int64)
    steps = np.array([0, 1, 0, 0, 7], dtype=np.int64)
    keys = step_keys(seeds, steps)
    assert keys.dtype == np.int64 and (keys >= 0).all() and len(set(keys.tolist())) == 5
    assert step_keys(seeds, steps).tolist() == keys.tolist()


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


def test_filtered_sampling_follows_the_filtered_distribution():
    torch.manual_seed(4)
    row = torch.randn(50)
    draws, temperature = 40_000, 0.8
    params = SamplingTensors(torch.full((draws,), temperature), top_k=torch.full((draws,), 7),
                             top_p=torch.full((draws,), 0.9), candidates=7)
    out = Sampler()(row.repeat(draws, 1), params).token_ids
    allowed = sorted(reference_keep(row / temperature, 7, 0.9, 0.0))
    counts = torch.bincount(out, minlength=50).double()
    assert counts.sum() == counts[allowed].sum()  # never outside the kept set
    expected = torch.softmax(row[allowed].double() / temperature, 0) * draws
    chi2 = ((counts[allowed] - expected) ** 2 / expected).sum().item()
    assert chi2 < 10 + 6 * (2 * len(allowed)) ** 0.5, (counts[allowed], expected)


def keyed(rows: int, keys: dict[int, int]) -> torch.Tensor:
    row_seeds = torch.full((rows,), -1, dtype=torch.int64)
    for row, key in keys.items():
        row_seeds[row] = key
    return row_seeds


def test_seeded_rows_ignore_the_rest_of_the_batch():
    torch.manual_seed(5)
    logits = torch.randn(5, 100)
    sampler = Sampler()
    alone = sampler(logits[2:3], SamplingTensors(torch.ones(1), row_seeds=keyed(1, {0: 42}))).token_ids[0].item()
    for _ in range(5):
        mixed = sampler(logits, SamplingTensors(torch.ones(5), row_seeds=keyed(5, {2: 42}))).token_ids[2].item()
        assert mixed == alone
    draws = {sampler(logits[2:3], SamplingTensors(torch.ones(1), row_seeds=keyed(1, {0: s}))).token_ids[0].item()
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


@pytest.mark.slow
def test_gumbel_kernel_follows_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draws = 400  # the interpreter runs one program at a time: a small sample, so a loose bound
    logits = (probs.log() * 0.7).repeat(draws, 1)  # at temperature 0.7, exactly `probs`
    out = gumbel_max_sample(logits, torch.full((draws,), 0.7), seed=3, chunk=1024)
    counts = torch.bincount(out, minlength=6).double()
    chi2 = ((counts - probs * draws) ** 2 / (probs * draws)).sum().item()
    assert chi2 < 25.0, counts  # 5 degrees of freedom: p < 1e-4 by chance


@pytest.mark.slow
def test_gumbel_kernel_floors_bound_the_draw():
    vocab, rows = 2500, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(9))
    floors = logits.topk(3, dim=-1).values[:, -1].clone()  # three tokens per row stay
    floors[5] = float("-inf")
    seen: list[set[int]] = [set() for _ in range(rows)]
    for seed in range(8):
        out = gumbel_max_sample(logits, torch.full((rows,), 50.0), seed=seed, chunk=1024, floors=floors)
        for row in range(rows):
            seen[row].add(out[row].item())
    for row in range(5):
        assert seen[row] == set(logits[row].topk(3).indices.tolist())  # only those three, and each of them
    assert len(seen[5]) > 3
    # a greedy row is the argmax whatever its floor
    greedy = gumbel_max_sample(logits, torch.zeros(rows), seed=4, chunk=1024, floors=floors)
    assert greedy.tolist() == logits.argmax(-1).tolist()


def test_gumbel_kernel_seeded_rows_depend_on_their_key_alone():
    vocab = 2500
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(10))
    logits = torch.stack([torch.randn(vocab), torch.randn(vocab), row, row])
    temperatures = torch.full((4,), 3.0)  # flat: a different stream gives a different token
    alone = [gumbel_max_sample(row.unsqueeze(0), temperatures[:1], seed=1, chunk=1024,
                               row_seeds=torch.tensor([key])).item() for key in range(12)]
    assert len(set(alone)) > 3
    for key in (0, 5):
        keys = torch.tensor([-1, -1, key, -1])
        out = gumbel_max_sample(logits, temperatures, seed=key + 7, chunk=1024, row_seeds=keys)
        assert out[2].item() == alone[key]  # another row, another step seed, other neighbours: the same token
        # unseeded rows keep the step's stream, as without row seeds
        plain = gumbel_max_sample(logits, temperatures, seed=key + 7, chunk=1024)
        assert out[[0, 1, 3]].tolist() == plain[[0, 1, 3]].tolist()


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


@pytest.mark.parametrize("batch", range(1, 10))
def test_per_row_settings_start_16_byte_aligned_at_every_batch_size(batch):
    """Triton specialises a kernel on whether each pointer is 16-byte aligned: settings whose start moved with the
    batch size would compile another variant of the sampling kernels in the middle of a run."""
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

    seqs = [Sequence([1, 2], SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=i))
            for i in range(batch)]
    tensors = Sampler().prepare(seqs)
    for settings in (tensors.temperatures, tensors.top_p, tensors.min_p, tensors.top_k, tensors.row_seeds):
        assert settings.shape == (batch,) and settings.is_contiguous()
        assert settings.storage_offset() * settings.element_size() % 16 == 0
    assert tensors.top_p.tolist() == pytest.approx([0.9] * batch) and tensors.top_k.tolist() == [5] * batch
    assert tensors.min_p.tolist() == pytest.approx([0.1] * batch)
    assert tensors.row_seeds.tolist() == step_keys(np.arange(batch), np.zeros(batch, dtype=np.int64)).tolist()
