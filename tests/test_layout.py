"""Every part of tokq lives under tokq/ and imports as tokq.<part>; nothing else is importable from the root."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["engine", "kernels", "quantize", "longctx", "evalsuite", "reports"]


def test_each_part_is_a_tokq_subpackage():
    for part in PARTS:
        module = importlib.import_module(f"tokq.{part}")
        assert Path(module.__file__).resolve().parent == ROOT / "tokq" / part


def test_no_package_at_the_repo_root_but_tokq_and_tests():
    # Tests and `python -m` put the repo root on sys.path: a root folder named kernels/ once
    # shadowed the `kernels` distribution that transformers imports, and every test failed to collect.
    packages = sorted(d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file())
    assert packages == ["tests", "tokq"]


def test_every_folder_under_tokq_is_a_package():
    # packages.find only ships folders with an __init__.py; one without would silently miss the wheel.
    for folder in (ROOT / "tokq").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").is_file(), f"{folder} has no __init__.py"


def test_kernels_import_nothing_else_of_tokq():
    for path in (ROOT / "tokq" / "kernels").rglob("*.py"):
        text = path.read_text()
        assert "from tokq" not in text and "import tokq" not in text, path


def test_engine_never_imports_quantize_or_evalsuite():
    for path in (ROOT / "tokq" / "engine").rglob("*.py"):
        text = path.read_text()
        for banned in ("tokq.quantize", "tokq.evalsuite", "tokq.longctx", "tokq.reports"):
            assert banned not in text, f"{path} imports {banned}"
