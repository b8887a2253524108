"""What a new user meets first: the install line, the command line, hub ids, chat content, seeds, refusals."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.batch.flags import engine_options
from nanovllm.cli import parse_args
from nanovllm.utils import random_checkpoint
from nanovllm.utils.device import cap_cpu_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = {"num_kvcache_blocks": 16, "max_model_len": 256, "max_num_seqs": 4}
SAMPLED = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


def run_python(*args: str, env: dict | None = None, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory) -> dict:
    """An environment in which `import torch` fails, as on a machine where it is not installed."""
    folder = tmp_path_factory.mktemp("no-torch")
    (folder / "torch.py").write_text("raise ImportError('torch is not importable here')\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), ROOT])}


def test_readme_gpu_install_builds_flash_attn_against_the_installed_torch():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme[readme.index("# to use it on an NVIDIA GPU"):]
    block = block[:block.index("```")]
    commands = [line for line in block.splitlines() if line.startswith("pip install")]
    cuda = next(i for i, line in enumerate(commands) if '".[cuda]"' in line)
    # flash-attn's setup.py imports these: without build isolation they must be installed before it builds
    assert "--no-build-isolation" in commands[cuda], commands
    before = [word.strip('"') for word in " ".join(commands[:cuda]).split()]
    # without build isolation our own build uses the setuptools installed: pyproject.toml needs 77 or newer
    for package in ("torch==2.13.0", "setuptools>=77", "wheel", "packaging", "ninja", "psutil"):
        assert package in before, (package, commands)


def test_help_and_usage_errors_need_no_torch(no_torch):
    top = run_python("-m", "nanovllm", "--help", env=no_torch)
    assert top.returncode == 0 and "run-batch" in top.stdout, top.stderr
    sub = run_python("-m", "nanovllm", "run-batch", "--help", env=no_torch)
    assert sub.returncode == 0 and "--dtype" in sub.stdout and "--seed" in sub.stdout, sub.stderr
    wrong = run_python("-m", "nanovllm", "run-batch", "-i", "a", "-o", "b", "--model", "m", "--bogus", env=no_torch)
    assert wrong.returncode == 2 and "usage: nanovllm run-batch" in wrong.stderr, wrong.stderr
    assert "unrecognized arguments: --bogus" in wrong.stderr and "not importable" not in wrong.stderr
    writer = run_python("-m", "nanovllm.utils.random_checkpoint", "--help", env=no_torch)
    assert writer.returncode == 0 and "--overwrite" in writer.stdout, writer.stderr
    version = run_python("-c", "import nanovllm; print(nanovllm.__version__)", env=no_torch)
    assert version.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+.*", version.stdout.strip()), version.stderr


def test_run_batch_dtype_and_seed_reach_the_engine():
    args = parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m", "--dtype", "float32", "--seed", "7"])
    assert engine_options(args) == {"dtype": "float32", "seed": 7}
    assert engine_options(parse_args(["run-batch", "-i", "a", "-o", "b", "--model", "m"])) == {}


def test_run_batch_seed_repeats_unseeded_sampling(tiny_model, tmp_path):
    from nanovllm.cli import main

    lines = [{"custom_id": f"r{i}", "url": "/v1/completions", "method": "POST",
              "body": {"prompt": [5 + i, 9, 11], "max_tokens": 8, "temperature": 1.0}} for i in range(3)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    texts = []
    for run in ("a", "b"):
        out = tmp_path / f"{run}.jsonl"
        assert main(["run-batch", "-i", str(source), "-o", str(out), "--model", tiny_model, "--seed", "3",
                     "--dtype", "float32", "--num-kvcache-blocks", "16", "--max-model-len", "256"]) == 0
        records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["custom_id"])
        texts.append([r["response"]["body"]["choices"][0]["text"] for r in records])
    assert texts[0] == texts[1]


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, **ENGINE) as engine:
        yield engine


def test_chat_content_parts_render_as_vllm_joins_them(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    plain = [{"role": "user", "content": "hello\nthere"}]
    by_parts, by_text = llm.chat(parts, greedy, use_tqdm=False)[0], llm.chat(plain, greedy, use_tqdm=False)[0]
    assert by_parts.prompt == by_text.prompt and "[{" not in by_parts.prompt
    assert by_parts.outputs[0].token_ids == by_text.outputs[0].token_ids


@pytest.mark.parametrize("content, error, words", [
    ([{"type": "image_url", "image_url": {"url": "x"}}], ValueError, "'image_url'"),
    (None, TypeError, "content None"),
    (5, TypeError, "content 5"),
    ([{"type": "text", "text": 3}], TypeError, "content part 0"),
])
def test_chat_refuses_other_content(llm, content, error, words):
    with pytest.raises(error, match=re.escape(words)):
        llm.chat([{"role": "user", "content": content}], use_tqdm=False)


def test_chat_template_kwargs_override_add_generation_prompt(llm):
    conversation = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=1)
    opened = llm.chat(conversation, params, use_tqdm=False)[0].prompt
    closed = llm.chat(conversation, params, use_tqdm=False,
                      chat_template_kwargs={"add_generation_prompt": False})[0].prompt
    assert opened.endswith("<|im_start|>assistant\n") and opened.startswith(closed) and opened != closed


def test_tool_messages_and_tool_calls_pass_to_the_template(llm):
    from nanovllm.batch.requests import CHAT, prompt_of

    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                       "function": {"name": "w", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text, token_ids = prompt_of({"messages": messages}, CHAT, llm)
    assert "sunny" in text and token_ids


def test_prompt_dicts_with_other_keys_are_refused(llm):
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([{"prompt": "hi", "multi_modal_data": {"image": None}}], use_tqdm=False)


def test_length_errors_name_the_prompt_and_the_room(llm):
    with pytest.raises(ValueError, match=r"prompt 1 of 300 tokens is not shorter than max_model_len=256"):
        llm.generate([[5, 6], [7] * 300], use_tqdm=False)
    with pytest.raises(ValueError, match=r"min_tokens=300 is more than the 254 tokens prompt 0 leaves") as caught:
        llm.generate([[5, 6]], SamplingParams(max_tokens=None, min_tokens=300), use_tqdm=False)
    assert "max_tokens=" not in str(caught.value)


def test_a_folder_without_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{re.escape(str(tmp_path))} has no config.json"):
        LLM(str(tmp_path))


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_model):
    positions = json.load(open(os.path.join(tiny_model, "config.json")))["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"max_model_len={positions + 1} is more than the model's "
                                         rf"max_position_embeddings={positions}"):
        LLM(tiny_model, max_model_len=positions + 1)


def test_hub_id_from_the_local_cache_offline(tiny_model, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--someorg--tiny-model" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_model, snapshot)
    (tmp_path / "hub" / "models--someorg--tiny-model" / "refs").mkdir()
    (tmp_path / "hub" / "models--someorg--tiny-model" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    greedy = SamplingParams(temperature=0, max_tokens=5)
    with LLM("someorg/tiny-model", **ENGINE) as by_id, LLM(tiny_model, **ENGINE) as by_path:
        assert by_id.config.model == str(snapshot)
        assert by_id.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
            by_path.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"model 'someorg/missing' is not a local folder, nor in the Hugging Face "
                                         r"cache \(HF_HUB_OFFLINE is set\)"):
        LLM("someorg/missing")


def test_random_checkpoint_keeps_an_existing_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    random_checkpoint.write_random_checkpoint(path, "tiny", seed=0)
    before = open(os.path.join(path, "model.safetensors"), "rb").read()
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        random_checkpoint.write_random_checkpoint(path, "tiny", seed=1)
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == before
    refused = run_python("-m", "nanovllm.utils.random_checkpoint", path, "--shape", "tiny", "--seed", "1")
    assert refused.returncode == 2 and "--overwrite" in refused.stderr
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == before
    random_checkpoint.write_random_checkpoint(path, "tiny", seed=1, overwrite=True)
    assert open(os.path.join(path, "model.safetensors"), "rb").read() != before
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(path):
        assert stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode) == 0o666 & ~umask, name


def test_two_engines_with_one_seed_sample_alike(tiny_model):
    prompts = [[5, 6, 7], [9, 10]]
    with LLM(tiny_model, seed=42, **ENGINE) as first, LLM(tiny_model, seed=42, **ENGINE) as second:
        torch.rand(1000)  # user code drawing from torch's global generator in between
        a = [o.outputs[0].token_ids for o in first.generate(prompts, SAMPLED, use_tqdm=False)]
        torch.manual_seed(1234)
        b = [o.outputs[0].token_ids for o in second.generate(prompts, SAMPLED, use_tqdm=False)]
    assert a == b
    with LLM(tiny_model, seed=43, **ENGINE) as other:
        assert [o.outputs[0].token_ids for o in other.generate(prompts, SAMPLED, use_tqdm=False)] != a


def test_tensor_parallel_script_without_main_guard_is_refused(tiny_model, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from nanovllm import LLM
        llm = LLM({tiny_model!r}, tensor_parallel_size=2, num_kvcache_blocks=8, max_model_len=256)
    """))
    result = run_python(str(script), env={"PYTHONPATH": ROOT})
    assert result.returncode != 0
    assert 'if __name__ == "__main__":' in result.stderr and "bootstrapping" not in result.stderr, result.stderr


def test_cpu_threads_follow_the_free_cores(monkeypatch):
    threads = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # every core busy elsewhere
        assert cap_cpu_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
        assert cap_cpu_threads() == min(2, len(os.sched_getaffinity(0)))  # never more than before
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
        assert cap_cpu_threads() == 2  # the user's number stands
    finally:
        torch.set_num_threads(threads)


# --- what a newcomer tripped on (issue 58) ------------------------------------------------------------------------
def test_run_batch_names_a_non_string_custom_id_and_a_chat_body_without_messages():
    """An integer custom_id is refused by name (OpenAI's batch API takes strings only), not answered as null with
    "no custom_id"; a chat body with `prompt` says that messages is required, not that prompt is unsupported."""
    from nanovllm.batch import io as batch_io
    from nanovllm.batch.requests import CHAT, COMPLETIONS, check_fields

    with pytest.raises(batch_io.LineError, match=r"custom_id must be a string, got int 7") as caught:
        batch_io.parse_line(b'{"custom_id": 7, "url": "/v1/completions", "body": {"prompt": "hi"}}')
    assert caught.value.code == "invalid_custom_id"
    with pytest.raises(batch_io.LineError, match=r"^messages is required for /v1/chat/completions \(prompt is for "
                                                 r"/v1/completions\)$"):
        check_fields({"prompt": "hi", "max_tokens": 2}, CHAT)
    with pytest.raises(batch_io.LineError, match=r"^prompt is required for /v1/completions \(messages is for "):
        check_fields({"messages": [{"role": "user", "content": "hi"}]}, COMPLETIONS)


def test_run_batch_warns_of_an_empty_input_before_loading_the_model(tmp_path, capsys):
    from nanovllm.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text("\n  \n")
    no_model = str(tmp_path / "no-such-model")  # loading it would fail: the run must not try
    assert main(["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", no_model]) == 0
    err = capsys.readouterr().err
    assert "warning: " in err and "holds no requests (it is empty or blank); nothing to do" in err, err


def test_sigterm_mid_run_says_how_to_resume_as_ctrl_c_does(tiny_model, tmp_path, capsys, monkeypatch):
    import signal

    from nanovllm.batch import output
    from nanovllm.cli import main

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {
        "prompt": [5 + i, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(8)))
    write = output.OutputWriter.write

    def write_then_terminated(self, record: dict) -> None:  # the kill lands after the first result is on disk
        write(self, record)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(output.OutputWriter, "write", write_then_terminated)

    def unhandled(signum: int, frame: object) -> None:  # in place of the default action, which would end pytest
        raise AssertionError("run-batch left SIGTERM to the handler it found")

    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = main(["run-batch", "-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", tiny_model,
                     *engine_options_flags()])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # the command's handler lasts only while it runs
    finally:
        signal.signal(signal.SIGTERM, before)
    err = capsys.readouterr().err
    assert code == 130 and "run the same command again to resume" in err, err


def engine_options_flags() -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE.items()]


def test_enable_prefix_caching_true_is_accepted_false_says_it_is_always_on(tiny_model):
    with LLM(tiny_model, enable_prefix_caching=True, **ENGINE) as engine:
        assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    with pytest.raises(ValueError, match=r"enable_prefix_caching=False is not supported: prefix caching is always "
                                         r"on in nano-vllm"):
        LLM(tiny_model, enable_prefix_caching=False, **ENGINE)


@pytest.mark.parametrize("options, error, message", [
    ({"max_tokens": "10"}, ValueError, r"SamplingParams.max_tokens='10' must be an integer or None, got str"),
    ({"temperature": "0.5"}, ValueError, r"SamplingParams.temperature='0.5' must be a number, got str"),
    ({"n": 2.0}, ValueError, r"SamplingParams.n=2.0 must be an integer, got float"),
    ({"top_k": True}, ValueError, r"SamplingParams.top_k=True must be an integer, got bool"),
    ({"max_token": 5}, TypeError, r"unexpected keyword argument 'max_token'; did you mean 'max_tokens'\?"),
    ({"temprature": 0}, TypeError, r"unexpected keyword argument 'temprature'; did you mean 'temperature'\?"),
])
def test_sampling_params_name_a_wrong_type_and_a_misspelt_keyword(options, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**options)
