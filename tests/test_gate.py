"""`tokq gate` on tiny checkpoints: a good variant passes, a damaged one fails its quality rule, an impossible speed
rule fails honestly, a variant is built from its recipe, reruns agree, and bad configs exit 2."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_models_vs_hf import make_hf_checkpoint, near_copy
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    for name, seed in (("base", 0), ("damaged", 1)):
        make_hf_checkpoint("llama", root / name, seed=seed)
        save_word_tokenizer(root / name)
    near_copy(root / "base", root / "same")  # the base's weights, not its bytes (a byte-identical copy is refused)
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for i, n in enumerate((400, 300, 250)):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    (root / "tokq.toml").write_text(f'''[base]
model = "{root / 'base'}"
dtype = "fp32"

[variants]
same = "same"
damaged = {{ path = "damaged" }}
rtn = {{ path = "built/rtn", recipe = {{ method = "rtn", group_size = 32 }} }}

[data.docs]
path = "docs"
window = 128

[bench]
prompt_len = 12
gen_len = 4
concurrency = 2
max_seconds = 1

[gate.quality]
max_kl = 0.05
min_top1 = 0.5

[gate.speed]
max_memory_ratio = 1.5
''')
    return root


def absolute(text: str, project: Path) -> str:
    """The project's tokq.toml with its relative paths made absolute (to copy it elsewhere)."""
    for rel in ("docs", "base", "same", "damaged", "built/rtn"):
        text = text.replace(f'"{rel}"', f'"{project / rel}"')
    return text


def gate(project: Path, tmp_path: Path, *args) -> tuple[int, dict | None]:
    out = tmp_path / "report"
    code = main(["gate", "--config", str(project / "tokq.toml"), "--report-dir", str(out), "--threads", "1", *args])
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None
    return code, report


def test_good_variant_passes_and_damaged_fails(project, tmp_path, capsys):
    code, report = gate(project, tmp_path, "--variant", "same", "--variant", "damaged")
    assert code == 1
    same, damaged = report["variants"]["same"], report["variants"]["damaged"]
    assert same["passed"] and not damaged["passed"]
    failed = [r for r in damaged["rules"] if not r["passed"]]
    assert [r["name"] for r in failed] == ["min_top1"] and failed[0]["kind"] == "quality"  # random models: flat KL
    assert {r["name"] for r in same["rules"]} == {"max_kl", "min_top1", "max_memory_ratio"}
    # report.json is the source of truth: what ran, on what, with which inputs.
    assert report["versions"]["torch"] and report["runtime"]["hardware"] and len(report["config_sha256"]) == 64
    hashes = {name: (v["compare"]["a"]["sha256"], v["compare"]["b"]["sha256"]) for name, v in report["variants"].items()}
    assert hashes["same"][0] == hashes["damaged"][0] != hashes["damaged"][1] != hashes["same"][1]
    assert same["compare"]["data_sha256"] == damaged["compare"]["data_sha256"]
    out = tmp_path / "report"
    assert sorted(p.name for p in out.iterdir()) == [".tokq-owner.json", "junit.xml", "report.html", "report.json",
                                                     "report.md"]
    assert (out / "report.html").read_text().count("data:image/png") >= 4
    assert "damaged: min_top1" in (out / "junit.xml").read_text()
    text = capsys.readouterr().out
    assert "FAIL" in text and "min_top1" in text


def test_recipe_builds_the_variant_and_reruns_agree(project, tmp_path):
    shutil.rmtree(project / "built", ignore_errors=True)
    verdicts = []
    for i in range(2):
        code, report = gate(project, tmp_path / str(i), "--variant", "rtn", "--no-speed")
        verdicts.append((code, [(r["name"], r["passed"], r["value"], r["low"], r["high"])
                                for r in report["variants"]["rtn"]["rules"]]))
    assert (project / "built" / "rtn" / "config.json").is_file()
    assert verdicts[0] == verdicts[1]


def test_speed_rule_fails_honestly(project, tmp_path):
    config = (project / "tokq.toml").read_text().replace("max_memory_ratio = 1.5", "min_tpot_speedup = 50.0")
    path = tmp_path / "tokq.toml"
    path.write_text(absolute(config, project))
    out = tmp_path / "report"
    code = main(["gate", "--config", str(path), "--variant", "same", "--out", str(out), "--threads", "1"])
    report = json.loads((out / "report.json").read_text())
    speed = [r for r in report["variants"]["same"]["rules"] if r["kind"] == "speed"]
    assert code == 1 and speed and not speed[0]["passed"] and "TPOT speedup" in speed[0]["rule"]
    # the same model on both sides: a speedup near 1 (a tiny model on a shared CPU: noisy) whose interval misses 50x
    assert speed[0]["result"] == "fail" and speed[0]["high"] < 50 and 0.2 < speed[0]["value"] < 5
    bench = report["variants"]["same"]["bench"]
    assert bench["passes"] >= 2 and bench["analysis"]["steps"] > 0  # paired passes, interleaved
    assert bench["base"]["metrics"]["completed"] == bench["variant"]["metrics"]["completed"]
    assert bench["machine_load"]["seconds"] > 0


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace("[base]\n", "[base]\nmodle = 1\n"), "tokq.toml:2: [base] modle is not a known key"),
    (lambda s: s.replace("max_kl = 0.05", 'max_kl = "small"'), "max_kl = 'small' must be a number"),
    (lambda s: s.replace('path = "docs"', 'path = "nowhere"'), "tokq.toml:11: [data.docs] path = "),
    (lambda s: re.sub(r'model = ".*"', 'model = "/no/such/model"', s, count=1),
     "tokq.toml:2: [base] model = '/no/such/model': model directory /no/such/model does not exist"),
    (lambda s: s.replace('damaged = { path = "damaged" }', 'damaged = { path = "gone" }'),
     "tokq.toml:7: [variants] damaged points at"),
    # the base itself as a variant would pass every rule: refused, however it is reached
    (lambda s: s.replace('same = "same"', 'same = "base"'), "whose weights and config are the base's"),
    (lambda s: s.replace("max_kl = 0.05", "max_kl = 1e308"), "max_kl = 1e+308 cannot fail"),
    (lambda s: s.replace("max_memory_ratio = 1.5", "min_tpot_speedup = 0"), "min_tpot_speedup = 0 cannot fail"),
])
def test_bad_config_exits_2(project, tmp_path, capsys, edit, message):
    path = tmp_path / "tokq.toml"
    path.write_text(absolute(edit((project / "tokq.toml").read_text()), project))
    out = tmp_path / "report"
    assert main(["gate", "--config", str(path), "--out", str(out), "--no-speed"]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")
    assert not out.exists()


@pytest.mark.parametrize("how", ["symlink", "copy"])
def test_a_variant_that_is_the_base_is_refused(project, tmp_path, capsys, how):
    """A link to the base's folder, or a byte-identical copy of it, is not a build to gate (issue 34: it passed)."""
    alias = tmp_path / "alias"
    alias.symlink_to(project / "base") if how == "symlink" else shutil.copytree(project / "base", alias)
    path = tmp_path / "tokq.toml"
    path.write_text(absolute((project / "tokq.toml").read_text(), project).replace(
        f'same = "{project / "same"}"', f'same = "{alias}"'))
    out = tmp_path / "report"
    assert main(["gate", "--config", str(path), "--out", str(out), "--no-speed"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "[variants] same points at" in err and "byte for byte" in err and not out.exists()


def test_out_that_is_not_a_report_folder_is_refused(project, tmp_path, capsys):
    out = tmp_path / "mywork"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code = main(["gate", "--config", str(project / "tokq.toml"), "--out", str(out), "--no-speed"])
    assert code == 2 and "is not a tokq report folder" in capsys.readouterr().err.replace("\n", " ")
    assert (out / "notes.txt").read_text() == "keep me"


def test_unknown_variant_exits_2(project, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["gate", "--config", str(project / "tokq.toml"), "--variant", "int9", "--out", str(out)]) == 2
    assert "variant 'int9' is not in [variants]" in capsys.readouterr().err.replace("\n", " ")


def test_interrupted_report_write_leaves_no_report(project, tmp_path, monkeypatch):
    # A previous run's complete report is there; this run is interrupted while writing report.html.
    out = tmp_path / "report"
    assert gate(project, tmp_path, "--variant", "same", "--no-speed")[0] == 0
    assert (out / "report.json").is_file()
    from tokq.reports import gate_report

    def interrupted(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(gate_report, "gate_html", interrupted)
    code, report = gate(project, tmp_path, "--variant", "same", "--no-speed")
    assert code == 130 and report is None
    assert not out.exists()  # neither the stale verdict nor a half-written folder
    assert [p.name for p in tmp_path.iterdir()] == []


def test_sigterm_mid_gate_leaves_no_report(project, tmp_path):
    # What a CI cancel does: SIGTERM while the bench runs (a workload long enough to still be running).
    config = (project / "tokq.toml").read_text().replace("gen_len = 4", "gen_len = 1500").replace(
        "prompt_len = 12", "prompt_len = 400").replace("max_seconds = 1", "max_seconds = 600")
    path = tmp_path / "tokq.toml"
    path.write_text(absolute(config, project))
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.json").write_text("{}")  # a stale report from an earlier run
    proc = subprocess.Popen([sys.executable, "-m", "tokq", "gate", "--config", str(path), "--variant", "same",
                             "--out", str(out), "--threads", "1"], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "speed on the [bench] workload" in line:
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            break
    proc.stderr.read()
    assert proc.wait(timeout=60) == 130, "".join(seen)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["tokq.toml"]


def _plot_pixels(png: Path) -> int:
    """Pixels drawn in matplotlib's first two cycle colours (tab:blue, tab:orange): plot marks, never page text."""
    import matplotlib.image
    import numpy as np

    rgb = (matplotlib.image.imread(png)[..., :3] * 255).astype(np.int16)
    colours = np.array([[31, 119, 180], [255, 127, 14]], dtype=np.int16)
    near = (np.abs(rgb[:, :, None, :] - colours[None, None]).max(axis=-1) <= 12).any(axis=-1)
    return int(near.sum())


def test_report_screenshot_in_chromium_shows_the_plots(project, tmp_path):
    from tokq.errors import ConfigError
    from tokq.reports.screenshot import find_chromium, screenshot

    if find_chromium() is None:
        pytest.skip("no Chromium here: scripts/test.sh installs the `chromium` package (apt-get install chromium)")
    blank = tmp_path / "blank.html"
    blank.write_text("<!doctype html><p>tokq</p>")
    try:  # the browser itself must work here before it can judge a report
        screenshot(blank, tmp_path / "blank.png", height=200)
    except ConfigError as exc:
        pytest.skip(f"Chromium is installed but cannot run here: {exc}")
    out = tmp_path / "report"
    assert gate(project, tmp_path, "--variant", "same", "--variant", "damaged")[0] == 1
    png = tmp_path / "shot.png"
    assert main(["report", str(out), "--screenshot", str(png)]) == 0
    drawn = _plot_pixels(png)
    # The same page with its images broken: what a report whose plots failed to render looks like.
    broken = tmp_path / "broken"
    broken.mkdir()
    html_text = (out / "report.html").read_text()
    (broken / "report.html").write_text(re.sub(r'src="data:image/png;base64,[^"]+"', 'src="data:image/png;base64,AA"',
                                               html_text))
    assert _plot_pixels(screenshot(broken / "report.html", tmp_path / "broken.png")) < 20
    assert drawn > 300, f"only {drawn} plot pixels in the screenshot"


def _own_project(project: Path, folder: Path, recipe: str = "method = \"rtn\", group_size = 32") -> Path:
    """A tokq.toml in `folder` whose base is ./base (a copy of the fixture's base) and whose rtn variant is built
    from `recipe`; quality rules only."""
    if not (folder / "base").exists():
        shutil.copytree(project / "base", folder / "base")
    path = folder / "tokq.toml"
    path.write_text(f'''[base]
model = "base"
dtype = "fp32"

[variants]
rtn = {{ path = "built/rtn", recipe = {{ {recipe} }} }}

[data.docs]
path = "{project / 'docs'}"
window = 128
sample_windows = 3

[gate.quality]
max_kl = 10.0
''')
    return path


def _gate_at(path: Path, out: Path, *args) -> tuple[int, dict | None]:
    code = main(["gate", "--config", str(path), "--out", str(out), "--threads", "1", *args])
    return code, json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else None


def test_relative_base_is_the_one_next_to_tokq_toml(project, tmp_path, monkeypatch):
    # The working directory holds a different ./base (the damaged model): it must not be used.
    cwd = tmp_path / "cwd"
    shutil.copytree(project / "damaged", cwd / "base")
    monkeypatch.chdir(cwd)
    folder = tmp_path / "x"
    folder.mkdir()
    path = folder / "tokq.toml"
    path.write_text(_own_project(project, folder).read_text().replace(
        'rtn = { path = "built/rtn", recipe = { method = "rtn", group_size = 32 } }', 'same = "same"'))
    near_copy(folder / "base", folder / "same")
    code, report = _gate_at(path, tmp_path / "report")
    assert report["base_checkpoint"] == str(folder / "base")
    a, b = report["variants"]["same"]["compare"]["a"], report["variants"]["same"]["compare"]["b"]
    assert code == 0 and a["checkpoint"] == str(folder / "base") and b["checkpoint"] == str(folder / "same")


def test_recipe_hash_reuse_rebuild_and_interrupted_rebuild(project, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "x"
    folder.mkdir()
    monkeypatch.chdir(tmp_path)  # the gate must build from x/base, not ./base (there is none here)
    path = _own_project(project, folder)
    built = folder / "built" / "rtn"
    assert _gate_at(path, tmp_path / "r1")[0] == 0
    first = json.loads((built / "tokq_quantization.json").read_text())
    assert len(first["recipe_sha256"]) == 64 and first["source_checkpoint"] == str(folder / "base")
    assert first["scheme"]["weights"]["group_size"] == 32
    capsys.readouterr()

    # Same recipe, same base: reused as it is.
    stamp = (built / "tokq_quantization.json").stat().st_mtime_ns
    assert _gate_at(path, tmp_path / "r2")[0] == 0
    assert (built / "tokq_quantization.json").stat().st_mtime_ns == stamp
    assert "follows its recipe" in capsys.readouterr().err.replace("\n", " ")

    # An edited recipe: rebuilt, and said so.
    _own_project(project, folder, "method = \"rtn\", group_size = 16")
    code, report = _gate_at(path, tmp_path / "r3")
    second = json.loads((built / "tokq_quantization.json").read_text())
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 0 and "rebuilding it (the old checkpoint stays until the new one is complete)" in err
    assert second["recipe_sha256"] != first["recipe_sha256"] and second["scheme"]["weights"]["group_size"] == 16
    assert report["variants"]["rtn"]["compare"]["b"]["sha256"] != report["variants"]["rtn"]["compare"]["a"]["sha256"]

    # A rebuild interrupted half-way keeps the complete old checkpoint (and its hash).
    from tokq.quantization import pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "quantize_model", interrupted)
    _own_project(project, folder, "method = \"rtn\", group_size = 32")
    assert _gate_at(path, tmp_path / "r4") == (130, None)
    assert json.loads((built / "tokq_quantization.json").read_text()) == second
    assert sorted(p.name for p in built.parent.iterdir()) == ["rtn"]  # no temporary folder left


def test_checkpoint_not_built_from_its_recipe_is_refused(project, tmp_path, capsys):
    folder = tmp_path / "x"
    folder.mkdir()
    path = _own_project(project, folder)
    shutil.copytree(project / "damaged", folder / "built" / "rtn")  # put there by hand, not by the gate
    before = sorted(p.name for p in (folder / "built" / "rtn").iterdir())
    code, report = _gate_at(path, tmp_path / "report")
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 2 and report is None and not (tmp_path / "report").exists()
    line = path.read_text().splitlines().index(
        'rtn = { path = "built/rtn", recipe = { method = "rtn", group_size = 32 } }') + 1
    assert f"tokq.toml:{line}: [variants] rtn has a recipe, but its checkpoint" in err
    assert "delete the checkpoint so the gate rebuilds it from the recipe, or drop the recipe" in err
    assert sorted(p.name for p in (folder / "built" / "rtn").iterdir()) == before


def test_a_bug_while_building_a_variant_exits_4_not_blaming_the_recipe(project, tmp_path, monkeypatch, capsys):
    from tokq.quantization import pipeline

    def broken(*args, **kwargs):
        raise RuntimeError("kernel bug")

    monkeypatch.setattr(pipeline, "quantize_model", broken)
    folder = tmp_path / "x"
    folder.mkdir()
    code, report = _gate_at(_own_project(project, folder), tmp_path / "report")
    err = capsys.readouterr().err
    assert code == 4 and report is None and not (folder / "built" / "rtn").exists()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: internal error (RuntimeError: kernel bug); the traceback")
    assert "fix the recipe" not in err


def test_no_speed_with_only_speed_rules_is_refused(project, tmp_path, capsys):
    folder = tmp_path / "x"
    folder.mkdir()
    path = _own_project(project, folder)
    path.write_text(path.read_text().replace("[gate.quality]\nmax_kl = 10.0", "[gate.speed]\nmin_tpot_speedup = 1.0"))
    code, report = _gate_at(path, tmp_path / "report", "--no-speed")
    assert code == 2 and report is None and not (folder / "built").exists()  # refused before building anything
    assert "[gate.quality] holds no rule and --no-speed skips [gate.speed]" in capsys.readouterr().err.replace("\n", " ")


def test_data_caps_in_tokq_toml_skip_a_long_document(project, tmp_path, caplog):
    """[data.NAME] max_doc_mb reaches the gate's document loading: a longer document is skipped, warned."""
    docs = tmp_path / "docs"
    docs.mkdir()
    rng = random.Random(1)
    for i in range(3):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + "\n")  # ~1.4 KB
    (docs / "big.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(3000)) + "\n")  # ~14 KB
    config = absolute((project / "tokq.toml").read_text(), project).replace(
        f'path = "{project / "docs"}"', f'path = "{docs}"\nmax_doc_mb = 0.0078125')  # 8 KiB
    assert "max_doc_mb = 0.0078125" in config
    path = tmp_path / "tokq.toml"
    path.write_text(config)
    out = tmp_path / "report"
    with caplog.at_level("WARNING", logger="tokq"):
        code = main(["gate", "--config", str(path), "--variant", "same", "--out", str(out), "--threads", "1",
                     "--no-speed"])
    report = json.loads((out / "report.json").read_text())
    assert code == 0, report["variants"]["same"]["rules"]
    assert report["variants"]["same"]["compare"]["data"] | {"path": None} == {
        "path": None, "documents": 3, "skipped": 1, "shorter_than_window": 0, "windowed": 3}
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokq"]
    skip = "larger than 0.0078125 MiB (--max-doc-mb 0.0078125)"
    assert any("big.txt" in w and skip in w for w in warnings), warnings


def test_a_variant_judged_far_from_its_calibration_is_warned_about(project, tmp_path, capsys):
    """A GPTQ recipe calibrated on documents of other words than the gate's: the report and the console say so."""
    folder = tmp_path / "far"
    calib = folder / "calib"
    calib.mkdir(parents=True)
    rng = random.Random(3)
    unused = WORDS[150:]  # the gate's documents draw from all WORDS; these few dominate nothing there
    (calib / "other.txt").write_text(" ".join(rng.choice(unused) for _ in range(600)) + "\n")
    path = _own_project(project, folder, f'method = "gptq", group_size = 32, num_samples = 4, seq_len = 64, '
                                         f'calib = "{calib}"')
    code, report = _gate_at(path, tmp_path / "report")
    err = " ".join(capsys.readouterr().err.split())
    distance = report["variants"]["rtn"]["compare"]["calibration_distance"]["b"]
    assert distance["far"] and distance["excess_bits"] > distance["threshold"]
    assert distance["source_tokens"] == {"other.txt": 4 * 64}
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "rtn: warning:" in markdown and "calibrated on documents far from these" in markdown
    assert "calibrated on documents far from these" in err and code == 0  # a warning, not a verdict


def test_html_report_says_what_the_markdown_says(project, tmp_path):
    """report.html carries each variant's decode path, noise floor, KL tail and calibration distance, as report.md
    does; an inconclusive rule and verdict stand out in their own style, not as a pass."""
    from tokq.reports.gate_report import gate_html, gate_markdown

    code, report = gate(project, tmp_path, "--no-speed", "--variant", "same")
    compare = report["variants"]["same"]["compare"]
    compare["calibration_distance"] = {"b": {
        "warning": "these documents lie far from the calibration documents", "calibration_source": "code/",
        "calibration_tokens": 1000, "evaluated_tokens": 2000, "excess_bits": 0.61, "js_bits": 0.7,
        "same_distribution_bits": 0.09, "threshold": 0.25}}
    rule = report["variants"]["same"]["rules"][0]
    rule.update(result="inconclusive", passed=False, inconclusive=True)
    report["result"], report["passed"] = "inconclusive", False
    page, markdown = gate_html(report), gate_markdown(report)
    assert "Quality details: same" in page and "decode path" in page
    assert "KL tail over the scored tokens" in page and "KL tail over the scored tokens" in markdown
    if compare.get("noise_floor"):
        assert "Noise floor" in page and "Noise floor" in markdown
    assert "far from the calibration documents" in page and "0.610 bits" in page and "0.610 bits" in markdown
    assert '<span class=inconclusive>INCONCLUSIVE</span>' in page and "<td class=inconclusive>INCONCLUSIVE" in page
    assert ".inconclusive{" in page
