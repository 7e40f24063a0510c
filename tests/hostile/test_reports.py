"""Hostile input to the report writers: markup in names, labels and texts that end up in report.html (stored XSS
in a CI artifact), mathtext specials (`$`, `_`, `^`) in variant and folder names that matplotlib would parse,
bucket labels that are no position bucket (from the command line or a PR's tokq.toml), a malformed or missing
report.json given to `tokq report`, and the flags the screenshot browser runs with."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from tests.hostile.conftest import write_word_docs
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.cli import main

# Closes an attribute, opens a tag, and runs a script: a raw copy of any of it in report.html is an injection.
PAYLOAD = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
DOLLAR_NAMES = ("a$b$c", "v$_$1", "q$^$", "x$\\foo$")


def run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 0), ("b", 1), ("v$_$1", 1)):
        make_hf_checkpoint("llama", root / name, seed=seed)
        save_word_tokenizer(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_word_docs(tmp_path_factory.mktemp("docs"), (300, 200))


def compare_args(a: Path, b: Path, docs: Path, *extra) -> list[str]:
    return ["compare", str(a), str(b), "--data", str(docs), "--window", "64", "--threads", "1", "--dtype", "fp32",
            "--decode-tokens", "8", "--resamples", "100", *map(str, extra)]


@pytest.fixture(scope="module")
def compare_result(models, docs, tmp_path_factory) -> dict:
    """A real compare's report.json (with probes, so the probe grids are drawn too)."""
    folder = tmp_path_factory.mktemp("reports") / "compare"
    assert main(compare_args(models["a"], models["b"], docs, "--max-kl", "0.01", "--max-flip-rate", "0.9",
                             "--report-dir", folder)) == 1
    return json.loads((folder / "report.json").read_text())


def write_report_json(folder: Path, report: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report), encoding="utf-8")
    return folder


def bench(name: str) -> dict:
    """A paired speed experiment as the gate records it, its text fields naming `name`."""
    side = {"metrics": {"mean_ttft_ms": 10.0, "mean_tpot_ms": 2.0, "output_throughput": 100.0},
            "memory": {"weights_bytes": 2**20}, "stalls": 0, "roofline_fraction": 0.5,
            "kernels": {"linear": [f"{name} linear"], "attention": [f"{name} attention"]}}
    return {"base": side, "variant": copy.deepcopy(side), "passes": 3, "seconds": 1.0, "max_seconds": 1.0,
            "block_steps": 4, "machine_load": {}, "analysis": {"decode_step_ms": {"base": [1.0, 1.2, 1.1],
                                                                                   "variant": [0.9, 1.0, 1.1]},
                                                            "warnings": [name]}}


def gate_report(compare: dict, names: list[str], text: str = "docs") -> dict:
    """A gate's report.json around real compare results: one variant per name, its quality rules the compare's
    thresholds and one speed rule; every free text field holds `text`."""
    variants = {}
    for name in names:
        rules = [{**t, "kind": "quality", "result": "pass" if t["passed"] else "fail"} for t in compare["thresholds"]]
        rules.append({"kind": "speed", "name": "min_tpot_speedup", "metric": "TPOT speedup", "bucket": None,
                      "threshold": 1.2, "direction": "min", "value": 1.1, "low": 1.0, "high": 1.3,
                      "result": "inconclusive", "passed": False, "rule": text})
        variants[name] = {"rules": rules, "compare": {**compare, "b": {**compare["b"], "name": name}},
                          "bench": bench(name), "result": "fail"}
    return {"tokq_version": compare["tokq_version"], "command": "gate", "config": text, "base": text, "data": text,
            "runtime": {"hardware": text, "device": text, "threads": 1},
            "context": {"commit": text, "base_source": text}, "variants": variants, "result": "fail", "passed": False}


def assert_escaped(page: str) -> None:
    lowered = page.lower()
    assert "<script" not in lowered and "<img src=x" not in lowered and 'onerror=alert(1)>' not in lowered
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # should markup ever slip through, the page itself forbids scripts and any load but data: images
    assert "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:;" in page


def test_markup_in_compare_names_labels_and_texts_is_escaped(capsys, compare_result, tmp_path):
    """Hostile case: a compare report.json whose model names, KL method, noise floor, version, rule names, bucket
    labels and rule texts hold <script> and an attribute breakout; `tokq report` must write them escaped."""
    result = copy.deepcopy(compare_result)
    result["a"]["name"] = result["b"]["name"] = result["kl_method"] = result["tokq_version"] = PAYLOAD
    if result.get("noise_floor"):
        result["noise_floor"]["what"] = PAYLOAD
    result["thresholds"] = [{**t, "name": PAYLOAD, "bucket": PAYLOAD, "rule": PAYLOAD, "threshold": PAYLOAD}
                            for t in result["thresholds"]]
    folder = write_report_json(tmp_path / "report", result)
    code, text = run(capsys, "report", folder)
    assert code == 0, text
    page = (folder / "report.html").read_text()
    assert_escaped(page)
    assert page.count('src="data:image/png;base64,') == 5  # the plots are tokq's own markup: still inline images
    assert '<span class="fail">REGRESSION</span>' in page


def test_markup_in_gate_names_labels_and_texts_is_escaped(capsys, compare_result, tmp_path):
    """Hostile case: a gate report.json whose variant name, base, data set, commit, hardware, kernels, rule
    texts and bucket labels hold <script> and an attribute breakout; `tokq report` must write them escaped."""
    report = gate_report(compare_result, [PAYLOAD], PAYLOAD)
    for rule in report["variants"][PAYLOAD]["rules"]:
        rule.update({"name": PAYLOAD, "bucket": PAYLOAD if rule["kind"] == "quality" else None})
    folder = write_report_json(tmp_path / "report", report)
    code, text = run(capsys, "report", folder)
    assert code == 0, text
    page = (folder / "report.html").read_text()
    assert_escaped(page)
    assert page.count('src="data:image/png;base64,') == 7 and "<h1>tokq gate: <span class=" in page


def test_dollar_in_model_folder_name_does_not_crash_the_plots(capsys, models, docs, tmp_path):
    """Hostile case: `tokq compare a 'v$_$1' --report-dir DIR`: the folder name is B's name in the plot legend,
    where matplotlib's mathtext failed on `$_$` after all scoring. The report must be written, and the old one
    in DIR kept until the new one is complete."""
    folder = tmp_path / "report"
    write_report_json(folder, {"old": True})
    code, text = run(capsys, *compare_args(models["a"], models["v$_$1"], docs, "--no-probes", "--report-dir", folder))
    assert code == 0, text
    assert "v$_$1" in (folder / "report.html").read_text()
    assert json.loads((folder / "report.json").read_text())["b"]["name"].endswith("v$_$1")


def test_dollar_in_variant_names_is_drawn_literally(capsys, compare_result, tmp_path, monkeypatch):
    """Hostile case: gate variants named a$b$c, v$_$1, q$^$ and x$\\foo$: in legends, tick labels and titles
    matplotlib would read $...$ as math (a$b$c drawn as 'abc', the others a crash); every text is drawn as is."""
    from matplotlib.text import Text

    from tokq.reports import plots

    drawn: list[tuple[str, bool]] = []
    real = plots._data_uri

    def record(fig):
        uri = real(fig)  # drawn first: tick labels exist once the figure is rendered
        drawn.extend((t.get_text(), t.get_parse_math()) for t in fig.findobj(Text) if "$" in t.get_text())
        return uri

    monkeypatch.setattr(plots, "_data_uri", record)
    folder = write_report_json(tmp_path / "report", gate_report(compare_result, list(DOLLAR_NAMES)))
    code, text = run(capsys, "report", folder)
    assert code == 0, text
    page = (folder / "report.html").read_text()
    assert all(name in page for name in DOLLAR_NAMES)
    assert {name for name in DOLLAR_NAMES if any(name in t for t, _ in drawn)} == set(DOLLAR_NAMES)
    assert not [t for t, parsed in drawn if parsed]


@pytest.mark.parametrize("flag, value", [("--max-flip-rate", "<script>alert(1)</script>=0.5"),
                                         ("--max-kl", "<script>alert(1)</script>=0.1"),
                                         ("--min-top1", '"><img src=x onerror=alert(1)>=0.5'),
                                         ("--max-flip-rate", "4K-8K=0.5")])
def test_bucket_label_from_command_line_is_refused(capsys, tmp_path, flag, value):
    """Hostile case: a threshold's bucket label on the command line that is no position bucket (markup, or any
    bucket for the flip rate, which the probes do not split by position): refused naming the flag, before the
    models are even looked up."""
    code, text = run(capsys, "compare", tmp_path / "missing-a", tmp_path / "missing-b", flag, value)
    assert code == 2
    assert flag in text and "bucket" in text and "missing-a" not in text and "Traceback" not in text


def test_bucket_label_from_tokq_toml_is_refused_with_its_line(capsys, tmp_path, monkeypatch):
    """Hostile case: a PR's tokq.toml with a markup bucket label under [compare.thresholds] (read by `tokq
    compare`) or [gate.quality], or a position bucket on max_flip_rate: refused naming file:line."""
    config = tmp_path / "tokq.toml"
    monkeypatch.setenv("TOKQ_CONFIG", str(config))
    config.write_text('[compare.thresholds]\nmin_top1 = 0.5\nmax_flip_rate = { "<script>alert(1)</script>" = 0.5 }\n')
    code, text = run(capsys, "compare", tmp_path / "missing-a", tmp_path / "missing-b")
    assert code == 2 and f"{config}:3" in text and "bucket" in text and "missing-a" not in text, text
    project = '[base]\nmodel = "base"\n[variants]\nv = "v"\n[data.d]\npath = "d"\n[gate.quality]\nmax_kl = 0.1\n'
    for rule in ('max_kl = { "<script>alert(1)</script>" = 0.5 }', 'max_flip_rate = { "4K-8K" = 0.5 }'):
        config.write_text(project.replace("max_kl = 0.1", rule))
        code, text = run(capsys, "gate", "--config", config, "--out", tmp_path / "out")
        assert code == 2 and f"{config}:8" in text and "bucket" in text, text
        assert not (tmp_path / "out").exists()


def malformed_reports(compare: dict) -> dict[str, bytes]:
    def json_bytes(value) -> bytes:
        return json.dumps(value).encode()

    no_name = copy.deepcopy(compare)
    del no_name["a"]["name"]
    wrong_types = copy.deepcopy(compare)
    wrong_types["prefill"] = "high"
    bad_threshold = copy.deepcopy(compare)
    bad_threshold["thresholds"] = 5
    return {"not json": b"{this is not json", "not utf-8": b"\xff\xfe\x00garbage", "a list": json_bytes([1, 2]),
            "a string": json_bytes("report"), "empty object": json_bytes({}), "gate, no variants": json_bytes(
                {"command": "gate"}), "gate, variants a list": json_bytes({"command": "gate", "variants": []}),
            "no model name": json_bytes(no_name), "prefill a string": json_bytes(wrong_types),
            "thresholds a number": json_bytes(bad_threshold), "deeply nested": b"[" * 100_000 + b"]" * 100_000}


@pytest.mark.parametrize("case", ["not json", "not utf-8", "a list", "a string", "empty object", "gate, no variants",
                                  "gate, variants a list", "no model name", "prefill a string",
                                  "thresholds a number", "deeply nested", "missing", "a folder"])
def test_malformed_report_json_is_one_line_error(capsys, compare_result, tmp_path, case):
    """Hostile case: `tokq report DIR` on a report.json that is not JSON, not UTF-8, JSON but not an object,
    missing keys, holding values of the wrong type, nested past the parser's limit, missing, or a folder:
    one line naming the file and the fix, exit 2, and the folder left exactly as it was."""
    folder = tmp_path / "report"
    folder.mkdir()
    (folder / "report.md").write_text("old\n")
    source = folder / "report.json"
    if case == "a folder":
        source.mkdir()
    elif case != "missing":
        source.write_bytes(malformed_reports(compare_result)[case])
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    code, text = run(capsys, "report", folder)
    assert code == 2, text
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "report.json" in lines[0], text
    assert "internal error" not in text and "tokq compare --report-dir" in lines[0]
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no temporary folder left behind


def fake_browser(tmp_path: Path, fail_sandboxed: bool = False) -> Path:
    """A stand-in for Chromium that records its arguments and writes the --screenshot file (or, like a Chromium
    without a usable sandbox, refuses to start unless given --no-sandbox)."""
    script = tmp_path / "fake-chromium"
    log = tmp_path / "argv.json"
    refuse = ("if '--no-sandbox' not in args:\n    sys.stderr.write('FATAL: No usable sandbox!\\n'); sys.exit(1)\n"
              if fail_sandboxed else "")
    script.write_text(f"#!{shutil.which('python3') or '/usr/bin/python3'}\nimport json, sys\nargs = sys.argv[1:]\n"
                      f"open({str(log)!r}, 'a').write(json.dumps(args) + '\\n')\n{refuse}"
                      "shot = next(a.split('=', 1)[1] for a in args if a.startswith('--screenshot='))\n"
                      "open(shot, 'wb').write(b'png')\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("uid, fail_sandboxed, runs", [(1000, False, [False]), (0, False, [True]),
                                                       (1000, True, [False, True])])
def test_screenshot_browser_runs_sandboxed_without_scripts(tmp_path, monkeypatch, uid, fail_sandboxed, runs):
    """Hostile case: a report page is untrusted input to the browser that screenshots it: Chromium runs with its
    sandbox unless it cannot (root, or no usable sandbox on this kernel) and resolves no host names (nothing
    on the page may load from the network); the page's own CSP forbids scripts (assert_escaped)."""
    from tokq.reports import screenshot as shot

    monkeypatch.setenv("TOKQ_CHROMIUM", str(fake_browser(tmp_path, fail_sandboxed)))
    monkeypatch.setattr(shot.os, "geteuid", lambda: uid)
    page = tmp_path / "report.html"
    page.write_text("<!doctype html><p>report</p>")
    assert shot.screenshot(page, tmp_path / "out.png").read_bytes() == b"png"
    calls = [json.loads(line) for line in (tmp_path / "argv.json").read_text().splitlines()]
    assert ["--no-sandbox" in args for args in calls] == runs
    for args in calls:
        assert "--host-resolver-rules=MAP * ~NOTFOUND" in args
