"""The GitHub Action (action.yml) as CI runs it: its `run:` steps, in order, in a fresh clone of a project, twice,
the second time in another clone (another absolute path) with the first run's cache restored: the variant built
from its recipe the first time is reused the second, the report reaches the job summary, junit.xml is written.

Only `uses:` steps (setup-python, the cache, artifact and check-run actions) are not run; the cache's restore is
done here, by copying the action's cache paths. Installing is a no-op: `python -m pip` is shimmed (tokq is
installed in this venv already), everything else the steps run is real."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
EXPRESSION = re.compile(r"\$\{\{\s*([^}]*?)\s*\}\}")

TOKQ_TOML = '''[base]
model = "base"
dtype = "fp32"

[variants]
rtn = { path = "tokq_out/rtn", recipe = { method = "rtn", group_size = 32 } }

[data.docs]
path = "docs"
window = 128
sample_windows = 3

[gate.quality]
max_kl = 10.0
'''


def action() -> dict:
    return yaml.safe_load((ROOT / "action.yml").read_text())


def evaluate(text: str, inputs: dict[str, str]) -> str:
    """The expressions the action's env values use: its inputs and its own path."""
    def value(match: re.Match) -> str:
        expr = match.group(1)
        if expr == "github.action_path":
            return str(ROOT)
        if expr.startswith("inputs."):
            return inputs[expr.removeprefix("inputs.")]
        raise AssertionError(f"an expression the test does not know: {expr}")
    return EXPRESSION.sub(value, text)


def shims(folder: Path) -> Path:
    """`python` (with `-m pip` a no-op: tokq is installed in this venv already) and `tokq`, this venv's."""
    folder.mkdir()
    (folder / "python").write_text(f'#!/bin/sh\n[ "$1 $2" = "-m pip" ] && exit 0\nexec "{sys.executable}" "$@"\n')
    (folder / "tokq").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tokq "$@"\n')
    for shim in folder.iterdir():
        shim.chmod(0o755)
    return folder


def project_repo(tmp_path: Path) -> Path:
    """A git repository holding a tokq.toml, a tiny base model and documents, as a user's project would."""
    repo = tmp_path / "origin"
    repo.mkdir()
    make_hf_checkpoint("llama", repo / "base", seed=0)
    save_word_tokenizer(repo / "base")
    (repo / "docs").mkdir()
    rng = random.Random(0)
    for i, n in enumerate((400, 300, 250)):
        (repo / "docs" / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    (repo / "tokq.toml").write_text(TOKQ_TOML)
    (repo / ".gitignore").write_text("tokq_out/\ntokq_gate/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "project"], check=True)
    return repo


def run_steps(workspace: Path, env: dict[str, str], inputs: dict[str, str],
              timeout: float = 900) -> tuple[dict[str, str], str, float]:
    """Every `run:` step of action.yml in order, as the runner does (bash -eo pipefail, the step's env, outputs
    through $GITHUB_OUTPUT); stops at the first failing step as CI does. (outputs by step id, the log, seconds)."""
    outputs: dict[str, str] = {}
    log = []
    started = time.perf_counter()
    for step in action()["runs"]["steps"]:
        if "run" not in step:
            continue
        assert "${{" not in step["run"], f"step {step.get('id')}: expressions belong in env:, never in run:"
        out_file = workspace.parent / f"{workspace.name}-{step.get('id', 'step')}.out"
        out_file.write_text("")
        step_env = {**env, **{k: evaluate(str(v), inputs) for k, v in step.get("env", {}).items()},
                    "GITHUB_OUTPUT": str(out_file)}
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]],
                              cwd=workspace, env=step_env, capture_output=True, text=True, timeout=timeout)
        log.append(f"== {step.get('id')} (exit {proc.returncode})\n{proc.stdout}{proc.stderr}")
        for line in out_file.read_text().splitlines():
            key, _, value = line.partition("=")
            outputs[f"{step.get('id')}.{key}"] = value
        if proc.returncode != 0:
            break
    return outputs, "\n".join(log), time.perf_counter() - started


@pytest.mark.slow
def test_the_action_gates_a_fresh_clone_and_the_second_run_reuses_the_cached_variant(tmp_path):
    repo = project_repo(tmp_path)
    inputs = {name: str(spec.get("default", "")) for name, spec in action()["inputs"].items()}
    home = tmp_path / "runner-home" / ".cache" / "tokq"
    env = {**os.environ, "PATH": f"{shims(tmp_path / 'shims')}{os.pathsep}{os.environ['PATH']}",
           "TOKQ_HOME": str(home), "TOKQ_COMPILE": "0"}
    cache_paths = [home, Path(inputs["variants-dir"])]  # the actions/cache step's paths (home: steps.keys.home)

    runs = []
    for n in (1, 2):
        workspace = tmp_path / f"runner-{n}" / "project"  # another absolute path each run
        subprocess.run(["git", "clone", "-q", str(repo), str(workspace)], check=True)
        if n == 2:  # the cache step restores what run 1 saved
            saved = tmp_path / "runner-1" / "project" / inputs["variants-dir"]
            shutil.copytree(saved, workspace / inputs["variants-dir"], symlinks=True)
        summary = tmp_path / f"summary-{n}.md"
        outputs, log, seconds = run_steps(workspace, {**env, "GITHUB_STEP_SUMMARY": str(summary)}, inputs)
        runs.append((workspace, outputs, log, seconds, summary))
        print(f"run {n}: {seconds:.1f} s")

    for workspace, outputs, log, _seconds, summary in runs:
        assert outputs.get("gate.exit-code") == "0", log
        assert outputs["keys.home"] == str(home) and len(outputs["keys.tokq"]) == 16
        report = workspace / inputs["report-dir"]
        assert (report / "junit.xml").is_file() and (report / "report.html").is_file()
        assert "tokq gate" in summary.read_text() and "rtn" in summary.read_text()
    first, second = runs[0][2], runs[1][2]
    assert "quantiz" in first.lower() and "follows its recipe" not in first.replace("\n", " ")
    assert "follows its recipe" in second.replace("\n", " "), second  # reused, not rebuilt
    assert runs[0][1]["keys.tokq"] == runs[1][1]["keys.tokq"]  # the same tokq: the same cache key
    assert all(p.is_absolute() or p == Path("tokq_out") for p in cache_paths)


def test_the_example_workflow_uses_the_action_at_a_commit():
    workflow = yaml.safe_load((ROOT / "examples" / "ci" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["gate"]["steps"]
    uses = [s["uses"] for s in steps if "tokq@" in s.get("uses", "")]
    assert len(uses) == 1 and re.fullmatch(r"[\w.-]+/tokq@[0-9a-f]{40}", uses[0]), uses
    assert workflow["permissions"]["checks"] == "write"  # the JUnit check run
    assert set(next(s for s in steps if "tokq@" in s.get("uses", ""))["with"]) <= set(action()["inputs"])


def gitlab_job() -> dict:
    return yaml.safe_load((ROOT / "examples" / "ci" / "gitlab-ci.yml").read_text())["tokq-gate"]


@pytest.mark.slow
def test_the_gitlab_template_gates_a_fresh_clone_and_the_second_run_reuses_its_cache(tmp_path):
    """The template's script, line by line in one shell as the runner does, with tokq cloned from this repository
    at its HEAD commit; run twice in two clones, the second with the first's cache paths restored."""
    repo = project_repo(tmp_path)
    job = gitlab_job()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    runs = []
    for n in (1, 2):
        workspace = tmp_path / f"gitlab-{n}" / "project"
        subprocess.run(["git", "clone", "-q", str(repo), str(workspace)], check=True)
        if n == 2:
            for path in job["cache"]["paths"]:
                saved = tmp_path / "gitlab-1" / "project" / path
                if saved.exists():
                    shutil.copytree(saved, workspace / path, symlinks=True)
        env = {**os.environ, "PATH": f"{shims(tmp_path / f'shims-{n}')}{os.pathsep}{os.environ['PATH']}",
               "CI_PROJECT_DIR": str(workspace), "TOKQ_COMPILE": "0"}
        for key, value in job["variables"].items():
            env[key] = os.path.expandvars(str(value)) if "$" in str(value) else str(value)
        env |= {"TOKQ_REPO": str(ROOT), "TOKQ_COMMIT": head}
        env = {k: (v.replace("$CI_PROJECT_DIR", str(workspace))) for k, v in env.items()}
        script = "\n".join(job["script"])
        started = time.perf_counter()
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script], cwd=workspace,
                              env=env, capture_output=True, text=True, timeout=900)
        runs.append((workspace, proc, time.perf_counter() - started))
        print(f"gitlab run {n}: {runs[-1][2]:.1f} s")
    for workspace, proc, _ in runs:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert (workspace / "tokq_gate" / "junit.xml").is_file()
        assert (workspace / ".tokq-cache").is_dir()  # TOKQ_HOME inside the project, where the cache can keep it
    assert "follows its recipe" in runs[1][1].stderr.replace("\n", " ")
    assert "follows its recipe" not in runs[0][1].stderr.replace("\n", " ")
    assert job["artifacts"]["reports"]["junit"] == "tokq_gate/junit.xml"
    assert re.fullmatch(r"[0-9a-f]{40}", job["variables"]["TOKQ_COMMIT"])  # a commit, never a branch or tag
