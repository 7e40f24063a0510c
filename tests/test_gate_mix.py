"""`tokq gate` with a recipe that asks for target = "gate": the search runs on documents the gate's windows do not
use, judges builds by the gate's own rules on held-out documents, builds the smallest that passed, records the
search in the checkpoint and draws it in the report; a bad target is refused when tokq.toml is read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main


def write_project(root: Path, recipe: str, max_kl: float = 0.05) -> Path:
    make_hf_checkpoint("llama", root / "base", seed=0)
    save_word_tokenizer(root / "base")
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for i in range(10):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + "\n")
    (root / "tokq.toml").write_text(f'''[base]
model = "{root / 'base'}"
dtype = "fp32"

[variants]
mixed = {{ path = "built/mixed", recipe = {recipe} }}

[data.docs]
path = "docs"
window = 128
sample_windows = 3
probe_depths = 1
probe_max_context = 128

[gate.quality]
max_kl = {max_kl}
''')
    return root / "tokq.toml"


def test_target_gate_searches_off_the_gate_windows_and_builds_the_smallest_passing(tmp_path):
    config = write_project(tmp_path, '{ method = "rtn", mix = "w4a16,w8a16,bf16", target = "gate" }', max_kl=0.0001)
    out = tmp_path / "report"
    code = main(["gate", "--config", str(config), "--report-dir", str(out), "--threads", "1", "--no-speed"])
    assert code in (0, 1, 3)
    report = json.loads((out / "report.json").read_text())
    variant = report["variants"]["mixed"]
    search = variant["search"]
    assert search is not None
    docs = search["documents"]
    # the gate's 3 windows come from at most 3 documents; the search uses only the other ones, split in two
    assert docs["gate_windows"] <= 3 and docs["choice"] + docs["held_out"] == 10 - docs["gate_windows"]
    assert docs["choice"] >= 1 and docs["held_out"] >= 1
    frontier, evaluations = search["frontier"], search["evaluations"]
    assert [p["bytes"] for p in frontier] == sorted(p["bytes"] for p in frontier)
    assert 1 <= len(evaluations) <= 4
    chosen = search["chosen"]
    passed = [e["index"] for e in evaluations if e["result"] == "pass"]
    if passed:  # the smallest judged build that passed, and every smaller judged one did not
        assert chosen == min(passed)
        assert all(e["result"] != "pass" for e in evaluations if e["index"] < chosen)
    else:
        assert chosen == max(e["index"] for e in evaluations) and search["note"]
    record = json.loads((tmp_path / "built" / "mixed" / "tokq_quantization.json").read_text())
    assert record["gate_search"]["chosen_assignment"] == search["chosen_assignment"]
    assert record["format"] == "mixed-precision" and len(record["recipe_sha256"]) == 64
    counts = {}
    for fmt in search["chosen_assignment"].values():
        counts[fmt] = counts.get(fmt, 0) + 1
    assert counts == {k: v for k, v in frontier[chosen]["counts"].items() if v}
    html = (out / "report.html").read_text()
    assert "Mixed-precision search: mixed" in html and 'alt="size/quality frontier mixed"' in html
    assert "## Mixed-precision search: mixed" in (out / "report.md").read_text()
    # a rerun with the same recipe, rules and documents reuses the build; a changed rule rebuilds it
    stamp = (tmp_path / "built" / "mixed" / "model.safetensors").stat().st_mtime_ns
    assert main(["gate", "--config", str(config), "--report-dir", str(tmp_path / "r2"), "--threads", "1",
                 "--no-speed"]) == code
    assert (tmp_path / "built" / "mixed" / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_gptq_target_gate_measures_gptqs_own_linears(tmp_path):
    config = write_project(tmp_path, '{ method = "gptq", mix = "w4a16,bf16", target = "gate", num_samples = 4, '
                                     'seq_len = 64 }', max_kl=0.0001)
    code = main(["gate", "--config", str(config), "--report-dir", str(tmp_path / "report"), "--threads", "1",
                 "--no-speed"])
    assert code in (0, 1, 3)
    record = json.loads((tmp_path / "built" / "mixed" / "tokq_quantization.json").read_text())
    assert record["method"] == "gptq" and record["format"] == "mixed-precision"
    assert any("except w4a16: the given weights" in n for n in record["gate_search"]["sensitivity_notes"])


@pytest.mark.parametrize("recipe, message", [
    ('{ method = "rtn", target = "gate" }', "add mix ="),
    ('{ method = "rtn", mix = "w4a16,bf16", target = "best" }', "is not a target"),
    ('{ method = "rtn", mix = "w4a16,bf16", target = "gate", target_kl = 0.1 }', "drop target_kl"),
])
def test_bad_target_is_refused_when_tokq_toml_is_read(tmp_path, capsys, recipe, message):
    config = write_project(tmp_path, recipe)
    code = main(["gate", "--config", str(config), "--report-dir", str(tmp_path / "r"), "--no-speed"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "built").exists()


def test_gate_using_every_document_leaves_nothing_to_search_on(tmp_path, capsys):
    config = write_project(tmp_path, '{ method = "rtn", mix = "w4a16,bf16", target = "gate" }')
    config.write_text(config.read_text().replace("sample_windows = 3\n", ""))
    code = main(["gate", "--config", str(config), "--report-dir", str(tmp_path / "r"), "--no-speed"])
    assert code == 2
    assert "sample_windows" in capsys.readouterr().err
    assert not (tmp_path / "built").exists() or not any((tmp_path / "built").iterdir())
