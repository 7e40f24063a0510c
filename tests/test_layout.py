"""Each top-level folder imports as tokq.<folder>; the distribution exposes no other import name."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["engine", "kernels", "quantize", "longctx", "evalsuite", "reports"]


def test_each_folder_is_a_tokq_subpackage():
    for part in PARTS:
        module = importlib.import_module(f"tokq.{part}")
        assert Path(module.__file__).resolve().parent == ROOT / part


def test_no_other_top_level_import_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = project["tool"]["setuptools"]["packages"]
    assert all(p == "tokq" or p.startswith("tokq.") for p in packages)
    mapped = project["tool"]["setuptools"]["package-dir"]
    assert set(mapped) == set(packages)
    # Every folder with Python code is listed, so nothing is silently left out of a wheel.
    tops = [d for d in ROOT.iterdir() if d.is_dir() and not d.name.startswith(".")
            and d.name not in ("tests", "benchmarks", "build", "scripts", "docs", "examples")]
    for top in tops:
        for init in top.rglob("__init__.py"):
            folder = init.parent.relative_to(ROOT).as_posix()
            assert folder in mapped.values(), f"{folder} is not packaged"


def test_kernels_import_nothing_else_of_tokq():
    for path in (ROOT / "kernels").rglob("*.py"):
        text = path.read_text()
        assert "from tokq" not in text and "import tokq" not in text, path


def test_engine_never_imports_quantize_or_evalsuite():
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        for banned in ("tokq.quantize", "tokq.evalsuite", "tokq.longctx", "tokq.reports"):
            assert banned not in text, f"{path} imports {banned}"
