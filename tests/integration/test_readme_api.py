"""docs/api.md's Python API example, run as written on the real SmolLM2-135M: quantize (AWQ), compare, bench,
LLM.generate and gate, in an empty folder holding mydocs/ (six real long documents)."""

from __future__ import annotations

import json
import re
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
README = Path(__file__).resolve().parents[2] / "docs" / "api.md"  # the API example moved out of the front page


def readme_api_example() -> str:
    text = README.read_text(encoding="utf-8")
    marker = text.index("<!-- run by tests/integration/test_readme_api.py")
    return re.search(r"```python\n(.*?)```", text[marker:], re.S).group(1)


def test_readme_api_example_runs(tmp_path, monkeypatch, capsys):
    from tokq.config import tomllib
    from tokq.evalsuite import baseline_cache

    monkeypatch.setattr(baseline_cache, "cache_dir", lambda: tmp_path / "cache")  # models stay in the shared home
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKQ_CONFIG", raising=False)
    docs = tmp_path / "mydocs"
    docs.mkdir()
    for name in ("argparse.py", "textwrap.py", "difflib.py", "pathlib.py", "calendar.py", "string.py"):
        source = Path(sysconfig.get_paths()["stdlib"]) / name
        (docs / f"{name}.txt").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    exec(compile(readme_api_example(), str(README), "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert (tmp_path / "smollm2-awq" / "tokq_quantization.json").is_file()
    assert tomllib.loads((tmp_path / "tokq.toml").read_text())["variants"]["awq"] == {"path": "smollm2-awq"}
    compare = json.loads((tmp_path / "compare-report" / "report.json").read_text())
    assert compare["b"]["name"] == "awq" and compare["windows"]["count"] == 8
    gate = json.loads((tmp_path / "gate-report" / "report.json").read_text())
    assert gate["variants"]["awq"]["compare"]["settings"]["window"] == 512  # [data.mydocs] reached the compare
    # AWQ int4 on its calibration documents: the KL is small, so both runs pass their loose rules
    assert compare["passed"] and gate["result"] == "pass"
    assert "pass 0" in out
