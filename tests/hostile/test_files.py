"""Hostile files and folders: output folders that hold the user's work (--report-dir, gate --out ., quantize
--force), recipes that name output paths, two writers on one folder, tokq.toml files that a text edit would
break, and a umask that atomic writes ignored. tokq removes or replaces only a folder it wrote itself, edits
tokq.toml without losing a comment or leaving it unparseable, and writes files with the modes a plain open()
gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.hostile.conftest import write_word_docs
from tests.test_models_vs_hf import near_copy
from tokq.cli import main
from tokq.config import find_variant, tomllib  # tomllib, or tomli before Python 3.11

MARKER = ".tokq-owner.json"


def run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).replace("\n", " ")


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_word_docs(tmp_path_factory.mktemp("docs"), (400, 300))


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKQ_CONFIG", raising=False)
    return tmp_path


def quantize(capsys, checkpoint: Path, out: Path, *extra) -> tuple[int, str]:
    return run(capsys, "quantize", "--model", checkpoint, "--out", out, "--threads", 1, "--method", "rtn",
               "--group-size", 32, *extra)


def gate_project(root: Path, checkpoint: Path, docs: Path, variants: str = 'same = "same"') -> Path:
    """A tokq.toml whose gate needs no quantization: the base against a near copy of itself (the base itself, byte
    for byte, is refused)."""
    (root / "base").symlink_to(checkpoint)
    if "same" in variants:
        near_copy(checkpoint, root / "same")
    path = root / "tokq.toml"
    path.write_text(f'[base]\nmodel = "base"\ndtype = "fp32"\n\n[variants]\n{variants}\n\n'
                    f'[data.docs]\npath = "{docs}"\nwindow = 128\n\n[gate.quality]\nmax_kl = 0.05\n')
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------------------
# Data loss: only folders tokq wrote are replaced or removed


def test_compare_report_dir_holding_user_files_and_a_report_json_is_refused(capsys, checkpoint, docs, tmp_path):
    """Hostile: --report-dir P where P holds the user's src/important.py next to a report.json."""
    folder = tmp_path / "P"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "important.py").write_text("x\n")
    (folder / "report.json").write_text("{}")
    before = snapshot(folder)
    code, text = run(capsys, "compare", checkpoint, checkpoint, "--data", docs, "--window", 128, "--threads", 1,
                     "--no-probes", "--report-dir", folder)
    assert code == 2 and f"{folder} exists and is not a tokq report folder" in text, text
    assert "--report-dir" in text and "remove it yourself" in text
    assert snapshot(folder) == before


def test_gate_out_dot_in_a_project_with_a_report_json_never_removes_it(capsys, checkpoint, docs, project):
    """Hostile: `tokq gate --out .` run in a project folder that happens to hold a report.json."""
    gate_project(project, checkpoint, docs)
    (project / "report.json").write_text("{}")
    (project / "src").mkdir()
    (project / "src" / "main.py").write_text("print('mine')\n")
    before = snapshot(project)
    code, text = run(capsys, "gate", "--out", ".", "--no-speed", "--threads", 1)
    assert code == 2 and f". is the working directory {project.resolve()}" in text, text
    assert "remove it yourself" not in text and snapshot(project) == before


def test_gate_out_holding_a_report_and_a_user_file_is_refused(capsys, checkpoint, docs, project):
    """Hostile: a report folder tokq wrote, into which the user later dropped notes.txt."""
    path = gate_project(project, checkpoint, docs)
    out = project / "report"
    assert run(capsys, "gate", "--config", path, "--out", out, "--no-speed", "--threads", 1)[0] == 0
    assert json.loads((out / MARKER).read_text())["kind"] == "report"
    (out / "notes.txt").write_text("keep me")
    code, text = run(capsys, "gate", "--config", path, "--out", out, "--no-speed", "--threads", 1)
    assert code == 2 and "notes.txt" in text and "remove it yourself" in text, text
    assert (out / "notes.txt").read_text() == "keep me" and (out / "report.json").is_file()


def test_gate_replaces_its_own_and_an_earlier_tokq_report(capsys, checkpoint, docs, project):
    """Hostile (the other side): a report of this tokq and one from a tokq without markers are still replaced,
    and a stale report is gone once the gate starts."""
    path = gate_project(project, checkpoint, docs)
    out = project / "report"
    out.mkdir()
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        (out / name).write_text("old")  # an earlier tokq's report: no marker
    assert run(capsys, "gate", "--config", path, "--out", out, "--no-speed", "--threads", 1)[0] == 0
    assert json.loads((out / "report.json").read_text())["command"] == "gate"
    assert run(capsys, "gate", "--config", path, "--out", out, "--no-speed", "--threads", 1)[0] == 0
    assert sorted(p.name for p in project.iterdir()) == ["base", "report", "same", "tokq.toml"]  # no lock or temp


def test_quantize_force_over_a_user_folder_is_refused(capsys, checkpoint, project):
    """Hostile: `tokq quantize --out ANYDIR --force` where ANYDIR is the user's folder."""
    out = project / "work"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    code, text = quantize(capsys, checkpoint, out, "--force")
    assert code == 2 and f"{out} exists and is not a tokq checkpoint folder" in text, text
    assert "--out" in text and (out / "thesis.tex").read_text() == "mine"


def test_quantize_force_replaces_only_an_untouched_tokq_checkpoint(capsys, checkpoint, project):
    """Hostile: --force over tokq's own checkpoint (replaced), over one written by a tokq without markers
    (replaced), and over one where the user added a file (refused)."""
    out = project / "q"
    assert quantize(capsys, checkpoint, out)[0] == 0
    owner = json.loads((out / MARKER).read_text())
    assert owner["kind"] == "checkpoint" and owner["written_by"] == "tokq quantize"
    assert set(owner["entries"]) == {p.name for p in out.iterdir()} - {MARKER}
    assert quantize(capsys, checkpoint, out, "--force")[0] == 0
    (out / MARKER).unlink()  # as an earlier tokq wrote it
    assert quantize(capsys, checkpoint, out, "--force")[0] == 0
    (out / "README.md").write_text("my notes")
    code, text = quantize(capsys, checkpoint, out, "--force")
    assert code == 2 and "README.md" in text and (out / "README.md").read_text() == "my notes"


def test_quantize_out_below_a_file_is_refused_before_the_work(capsys, checkpoint, project):
    """Hostile: --out below a file (a typo): the write failed with a traceback once the quantization was done."""
    (project / "afile").write_text("x")
    code, text = quantize(capsys, checkpoint, project / "afile" / "q")
    assert code == 2 and f"{project / 'afile' / 'q'} cannot be written" in text and "choose another --out" in text


def test_recipe_naming_an_output_path_or_unknown_key_is_refused_at_load(capsys, checkpoint, docs, project):
    """Hostile: recipe = { method = "rtn", out = "/elsewhere", force = true } and a recipe with a key that is no
    `tokq quantize` option: refused with tokq.toml:LINE before anything is built or removed."""
    elsewhere = project / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.txt").write_text("precious")
    for recipe, key in ((f'method = "rtn", out = "{elsewhere}", force = true', "out"),
                        ('method = "rtn", outdir = "x"', "outdir"), ('method = "rtn", name = "v"', "name")):
        path = gate_project(project, checkpoint, docs, f"v = {{ path = \"built/v\", recipe = {{ {recipe} }} }}")
        line = path.read_text().splitlines().index(f"v = {{ path = \"built/v\", recipe = {{ {recipe} }} }}") + 1
        code, text = run(capsys, "gate", "--config", path, "--out", project / "r", "--no-speed")
        assert code == 2 and f"tokq.toml:{line}: [variants] v recipe key {key!r} is not" in text, text
        assert (elsewhere / "data.txt").read_text() == "precious"
        assert not (project / "built").exists() and not (project / "r").exists()
        (project / "base").unlink()


def test_build_default_force_over_a_user_folder_is_refused(capsys, tmp_path):
    """Hostile: `tokq data build-default --out MYDIR --force` where MYDIR is the user's folder: refused before the
    scan, never replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, text = run(capsys, "data", "build-default", "--out", mine, "--force", "--model", "none")
    assert code == 2 and f"{mine} exists and is not a tokq document set folder" in text, text
    assert (mine / "notes.txt").read_text() == "mine"


def test_default_set_rebuild_replaces_its_own_and_an_earlier_tokq_set(tmp_path):
    """Hostile (the other side): a set tokq built, and one built by a tokq without markers (MANIFEST.json and
    the documents it lists), are rebuilt; the same set with a user file added is not."""
    from tokq.errors import ConfigError
    from tokq.longctx.default_set import build_default_set
    from tokq.longctx.default_sources import SourceSpec

    root = tmp_path / "src"
    (root / "sub").mkdir(parents=True)
    for i in range(3):
        (root / ("sub" if i else ".") / f"doc{i}.txt").write_text(f"document {i} " * 100)
    tree = [SourceSpec("docs", "docs-pkg", root, ("**/*.txt",), "MIT")]
    out = tmp_path / "set"
    build_default_set(out, sources=tree, min_chars=200, max_chars=2000)
    assert json.loads((out / MARKER).read_text())["kind"] == "document-set"
    build_default_set(out, sources=tree, min_chars=200, max_chars=2000)
    (out / MARKER).unlink()
    build_default_set(out, sources=tree, min_chars=200, max_chars=2000)
    (out / "extra.txt").write_text("mine")
    with pytest.raises(ConfigError, match="extra.txt"):
        build_default_set(out, sources=tree, min_chars=200, max_chars=2000)
    assert (out / "extra.txt").read_text() == "mine"


HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())
    print("locked", flush=True)
    time.sleep(60)
""")


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another process writing `folder`: it holds the flock on the sibling .NAME.lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder.parent / f".{folder.name}.lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_quantize_on_the_same_out_fails_fast(capsys, checkpoint, project, monkeypatch):
    """Hostile: two `tokq quantize --out same_dir --name ...` at once (both exited 0 and tokq.toml recorded two
    schemes for one folder): the second fails before any work (the model is never loaded), naming the other
    process."""
    import tokq.engine.checkpoint

    out = project / "q"
    monkeypatch.setattr(tokq.engine.checkpoint, "load_model",
                        lambda *a, **k: pytest.fail("the model was loaded before the lock was checked"))
    proc = hold_lock(out)
    try:
        code, text = quantize(capsys, checkpoint, out, "--name", "int4")
        assert code == 2 and f"another tokq process (pid {proc.pid}) is writing {out}" in text, text
        assert "choose another --out" in text
        assert not out.exists() and not (project / "tokq.toml").exists()
    finally:
        proc.kill()
        proc.wait()


SLOW_QUANTIZE = textwrap.dedent("""
    import sys, time
    import tokq.quantization.pipeline as pipeline
    real = pipeline.quantize_model
    def slow(*args, **kwargs):
        time.sleep(8)
        return real(*args, **kwargs)
    pipeline.quantize_model = slow
    from tokq.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_second_quantize_while_a_real_one_writes_fails_fast(capsys, checkpoint, project):
    """Hostile: a real `tokq quantize --out q --name a` process is quantizing when a second `tokq quantize
    --out q --name b` starts: the second is refused at once, and tokq.toml records one variant."""
    out = project / "q"
    args = ["quantize", "--model", str(checkpoint), "--out", str(out), "--threads", "1", "--method", "rtn",
            "--group-size", "32"]
    first = subprocess.Popen([sys.executable, "-c", SLOW_QUANTIZE, *args, "--name", "a"], stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        for line in first.stderr:
            if line.startswith("quantizing "):  # it holds the folder and sleeps in quantize_model
                break
        code, text = quantize(capsys, checkpoint, out, "--name", "b")
        assert code == 2 and f"another tokq process (pid {first.pid}) is writing {out}" in text, text
        first.stderr.read()
        assert first.wait(timeout=300) == 0
    finally:
        first.kill()
    assert set(tomllib.loads((project / "tokq.toml").read_text())["variants"]) == {"a"}
    assert sorted(p.name for p in project.iterdir()) == ["q", "tokq.toml"]  # no lock file left


def test_gate_on_a_report_folder_another_process_writes_fails_fast(capsys, checkpoint, docs, project):
    """Hostile: `tokq gate --out R` while another tokq process holds R: refused at the start."""
    path = gate_project(project, checkpoint, docs)
    out = project / "report"
    proc = hold_lock(out)
    try:
        code, text = run(capsys, "gate", "--config", path, "--out", out, "--no-speed", "--threads", 1)
        assert code == 2 and f"another tokq process (pid {proc.pid}) is writing {out}" in text, text
        assert not out.exists()
    finally:
        proc.kill()
        proc.wait()


def test_gate_building_a_variant_another_process_builds_fails_fast(capsys, checkpoint, docs, project):
    """Hostile: two gates on one project build the same recipe variant at once: the second is refused, naming
    the other process, not told to fix its recipe."""
    path = gate_project(project, checkpoint, docs, 'v = { path = "built/v", recipe = { method = "rtn", '
                                                   'group_size = 32 } }')
    (project / "built").mkdir()
    proc = hold_lock(project / "built" / "v")
    try:
        code, text = run(capsys, "gate", "--config", path, "--out", project / "r", "--no-speed", "--threads", 1)
        assert code == 2 and f"another tokq process (pid {proc.pid}) is writing {project / 'built' / 'v'}" in text
        assert "path for variant v in tokq.toml" in text and "fix the recipe" not in text, text
        assert not (project / "built" / "v").exists() and not (project / "r").exists()
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------------------------
# tokq.toml: edited with a format-preserving parser, checked before the work


@pytest.mark.parametrize("text", [
    "# my project\n[variants] # the checkpoints\nbase = \"models/base\"  # the reference\n\n[gate]\nx = 1\n",
    "variants = { base = \"models/base\" }\n\n[gate]\nx = 1\n",
    "[variants.base]\npath = \"models/base\"\n\n[gate]\nx = 1\n",
    "# only a comment\n",
    "[gate]\nx = 1 # keep\n",
])
def test_recording_a_variant_keeps_the_file_parseable_and_its_comments(capsys, checkpoint, project, text):
    """Hostile: a comment after [variants], an inline `variants = {...}`, [variants.NAME] tables, a file with no
    [variants]: the quantization finished, then tokq.toml was left unparseable."""
    (project / "tokq.toml").write_text(text)
    code, out = quantize(capsys, checkpoint, project / "q", "--name", "int4")
    assert code == 0, out
    edited = (project / "tokq.toml").read_text()
    parsed = tomllib.loads(edited)
    original = tomllib.loads(text)
    assert parsed["variants"]["int4"] == {"path": "q"}
    assert {k: v for k, v in parsed["variants"].items() if k != "int4"} == original.get("variants", {})
    assert {k: v for k, v in parsed.items() if k != "variants"} == {k: v for k, v in original.items()
                                                                    if k != "variants"}
    for line in text.splitlines():
        assert line in edited or line.startswith("variants = {")  # comments and layout kept
    assert find_variant("int4") == project / "q"


def test_replacing_a_variant_keeps_its_place_and_the_rest(capsys, checkpoint, project):
    """Hostile: the same --name twice in a file with comments around the entry."""
    (project / "tokq.toml").write_text("[variants]\n# first\nint4 = \"old\"  # was here\nbase = \"b\"\n")
    assert quantize(capsys, checkpoint, project / "q", "--name", "int4")[0] == 0
    lines = (project / "tokq.toml").read_text().splitlines()
    assert lines[:2] == ["[variants]", "# first"] and lines[2].startswith("int4 = ") and lines[3] == 'base = "b"'
    assert find_variant("int4") == project / "q" and find_variant("base") == project / "b"


@pytest.mark.parametrize("name", ["int4é", "a b", "x=y", "", "a.b", "int4\n[gate]"])
def test_variant_name_that_is_no_bare_toml_key_is_refused_before_the_work(capsys, checkpoint, project, name):
    """Hostile: a non-ASCII --name (isalnum accepted it), or one with spaces, dots or a newline."""
    (project / "tokq.toml").write_text("[variants]\n")
    code, text = quantize(capsys, checkpoint, project / "q", "--name", name)
    assert code == 2 and "--name" in text and "ASCII letters, digits" in text, text
    assert not (project / "q").exists() and (project / "tokq.toml").read_text() == "[variants]\n"


@pytest.mark.parametrize("text,message", [
    ("variants = 5\n", "tokq.toml:1: variants = 5 must be a table"),
    ("[variants]\nbase = \n", "fix the file"),
    ("[variants\n", "fix the file"),
])
def test_tokq_toml_that_cannot_be_edited_is_refused_before_the_work(capsys, checkpoint, project, text, message):
    """Hostile: `variants = 5`, or a tokq.toml that does not parse, with --name: refused after the
    quantization had finished (or the variant silently appended); now before any work."""
    (project / "tokq.toml").write_text(text)
    code, out = quantize(capsys, checkpoint, project / "q", "--name", "int4")
    assert code == 2 and message in out and "tokq.toml" in out, out
    assert not (project / "q").exists() and (project / "tokq.toml").read_text() == text


@pytest.mark.parametrize("folder", ["a\nb", "modèles/int4", 'quote"d\\back'])
def test_out_path_with_newline_or_non_ascii_is_stored_correctly(capsys, checkpoint, project, folder):
    """Hostile: a newline, non-ASCII letters, a quote or a backslash in --out."""
    (project / "tokq.toml").write_text("[variants]\n")
    out = project / folder
    assert quantize(capsys, checkpoint, out, "--name", "int4")[0] == 0
    assert tomllib.loads((project / "tokq.toml").read_text())["variants"]["int4"]["path"] == folder
    assert find_variant("int4") == out


# ------------------------------------------------------------------------------------------------------------
# Files: modes follow the umask


@pytest.fixture()
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_writes_follow_the_umask(tmp_path, umask_022):
    """Hostile: a shared cache or a container running as another user: mkstemp's 0600 and mkdtemp's 0700
    made every file tokq wrote unreadable to the group and others."""
    from tokq.paths import atomic_directory, atomic_write_text

    atomic_write_text(tmp_path / "f.txt", "x")
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o644
    with atomic_directory(tmp_path / "d") as tmp:
        (tmp / "inner.txt").write_text("y")
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "d" / "inner.txt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d" / MARKER).stat().st_mode & 0o777 == 0o644
    os.umask(0o077)
    atomic_write_text(tmp_path / "g.txt", "x")
    assert (tmp_path / "g.txt").stat().st_mode & 0o777 == 0o600
    (tmp_path / "f.txt").chmod(0o640)  # an existing file keeps its mode, as open() would keep it
    atomic_write_text(tmp_path / "f.txt", "z")
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o640


def test_quantized_checkpoint_and_tokq_toml_follow_the_umask(capsys, checkpoint, project, umask_022):
    """Hostile: the same through `tokq quantize --name`: the checkpoint folder, its files and tokq.toml."""
    assert quantize(capsys, checkpoint, project / "q", "--name", "int4")[0] == 0
    assert (project / "q").stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in (project / "q").iterdir()} == {0o644}
    assert (project / "tokq.toml").stat().st_mode & 0o777 == 0o644


def test_report_folder_and_baseline_cache_follow_the_umask(capsys, checkpoint, docs, tmp_path, umask_022):
    """Hostile: a report folder (mkdtemp: 0700) and the baseline cache's scores (safetensors writes 0600) on a
    shared runner."""
    folder = tmp_path / "report"
    code, text = run(capsys, "compare", checkpoint, checkpoint, "--data", docs, "--window", 128, "--threads", 1,
                     "--no-probes", "--report-dir", folder)
    assert code == 0, text
    assert folder.stat().st_mode & 0o777 == 0o755
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o644}
    cache = [p for p in Path(os.environ["TOKQ_HOME"]).rglob("*") if p.is_file()]
    assert cache and {p.stat().st_mode & 0o777 for p in cache} == {0o644}
