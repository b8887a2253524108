"""Sampling on the GPU: the distribution each option defines, drawn by the Triton kernel, and seeded requests.

The distribution test draws many single tokens from one full-vocabulary row and compares the counts with the
probabilities computed from the same logits in float64 by a plain reference of the definitions (a chi-square
bound that a wrong floor, temperature or seed handling fails by orders of magnitude; a floor one distinct value off
fails it where few tokens are kept, see test_the_check_fails_with_a_floor_one_value_off, and
test_gpu_top_p_floor.py checks the floors themselves)."""
from typing import Any

import numpy as np
import pytest
import torch
from hf_reference import assert_no_leaks

import nanovllm.sampling.floors as sampling_floors
from nanovllm import LLM, SamplingParams
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling.sampler import Sampler
from nanovllm.utils.random_checkpoint import write_random_checkpoint

pytestmark = pytest.mark.gpu
VOCAB = 151936
DEVICE = "cuda"


def reference_probs(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float,
                    seen: list[int] = (), repetition_penalty: float = 1.0) -> np.ndarray:
    """The options' distribution over `row` (float64), straight from their definitions. `seen`: the tokens the
    repetition penalty divides (a positive logit) or multiplies, in float32 as the sampler does."""
    if len(seen):
        penalised = torch.from_numpy(row).float()
        ids = torch.tensor(sorted(set(seen)))
        value = penalised[ids]
        penalised[ids] = torch.where(value > 0, value / repetition_penalty, value * repetition_penalty)
        row = penalised.double().numpy()
    scaled = row / temperature
    keep = np.ones(row.size, dtype=bool)
    if top_k > 0:
        keep &= row >= np.sort(row)[::-1][top_k - 1]
    if top_p < 1.0:
        probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-row, kind="stable")
        cumulative = np.concatenate([[0.0], np.cumsum(probs[order])])
        values = row[order]
        first_of_value = np.searchsorted(-values, -values, side="left")  # where each tie group starts
        strictly_before = np.empty(row.size)
        strictly_before[order] = cumulative[first_of_value]
        keep &= strictly_before < top_p
    if min_p > 0.0:
        keep &= scaled >= scaled[keep].max() + np.log(min_p)
    probs = np.where(keep, np.exp(scaled - scaled[keep].max()), 0.0)
    return probs / probs.sum()


def draw(row: torch.Tensor, params: SamplingParams, draws: int, rows_per_call: int = 2048,
         prompt: list[int] = (1,)) -> np.ndarray:
    """Token counts of `draws` samples from `row`; with a seed, every sample is a request of its own seed."""
    sampler = Sampler(device=torch.device(DEVICE))
    logits = row.to(DEVICE).repeat(rows_per_call, 1)
    counts = torch.zeros(row.numel(), dtype=torch.int64, device=DEVICE)
    for call in range(draws // rows_per_call):
        seed = None if params.seed is None else call * rows_per_call
        seqs = [Sequence(list(prompt), SamplingParams(**{**_fields(params),
                                                          "seed": None if seed is None else seed + i}))
                for i in range(rows_per_call)]
        tokens = sampler(logits, sampler.prepare(seqs)).token_ids
        counts += torch.bincount(tokens, minlength=row.numel())
    return counts.cpu().numpy()


def _fields(params: SamplingParams) -> dict:
    return dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                seed=params.seed, repetition_penalty=params.repetition_penalty)


OPTIONS = [dict(temperature=1.0), dict(temperature=0.6, top_k=20), dict(temperature=0.6, top_k=20, top_p=0.95),
           dict(temperature=1.0, top_k=200, top_p=0.5), dict(temperature=0.8, top_p=0.9),
           dict(temperature=0.8, min_p=0.2), dict(temperature=1.2, top_k=50, top_p=0.8, min_p=0.1),
           # top-p alone (no top-k bounds its candidates): Llama 3's defaults, and more p with and without
           # temperature
           dict(temperature=0.6, top_p=0.9), dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, top_p=0.95),
           dict(temperature=0.3, top_p=0.8)]


SHORT = dict(temperature="T", top_k="k", top_p="p", min_p="m", repetition_penalty="r")
DRAWS = 64 * 2048


def the_row(ties: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(VOCAB, generator=gen) * 2.5
    if ties:  # a few dozen distinct values, each held by hundreds to thousands of tokens
        row = torch.round(row * 2) / 2
    return row.to(torch.bfloat16)  # what the LM head hands over


def chi_square(counts: np.ndarray, probs: np.ndarray, draws: int) -> tuple[int, float, int]:
    """(draws of tokens the options exclude, chi2, degrees of freedom) of `counts` against `probs`."""
    expected = probs * draws
    big = expected >= 5
    observed_bins = np.append(counts[big], counts[~big].sum())
    expected_bins = np.append(expected[big], expected[~big].sum())
    if expected_bins[-1] < 5:  # too few to be a bin of its own: merge into the smallest
        observed_bins, expected_bins = observed_bins[:-1], expected_bins[:-1]
    chi2 = float(((observed_bins - expected_bins) ** 2 / expected_bins).sum())
    return int(counts[probs == 0].sum()), chi2, len(expected_bins) - 1


def chi2_bound(dof: int) -> float:
    return dof + 6 * (2 * dof) ** 0.5 + 10  # about 6 standard deviations


def assert_follows(counts: np.ndarray, probs: np.ndarray, label: str) -> None:
    excluded, chi2, dof = chi_square(counts, probs, DRAWS)
    print(f"\n{label}: {int((probs > 0).sum())} tokens kept, chi2 {chi2:.1f} over {dof} dof")
    assert excluded == 0, "drew a token the options exclude"
    assert dof >= 1
    assert chi2 < chi2_bound(dof), (chi2, dof)


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{SHORT[k]}{v}" for k, v in o.items()))
def test_sampled_distribution_is_the_options_distribution(options, seeded):
    row = the_row()
    params = SamplingParams(**options, seed=0 if seeded else None)
    counts = draw(row, params, DRAWS)
    probs = reference_probs(row.double().numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    assert_follows(counts, probs, f"{options} seeded={seeded}")


@pytest.mark.parametrize("options", [dict(temperature=1.0, top_p=0.9), dict(temperature=0.6, top_p=0.5),
                                     dict(temperature=0.6, top_k=20, top_p=0.95)],
                         ids=lambda o: "-".join(f"{SHORT[k]}{v}" for k, v in o.items()))
def test_ties_at_the_edge_are_kept_or_dropped_together(options):
    row = the_row(ties=True)
    params = SamplingParams(**options)
    counts = draw(row, params, DRAWS)
    probs = reference_probs(row.double().numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    assert_follows(counts, probs, f"{options} on a row of ties")


# Qwen2.5's defaults; top-p alone with the penalty (float32 logits through the search); a penalty strong enough
# to reorder the top tokens
PENALISED = [dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
             dict(temperature=0.6, top_p=0.9, repetition_penalty=1.05),
             dict(temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.5)]


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("options", PENALISED, ids=lambda o: "-".join(f"{SHORT[k]}{v}" for k, v in o.items()))
def test_penalised_distribution_is_the_options_distribution(options, seeded):
    row = the_row()
    # the prompt holds 30 of the 40 most likely tokens (and 30 others), so the penalty changes who is kept
    gen = torch.Generator().manual_seed(7)
    top = row.float().topk(40).indices[torch.randperm(40, generator=gen)[:30]]
    prompt = top.tolist() + torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    params = SamplingParams(**options, seed=0 if seeded else None)
    counts = draw(row, params, DRAWS, prompt=prompt)
    probs = reference_probs(row.double().numpy(), params.temperature, params.top_k, params.top_p, params.min_p,
                            prompt, params.repetition_penalty)
    assert_follows(counts, probs, f"{options} seeded={seeded}")


@pytest.mark.parametrize("direction", ["up", "down"])
def test_the_check_fails_with_a_floor_one_value_off(monkeypatch, direction):
    """top-p's floor moved to the next distinct logit above (one value fewer kept) or below (one more): the
    distribution check above must fail (here with few tokens kept, where it can tell)."""
    search = sampling_floors.top_p_floors

    def one_value_off(logits, rows, temperatures, top_p, floors, **sizes):
        scratch = search(logits, rows, temperatures, top_p, floors, **sizes)
        x, floor = logits.index_select(0, rows).float(), floors.index_select(0, rows).unsqueeze(1)
        moved = (torch.where(x > floor, x, float("inf")).amin(dim=1) if direction == "up"
                 else torch.where(x < floor, x, float("-inf")).amax(dim=1))
        floors.index_copy_(0, rows, moved)
        return scratch

    monkeypatch.setattr(sampling_floors, "top_p_floors", one_value_off)
    row = the_row()
    params = SamplingParams(temperature=0.6, top_p=0.9)
    counts = draw(row, params, DRAWS)
    probs = reference_probs(row.double().numpy(), params.temperature, params.top_k, params.top_p, params.min_p)
    excluded, chi2, dof = chi_square(counts, probs, DRAWS)
    print(f"\nfloor one value {direction}: {excluded} excluded draws, chi2 {chi2:.1f} (bound {chi2_bound(dof):.1f})")
    assert excluded > 0 or chi2 >= chi2_bound(dof)


def test_seeded_row_draws_the_same_token_in_any_batch():
    gen = torch.Generator().manual_seed(1)
    row = (torch.randn(VOCAB, generator=gen) * 2).to(torch.bfloat16).cuda()
    sampler = Sampler(device=torch.device(DEVICE))
    for options in (dict(temperature=1.0), dict(temperature=0.6, top_k=20, top_p=0.95), dict(min_p=0.05)):
        seeded = SamplingParams(**options, seed=1234)
        target = Sequence([1], seeded)
        alone = sampler(row.unsqueeze(0), sampler.prepare([target])).token_ids.item()
        for size, at in ((2, 1), (257, 0), (257, 200), (100, 99)):
            others = torch.randn(size, VOCAB, generator=gen).to(torch.bfloat16).cuda()
            others[at] = row
            seqs = [Sequence([1], SamplingParams(temperature=1.0, seed=i if i % 2 else None, top_k=i % 3 * 10))
                    for i in range(size)]
            seqs[at] = target
            assert sampler(others, sampler.prepare(seqs)).token_ids[at].item() == alone, (options, size, at)
        target.append_token(0)  # the next step of the request: a different draw is allowed (and likely)
        steps = {alone}
        for _ in range(10):
            steps.add(sampler(row.unsqueeze(0), sampler.prepare([target])).token_ids.item())
            target.append_token(0)
        assert len(steps) > 1, options


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("qwen3-0.6b")), "Qwen3-0.6B", std=0.05, seed=1)


class RecordingSampler:
    """The engine's sampler, keeping each seeded row's (seed, step, logits, token) as it samples."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.records: list[tuple[int, int, torch.Tensor, int]] = []
        self.rows: list[tuple[int | None, int]] = []

    def prepare(self, seqs, fed_token_ids=None):
        self.rows = [(seq.params.seed, seq.num_completion_tokens) for seq in seqs]
        return self.sampler.prepare(seqs, fed_token_ids)

    def __call__(self, logits, tensors):
        output = self.sampler(logits, tensors)
        for row, (seed, step) in enumerate(self.rows):
            if seed is not None:
                self.records.append((seed, step, logits[row].clone(), output.token_ids[row]))
        return output

    def __getattr__(self, name: str) -> Any:
        # everything else the runner asks of its sampler (structured-output masks, close) is the real one's
        if name == "sampler":  # not set yet (a copy): no recursion
            raise AttributeError(name)
        return getattr(self.sampler, name)


def run_recorded(model_path: str, batches: list[tuple[list, list]], **options) -> tuple[list, RecordingSampler]:
    """Each (prompts, params) batch through one engine, one generate call each; the tokens of every request."""
    with LLM(model_path, gpu_memory_utilization=0.4, max_model_len=1024, **options) as llm:
        recorder = RecordingSampler(llm.model_runner.sampler)
        llm.model_runner.sampler = recorder
        preempt, preempted = llm.scheduler._preempt, []
        llm.scheduler._preempt = lambda seq: (preempted.append(seq.seq_id), preempt(seq))
        tokens = [o.outputs[0].token_ids for prompts, params in batches
                  for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_leaks(llm)
    if options.get("num_kvcache_blocks"):
        assert preempted, "the cache was meant to be too small for every sequence at once"
    return tokens, recorder


def test_seeded_requests_draw_alone_what_they_draw_in_a_crowd_after_preemption_and_without_graphs(model_path):
    """A seeded token is a function of the request's own logits, seed and step alone. Every seeded draw the engine
    makes (alone, among 256 other requests, through preemption, without CUDA graphs) is redrawn from its recorded
    logits in a batch of one and must match; and the tokens are the same as alone for as long as the logits are.

    Whole sequences agree less often: the logits are bf16 sums whose rounding changes with the batch's size, and
    in this random model about one token in ten is a near-tie that such rounding flips (as between transformers'
    bf16 and float32), after which the two sequences go separate ways."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(20, 300, (24,), generator=gen).tolist()
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in lengths]
    crowd = [torch.randint(0, 150000, (200,), generator=gen).tolist() for _ in range(256)]
    options = dict(temperature=0.6, top_k=20, top_p=0.95, max_tokens=32, ignore_eos=True)
    seeded = [SamplingParams(**options, seed=1000 + i) for i in range(len(prompts))]
    unseeded = SamplingParams(**options)
    runs = {"alone": run_recorded(model_path, [([p], [s]) for p, s in zip(prompts, seeded)])}
    tokens, recorder = run_recorded(model_path, [(crowd[:128] + prompts + crowd[128:],
                                                  [unseeded] * 128 + seeded + [unseeded] * 128)])
    runs["among 256 others"] = (tokens[128:], recorder)
    runs["with preemption"] = run_recorded(model_path, [(prompts + crowd[:24], seeded + [unseeded] * 24)],
                                           num_kvcache_blocks=10)
    runs["without CUDA graphs"] = run_recorded(model_path, [(prompts, seeded)], enforce_eager=True)
    alone_sampler = Sampler(device=torch.device("cuda"))
    steps: dict[str, dict[tuple[int, int], tuple[torch.Tensor, int]]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name, (tokens, recorder) in runs.items():
        outputs[name] = tokens[:len(prompts)]
        steps[name] = {}
        for seed, step, logits, token in recorder.records:
            request = Sequence([1], seeded[seed - 1000])
            for _ in range(step):
                request.append_token(0)
            redrawn = alone_sampler(logits.unsqueeze(0), alone_sampler.prepare([request])).token_ids.item()
            assert redrawn == int(token), (name, seed, step)  # the batch around it changed nothing
            steps[name][seed, step] = (logits, int(token))  # a replayed step: the last draw is the one kept
        for i, tokens in enumerate(outputs[name]):
            assert [steps[name][1000 + i, step][1] for step in range(len(tokens))] == tokens, (name, i)
    for name in ("among 256 others", "with preemption", "without CUDA graphs"):
        same_logits_steps, identical = 0, 0
        for i, (ours, theirs) in enumerate(zip(outputs["alone"], outputs[name])):
            identical += ours == theirs
            for step in range(len(ours)):
                if not torch.equal(steps["alone"][1000 + i, step][0], steps[name][1000 + i, step][0]):
                    break
                same_logits_steps += 1
                assert ours[step] == theirs[step], (name, i, step)
        print(f"\nalone vs {name}: {identical} of {len(prompts)} sequences identical; the logits were bit-equal "
              f"for the first {same_logits_steps / len(prompts):.1f} steps on average, and so were the tokens")
