"""Top-p's floor without a sort (sampling/top_p_floor.py), in Triton's interpreter, against the float64 definition
(tests/top_p_reference.py, which also says how close to top_p a decision may go either way) and against the sort
that logit_floors' torch path does."""
import os

import numpy as np
import pytest
import torch
from top_p_reference import definition_floor, misjudged

from nanovllm.sampling import top_p_passes as passes
from nanovllm.sampling.floors import logit_floors
from nanovllm.sampling.top_p_floor import ScratchLayout, top_p_floors

# small sizes, so rows of a few thousand logits take every path: a second count, rounds in one program, the even
# splits, ties that do not fit the buffer
SMALL = dict(sample=64, candidates=128, tile_rows=32)


def search(logits: torch.Tensor, temperatures: list[float], top_p: list[float], rows: list[int] | None = None,
           start: list[float] | None = None, **sizes) -> tuple[torch.Tensor, list[int]]:
    """The floors top_p_floors leaves (from `start`, -inf by default) and the rounds each listed row took."""
    n = logits.size(0)
    rows = list(range(n)) if rows is None else rows
    floors = torch.tensor(start if start is not None else [float("-inf")] * n, dtype=torch.float32)
    scratch = top_p_floors(logits, torch.tensor(rows, dtype=torch.int64), torch.tensor(temperatures),
                           torch.tensor(top_p), floors, **sizes)
    layout = ScratchLayout(sizes.get("sample", 4096), sizes.get("candidates", 8192), sizes.get("tile_rows", 256))
    return floors, scratch[:, layout.state_at + passes.ROUNDS.value].int().tolist()


def assert_definitions(logits: torch.Tensor, temperatures: list[float], top_p: list[float], floors: torch.Tensor):
    for row in range(logits.size(0)):
        x = logits[row].float().numpy()
        assert misjudged(x, temperatures[row], top_p[row], floors[row].item()).size == 0, row
        assert floors[row].item() in set(x.tolist()), (row, floors[row].item())  # an actual logit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_floors_are_the_definitions_and_the_sorts(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 3000, generator=gen) * 2).to(dtype)
    logits[6] = logits[6] * 0.3  # flat
    logits[7, :5] += 12  # peaked
    temperatures = [1.0, 0.6, 1.5, 0.3, 0.05, 1.0, 0.6, 0.8]
    top_p = [0.5, 0.9, 0.99, 0.05, 0.8, 0.95, 0.9, 0.9]
    floors, rounds = search(logits, temperatures, top_p, **SMALL)
    assert_definitions(logits, temperatures, top_p, floors)
    sort = logit_floors(logits, torch.tensor(temperatures), None, torch.tensor(top_p), None, 1,
                        torch.arange(8), fused=False)
    assert torch.equal(floors, sort), (floors, sort)
    assert max(rounds) >= 3  # the rounds in one program ran


def test_ties_at_the_edge_stay_or_go_together():
    rows = torch.full((5, 1000), float("-inf"))
    rows[0, :3], rows[0, 3:8] = 2.0, 1.0  # the 2s hold 62% of the mass: top_p 0.7 keeps every 1, 0.5 none
    rows[1] = rows[0]
    rows[2, 0], rows[2, 1:501], rows[2, 501:] = 3.0, 1.0, 0.0  # the edge is a tie larger than the buffer
    rows[3, :2], rows[3, 2:40:2], rows[3, 3:40:2] = 1.0, 0.0, -0.0  # 0.0 and -0.0 are one value
    rows[4] = torch.randint(0, 5, (1000,)).float()  # five values: ties everywhere
    temperatures, top_p = [1.0, 1.0, 1.0, 1.0, 0.7], [0.7, 0.5, 0.3, 0.6, 0.6]
    floors, _ = search(rows, temperatures, top_p, **SMALL)
    assert floors[:4].tolist() == [1.0, 2.0, 1.0, 0.0]
    assert_definitions(rows, temperatures, top_p, floors)


def test_top_p_one_keeps_everything_and_a_tiny_top_p_the_maximum_with_its_ties():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2000, generator=gen).to(torch.bfloat16)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1
    floors, _ = search(logits, [1.0, 0.7, 0.7], [1.0, 1e-7, 1e-7], **SMALL)
    assert floors[0] == float("-inf")
    assert floors[1] == logits[1].float().max() and floors[2] == logits[2].float().max()


def test_minus_inf_logits_are_never_kept_and_a_row_without_logits_keeps_its_floor():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 2000, generator=gen)
    logits[0, ::3] = float("-inf")  # masked tokens (min_tokens, bad words)
    logits[1, 1:] = float("-inf")  # one token left
    logits[2] = float("-inf")
    floors, _ = search(logits, [1.0, 1.0, 1.0], [0.9, 0.9, 0.9], **SMALL)
    assert_definitions(logits[:2], [1.0, 1.0], [0.9, 0.9], floors[:2])
    assert floors[1] == logits[1, 0] and floors[2] == float("-inf")


def test_only_listed_rows_change_floors_only_rise_and_batch_order_does_not_matter():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 2500, generator=gen).to(torch.bfloat16)
    sizes = dict(sample=256, candidates=1024, tile_rows=32)
    alone, _ = search(logits, [0.8] * 5, [0.9] * 5, **sizes)
    start = [-7.0, 99.0, 0.5, -7.0, float("-inf")]  # e.g. min-p's floors
    floors, _ = search(logits, [0.8] * 5, [0.9] * 5, rows=[3, 1, 4], start=start, **sizes)
    assert floors[0] == -7.0 and floors[2] == 0.5  # not listed
    assert floors[1] == 99.0  # above top-p's: kept
    assert floors[3] == alone[3] and floors[4] == alone[4]


def test_rows_that_do_not_start_on_16_bytes():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 2999, generator=gen) * 2).to(torch.bfloat16)
    floors, _ = search(logits, [1.0, 0.6, 0.9], [0.9, 0.5, 0.95], **SMALL)
    assert_definitions(logits, [1.0, 0.6, 0.9], [0.9, 0.5, 0.95], floors)


def test_full_rows_with_the_default_sizes_take_one_count():
    """The benchmark's rows (a random model's nearly flat logits, Llama 3's defaults) and a peaked row."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(2, 151936, generator=gen) * 0.64).to(torch.bfloat16)
    logits[1, torch.randint(0, 151936, (20,), generator=gen)] += 14.0
    floors, rounds = search(logits, [0.6, 0.6], [0.9, 0.9])
    assert_definitions(logits, [0.6, 0.6], [0.9, 0.9], floors)
    assert floors[1] == definition_floor(logits[1].float().numpy(), 0.6, 0.9)
    assert rounds == [1, 1]


def test_logit_floors_searches_unbounded_rows_unless_told_to_sort():
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(4, 2048, generator=gen) * 2).to(torch.bfloat16)
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.2])
    top_k, top_p, min_p = torch.tensor([0, 20, 0, 0]), torch.tensor([0.9, 0.8, 0.5, 0.95]), torch.tensor([0.0] * 4)
    min_p[3] = 0.05
    unbounded = torch.tensor([0, 3])  # row 2 is greedy: no floor
    for parts in ((None, top_p, None), (top_k, top_p, min_p)):
        arguments = (logits, temperatures, *parts, 20, unbounded)
        searched = logit_floors(*arguments, fused=True)
        assert torch.equal(searched, logit_floors(*arguments, fused=True, top_p_by_sort=True))
        assert torch.equal(searched, logit_floors(*arguments, fused=False))
        assert searched[2] == float("-inf")
    assert np.isfinite(searched[[0, 1, 3]].numpy()).all()


def test_a_row_that_once_stalled_the_search_on_a_gpu():
    """The random Qwen3-0.6B logits row of tests/data on which a data-dependent bisection loop stalled a GPU
    program (the interpreter always finished it): the floor is the definition's."""
    bits = np.load(os.path.join(os.path.dirname(__file__), "data", "top_p_stalled_row.npz"))["logits_bf16_bits"]
    logits = torch.from_numpy(bits).view(torch.bfloat16).unsqueeze(0)
    floors, rounds = search(logits, [0.6], [0.9])
    assert_definitions(logits, [0.6], [0.9], floors)
    assert rounds == [1]
