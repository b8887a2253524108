"""Progress while the engine works (engine/progress.py): tokens counted at every step, and bars that show input
and output token rates before any request has finished."""
import json
import re

import pytest
from test_e2e_transformers import random_prompts

from nanovllm import LLM, SamplingParams
from nanovllm import cli as command_line
from nanovllm.engine import progress

SPEED = re.compile(r"(\d+)/(\d+) \[.*est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s\]")


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, num_kvcache_blocks=32, max_num_seqs=8, max_num_batched_tokens=64) as engine:
        yield engine


def frames(stderr: str) -> list[tuple[int, int, float, float]]:
    """(done, total, input rate, output rate) of every frame a tqdm bar drew."""
    return [(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in SPEED.finditer(stderr.replace("\r", "\n"))]


def test_the_engine_counts_prefilled_and_generated_tokens_at_every_step(llm):
    steps = []
    llm.token_counter.listeners.append(lambda: steps.append((llm.token_counter.prefilled,
                                                             llm.token_counter.generated)))
    try:
        before = llm.token_counter.prefilled, llm.token_counter.generated
        prompts = random_prompts([5, 9, 150], seed=70)  # 150 > the 64-token budget: a chunked prefill
        params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2),  # the 2nd sample shares it
                  SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.token_counter.listeners.clear()
    # every prompt token is prefilled once (the n=2 prompt too), every completion token is counted once
    assert steps[-1] == (before[0] + 5 + 9 + 150, before[1] + 4 + 2 * 3 + 2)
    generated = [g for _, g in steps]
    assert generated == sorted(generated) and len(set(generated)) > 3  # counted step by step, not at the end


def test_generate_shows_input_and_output_rates_before_the_first_request_finishes(llm, capsys, monkeypatch):
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)  # redraw at every step
    llm.generate(random_prompts([20, 30], seed=71), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    shown = frames(capsys.readouterr().err)
    assert shown[-1][:2] == (2, 2) and shown[-1][2] > 0 and shown[-1][3] > 0
    assert any(done == 0 and output > 0 for done, _, _, output in shown), shown


def test_a_hidden_bar_costs_the_engine_no_listener(llm):
    llm.generate(random_prompts([10], seed=72), SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.token_counter.listeners == []


def test_run_batch_bar_moves_with_the_engine_steps_not_only_finished_requests(tiny_model, tmp_path, capsys,
                                                                                 monkeypatch):
    monkeypatch.setattr(progress, "REFRESH_S", 0.0)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # both requests finish in the same step, so only the token rates can show the work before the end
    body = {"max_tokens": 24, "ignore_eos": True, "temperature": 0}
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions",
                                       "body": {"prompt": [3 + i, 40, 50, 60], **body}}) + "\n" for i in range(2)))
    assert command_line.main(["run-batch", "-i", str(inp), "-o", str(out), "--model", tiny_model,
                           "--num-kvcache-blocks", "32"]) == 0
    shown = frames(capsys.readouterr().err)
    assert shown[-1][:2] == (2, 2)
    before_first = [output for done, _, _, output in shown if done == 0]
    assert len(before_first) > 3 and before_first[-1] > 0, shown
