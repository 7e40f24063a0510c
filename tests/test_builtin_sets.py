"""A committed tokq.toml works on any machine: `tokq init` writes no path of the machine it ran on, and tokq's own
document set is named (`builtin = "default"`, `--data default`), each machine building its copy at first use."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokq.api.compare import resolve_data
from tokq.cli import main
from tokq.config import load_project
from tokq.errors import ConfigError
from tokq.longctx import default_set
from tokq.longctx.default_sources import SourceSpec


@pytest.fixture
def tiny_sources(tmp_path, monkeypatch) -> Path:
    """The built-in set's sources replaced by three long text files (the real build scans the stdlib)."""
    root = tmp_path / "sources"
    root.mkdir()
    for i in range(3):
        (root / f"doc{i}.txt").write_text(" ".join(f"word{i}x{j}" for j in range(4000)) + "\n")
    spec = SourceSpec(name="tiny", package="tiny-pkg", root=root, patterns=("*.txt",), licence="MIT",
                      max_documents=3)
    monkeypatch.setattr(default_set, "default_sources", lambda: [spec])
    return root


def test_init_writes_no_machine_path_and_the_file_works_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home-a"))
    first = tmp_path / "machine-a" / "project"
    first.mkdir(parents=True)
    assert main(["init", "--path", str(first / "tokq.toml")]) == 0
    text = (first / "tokq.toml").read_text()
    for machine_path in (str(tmp_path), str(Path.home()), "~/", ".cache/tokq"):
        assert machine_path not in text, machine_path
    # the same file committed and checked out at another path, on a machine with another $TOKQ_HOME
    other = tmp_path / "machine-b" / "checkout"
    other.mkdir(parents=True)
    shutil.copy(first / "tokq.toml", other / "tokq.toml")
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home-b"))
    project = load_project(other / "tokq.toml")
    assert project.data["default"].builtin == "default"
    assert project.data["default"].path == tmp_path / "home-b" / "data" / "default"
    assert project.variants["int4"].path == other / "tokq_out" / "smollm2-awq-int4"


def test_builtin_set_is_built_at_first_use_then_reused(tmp_path, monkeypatch, tiny_sources, capsys):
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "tokq.toml").write_text('[base]\nmodel = "m"\n[data.docs]\nbuiltin = "default"\nwindow = 512\n'
                                       '[gate.quality]\nmax_kl = 0.1\n')
    monkeypatch.chdir(project)
    folder, keys = resolve_data("docs")  # the [data.docs] table: its keys, and the set built now
    assert folder == tmp_path / "home" / "data" / "default" and keys["window"] == 512
    manifest = folder / "MANIFEST.json"
    assert manifest.is_file() and len(list((folder / "tiny").glob("*.txt"))) == 3
    assert "first use on this machine" in capsys.readouterr().err
    built_at = manifest.stat().st_mtime_ns
    again, _ = resolve_data("default")  # the built-in name itself, not a table: the same copy, not rebuilt
    assert again == folder and manifest.stat().st_mtime_ns == built_at
    assert "first use" not in capsys.readouterr().err


def test_a_folder_named_like_the_builtin_set_wins(tmp_path, monkeypatch, tiny_sources):
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    (tmp_path / "default").mkdir()
    monkeypatch.chdir(tmp_path)
    folder, _ = resolve_data("default")
    assert folder == Path("default") and not (tmp_path / "home" / "data" / "default").exists()


@pytest.mark.parametrize("table,message", [
    ('path = "docs"\nbuiltin = "default"', r"\[data.d\] needs one of path .* or builtin .*, not both"),
    ("window = 512", r"\[data.d\] needs one of path .* not neither"),
    ('builtin = "mydocs"', r"tokq.toml:4: \[data.d\] builtin = 'mydocs' is not a built-in document set; known: "
                          r"default"),
    ("builtin = 3", r"builtin = 3 is not a built-in document set"),
])
def test_bad_data_tables_name_the_line(tmp_path, table, message):
    path = tmp_path / "tokq.toml"
    path.write_text(f'[base]\nmodel = "m"\n[data.d]\n{table}\n[gate.quality]\nmax_kl = 0.1\n')
    with pytest.raises(ConfigError, match=message):
        load_project(path)


def test_code_set_is_source_code_from_installed_packages(tmp_path):
    """`code` is built from real source files of packages every tokq install has, each with its licence and version,
    and shares no file with the default set (whose code is the CPython standard library)."""
    from tokq.longctx.builtin_sets import builtin_sources
    from tokq.longctx.default_set import build_default_set

    sources = builtin_sources("code")
    assert {s.name for s in sources} == {"torch-python", "torch-cpp", "transformers-python"}
    summary = build_default_set(tmp_path / "code", sources=sources, max_documents=6, max_chars=40_000)
    assert summary.n_documents == 6 and not summary.unavailable
    import json

    manifest = json.loads((tmp_path / "code" / "MANIFEST.json").read_text())
    for doc in manifest["documents"]:
        assert doc["licence"] in ("BSD-3-Clause", "Apache-2.0") and doc["version"]
        assert doc["path"].endswith((".py.txt", ".h.txt")), doc["path"]
        assert "generated" not in doc["path"] and "/modular_" not in doc["path"]
        text = (tmp_path / "code" / doc["path"]).read_text()
        assert ("def " in text or "class " in text or "#include" in text or "template" in text), doc["path"]


def test_data_build_default_takes_the_code_set_and_refuses_an_unknown_one(tmp_path, capsys):
    assert main(["data", "build-default", "--set", "prose-and-more", "--out", str(tmp_path / "x"),
                 "--model", "none"]) == 2
    assert "--set = 'prose-and-more' is not a built-in document set; known: default, code" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_calib_names_a_builtin_set_unless_a_folder_of_that_name_exists(tmp_path, monkeypatch, tiny_sources):
    """`--calib code` / `--calib default` mean tokq's built-in sets (built at first use), as `--data` does; a folder of
    that name in the working directory is the user's and wins."""
    from tokq.longctx.builtin_sets import calibration_folder

    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert calibration_folder(None) == tmp_path / "home" / "data" / "default"
    assert (tmp_path / "home" / "data" / "default" / "MANIFEST.json").is_file()
    assert calibration_folder(Path("default")) == tmp_path / "home" / "data" / "default"
    (tmp_path / "code").mkdir()
    assert calibration_folder(Path("code")) == Path("code")
    assert calibration_folder(Path("elsewhere")) == Path("elsewhere")  # read (and refused) where it is read


def test_init_for_a_code_model_judged_on_the_code_set(tmp_path, monkeypatch):
    """`tokq init --model qwen2.5-coder-1.5b --data code`: the starter names that base, its int4 recipe carries the
    zoo's group size for it, and the gate judges on tokq's code set (by name: no path of this machine)."""
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    path = tmp_path / "project" / "tokq.toml"
    path.parent.mkdir()
    assert main(["init", "--path", str(path), "--model", "qwen2.5-coder-1.5b", "--data", "code"]) == 0
    project = load_project(path)
    assert project.base == "qwen2.5-coder-1.5b"
    assert project.variants["int4"].recipe["group_size"] == 128
    assert project.variants["int4"].path == path.parent / "tokq_out" / "qwen2.5-coder-1.5b-awq-int4"
    assert list(project.data) == ["code"] and project.data["code"].builtin == "code"
    assert str(tmp_path) not in path.read_text()
    # the default starter is SmolLM2's at group 64 (576 does not divide by 128)
    assert main(["init", "--path", str(path), "--force"]) == 0
    assert load_project(path).variants["int4"].recipe["group_size"] == 64
