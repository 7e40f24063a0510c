"""Every part of tokq lives under tokq/ and imports as tokq.<part>; nothing else is importable from the root."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["engine", "kernels", "quantization", "longctx", "evalsuite", "reports"]


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
    """Kernels import tokq.dtypes and tokq.errors (which import nothing else of tokq) and nothing else of tokq."""
    import ast

    allowed = {"tokq.dtypes", "tokq.errors"}
    for path in [*(ROOT / "tokq" / "kernels").rglob("*.py"), *(ROOT / "tokq" / f"{m}.py" for m in ("dtypes", "errors"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if name == "tokq" or name.startswith("tokq."):
                    assert name in allowed or name.rpartition(".")[0] in allowed, f"{path} imports {name}"


def test_engine_never_imports_quantize_or_evalsuite():
    for path in (ROOT / "tokq" / "engine").rglob("*.py"):
        text = path.read_text()
        for banned in ("tokq.quantization", "tokq.evalsuite", "tokq.longctx", "tokq.reports"):
            assert banned not in text, f"{path} imports {banned}"


# Import name -> distribution name, where they differ or the module is third-party.
_DISTRIBUTION = {"yaml": "pyyaml"}
# Declared but imported only by the libraries tokq calls: each needs the reason it is kept.
_RUNTIME_ONLY = {
    "gguf": "transformers reads GGUF files (`tokq models pull`) only when the gguf package is installed",
    "accelerate": "transformers' from_pretrained(gguf_file=...) refuses to run without accelerate",
    "sentencepiece": "transformers' GGUF tokenizer conversion builds sentencepiece-style (Llama/Gemma) tokenizers",
}


def _third_party_imports() -> set[str]:
    import ast
    import sys

    names: set[str] = set()
    for path in (ROOT / "tokq").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "tokq"}


def _declared() -> tuple[set[str], set[str]]:
    import re
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    required = {name(r) for r in project["dependencies"]}
    optional = {name(r) for extra in project["optional-dependencies"].values() for r in extra}
    return required, optional


def test_tokq_declares_what_it_imports_and_imports_what_it_declares():
    imported = {_DISTRIBUTION.get(n, n).lower().replace("_", "-") for n in _third_party_imports()}
    required, optional = _declared()
    missing = imported - required - optional
    assert not missing, f"tokq imports {sorted(missing)} but pyproject.toml does not declare them"
    unused = required - imported - set(_RUNTIME_ONLY)
    assert not unused, f"pyproject.toml declares {sorted(unused)} but tokq never imports them"
