"""tokq installs as a wheel, not only as an editable checkout: the wheel built from this source, installed into a
fresh venv, runs from a folder that holds no tokq source: its CLI, its package data (the native kernels' C++
source, compiled at first use from the installed copy) and a quantization of a tiny model."""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_built_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tests.test_quantize_cli import save_word_tokenizer

    # built from a clone at this repository's HEAD, as `pip install "tokq @ git+<repo>@<commit>"` builds it (and
    # no in-tree build/ folder of an earlier build can slip stale files in)
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the version comes from the commit")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    source = tmp_path / "source"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(source)], check=True)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(wheels), str(source)], check=True, timeout=600)
    (wheel,) = wheels.glob("tokq-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "tokq/kernels/cpu/native/gemv.cpp" in names and "tokq/kernels/cpu/native/attention.cpp" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names)

    # A fresh venv that sees this venv's dependencies (torch, transformers, ...) through a .pth file, but not its
    # tokq: tokq comes from the wheel alone.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = Path(sysconfig.get_paths()["purelib"])
    (site / "deps.pth").write_text(f"{deps}\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, timeout=600)
    base = tmp_path / "base"
    make_hf_checkpoint("llama", base, seed=0)
    save_word_tokenizer(base)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "TOKQ_HOME": str(tmp_path / "home"),
           "TOKQ_COMPILE": "0"}

    def run(*args: str) -> str:
        proc = subprocess.run([str(python), *args], cwd=elsewhere, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    where = run("-c", "import tokq, tokq.kernels.cpu.native as n; print(tokq.__file__); print(n.unavailable())")
    assert where.splitlines()[0].startswith(str(site)), where  # the wheel's tokq, not the checkout's
    assert where.splitlines()[1] in ("None",) or "compiler" in where  # built from the installed .cpp files
    version = run("-m", "tokq", "version").strip()
    assert re.fullmatch(r"0\.1\.\d+\.dev\d+\+g[0-9a-f]+", version) and f"+g{head[:7]}" in version, (version, head)
    assert zipfile.ZipFile(wheel).namelist().count("tokq/_version.py") == 1  # the version travels in the wheel
    run("-m", "tokq", "quantize", "--model", str(base), "--method", "rtn", "--group-size", "32", "--out", "q")
    assert (elsewhere / "q" / "config.json").is_file()
