"""Structured outputs across processes: run-batch's response_format and structured_outputs fields (a spec that
does not compile is its line's error; kill -9 and resume answers each line once), tensor parallelism and data
parallelism over processes."""
import json
import re

import pytest
from test_run_batch import ENGINE, TIMEOUT, by_id, choices, cli, kill_after_records, request, write_lines
from test_structured_outputs import SCHEMA, check_schema

from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm import cli as command_line
from nanovllm.data_parallel import DataParallel

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def lines() -> list[dict]:
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    return [
        request("schema", {"messages": MESSAGES, "max_tokens": 120, "seed": 1, "response_format": schema_format},
                CHAT),
        request("object", {"messages": MESSAGES, "max_tokens": 40, "seed": 2, "temperature": 0,
                           "response_format": {"type": "json_object"}}, CHAT),
        request("text", {"messages": MESSAGES, "max_tokens": 8, "response_format": {"type": "text"}}, CHAT),
        request("regex", {"prompt": "Code:", "max_tokens": 20, "structured_outputs": {"regex": r"[A-Z]{3}\d{2}"}}),
        request("choice", {"messages": MESSAGES, "max_tokens": 20,
                           "structured_outputs": {"choice": ["alpha", "beta"]}}, CHAT),
        request("bad-regex", {"prompt": "x", "structured_outputs": {"regex": "[a-"}}),
        request("bad-schema", {"messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "frob"}}}}, CHAT),
        request("two-kinds", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}),
        request("unknown-field", {"prompt": "x", "structured_outputs": {"regexp": "a"}}),
        request("both-fields", {"prompt": "x", "response_format": {"type": "json_object"},
                                "structured_outputs": {"regex": "a"}}),
        request("bad-format", {"prompt": "x", "response_format": {"type": "yaml"}}),
        request("with-ignore-eos", {"prompt": "x", "ignore_eos": True, "structured_outputs": {"regex": "a+"}}),
    ]


def content(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_run_batch_constrains_each_line_and_a_bad_spec_is_its_own_error(tiny_model, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", lines())
    out = tmp_path / "out.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    found = by_id(out)
    check_schema(json.loads(content(found["schema"]), strict=False))
    object_finish = found["object"]["response"]["body"]["choices"][0]["finish_reason"]
    assert content(found["object"]).startswith("{")
    if object_finish == "stop":
        assert isinstance(json.loads(content(found["object"]), strict=False), dict)
    assert found["text"]["response"]["status_code"] == 200
    assert re.fullmatch(r"[A-Z]{3}\d{2}", content(found["regex"]))
    assert content(found["choice"]) in ("alpha", "beta")
    errors = {cid: r["error"] for cid, r in found.items() if r["error"] is not None}
    assert sorted(errors) == ["bad-format", "bad-regex", "bad-schema", "both-fields", "two-kinds",
                              "unknown-field", "with-ignore-eos"]
    assert all(set(e) == {"code", "message"} for e in errors.values())
    assert "regex does not compile" in errors["bad-regex"]["message"]
    assert "json does not compile" in errors["bad-schema"]["message"]
    assert "got regex and choice" in errors["two-kinds"]["message"]
    assert errors["unknown-field"]["code"] == "unsupported_parameter" and "'regexp'" in errors["unknown-field"][
        "message"]
    assert "not both" in errors["both-fields"]["message"] and "yaml" in errors["bad-format"]["message"]
    assert "ignore_eos=True cannot be combined with structured_outputs" in errors["with-ignore-eos"]["message"]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_answers_each_constrained_line_once(tiny_model, tmp_path):
    spec = {"regex": r"[a-z]{30,60}"}
    batch = [request(f"r{i}", {"prompt": [7 + i, 40], "max_tokens": 64, "seed": i, "structured_outputs": spec})
             for i in range(30)] + [request("bad", {"prompt": "x", "structured_outputs": {"regex": "(("}})]
    inp = write_lines(tmp_path / "in.jsonl", batch)
    out = tmp_path / "out.jsonl"
    engine = [*ENGINE, "--max-num-seqs", "2"]
    written = kill_after_records(cli("-i", inp, "-o", str(out), "--model", tiny_model, *engine), out, 3)
    assert written < len(batch), "the kill should land mid-run"
    proc = cli("-i", inp, "-o", str(out), "--model", tiny_model, *engine)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    resumed = by_id(out)
    assert sorted(resumed) == sorted([f"r{i}" for i in range(30)] + ["bad"])
    assert "does not compile" in resumed["bad"]["error"]["message"]
    reference = tmp_path / "reference.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(reference), "--model", tiny_model, *engine]) == 0
    uninterrupted = by_id(reference)
    ok = [cid for cid in resumed if cid != "bad"]
    assert {cid: choices(resumed[cid]) for cid in ok} == {cid: choices(uninterrupted[cid]) for cid in ok}
    assert all(re.fullmatch(r"[a-z]{30,60}", content(resumed[cid])) for cid in ok
               if resumed[cid]["response"]["body"]["choices"][0]["finish_reason"] == "stop")


GREEDY_JSON = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
    json=SCHEMA, disable_any_whitespace=True))


@pytest.mark.slow
def test_tensor_and_data_parallel_each_run_a_constrained_request_as_one_engine_does(tiny_model):
    prompts = [[5, 6, 7], [9, 10]]
    options = {"num_kvcache_blocks": 32, "max_model_len": 512, "max_num_seqs": 2}
    with LLM(tiny_model, **options) as single:
        outputs = single.generate(prompts, GREEDY_JSON, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outputs]
    check_schema(json.loads(outputs[0].outputs[0].text, strict=False))
    with LLM(tiny_model, tensor_parallel_size=2, **options) as tp:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, GREEDY_JSON, use_tqdm=False)] == expected
    with DataParallel(tiny_model, 2, "mp", **options) as dp:
        found = {i: out.outputs[0].token_ids for i, out in dp.iter_generate(prompts * 2, GREEDY_JSON)}
    assert [found[i] for i in range(4)] == expected * 2
