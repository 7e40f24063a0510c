"""tokq.toml: `tokq init`'s starter parses; every bad value is an error naming the file and line."""

from __future__ import annotations

import pytest

from tokq.cli import main
from tokq.config import STARTER, load_project
from tokq.errors import ConfigError
from tokq.paths import data_dir


def test_init_writes_a_starter_that_parses(tmp_path, capsys):
    path = tmp_path / "tokq.toml"
    assert main(["init", "--path", str(path)]) == 0
    project = load_project(path)
    assert project.base == "smollm2-135m" and set(project.variants) == {"int4"}
    assert project.variants["int4"].recipe["method"] == "awq"
    assert project.variants["int4"].path == tmp_path / "tokq_out/smollm2-awq-int4"
    assert project.data["default"].window == 2048 and project.bench.concurrency == 16
    assert project.data["default"].path == data_dir() / "default"  # $TOKQ_HOME's default set
    assert {r.name for r in project.quality} == {"max_kl", "min_top1", "max_ppl_ratio", "max_flip_rate"}
    assert [(r.name, r.direction, r.threshold) for r in project.speed] == [("min_tpot_speedup", "min", 1.2)]
    assert main(["init", "--path", str(path)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_per_bucket_rules(tmp_path):
    path = tmp_path / "tokq.toml"
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nmax_kl = { overall = 0.05, "4K-8K" = 0.1 }\n')
    rules = load_project(path).quality
    assert [(r.bucket, r.threshold) for r in rules] == [(None, 0.05), ("4K-8K", 0.1)]
    assert load_project(path).quality_on == "bound"
    path.write_text('[base]\nmodel = "m"\n[gate.quality]\nci = "point"\nmax_kl = 0.05\n')
    project = load_project(path)
    assert project.quality_on == "point" and [r.name for r in project.quality] == ["max_kl"]


@pytest.mark.parametrize("edit,message", [
    (lambda s: s.replace('model = "smollm2-135m"', "# no model"), r"tokq.toml:\d+: \[base\] needs model"),
    (lambda s: s.replace("concurrency = 16", "concurrency = \"many\""),
     r"tokq.toml:21: \[bench\] concurrency = 'many' must be an integer"),
    (lambda s: s.replace("max_kl = 0.05", "max_kl = \"low\""), r"tokq.toml:\d+: \[gate.quality\] max_kl = 'low' must be a number"),
    (lambda s: s.replace("window = 2048", "windw = 2048"), r"\[data.default\] windw is not a known key"),
    (lambda s: s.replace("[bench]\nprompt_len", "[bench]\nspeed = 3\nprompt_len"), r"\[bench\] speed is not a known key"),
    (lambda s: s + "\n[gates]\nx = 1\n", r"gates is not a known table"),
    (lambda s: s.replace('ci = "bound"', 'ci = "upper"'), r"tokq.toml:\d+: \[gate.quality\] ci = 'upper' must be"),
    (lambda s: s.replace("min_tpot_speedup = 1.2", "min_tpot_speedup = true"), r"must be a number"),
    (lambda s: s.replace('int4 = {', 'int4 = { recipe = "awq" }\nx = {'), r"recipe must be a table"),
])
def test_bad_values_name_the_line(tmp_path, edit, message):
    path = tmp_path / "tokq.toml"
    path.write_text(edit(STARTER))
    with pytest.raises(ConfigError, match=message):
        load_project(path)


def test_missing_file_points_to_init(tmp_path):
    with pytest.raises(ConfigError, match="run `tokq init`"):
        load_project(tmp_path / "tokq.toml")


def test_ci_examples_run_the_gate():
    """The CI examples parse as YAML and run `tokq gate`, keep its report and publish its JUnit file."""
    from pathlib import Path

    yaml = pytest.importorskip("yaml")
    root = Path(__file__).resolve().parents[1] / "examples" / "ci"
    github = yaml.safe_load((root / "github-actions.yml").read_text())
    steps = github["jobs"]["gate"]["steps"]
    assert any(s.get("run", "").startswith("tokq gate") for s in steps)
    assert any("junit.xml" in str(s.get("with", {})) for s in steps)
    gitlab = yaml.safe_load((root / "gitlab-ci.yml").read_text())["tokq-gate"]
    assert any(line.startswith("tokq gate") for line in gitlab["script"])
    assert gitlab["artifacts"]["reports"]["junit"] == "tokq_gate/junit.xml"
