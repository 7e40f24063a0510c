"""Bad input through the CLI: one line naming the thing and the fix, exit code 2; a bug (an unexpected
exception): one line naming a log file with the traceback, exit 4."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.test_models_vs_hf import make_hf_checkpoint
from tokq.cli import main


@pytest.fixture()
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("a real sentence of text. " * 200)
    return folder


def run(capsys, *args) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def test_missing_model_directory(capsys, tmp_path, docs):
    code, err = run(capsys, "score", str(tmp_path / "missing"), "--data", str(docs))
    assert code == 2 and "model directory" in err and "does not exist" in err


def test_unsupported_architecture(capsys, tmp_path, docs):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    code, err = run(capsys, "score", str(tmp_path), "--data", str(docs))
    assert code == 2 and "BertModel is not supported" in err and "LlamaForCausalLM" in err


def test_window_longer_than_context(capsys, tmp_path, docs):
    make_hf_checkpoint("llama", tmp_path / "m")  # max_position_embeddings 512
    code, err = run(capsys, "score", str(tmp_path / "m"), "--data", str(docs), "--window", "4096")
    assert code == 2 and "--window 4096 exceeds the context" in err and "512" in err


def test_empty_data_folder(capsys, tmp_path):
    make_hf_checkpoint("llama", tmp_path / "m")
    (tmp_path / "empty").mkdir()
    code, err = run(capsys, "score", str(tmp_path / "m"), "--data", str(tmp_path / "empty"), "--window", "64")
    assert code == 2 and "empty" in err and ".txt" in err


def test_binary_only_data_folder(capsys, tmp_path):
    make_hf_checkpoint("llama", tmp_path / "m")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "blob.txt").write_bytes(bytes(range(256)) * 20)
    code, err = run(capsys, "score", str(tmp_path / "m"), "--data", str(tmp_path / "bin"), "--window", "64")
    assert code == 2 and "blob.txt" in err and "binary" in err


def test_bad_device(capsys, tmp_path, docs):
    make_hf_checkpoint("llama", tmp_path / "m")
    code, err = run(capsys, "score", str(tmp_path / "m"), "--data", str(docs), "--device", "tpu")
    assert code == 2 and "--device 'tpu' is not a device" in err


def test_usage_error_exits_2(capsys):
    assert main(["score"]) == 2


def test_help_everywhere(capsys):
    for args in (["--help"], ["score", "--help"], ["models", "--help"], ["models", "pull", "--help"],
                 ["data", "--help"], ["data", "build-default", "--help"], ["data", "inspect", "--help"]):
        assert main(args) == 0, args
    out = capsys.readouterr().out
    assert "--json" in out and "--threads" in out


def _crash(monkeypatch, tmp_path):
    """A bug inside a command: `tokq gate` hits an unexpected RuntimeError while reading its config."""
    import tokq.config

    def broken(path):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(tokq.config, "load_project", broken)
    (tmp_path / "tokq.toml").write_text('[base]\nmodel = "m"\n')
    return ["gate", "--config", str(tmp_path / "tokq.toml"), "--out", str(tmp_path / "report")]


def test_internal_error_exits_4_with_one_line_and_a_log(capsys, monkeypatch, tmp_path):
    from tokq.paths import tokq_home

    monkeypatch.delenv("TOKQ_DEBUG", raising=False)
    code, err = run(capsys, *_crash(monkeypatch, tmp_path))
    assert code == 4
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    match = re.fullmatch(r"error: internal error \(RuntimeError: boom second line\); the traceback is in (\S+)",
                         lines[0])
    assert match, lines[0]
    log = Path(match.group(1))
    assert log.parent == tokq_home() / "logs" and re.fullmatch(rf"tokq-\d{{8}}-\d{{6}}-{os.getpid()}(-\d+)?\.log",
                                                                log.name)
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in broken" in text and "command: tokq gate" in text
    # A second crash in the same second keeps the first log.
    assert run(capsys, *_crash(monkeypatch, tmp_path))[0] == 4
    assert log.read_text() == text and len(list(log.parent.iterdir())) == 2


@pytest.mark.parametrize("how", ["--debug", "TOKQ_DEBUG=1"])
def test_debug_prints_the_traceback(capsys, monkeypatch, tmp_path, how):
    args = _crash(monkeypatch, tmp_path)
    if how == "--debug":
        monkeypatch.delenv("TOKQ_DEBUG", raising=False)
        args = ["--debug", *args]
    else:
        monkeypatch.setenv("TOKQ_DEBUG", "1")
    code, err = run(capsys, *args)
    assert code == 4 and "Traceback (most recent call last)" in err and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("error: internal error (RuntimeError: boom second line)")
    # --debug lasts for its own command only.
    monkeypatch.delenv("TOKQ_DEBUG", raising=False)
    code, err = run(capsys, *_crash(monkeypatch, tmp_path))
    assert code == 4 and "Traceback" not in err


def test_bad_input_is_not_an_internal_error(capsys, tmp_path):
    code, err = run(capsys, "gate", "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "internal error" not in err and "tokq init" in err
