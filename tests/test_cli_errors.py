"""Bad input through the CLI: one line naming the thing and the fix, exit code 2."""

from __future__ import annotations

import json

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
