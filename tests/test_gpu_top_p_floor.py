"""Top-p's floor searched on the GPU (sampling/top_p_floor.py) for full 151,936-token rows of many shapes, against the
float64 definition (tests/top_p_reference.py): every row's kept set exactly, borderline values aside."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from top_p_reference import misjudged

from nanovllm.sampling import top_p_passes as passes
from nanovllm.sampling.floors import logit_floors
from nanovllm.sampling.top_p_floor import ScratchLayout, top_p_floors

pytestmark = pytest.mark.gpu
VOCAB = 151936


def rows_of_every_shape(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """64 rows: a random model's flat logits, wider ones, peaked ones (a few tokens far above the rest), ties,
    masked tokens; with temperatures 0.05-1.5 and top_p 0.01-0.99 (logits, temperatures, top_p)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, VOCAB, generator=gen)
    rows[:16] *= 0.64
    rows[16:32] *= 2.5
    rows[32:48] *= 2.0
    for row in range(32, 48):
        rows[row, torch.randint(0, VOCAB, (20,), generator=gen)] += 14.0
    rows[48:56] = torch.round(rows[48:56] * 2) / 2
    rows[56:, ::3] = float("-inf")
    temperatures = torch.tensor([0.6, 1.0, 0.3, 1.5, 0.05, 0.7, 0.8, 1.2] * 8)
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.8, 0.01, 0.7, 0.9] * 8)[torch.randperm(64, generator=gen)]
    return rows.to(dtype), temperatures, top_p


def assert_definitions(logits: torch.Tensor, temperatures: torch.Tensor, top_p: torch.Tensor,
                       floors: torch.Tensor) -> None:
    rows, floors = logits.float().cpu().numpy(), floors.cpu().numpy()
    wrong = [row for row in range(len(rows))
             if misjudged(rows[row], temperatures[row].item(), top_p[row].item(), floors[row]).size]
    assert not wrong, f"rows {wrong} keep or drop tokens the definition does not"
    assert all(floors[row] in rows[row] for row in range(len(rows)))  # actual logits


@pytest.mark.parametrize("sizes", [{}, dict(sample=256, candidates=256)], ids=["default", "small-buffers"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_floors_are_the_definitions(dtype, sizes):
    logits, temperatures, top_p = rows_of_every_shape(dtype)
    logits, temperatures, top_p = logits.cuda(), temperatures.cuda(), top_p.cuda()
    floors = torch.full((64,), float("-inf"), device="cuda")
    scratch = top_p_floors(logits, torch.arange(64, device="cuda"), temperatures, top_p, floors, **sizes)
    layout = ScratchLayout(sizes.get("sample", 4096), sizes.get("candidates", 8192), 256)
    rounds = scratch[:, layout.state_at + passes.ROUNDS.value].int().tolist()
    print(f"\n{dtype} {sizes}: rows by rounds {np.bincount(rounds).tolist()}")
    assert_definitions(logits, temperatures, top_p, floors)
    sort = logit_floors(logits, temperatures, None, top_p, None, 1, torch.arange(64, device="cuda"),
                        top_p_by_sort=True)
    assert_definitions(logits, temperatures, top_p, sort)
    print(f"{int((floors != sort).sum())} of 64 floors differ from the sort's (borderline values)")
    if sizes:
        assert max(rounds) >= 3  # rows went through the rounds in one program


def test_floors_do_not_depend_on_the_batch_and_repeat_exactly():
    logits, temperatures, top_p = (t.cuda() for t in rows_of_every_shape(torch.bfloat16))
    floors = [torch.full((64,), float("-inf"), device="cuda") for _ in range(3)]
    top_p_floors(logits, torch.arange(64, device="cuda"), temperatures, top_p, floors[0])
    top_p_floors(logits, torch.arange(64, device="cuda"), temperatures, top_p, floors[1])
    order = torch.randperm(64, generator=torch.Generator().manual_seed(1))
    top_p_floors(logits[order].contiguous(), torch.arange(64, device="cuda"), temperatures[order], top_p[order],
                 floors[2])
    assert torch.equal(floors[0], floors[1])
    assert torch.equal(floors[0][order.cuda()], floors[2])


def test_a_floor_one_value_off_is_caught():
    """The check above fails for floors moved to the next distinct logit, up or down (where there is one), except
    where the value moved across holds a borderline share of the mass (rows keeping 100,000 tokens or more)."""
    logits, temperatures, top_p = rows_of_every_shape(torch.bfloat16)
    floors = torch.full((64,), float("-inf"), device="cuda")
    top_p_floors(logits.cuda(), torch.arange(64, device="cuda"), temperatures.cuda(), top_p.cuda(), floors)
    x, floor = logits.float(), floors.cpu().unsqueeze(1)
    up = torch.where(x > floor, x, float("inf")).amin(dim=1)
    down = torch.where(x < floor, x, float("-inf")).amax(dim=1)
    moves = caught = 0
    for moved in (up, down):
        for row in range(64):
            if np.isfinite(moved[row].item()):
                moves += 1
                caught += misjudged(x[row].numpy(), temperatures[row].item(), top_p[row].item(),
                                    moved[row].item()).size > 0
    print(f"\n{caught} of {moves} floors moved one value caught")
    assert moves >= 100 and caught >= moves - 3


STALLED_ROW = os.path.join(os.path.dirname(__file__), "data", "top_p_stalled_row.npz")
CHILD = """
import sys, numpy as np, torch
from nanovllm.sampling.top_p_floor import top_p_floors
bits = np.load(sys.argv[1])["logits_bf16_bits"]
logits = torch.from_numpy(bits).view(torch.bfloat16).unsqueeze(0).cuda()
floors = torch.full((1,), float("-inf"), device="cuda")
one = torch.ones(1, device="cuda")
top_p_floors(logits, torch.zeros(1, dtype=torch.int64, device="cuda"), one * 0.6, one * 0.9, floors)
print(floors.item())
"""


def test_a_row_that_once_stalled_the_search_ends_at_the_definition():
    """A random Qwen3-0.6B's logits row (T 0.6, top_p 0.9) on which a bisection whose trip count depended on the data
    stalled the GPU program for good. In a child process, so a stall fails the test rather than hanging the suite."""
    done = subprocess.run([sys.executable, "-c", CHILD, STALLED_ROW], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    floor = float(done.stdout.strip().splitlines()[-1])
    row = torch.from_numpy(np.load(STALLED_ROW)["logits_bf16_bits"]).view(torch.bfloat16).float().numpy()
    assert misjudged(row, 0.6, 0.9, floor).size == 0 and floor in row
