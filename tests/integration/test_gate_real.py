"""`tokq gate` on the real SmolLM2-135M: a good variant (int8 weights) passes, a damaged one (int3 weights,
one scale per output channel) fails, with the failing quality rule named in the table, the report and the
JUnit file; both variants are built from their recipes; a rerun gives the same verdict and numbers."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from tokq.cli import main

pytestmark = pytest.mark.integration


def test_gate_passes_int8_and_fails_int3_per_channel(tmp_path, monkeypatch, capsys):
    from tokq.evalsuite import baseline_cache

    monkeypatch.setattr(baseline_cache, "cache_dir", lambda: tmp_path / "cache")  # models stay in the shared home
    docs = tmp_path / "docs"
    docs.mkdir()
    # real long documents, six of them: intervals over documents need more than two to say anything
    for name in ("argparse.py", "textwrap.py", "difflib.py", "pathlib.py", "calendar.py", "string.py"):
        source = Path(sysconfig.get_paths()["stdlib"]) / name
        (docs / f"{name}.txt").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "tokq.toml").write_text('''[base]
model = "smollm2-135m"
dtype = "bf16"

[variants]
int8 = { path = "built/int8", recipe = { method = "rtn", scheme = "w8a16", group_size = 64 } }
int3 = { path = "built/int3", recipe = { method = "rtn", bits = 3, group_size = -1 } }

[data.docs]
path = "docs"
window = 512
sample_windows = 6
probe_max_context = 256

[bench]
prompt_len = 32
gen_len = 8
concurrency = 2
max_seconds = 2

[gate.quality]
max_kl = 0.1
min_top1 = 0.85

[gate.speed]
max_memory_ratio = 0.9
''')
    reports = []
    for run, extra in enumerate(([], ["--variant", "int3", "--no-speed"])):  # the rerun: the damaged one only
        out = tmp_path / f"report{run}"
        code = main(["gate", "--config", str(tmp_path / "tokq.toml"), "--out", str(out), "--threads", "2", *extra])
        assert code == 1
        reports.append(json.loads((out / "report.json").read_text()))
        text = capsys.readouterr().out
        assert "int3: FAIL" in text and "max_kl" in text
    int8, int3 = reports[0]["variants"]["int8"], reports[0]["variants"]["int3"]
    assert int8["passed"], int8["rules"]
    failed = {r["name"] for r in int3["rules"] if not r["passed"]}
    assert "max_kl" in failed and "max_memory_ratio" not in failed
    kl8 = next(r for r in int8["rules"] if r["name"] == "max_kl")["value"]
    kl3 = next(r for r in int3["rules"] if r["name"] == "max_kl")["value"]
    print(f"SmolLM2 gate: KL int8 {kl8:.4f}, int3 per-channel {kl3:.4f}")
    assert kl3 > 20 * kl8
    junit = (tmp_path / "report0" / "junit.xml").read_text()  # failed rules as failures, inconclusive as errors
    assert '<failure message="' in junit and ' 95% bound ' in junit
    inconclusive = sum(r.get("result") == "inconclusive" for v in reports[0]["variants"].values() for r in v["rules"])
    assert junit.count('type="inconclusive"') == inconclusive

    def quality(v: dict) -> list:
        return [(r["name"], r["value"], r["low"], r["high"], r["passed"]) for r in v["rules"] if r["kind"] == "quality"]

    assert quality(reports[1]["variants"]["int3"]) == quality(int3)  # the rerun: same numbers, same verdict
