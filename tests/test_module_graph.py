"""The shape of the code: no import cycle inside tokq/, modules small enough to read in one sitting, and a CLI
that is a thin layer over the library (no library module imports the CLI)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tokq"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the tokq modules it imports (at any level: a function-level import is still a dependency)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            # `from tokq.a import b` depends on tokq.a.b when b is a module, else on tokq.a
            graph[name] |= {t for t in targets if t in paths and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_tokq():
    assert cycles(import_graph()) == []


def test_the_tokq_package_exports_are_lazy():
    """`import tokq` must not import torch (the CLI's start, `tokq init`, `tokq --help`)."""
    import subprocess
    import sys

    code = "import sys, tokq; assert 'torch' not in sys.modules; print(sorted(tokq.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for name in ("quantize", "compare", "bench", "gate", "LLM", "SamplingParams"):
        assert repr(name) in out.stdout


def test_no_library_module_imports_the_cli():
    graph = import_graph()
    cli = {m for m in graph if m == "tokq.cli" or m.startswith("tokq.commands")}
    for module, imports in graph.items():
        if module not in cli and module != "tokq.__main__":  # `python -m tokq` is the CLI's entry point
            assert not imports & cli, f"{module} imports the CLI layer: {sorted(imports & cli)}"


def test_long_modules_say_why_at_the_top():
    """A module over 400 lines states in its docstring's first lines why it is one module ("Over 400 lines: ...")."""
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > MAX_LINES:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            head = "\n".join(docstring.splitlines()[:6])
            assert "Over 400 lines:" in head, f"{path.relative_to(ROOT)} has {text.count(chr(10))} lines and no reason"


def test_no_api_name_is_shadowed_by_a_submodule():
    """Importing tokq.X sets the attribute tokq.X to that module: an API function of the same name (a package
    tokq/quantize/ beside tokq.quantize()) would turn into a module once anything imported the package."""
    import tokq

    submodules = {p.stem for p in PACKAGE.glob("*.py")} | {p.name for p in PACKAGE.iterdir() if p.is_dir()}
    assert not set(tokq.__all__) & submodules
    import subprocess
    import sys

    code = ("import tokq.quantization.pipeline, tokq.api.compare, tokq\n"
            "assert tokq.quantize.__module__ == 'tokq.api.quantize' and callable(tokq.compare), tokq.quantize")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
