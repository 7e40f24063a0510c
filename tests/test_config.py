"""tokq.toml: `tokq init`'s starter parses; every bad value is an error naming the file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokq.cli import main
from tokq.config import load_project
from tokq.config_starter import STARTER
from tokq.errors import ConfigError
from tokq.paths import data_dir


def test_init_writes_a_starter_that_parses(tmp_path, capsys):
    path = tmp_path / "tokq.toml"
    assert main(["init", "--path", str(path)]) == 0
    project = load_project(path)
    assert project.base == "smollm2-135m" and set(project.variants) == {"int4"}
    assert project.variants["int4"].recipe["method"] == "awq"
    assert project.variants["int4"].path == tmp_path / "tokq_out/smollm2-awq-int4"
    assert project.data["default"].window == 2048 and project.bench.concurrency == 4  # sized for 2 cores
    assert project.data["default"].path == data_dir() / "default"  # $TOKQ_HOME's default set
    assert {r.name for r in project.quality} == {"max_kl", "min_top1", "max_ppl_ratio", "max_flip_rate"}
    assert [(r.name, r.direction, r.threshold) for r in project.speed] == [("min_tpot_speedup", "min", 1.2),
                                                                           ("max_ttft_p50_ratio", "max", 1.5)]
    assert project.bench.max_seconds == 60 and project.bench.block_steps == 8
    assert main(["init", "--path", str(path)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_per_bucket_rules(tmp_path):
    path = tmp_path / "tokq.toml"
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nmax_kl = { overall = 0.05, "4K-8K" = 0.1 }\n')
    rules = load_project(path).quality
    assert [(r.bucket, r.threshold) for r in rules] == [(None, 0.05), ("4K-8K", 0.1)]
    assert load_project(path).threshold_on == "bound"
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nthreshold_on = "point"\nmax_kl = 0.05\n')
    project = load_project(path)
    assert project.threshold_on == "point" and [r.name for r in project.quality] == ["max_kl"]


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace('model = "smollm2-135m"', "# no model"), r"tokq.toml:\d+: \[base\] needs model"),
    (lambda s: s.replace("concurrency = 4", "concurrency = \"many\""),
     r"tokq.toml:29: \[bench\] concurrency = 'many' must be an integer"),
    (lambda s: s.replace("max_kl = 0.05", "max_kl = \"low\""), r"tokq.toml:\d+: \[gate.quality\] max_kl = 'low' must be a number"),
    (lambda s: s.replace("window = 2048", "windw = 2048"), r"\[data.default\] windw is not a known key"),
    (lambda s: s.replace("\nprompt_len = 512", "\nspeed = 3\nprompt_len = 512"), r"\[bench\] speed is not a known key"),
    (lambda s: s + "\n[gates]\nx = 1\n", r"gates is not a known table"),
    (lambda s: s.replace('threshold_on = "bound"', 'threshold_on = "upper"'), r"tokq.toml:\d+: \[gate.quality\] threshold_on = 'upper' must be"),
    (lambda s: s.replace("min_tpot_speedup = 1.2", "min_tpot_speedup = true"), r"must be a number"),
    (lambda s: s.replace('int4 = {', 'int4 = { recipe = "awq" }\nx = {'), r"recipe must be a table"),
])
def test_bad_values_name_the_line(tmp_path, edit, message):
    path = tmp_path / "tokq.toml"
    path.write_text(edit(STARTER))
    with pytest.raises(ConfigError, match=message):
        load_project(path)


QUICK = '[base]\nmodel = "m"\n[data.default]\npath = "docs"\nwindow = 2048\nprobe_max_context = 1024\n{data}' \
        '[gate.quality]\n{rules}\n'


def quick(tmp_path, rules: str, data: str = "") -> Path:
    """A tokq.toml with the quickstart's probe grid (window 2048, probes up to 1024: one context, 5 depths)."""
    path = tmp_path / "tokq.toml"
    path.write_text(QUICK.format(rules=rules, data=data))
    return path


def test_flip_rule_needs_enough_probes(tmp_path):
    """0 flips of 5 probes: exact upper 95% bound 1 - 0.025^(1/5) = 0.52, so max_flip_rate 0.25 can never pass."""
    path = quick(tmp_path, "max_kl = 0.3\nmax_flip_rate = 0.25")
    with pytest.raises(ConfigError) as err:
        load_project(path)
    line = path.read_text().splitlines().index("max_flip_rate = 0.25") + 1
    message = str(err.value)
    assert message.startswith(f"{path}:{line}: [gate.quality] max_flip_rate = 0.25 cannot pass"), message
    assert "5 retrieval probes of [data.default]" in message and "bound is 0.52" in message
    assert "needs at least 13 probes (has 5): raise probe_repeats / probe_depths" in message
    # 3 repeats of the 5 depths: 15 probes, best case 0.22 <= 0.25
    project = load_project(quick(tmp_path, "max_flip_rate = 0.25", "probe_repeats = 3\n"))
    assert project.data["default"].probe_repeats == 3 and project.data["default"].probe_depths == 5
    load_project(quick(tmp_path, "max_flip_rate = 0.25", "probe_depths = 13\n"))  # 13 depths x 1
    with pytest.raises(ConfigError, match=r"needs at least 13 probes \(has 12\)"):
        load_project(quick(tmp_path, "max_flip_rate = 0.25", "probe_depths = 4\nprobe_repeats = 3\n"))
    # threshold_on = "point" decides on the estimate: 0 flips of 5 is 0 <= 0.25, so the rule can pass
    assert load_project(quick(tmp_path, 'threshold_on = "point"\nmax_flip_rate = 0.25')).threshold_on == "point"
    # probes up to the window (4096): contexts 1024, 2048, 4096 x 5 depths = 15 probes
    path.write_text(QUICK.format(rules="max_flip_rate = 0.25", data="").replace(
        "window = 2048\nprobe_max_context = 1024", "window = 4096"))
    load_project(path)


@pytest.mark.parametrize("rule,message", [
    ("max_flip_rate = 1.0", "max_flip_rate = 1 cannot fail: the metric is at most 1"),
    ("min_top1 = 0", "min_top1 = 0 cannot fail: the metric is at least 0"),
    ("max_rms_delta_p = 1.5", "max_rms_delta_p = 1.5 cannot fail"),
    ("max_kl = -0.1", "max_kl = -0.1 cannot pass: the metric is at least 0"),
    ("max_kl_p99 = -1", "max_kl_p99 = -1 cannot pass"),
    ("max_ppl_ratio = 0", "max_ppl_ratio = 0 cannot pass: the metric is above 0"),
    ('min_top1 = { overall = 0.8, "1K-2K" = 1.2 }', r"min_top1 \(1K-2K\) = 1.2 cannot pass: the metric is at most 1"),
])
def test_rules_that_cannot_fail_or_cannot_pass(tmp_path, rule, message):
    with pytest.raises(ConfigError, match=r"tokq.toml:\d+: \[gate.quality\] " + message):
        load_project(quick(tmp_path, rule, "probe_repeats = 3\n"))


def test_one_document_gives_no_interval(tmp_path):
    with pytest.raises(ConfigError, match=r"max_kl = 0.3 cannot pass with the 1 document of \[data.default\]"):
        load_project(quick(tmp_path, "max_kl = 0.3", "sample_windows = 1\n"))
    assert load_project(quick(tmp_path, "max_kl = 0.3", "sample_windows = 2\n")).quality[0].name == "max_kl"
    assert load_project(quick(tmp_path, 'threshold_on = "point"\nmax_kl = 0.3', "sample_windows = 1\n")).threshold_on == "point"


def test_probes_to_pass_is_the_smallest_sufficient_grid():
    from tokq.evalsuite.power import probes_to_pass
    from tokq.evalsuite.stats.exact import clopper_pearson

    for threshold in (0.05, 0.1, 0.2, 0.25, 0.3, 0.5, 0.52, 0.9):
        n = probes_to_pass(threshold)
        assert clopper_pearson(0, n)[1] <= threshold, threshold
        assert n == 1 or clopper_pearson(0, n - 1)[1] > threshold, threshold
    assert probes_to_pass(0.25) == 13 and probes_to_pass(0.0) is None


def test_the_quickstart_rules_are_decidable():
    """examples/quickstart/tokq.toml loads: its probe grid is large enough for its max_flip_rate."""
    from tokq.evalsuite.power import probes_to_pass
    from tokq.longctx.probes import probe_grid

    project = load_project(Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "tokq.toml")
    data = project.data["default"]
    grid = probe_grid(data.window, data.probe_max_context, data.probe_depths, data.probe_repeats)
    flip = next(r for r in project.quality if r.name == "max_flip_rate")
    assert grid.size >= probes_to_pass(flip.threshold)


def test_missing_file_points_to_init(tmp_path):
    with pytest.raises(ConfigError, match="run `tokq init`"):
        load_project(tmp_path / "tokq.toml")


def test_ci_examples_run_the_gate():
    """The CI examples parse as YAML: GitHub's uses tokq's action (tests/test_ci_action.py runs both), GitLab's
    runs `tokq gate`, keeps its report and publishes its JUnit file."""
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[1]
    github = yaml.safe_load((root / "examples" / "ci" / "github-actions.yml").read_text())
    assert any("/tokq@" in s.get("uses", "") for s in github["jobs"]["gate"]["steps"])
    action = yaml.safe_load((root / "action.yml").read_text())
    assert any("tokq gate" in s.get("run", "") for s in action["runs"]["steps"])
    assert any("junit.xml" in str(s.get("with", {})) for s in action["runs"]["steps"])
    gitlab = yaml.safe_load((root / "examples" / "ci" / "gitlab-ci.yml").read_text())["tokq-gate"]
    assert any("tokq gate" in line for line in gitlab["script"])
    assert gitlab["artifacts"]["reports"]["junit"] == "tokq_gate/junit.xml"


def _line(text: str, marker: str) -> int:
    (number,) = [i for i, raw in enumerate(text.splitlines(), 1) if marker in raw]
    return number


INT4 = 'int4 = { path = "tokq_out/smollm2-awq-int4", recipe = { method = "awq", scheme = "w4a16", group_size = 64 } }'


@pytest.mark.parametrize("edit,marker,message", [
    # nan and inf thresholds: a nan compares false both ways, so it would pass or fail nothing
    (lambda s: s.replace("max_kl = 0.05", "max_kl = nan"), "max_kl = nan",
     "[gate.quality] max_kl = nan must be a finite number"),
    (lambda s: s.replace("min_top1 = 0.85", 'min_top1 = { overall = 0.85, "4K-8K" = -inf }'), "min_top1 = {",
     "[gate.quality] min_top1 = -inf must be a finite number"),
    (lambda s: s.replace("min_tpot_speedup = 1.2", "min_tpot_speedup = inf"), "min_tpot_speedup = inf",
     "[gate.speed] min_tpot_speedup = inf must be a finite number"),
    (lambda s: s + "\n[compare.thresholds]\nmax_ppl_ratio = nan\n", "max_ppl_ratio = nan",
     "[compare.thresholds] max_ppl_ratio = nan must be a finite number"),
    # unknown keys
    (lambda s: s.replace(INT4, 'int4 = { path = "q", method = "awq" }'), "int4 = {",
     "[variants] int4 has an unknown key 'method': a variant takes path and recipe"),
    (lambda s: s.replace("group_size = 64 }", "groupsize = 64 }"), "int4 = {",
     "[variants] int4 recipe key 'groupsize' is not a `tokq quantize` option a recipe can set; known: act_order"),
    (lambda s: s.replace("group_size = 64 }", 'out = "elsewhere" }'), "int4 = {",
     "[variants] int4 recipe key 'out' is not a `tokq quantize` option"),  # the gate sets --out itself
    (lambda s: s.replace("group_size = 64 }", 'group_size = "64" }'), "int4 = {",
     "[variants] int4 recipe group_size = '64' must be an integer (as `tokq quantize --group-size` takes it)"),
    (lambda s: s.replace("group_size = 64 }", 'sym = "no" }'), "int4 = {",
     "[variants] int4 recipe sym = 'no' must be true or false"),
    (lambda s: s.replace('method = "awq"', 'method = "awk"'), "int4 = {",
     "[variants] int4 recipe method = 'awk' is not a method; choose one of rtn, awq"),
    (lambda s: s + "\n[compare]\nthreshold = 0.1\n", "threshold = 0.1",
     "[compare] threshold is not a known key; known: thresholds"),
    (lambda s: s + "\n[compare.thresholds]\nmax_kll = 0.1\n", "max_kll = 0.1",
     "[compare.thresholds] max_kll is not a known key; known: max_flip_rate"),
    (lambda s: s.replace("max_kl = 0.05", 'max_kl = { overall = 0.05, "4k-8k" = 0.1 }'), "max_kl = {",
     "[gate.quality] max_kl names bucket '4k-8k', which is not a position bucket; use overall or one of 0-511, "
     "512-1K"),
    (lambda s: s + '\n[compare.thresholds]\nmin_top1 = { "middle" = 0.9 }\n', '"middle"',
     "[compare.thresholds] min_top1 names bucket 'middle'"),
    (lambda s: s.replace('dtype = "auto"', 'dtype = "auto"\nrevision = "main"'), 'revision = "main"',
     "[base] revision is not a known key; known: dtype, model"),
])
def test_load_time_checks_name_the_line_and_the_fix(tmp_path, edit, marker, message):
    path = tmp_path / "tokq.toml"
    text = edit(STARTER)
    assert text != STARTER
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_project(path)
    assert info.value.message.startswith(f"{path}:{_line(text, marker)}: {message}"), info.value.message


@pytest.mark.parametrize("gate", ["", "[gate.quality]\nci = \"point\"\n[gate.speed]\n", "[gate.speed]\n"])
def test_a_gate_without_rules_is_refused(tmp_path, gate):
    path = tmp_path / "tokq.toml"
    path.write_text(f'[base]\nmodel = "smollm2-135m"\n[compare.thresholds]\nmax_kl = 0.05\n{gate}')
    with pytest.raises(ConfigError, match=r"holds no rule and neither does \[gate\.(speed|quality)\]: a gate without "
                                          r"rules would pass any variant; add one, e.g. max_kl = 0.05"):
        load_project(path)
    # compare is not a gate: a project without [compare.thresholds] loads once it has one gate rule.
    path.write_text('[base]\nmodel = "smollm2-135m"\n[compare]\n[gate.speed]\nmax_weights_ratio = 0.5\n')
    assert [r.name for r in load_project(path).speed] == ["max_weights_ratio"]


def test_relative_base_resolves_against_the_file_not_the_working_directory(tmp_path, monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "base").mkdir(parents=True)
    (elsewhere / "base").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # a different ./base here must not be picked
    path = project / "tokq.toml"
    for written in ("base", "./base"):
        path.write_text(f'[base]\nmodel = "{written}"\n[gate.quality]\nmax_kl = 0.05\n')
        assert load_project(path).base == str(project / "base")
        assert load_project(Path("..") / "project" / "tokq.toml").base == str(project / "base")
    path.write_text('[base]\nmodel = "smollm2-135m"\n[gate.quality]\nmax_kl = 0.05\n')
    assert load_project(path).base == "smollm2-135m"  # a zoo name stays a zoo name
    path.write_text(f'[base]\nmodel = "{elsewhere / "base"}"\n[gate.quality]\nmax_kl = 0.05\n')
    assert load_project(path).base == str(elsewhere / "base")


@pytest.mark.parametrize("code", [0, 1, 2, 3, 4])
def test_ci_examples_fail_the_job_on_every_nonzero_exit(tmp_path, code):
    """The CI examples' gate step, run by a shell with a stand-in `tokq` that exits `code`: the job's status is
    that code (3, inconclusive, is not a pass), and 3 gets a warning saying to rerun or lengthen the run."""
    import os
    import subprocess

    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[1]
    action = yaml.safe_load((root / "action.yml").read_text())
    (gate_step,) = [s for s in action["runs"]["steps"] if s.get("id") == "gate"]
    gitlab = yaml.safe_load((root / "examples" / "ci" / "gitlab-ci.yml").read_text())["tokq-gate"]["script"]
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "tokq").write_text(f"#!/bin/sh\nexit {code}\n")
    (fake / "tokq").chmod(0o755)
    outputs = tmp_path / "github_output"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(outputs),
           "TOKQ_CONFIG_FILE": "tokq.toml", "TOKQ_REPORT_DIR": "tokq_gate"}
    # GitHub runs `bash --noprofile --norc -eo pipefail`; GitLab runs the script lines in one shell with errexit,
    # here from the gate's line on (the ones before install tokq).
    gate_lines = gitlab[next(i for i, line in enumerate(gitlab) if "tokq gate" in line):]
    for shell, script in ((["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c"], gate_step["run"]),
                          (["sh", "-e", "-c"], "\n".join(gate_lines))):
        done = subprocess.run([*shell, script], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == code, (script, done.stderr)
        assert ("inconclusive (exit 3): rerun the job or lengthen the run" in done.stdout) == (code == 3)
    assert outputs.read_text() == f"exit-code={code}\n"  # the action's output


@pytest.mark.parametrize("value,message", [
    ("0", "max_doc_mb = 0 must be a positive number of MiB"),
    ("-1.5", "max_doc_mb = -1.5 must be a positive number of MiB"),
    ("nan", "max_doc_mb = nan must be a finite number"),
    ("inf", "max_doc_mb = inf must be a finite number"),
    ('"64"', "max_doc_mb = '64' must be a number"),
])
def test_data_read_caps_must_be_positive_mib(tmp_path, value, message):
    path = quick(tmp_path, "max_kl = 0.3", f"max_doc_mb = {value}\n")
    line = path.read_text().splitlines().index(f"max_doc_mb = {value}") + 1
    with pytest.raises(ConfigError) as err:
        load_project(path)
    assert str(err.value) == f"{path}:{line}: [data.default] {message}"
    other = rf"tokq.toml:{line}: \[data.default\] max_file_mb = 0 must be a positive"
    with pytest.raises(ConfigError, match=other):
        load_project(quick(tmp_path, "max_kl = 0.3", "max_file_mb = 0\n"))


def test_data_read_caps_default_to_the_flags(tmp_path):
    from tokq.longctx.read_limits import DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB

    data = load_project(quick(tmp_path, "max_kl = 0.3")).data["default"]
    assert (data.max_doc_mb, data.max_file_mb) == (DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB)
    caps = "max_doc_mb = 0.5\nmax_file_mb = 8\n"
    data = load_project(quick(tmp_path, "max_kl = 0.3", caps)).data["default"]
    assert (data.max_doc_mb, data.max_file_mb) == (0.5, 8.0)
    # the starter shows both, commented, with the flags' defaults
    assert "# max_doc_mb = 64 " in STARTER and "# max_file_mb = 1024 " in STARTER


def test_the_former_ci_key_still_reads_with_a_warning(tmp_path, caplog):
    """[gate.quality] ci was renamed threshold_on (the name `tokq compare --threshold-on` uses): an old file still
    gates the same way, warned; both keys at once are refused."""
    path = tmp_path / "tokq.toml"
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nci = "point"\nmax_kl = 0.05\n')
    with caplog.at_level("WARNING", logger="tokq"):
        assert load_project(path).threshold_on == "point"
    assert "ci is now called threshold_on" in caplog.text
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nci = "point"\nthreshold_on = "point"\nmax_kl = 0.05\n')
    with pytest.raises(ConfigError, match="same setting"):
        load_project(path)


def test_checking_tokq_toml_loads_no_torch(tmp_path):
    """`tokq init` and every tokq.toml check stay light: recipes, bucketed rules and data sets are checked
    against light tables (quantization.recipe, evalsuite.rule_defs), not the modules that compute."""
    import subprocess
    import sys

    path = tmp_path / "tokq.toml"
    path.write_text('[base]\nmodel = "smollm2-135m"\n[variants]\na = { path = "x", recipe = { method = "awq", '
                    'group_size = 64 } }\n[data.d]\npath = "."\n[gate.quality]\nmax_kl = { overall = 0.1, '
                    '"1K-2K" = 0.2 }\n')
    code = ("import sys; from pathlib import Path; from tokq.config import load_project; "
            f"p = load_project(Path({str(path)!r})); assert p.variants['a'].recipe['method'] == 'awq'; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
