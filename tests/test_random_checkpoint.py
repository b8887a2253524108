"""example.py and `python -m nanovllm.utils.random_checkpoint`: their command lines, and what a failed write
leaves behind (nothing)."""
import json
import os
import runpy
import sys

import pytest

from nanovllm.utils import random_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "example.py")


def run_main(argv: list[str], monkeypatch, path: str | None = None) -> int:
    """Run example.py (path) or random_checkpoint's main in this process, as its command line would; the exit code."""
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        if path is None:
            random_checkpoint.main()
        else:
            runpy.run_path(path, run_name="__main__")
    return exit_info.value.code


def test_a_bad_shape_is_a_one_line_usage_error_and_creates_nothing(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOVLLM_CACHE", str(cache))
    for argv, path in ((["example.py", "--shape", "nonsense"], EXAMPLE),
                       (["random_checkpoint", str(tmp_path / "out"), "--shape", "nonsense"], None)):
        assert run_main(argv, monkeypatch, path) == 2
        err = capsys.readouterr().err
        assert "argument --shape: invalid choice: 'nonsense'" in err and "Traceback" not in err
        assert "writing" not in err
    assert not cache.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="unknown shape 'nonsense'"):
        random_checkpoint.default_checkpoint("nonsense")
    assert not cache.exists()


def test_help_texts_are_whole_and_list_the_shapes(monkeypatch, capsys):
    for argv, path, sentence in ((["example.py", "--help"], EXAMPLE, "the point is that the whole engine runs."),
                                 (["random_checkpoint", "--help"], None, "without a model hub.")):
        assert run_main(argv, monkeypatch, path) == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse rewraps lines
        assert sentence in text
        assert "tiny" in text and "Qwen3-30B-A3B" in text and "(default: Qwen3-0.6B" in text


def test_a_write_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOVLLM_CACHE", str(cache))

    def interrupted(path: str, vocab_size: int) -> None:
        raise KeyboardInterrupt  # as Ctrl-C while the tokenizer is written, after the weights

    monkeypatch.setattr(random_checkpoint, "write_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        random_checkpoint.default_checkpoint("tiny")
    assert not cache.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(KeyboardInterrupt):
        random_checkpoint.write_random_checkpoint(str(existing / "a" / "b"), "tiny")
    assert os.listdir(existing) == []  # the folders it made are gone; the one it found stays


def test_layers_cuts_a_shape_and_a_bad_count_is_refused(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cut"
    monkeypatch.setattr(sys, "argv", ["random_checkpoint", str(out), "--shape", "tiny", "--layers", "1"])
    random_checkpoint.main()
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {name.split(".")[2] for name in weights.keys() if name.startswith("model.layers.")} == {"0"}
    assert run_main(["random_checkpoint", str(tmp_path / "none"), "--layers", "0"], monkeypatch) == 2
    assert "--layers 0: a model needs at least 1 layer" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
