"""`nanovllm run-batch`: OpenAI batch files through the engine, one record per request, resumable after a kill."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hf_reference import hf_greedy
from transformers import AutoTokenizer

from nanovllm import LLM, SamplingParams
from nanovllm import cli as command_line
from nanovllm.batch import flags
from nanovllm.batch import io as batch_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = ["--num-kvcache-blocks", "32", "--max-model-len", "512"]
TIMEOUT = 600  # seconds: only a bound for a hung run; a loaded CI machine can be many times slower than usual


def request(custom_id: str | None, body: dict, url: str = "/v1/completions") -> dict:
    line = {"method": "POST", "url": url, "body": body}
    return line if custom_id is None else {"custom_id": custom_id, **line}


def write_lines(path, lines: list) -> str:
    """Dicts become JSON lines; strings and bytes are written as they are (bad lines)."""
    with open(path, "wb") as f:
        for line in lines:
            data = line if isinstance(line, bytes) else (line if isinstance(line, str) else json.dumps(line)).encode()
            f.write(data + b"\n")
    return str(path)


def records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def by_id(path) -> dict[str | None, dict]:
    found = records(path)
    ids = [r["custom_id"] for r in found if r["custom_id"] is not None]
    assert len(ids) == len(set(ids)), "a custom_id answered twice"
    return {r["custom_id"]: r for r in found}


def cli(*args: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "nanovllm", "run-batch", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, encoding="utf-8", errors="replace", **popen)


def kill_after_records(proc: subprocess.Popen, out, count: int) -> int:
    """SIGKILL a run once its output holds `count` records; returns how many complete ones it holds then (the kill
    may have torn one more)."""
    try:
        deadline = time.monotonic() + TIMEOUT
        while (not out.exists() or out.read_bytes().count(b"\n") < count) and proc.poll() is None:
            assert time.monotonic() < deadline, "the run wrote nothing"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
    written = out.read_bytes().count(b"\n")
    assert written >= count, f"the run ended with {written} records, before the kill"
    return written


def choices(record: dict) -> list:
    """What must not change between runs: everything in a result but its ids and timestamp."""
    body = record["response"]["body"]
    return [body["object"], body["choices"], body["usage"]]


@pytest.mark.slow
def test_cli_greedy_results_equal_transformers(tiny_model, hf_model, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": 8, "skip_special_tokens": False}
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    lines = [request("text", {"prompt": "The quick brown fox", **greedy}),
             request("ids", {"prompt": [5, 17, 300, 42, 8, 99], "model": "ignored", "n": 1, **greedy}),
             request("chat", {"messages": conversation, "chat_template_kwargs": {"enable_thinking": False},
                              "max_completion_tokens": 8, **{k: v for k, v in greedy.items() if k != "max_tokens"}},
                     url="/v1/chat/completions")]
    prompts = {"text": tokenizer.encode("The quick brown fox"), "ids": [5, 17, 300, 42, 8, 99],
               "chat": tokenizer.encode(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                                      tokenize=False))}
    out = tmp_path / "out.jsonl"
    proc = cli("-i", write_lines(tmp_path / "in.jsonl", lines), "-o", str(out), "--model", tiny_model, *ENGINE)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    assert "3 succeeded, 0 failed, 0 skipped" in stderr
    results = by_id(out)
    assert set(results) == set(prompts)
    for custom_id, prompt in prompts.items():
        record = results[custom_id]
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert record["id"].startswith("batch_req_")
        body = record["response"]["body"]
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}
        [choice] = body["choices"]
        assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
        expected = tokenizer.decode(hf_greedy(hf_model, prompt, 8), skip_special_tokens=False)
        if custom_id == "chat":
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            assert choice["message"] == {"role": "assistant", "content": expected}
        else:
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert choice["text"] == expected


def test_each_bad_line_gets_one_error_record_and_the_rest_succeed(tiny_model, tmp_path):
    ok = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    lines = [
        request("good-1", ok),
        "{this is not json",
        request(None, ok),  # no custom_id
        b'{"custom_id": "latin-1", "body": "caf\xe9"}',  # not UTF-8
        "[1, 2]",
        request("bad-url", ok, url="/v1/embeddings"),
        request("unsupported", {**ok, "logit_bias": {"5": 10}}),
        request("tools", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                url="/v1/chat/completions"),
        request("bad-param", {**ok, "temperature": -1}),
        request("absurd-n", {**ok, "n": 10**9}),  # refused before a sample is made, not a stalled run
        request("huge-seed", {**ok, "seed": 2**64}),
        request("bad-chat-logprobs", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3},
                url="/v1/chat/completions"),
        request("too-long", {**ok, "prompt": list(range(1, 600))}),
        request("too-long-text", {**ok, "prompt": "word " * 600}),
        request("outside-vocab", {**ok, "prompt": [1, 2, 5000]}),  # caught by the engine, not the runner
        request("stop-outside-vocab", {**ok, "stop_token_ids": [10**6]}),
        request("good-2", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                           "max_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 2},
                url="/v1/chat/completions"),
        request("good-3", {**ok, "n": 2, "temperature": 1.0, "seed": 7, "logprobs": 1, "presence_penalty": 0.5}),
    ]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    found = records(out)
    assert len(found) == len(lines)
    results = by_id(out)
    codes = {cid: r["error"]["code"] for cid, r in results.items() if r["error"] is not None and cid is not None}
    assert codes == {"bad-url": "invalid_url", "unsupported": "unsupported_parameter", "tools": "unsupported_parameter",
                     "bad-param": "invalid_request", "absurd-n": "invalid_request", "huge-seed": "invalid_request",
                     "bad-chat-logprobs": "invalid_request",
                     "too-long": "prompt_too_long", "too-long-text": "prompt_too_long",
                     "outside-vocab": "invalid_request", "stop-outside-vocab": "invalid_request"}
    assert "temperature" in results["bad-param"]["error"]["message"]
    assert results["absurd-n"]["error"]["message"] == ("line 10: SamplingParams.n=1000000000 is out of range: "
                                                       "allowed an integer in [1, 16384]")
    assert results["huge-seed"]["error"]["message"] == ("line 11: SamplingParams.seed=18446744073709551616 is out of "
                                                        "range: allowed None or an integer in [-2**63, 2**63)")
    assert "logit_bias" in results["unsupported"]["error"]["message"]
    id_less = sorted((r["error"]["code"], r["error"]["message"].split(":")[0]) for r in found if r["custom_id"] is None)
    assert id_less == [("invalid_json", "line 2"), ("invalid_json", "line 4"), ("invalid_json", "line 5"),
                       ("missing_custom_id", "line 3")]
    for r in found:
        if r["error"] is not None:
            assert r["response"] is None
    for cid in ("good-1", "good-2", "good-3"):
        assert results[cid]["error"] is None and results[cid]["response"]["status_code"] == 200
    chat = results["good-2"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chat) == 2 and all(len(t["top_logprobs"]) == 2 and t["top_logprobs"][0]["logprob"] >= t["logprob"]
                                  for t in chat)
    samples = results["good-3"]["response"]["body"]["choices"]
    assert [c["index"] for c in samples] == [0, 1]
    assert all(len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"]) for c in samples)
    # a second run answers nothing again: error records count as answered, id-less ones by their line
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    assert records(out) == found



def test_lines_no_parser_or_tokenizer_can_take_get_records_and_the_rest_run(tiny_model, tmp_path):
    ok = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
    chat = "/v1/chat/completions"
    lines = [
        request("good-1", ok),
        '{"custom_id": "lone-surrogate-prompt", "url": "/v1/completions", "body": {"prompt": "a\\ud800b"}}',
        '{"custom_id": "lone-surrogate-chat", "url": "/v1/chat/completions", "body": {"messages": '
        '[{"role": "user", "content": "x\\udc00"}]}}',
        '{"custom_id": "id-\\ud800", "url": "/v1/completions", "body": {"prompt": [4, 5], "max_tokens": 2}}',
        "[" * 100_000,  # nested deeper than the JSON parser recurses
        request("good-2", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, url=chat),
    ]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    found = records(out)  # every line valid JSON, so valid UTF-8 too (records() reads it strictly)
    assert len(found) == len(lines)
    results = by_id(out)
    for cid in ("lone-surrogate-prompt", "lone-surrogate-chat"):
        assert results[cid]["error"]["code"] == "invalid_request"
        assert "cannot be tokenized" in results[cid]["error"]["message"]
    assert results["id-\ud800"]["error"] is None  # kept: the output escapes it, as JSON allows
    assert results["id-\ud800"]["response"]["body"]["usage"]["completion_tokens"] == 2
    assert b'"id-\\ud800"' in out.read_bytes()
    assert [r["error"]["code"] for r in found if r["custom_id"] is None] == ["invalid_json"]
    assert results["good-1"]["error"] is None and results["good-2"]["error"] is None
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    assert records(out) == found  # resume: nothing answered twice

def test_duplicate_custom_ids_stop_the_run_before_any_output(tiny_model, tmp_path, capsys):
    lines = [request("a", {"prompt": "x"}), request("b", {"prompt": "y"}), request("a", {"prompt": "z"}),
             request("b", {"prompt": "w"}), request("c", {"prompt": "v"}), request("a", {"prompt": "u"})]
    out = tmp_path / "out.jsonl"
    code = command_line.main(["run-batch", "-i", write_lines(tmp_path / "in.jsonl", lines), "-o", str(out),
                           "--model", tiny_model])
    assert code != 0 and not out.exists()
    err = capsys.readouterr().err
    assert "'a' on lines 1, 3, 6" in err and "'b' on lines 2, 4" in err and "'c'" not in err


def test_command_line_usage_errors_and_engine_options(tiny_model):
    with pytest.raises(SystemExit) as exit_info:
        command_line.main(["serve", "--model", tiny_model])
    assert exit_info.value.code == 2
    args = command_line.build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m",
                                                "--max-num-seqs", "4", "--no-async-scheduling", "--enforce-eager"])
    assert flags.engine_options(args) == {"max_num_seqs": 4, "async_scheduling": False, "enforce_eager": True}
    args = command_line.build_parser().parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m"])
    assert flags.engine_options(args) == {}  # the engine's own defaults hold


def test_read_output_finds_a_torn_last_line_and_drop_torn_truncates_only_it(tmp_path):
    path = tmp_path / "out.jsonl"
    good = [batch_io.success_record("a", {}), batch_io.error_record(None, 7, "invalid_json", "bad")]
    complete = "".join(json.dumps(r) + "\n" for r in good)
    for torn in ['{"id": "batch_req_1", "custom_id": "b", "resp', json.dumps(batch_io.success_record("b", {})),
                 "not json at all"]:  # cut mid-record; whole but without its newline; no JSON and no newline
        path.write_text(complete + torn)
        done = batch_io.read_output(str(path))
        assert path.read_text() == complete + torn  # reading changes nothing
        assert done.torn == batch_io.Torn(line=3, offset=len(complete), size=len(torn))
        batch_io.drop_torn(str(path), done.torn)
        assert path.read_text() == complete
        assert "a" in done.ids and len(done.ids) == 1 and done.lines == {7}
        assert done.has("a", 1) and done.has(None, 7) and not done.has("b", 2)
    assert batch_io.read_output(str(path)).torn is None
    # a whole line (newline and all) that is not a record is not what a kill leaves, at the end or in the middle:
    # refused rather than dropped as if torn
    for garbage in ("garbage\n", '{"half": "a record"\n', "[1, 2]\n"):
        for after in ("", complete):  # the end first: the case once dropped as torn
            path.write_text(complete + garbage + after)
            with pytest.raises(ValueError) as caught:
                batch_io.read_output(str(path))
            assert str(caught.value) == (f"{path}: line 3 is not a valid JSON record, and not a torn last write "
                                         f"(that has no newline), so fix or remove that line by hand")
    missing = batch_io.read_output(str(tmp_path / "missing.jsonl"))
    assert len(missing.ids) == 0 and not missing.lines and missing.torn is None


def test_an_output_that_is_the_input_is_refused_however_spelled(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    inp = write_lines(tmp_path / "in.jsonl", [request("a", {"prompt": "x"})])
    before = (tmp_path / "in.jsonl").read_bytes()
    os.symlink("in.jsonl", tmp_path / "link.jsonl")
    os.link("in.jsonl", tmp_path / "hard.jsonl")
    for output in ("in.jsonl", "./in.jsonl", inp, "link.jsonl", "hard.jsonl"):
        code = command_line.main(["run-batch", "-i", "in.jsonl", "-o", output, "--model", tiny_model])
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"the output file {output!r} is the input file 'in.jsonl'" in err
        assert "skipped" not in err  # refused before any work, not "0 succeeded, 1 skipped"
    assert (tmp_path / "in.jsonl").read_bytes() == before


def test_an_engine_that_cannot_start_creates_or_changes_no_output(tiny_model, tmp_path, capsys):
    inp = write_lines(tmp_path / "in.jsonl", [request("a", {"prompt": [1, 2, 3], "max_tokens": 2}),
                                              request("b", {"prompt": [4, 5, 6], "max_tokens": 2})])
    out = tmp_path / "out.jsonl"
    for engine in (["--model", str(tmp_path / "no-such-model")], ["--model", tiny_model, "--max-num-seqs", "0"]):
        assert command_line.main(["run-batch", "-i", inp, "-o", str(out), *engine]) == 1
        assert "cannot start the engine" in capsys.readouterr().err
        assert not out.exists()
    missing_folder = tmp_path / "no-such-folder" / "out.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(missing_folder), "--model", tiny_model]) == 1
    assert "does not exist" in capsys.readouterr().err and not missing_folder.parent.exists()
    # a resumable output with a torn last line: untouched by a run that cannot start, repaired (and said so) by
    # one that can
    torn = b'{"id": "batch_req_torn", "custom_id": "b", "resp'
    out.write_bytes(json.dumps(batch_io.success_record("a", {})).encode() + b"\n" + torn)
    before = out.read_bytes()
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", str(tmp_path / "no-such-model")]) == 1
    assert out.read_bytes() == before and "dropped" not in capsys.readouterr().err
    assert command_line.main(["run-batch", "-i", inp, "-o", str(out), "--model", tiny_model, *ENGINE]) == 0
    err = capsys.readouterr().err
    assert f"{out}: dropped its last line, line 2 ({len(torn)} bytes)" in err
    assert "1 succeeded, 0 failed, 1 skipped" in err
    assert sorted(by_id(out)) == ["a", "b"]


def test_every_flag_has_a_help_text_that_says_its_default():
    parser = command_line.build_parser()
    [run] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)][0].choices.values()
    flags = {a.option_strings[-1] if a.option_strings[-1].startswith("--") else a.option_strings[0]: a.help
             for a in run._actions if a.option_strings and a.dest != "help"}
    assert len(flags) == 20  # -i, -o, --model, the 15 engine flags, and the data-parallel size and backend
    assert all(text and len(text) > 20 for text in flags.values()), [f for f, text in flags.items() if not text]
    optional = [flag for flag in flags if flag not in ("--input-file", "--output-file", "--model")]
    assert all("default" in flags[flag] for flag in optional), [f for f in optional if "default" not in flags[f]]
    # the engine's defaults, read from Config
    assert "(default: 512)" in flags["--max-num-seqs"] and "(default: 4096," in flags["--max-model-len"]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_answers_each_request_once(tiny_model, tmp_path):
    # r0 is long, so the run is still busy with it when the short ones have been written and the kill comes
    lines = [request(f"r{i}", {"prompt": [7 + i, 100 + 3 * i, 40], "max_tokens": 320 if i == 0 else 24 + i % 9,
                               "temperature": 0, "ignore_eos": True}) for i in range(40)]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    engine = [*ENGINE, "--max-num-seqs", "4"]  # requests finish a few at a time
    written = kill_after_records(cli("-i", inp, "-o", str(out), "--model", tiny_model, *engine), out, 3)
    assert written < 40, "the kill should land mid-run"
    with open(out, "a") as f:  # and as if it had also landed mid-write
        f.write('{"id": "batch_req_torn", "custom_id": "r0", "response": {"status_')
    proc = cli("-i", inp, "-o", str(out), "--model", tiny_model, *engine)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, stderr
    assert f"{40 - written} succeeded, 0 failed, {written} skipped" in stderr
    resumed = by_id(out)
    assert sorted(resumed) == sorted(f"r{i}" for i in range(40))
    reference = tmp_path / "reference.jsonl"
    assert command_line.main(["run-batch", "-i", inp, "-o", str(reference), "--model", tiny_model, *engine]) == 0
    uninterrupted = by_id(reference)
    assert {cid: choices(r) for cid, r in resumed.items()} == {cid: choices(r) for cid, r in uninterrupted.items()}


def test_iter_generate_pulls_prompts_only_as_far_as_its_window(tiny_model):
    pulled = 0

    def prompts():
        nonlocal pulled
        for i in range(60):
            pulled += 1
            yield [3 + i, 9, 27]

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_model, num_kvcache_blocks=32, max_model_len=512, max_num_seqs=2) as llm:
        for window, bound in ((6, 6), (None, 4)):  # the default: 2 x max_num_seqs
            pulled = 0
            stream = llm.iter_generate(prompts(), params, window=window, errors="yield")
            first_index, _ = next(stream)
            pulled_at_first = pulled
            rest = list(stream)
            assert pulled_at_first <= bound + 1, f"{pulled_at_first} prompts pulled before the first output"
            assert sorted([first_index] + [i for i, _ in rest]) == list(range(60))
            assert all(not isinstance(out, Exception) and len(out.outputs[0].token_ids) == 4 for _, out in rest)
