"""Hostile-input probe of the real CLI (issue 14): every hostile case run as `python -m tokq ...`, classified.

    python benchmarks/hostile_probe.py [--timeout 120] [--only NAME ...] [--source issue|extra] [--list]
        [--keep] [--out PATH]

Builds, in a temporary folder, a tiny llama checkpoint with a word tokenizer (as tests/hostile/ do), NaN and
Inf copies of it, a small docs folder and a real compare report; then runs each probe as a hostile user
would: a subprocess `python -m tokq ...` with its own TOKQ_HOME, its working directory a fresh project
folder, and a timeout (a timeout counts as a hang). Probes run one after another, except the concurrency
ones, which start two writers at once. Source "issue": a case of issue 14 (set up as tests/hostile/ do);
"extra": a neighbouring case this probe adds (control characters in names, SIGTERM, corrupt files...).

Every probe states what it expects, and its outcome is exactly one class:

    clean_error   the expected failure: exit 2 for bad input (exit 1 where a broken model must fail the
                  check), the error is one `error: ...` line (the last line of stderr), it gives the reason
                  the probe expects, and nothing is half written (no temp/old/lock left, no output folder)
    handled       the expected success: a skip with a warning, or correct behaviour (a kept comment, an
                  escaped name, a refused-then-kept file, the right modes)
    traceback     "Traceback" or "internal error" in the output, exit 4, a crash by signal, or a crash log
                  under $TOKQ_HOME/logs
    hang          the command ran past the timeout
    silent_wrong  exit 0 / PASS where a failure was due, or wrong content (a raw <script> in report.html,
                  a wrong path in tokq.toml, wrong modes, a half-written output after success)
    data_lost     a file the user owned is gone or changed, or tokq.toml no longer parses

Anything else (an error of the right kind that is not one line or leaves a temp behind: `unclean`; another
exit code or another reason than expected: `unexpected`) is counted in the `other` column and listed.
Precedence when several apply: data_lost, hang, traceback, silent_wrong, other.

Writes benchmarks/results/hostile-probe.json: each probe's name, area, expectation, class, exit codes,
seconds, peak RSS, first stderr line (temp paths replaced by <tmp>), the table, the machine's load average
and tokq's git commit.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
sys.path.insert(0, str(REPO))  # the tests' tiny-model helpers

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MIB = 1 << 20
MARKER = ".tokq-owner.json"
CLASSES = ("clean_error", "handled", "traceback", "hang", "silent_wrong", "data_lost", "other")
AREAS = ("data loss", "tokq.toml", "injection", "data folder", "models/configs", "CLI/verdicts", "files",
         "forged verdicts")
PAYLOAD = '<script>alert(1)</script>"><img src=x onerror=alert(1)>'
FOLDER_PAYLOAD = "m<script>alert(1)<img src=x onerror=alert(1)>"  # no '/': it is a folder name
LEFTOVER = re.compile(r"^\..+\.(tmp|old)-|^\..+\.lock$")

COMPARE = ["--window", "128", "--threads", "1", "--dtype", "fp32", "--no-probes", "--decode-tokens", "16",
           "--resamples", "100"]
SCORE = ["--window", "64", "--max-tokens", "128", "--threads", "1"]
QUANT = ["--threads", "1", "--method", "rtn", "--group-size", "32"]

HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, str(os.getpid()).encode())
    print("locked", flush=True)
    time.sleep(120)
""")

# The real CLI, its quantize_model slowed by 8 s: stands in for a model that takes minutes to quantize.
SLOW_QUANTIZE = textwrap.dedent("""
    import sys, time
    import tokq.quantization.pipeline as pipeline
    real = pipeline.quantize_model
    def slow(*args, **kwargs):
        time.sleep(8)
        return real(*args, **kwargs)
    pipeline.quantize_model = slow
    from tokq.cli import main
    sys.exit(main(sys.argv[1:]))
""")


# The real CLI, pausing 8 s after it wrote the weights into its temporary folder (a large checkpoint's save).
SLOW_SAVE = textwrap.dedent("""
    import sys, time
    import tokq.quantization.formats.compressed_tensors as ct
    real = ct._write_safetensors
    def slow(*args, **kwargs):
        real(*args, **kwargs)
        print("weights written", file=sys.stderr, flush=True)
        time.sleep(8)
    ct._write_safetensors = slow
    from tokq.cli import main
    sys.exit(main(sys.argv[1:]))
""")


# ------------------------------------------------------------------------------------------------------------
# Outcomes


class Wrong(Exception):
    """silent_wrong: a success where a failure was due, or wrong content."""


class Unexpected(Exception):
    """other: another exit code or another reason than the probe expects."""


class Unclean(Exception):
    """other: the expected error, but not one line, or something half written left behind."""


@dataclass
class Result:
    argv: list[str]
    code: int | None
    out: str
    err: str
    seconds: float
    timed_out: bool
    maxrss_mib: float | None
    sent_signal: int | None = None  # a signal the probe itself sent: dying of it is no crash

    @property
    def text(self) -> str:
        return " ".join((self.out + "\n" + self.err).split())

    def first_line(self) -> str:
        """The `error:` line; for a failed check (exit 1) the stdout line that says FAIL; else stderr's first."""
        lines = [line.strip() for line in self.err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        if errors:
            return errors[0]
        fails = [line.strip() for line in self.out.splitlines() if "FAIL" in line]
        if self.code == 1 and fails:
            return "stdout: " + " ".join(fails[0].split())
        if lines:
            return lines[0]
        out = [line.strip() for line in self.out.splitlines() if line.strip()]
        return out[0] if out else ""

    def crashed(self) -> str | None:
        if self.timed_out:
            return None
        if self.code is not None and self.code < 0 and -self.code != self.sent_signal:
            return f"killed by signal {-self.code}"
        if "Traceback" in self.out + self.err:
            return "Traceback in the output"
        if self.code == 4 or "internal error" in self.err:
            return f"exit {self.code}: {self.first_line()}"
        return None


class Running:
    """A started tokq process: stdout and stderr read by threads, reaped with wait4 for its peak RSS."""

    def __init__(self, argv: list[str], cwd: Path, env: dict, timeout: float, umask: int | None,
                 stdin_text: str | None = None):
        self.argv = argv
        self.timeout = timeout
        self.timed_out = False
        self.sent_signal: int | None = None

        def pre():
            # as from an interactive shell: a parent started in the background (nohup, `&`) ignores SIGINT,
            # and Python then never turns Ctrl-C into KeyboardInterrupt
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if umask is not None:
                os.umask(umask)

        self.start = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=pre)
        self.chunks: dict[str, list[bytes]] = {"out": [], "err": []}
        self.line_waiters: list[tuple[str, threading.Event]] = []
        self.threads = [threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True)]
        for t in self.threads:
            t.start()
        self.timer = threading.Timer(timeout, self._kill)
        self.timer.start()

    def _read(self, stream, key: str) -> None:
        for line in iter(stream.readline, b""):
            self.chunks[key].append(line)
            text = line.decode(errors="replace")
            for prefix, event in self.line_waiters:
                if text.startswith(prefix):
                    event.set()

    def _kill(self) -> None:
        self.timed_out = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def send(self, sig: int) -> None:
        """`sig` to the command's process group, as a terminal's Ctrl-C or a CI runner's cancel does."""
        self.sent_signal = sig
        os.killpg(self.proc.pid, sig)

    def wait_for_line(self, prefix: str, seconds: float) -> bool:
        event = threading.Event()
        self.line_waiters.append((prefix, event))
        if any(c.decode(errors="replace").startswith(prefix) for c in self.chunks["err"] + self.chunks["out"]):
            return True
        return event.wait(seconds)

    def wait(self) -> Result:
        _, status, usage = os.wait4(self.proc.pid, 0)
        seconds = time.perf_counter() - self.start
        self.timer.cancel()
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        try:  # anything the command left running in its session (it should leave nothing)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for t in self.threads:
            t.join(timeout=10)
        out = b"".join(self.chunks["out"]).decode(errors="replace")
        err = b"".join(self.chunks["err"]).decode(errors="replace")
        return Result(self.argv, None if self.timed_out else self.proc.returncode, out, err, seconds,
                      self.timed_out, round(usage.ru_maxrss / 1024, 1), self.sent_signal)


# ------------------------------------------------------------------------------------------------------------
# Shared fixtures


@dataclass
class Shared:
    root: Path
    ck: Path
    nan: Path
    inf: Path
    docs: Path
    compare_report: dict


def build_shared(root: Path, timeout: float) -> Shared:
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    import transformers

    transformers.utils.logging.disable_progress_bar()
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tests.test_quantize_cli import WORDS, save_word_tokenizer

    models = {}
    for name, value in (("llama", None), ("nan", float("nan")), ("inf", float("inf"))):
        path = root / name
        make_hf_checkpoint("llama", path, seed=0)
        save_word_tokenizer(path)
        if value is not None:
            poison(path, value)
        models[name] = path
    docs = root / "docs"
    docs.mkdir()
    rng = random.Random(0)
    for i, n in enumerate((400, 300, 250)):
        (docs / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    # a second model (seed 1) so a real compare has something to report, then the report itself
    other = root / "llama-b"
    make_hf_checkpoint("llama", other, seed=1)
    save_word_tokenizer(other)
    report_dir = root / "compare-report"
    env = probe_env(root / "home")
    proc = subprocess.run([sys.executable, "-m", "tokq", "compare", str(models["llama"]), str(other), "--data",
                           str(docs), *COMPARE, "--max-kl", "0.01", "--report-dir", str(report_dir)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=timeout * 3)
    if proc.returncode not in (0, 1):
        sys.exit(f"setup: tokq compare exit {proc.returncode}\n{proc.stderr[-3000:]}")
    report = json.loads((report_dir / "report.json").read_text())
    return Shared(root, models["llama"], models["nan"], models["inf"], docs, report)


def poison(path: Path, value: float) -> None:
    """Every weight of layer 0's attention output projection set to `value`, as tests/hostile/test_cli.py."""
    import torch
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("layers.0.self_attn.o_proj.weight"))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, file, metadata={"format": "pt"})


def probe_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TOKQ_CONFIG", "TOKQ_DEBUG", "COLUMNS", "LINES")}
    env.update(TOKQ_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    return env


def tree_hash(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------------------
# One probe's context


class Probe:
    def __init__(self, name: str, root: Path, shared: Shared, timeout: float):
        self.name = name
        self.root = root
        self.project = root / "project"
        self.home = root / "home"
        self.project.mkdir(parents=True)
        self.home.mkdir()
        self.shared = shared
        self.timeout = timeout
        self.results: list[Result] = []
        self.owned: dict[Path, bytes] = {}  # user files: must keep these bytes
        self.tomls: list[Path] = []  # must parse afterwards if present (and stay present if they were)
        self.tomls_present: set[Path] = set()
        self.ignore: set[Path] = set()  # leftovers that are the probe's own (a lock file it holds)
        self.notes: list[str] = []

    # setup -----------------------------------------------------------------------------------------------
    def own(self, path: Path, data: str | bytes) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = data.encode() if isinstance(data, str) else data
        path.write_bytes(raw)
        self.owned[path] = raw
        return path

    def own_tree(self, folder: Path) -> None:
        for p in folder.rglob("*"):
            if p.is_file() and not p.is_symlink():
                self.owned[p] = p.read_bytes()

    def toml(self, path: Path, text: str | None = None) -> Path:
        if text is not None:
            self.own(path, text)
        self.tomls.append(path)
        if path.exists():
            self.tomls_present.add(path)
        return path

    def copy_ck(self, name: str = "m", source: Path | None = None) -> Path:
        return Path(shutil.copytree(source or self.shared.ck, self.root / name))

    def gate_project(self, variants: str = 'same = "same"', extra: str = "", owned: bool = False) -> Path:
        """tokq.toml whose gate needs no quantization: the base against a near copy of itself (the base itself,
        byte for byte, is refused since issue 34; tests/hostile/test_files.py)."""
        from tests.test_models_vs_hf import near_copy

        (self.project / "base").symlink_to(self.shared.ck)
        if '"same"' in variants:
            near_copy(self.shared.ck, self.project / "same")
        text = (f'[base]\nmodel = "base"\ndtype = "fp32"\n\n[variants]\n{variants}\n\n'
                f'[data.docs]\npath = "{self.shared.docs}"\nwindow = 128\n\n[gate.quality]\nmax_kl = 0.05\n{extra}')
        path = self.project / "tokq.toml"
        path.write_text(text)
        if owned:
            self.owned[path] = text.encode()
        return self.toml(path)

    # running ---------------------------------------------------------------------------------------------
    def start(self, *args, umask: int | None = None, raw: list[str] | None = None, cwd: Path | None = None,
              env: dict | None = None) -> Running:
        argv = raw if raw is not None else [sys.executable, "-m", "tokq", *map(str, args)]
        return Running(argv, cwd or self.project, {**probe_env(self.home), **(env or {})}, self.timeout, umask)

    def tokq(self, *args, **kwargs) -> Result:
        result = self.start(*args, **kwargs).wait()
        self.results.append(result)
        return result

    # expectations ----------------------------------------------------------------------------------------
    def error(self, r: Result, code: int, *needles: str, absent: tuple[Path, ...] = ()) -> str:
        """The expected failure, cleanly: exit `code`, one `error:` line naming the reason, nothing written."""
        if r.timed_out:
            return "hang"
        if r.code == 0:
            raise Wrong(f"exit 0 where exit {code} was due")
        if r.code != code:
            raise Unexpected(f"exit {r.code}, expected {code}: {r.first_line()}")
        lines = [line for line in r.err.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error:")]
        if len(errors) != 1 or lines[-1] != errors[0]:
            raise Unclean(f"stderr's error is not one last `error:` line ({len(errors)} error lines, "
                          f"{len(lines)} lines)")
        for needle in needles:
            if needle not in r.text:
                raise Unexpected(f"the error does not say {needle!r}: {r.first_line()}")
        for path in absent:
            if path.exists() or path.is_symlink():
                raise Unclean(f"{self.rel(path)} was written by a command that failed")
        return "clean_error"

    def verdict_fail(self, r: Result, *needles: str) -> str:
        """A broken model must fail the check: exit 1, saying why, no traceback."""
        if r.timed_out:
            return "hang"
        if r.code == 0:
            raise Wrong("exit 0 (a pass) for a model with non-finite logits")
        if r.code != 1:
            raise Unexpected(f"exit {r.code}, expected 1: {r.first_line()}")
        for needle in needles:
            if needle not in r.text:
                raise Unexpected(f"the output does not say {needle!r}")
        return "clean_error"

    def ok(self, r: Result, code: int = 0, *needles: str) -> None:
        """A step that must succeed (exit `code`), its output saying each needle."""
        if r.timed_out:
            return
        if r.code != code:
            raise Unexpected(f"exit {r.code}, expected {code}: {r.first_line()}")
        for needle in needles:
            if needle not in r.text:
                raise Wrong(f"the output does not say {needle!r}")

    def check(self, condition: bool, message: str) -> None:
        if not condition:
            raise Wrong(message)

    def read_json(self, path: Path) -> dict:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Wrong(f"{self.rel(path)} cannot be read after success ({type(exc).__name__})") from None

    def rel(self, path: Path) -> str:
        return sanitize(str(path), self.root, self.shared.root)

    # after ----------------------------------------------------------------------------------------------
    def lost(self) -> str | None:
        for path, raw in self.owned.items():
            if not path.is_file():
                return f"{self.rel(path)} is gone"
            if path.read_bytes() != raw:
                return f"{self.rel(path)} was changed"
        for path in self.tomls:
            if not path.exists():
                if path in self.tomls_present:
                    return f"{self.rel(path)} is gone"
                continue
            try:
                tomllib.loads(path.read_text(encoding="utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                return f"{self.rel(path)} no longer parses ({exc})"
        return None

    def leftovers(self) -> list[str]:
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                if LEFTOVER.search(name) and path not in self.ignore:
                    found.append(self.rel(path))
        return found

    def crash_logs(self) -> list[str]:
        logs = self.home / "logs"
        return sorted(p.name for p in logs.iterdir()) if logs.is_dir() else []


def sanitize(text: str, *roots: Path) -> str:
    for root in roots:
        for form in {str(root.resolve()), str(root)}:
            text = text.replace(form, "<tmp>")
    text = text.replace(str(REPO), "<repo>").replace(sys.executable, "python")
    return text.replace(str(Path.home()), "~")


# ------------------------------------------------------------------------------------------------------------
# Probes: each returns its class (or raises Wrong / Unexpected / Unclean)


@dataclass
class Case:
    name: str
    area: str
    expect: str
    fn: Callable[[Probe], str]
    source: str  # "issue": a case of issue 14 (tests/hostile); "extra": a neighbouring case this probe adds


CASES: list[Case] = []


def case(area: str, expect: str, source: str = "issue"):
    def register(fn):
        CASES.append(Case(fn.__name__.removeprefix("probe_").replace("_", "-"), area, expect, fn, source))
        return fn
    return register


def extra(area: str, expect: str):
    return case(area, expect, "extra")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- data loss: only folders tokq wrote are replaced or removed ----------------------------------------------

@case("data loss", "exit 2: --report-dir over a user folder with a report.json is refused, folder untouched")
def probe_report_dir_over_user_folder(p: Probe) -> str:
    folder = p.project / "P"
    p.own(folder / "src" / "important.py", "x\n")
    p.own(folder / "report.json", "{}")
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--report-dir", folder)
    return p.error(r, 2, "exists and is not a tokq report folder", "--report-dir")


@case("data loss", "exit 2: `gate --out .` in a project holding report.json and src/ is refused, all kept")
def probe_gate_out_dot(p: Probe) -> str:
    p.gate_project(owned=True)
    p.own(p.project / "report.json", "{}")
    p.own(p.project / "src" / "main.py", "print('mine')\n")
    r = p.tokq("gate", "--out", ".", "--no-speed", "--threads", "1")
    return p.error(r, 2, "is the working directory")


@case("data loss", "exit 2: `gate --out ..` (a folder above the project) is refused")
def probe_gate_out_parent(p: Probe) -> str:
    p.gate_project(owned=True)
    p.own(p.root / "notes.txt", "mine")
    r = p.tokq("gate", "--out", "..", "--no-speed", "--threads", "1")
    return p.error(r, 2, "or one above it")


@case("data loss", "exit 2: a report folder tokq wrote, then the user added notes.txt: rerun refused, kept")
def probe_gate_out_report_with_user_file(p: Probe) -> str:
    p.gate_project()
    p.ok(p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1"))
    p.own(p.project / "report" / "notes.txt", "keep me")
    p.own_tree(p.project / "report")
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, "notes.txt", "remove it yourself")


@case("data loss", "exit 0: a marker-less earlier tokq report and tokq's own are replaced; no temp/lock left")
def probe_gate_replaces_own_report(p: Probe) -> str:
    p.gate_project()
    out = p.project / "report"
    out.mkdir()
    for name in ("report.json", "report.md", "report.html", "junit.xml"):
        (out / name).write_text("old")
    p.ok(p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1"))
    p.check(p.read_json(out / "report.json").get("command") == "gate", "report.json is not the gate's")
    p.ok(p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1"))
    names = sorted(x.name for x in p.project.iterdir())
    p.check(names == ["base", "report", "tokq.toml"], f"the project holds {names}")
    return "handled"


@case("data loss", "exit 2: `quantize --out ANYDIR --force` over a user folder is refused, thesis.tex kept")
def probe_quantize_force_over_user_folder(p: Probe) -> str:
    p.own(p.project / "work" / "thesis.tex", "mine")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "work", *QUANT, "--force")
    return p.error(r, 2, "exists and is not a tokq checkpoint folder")


@case("data loss", "exit 0: `quantize --force` over tokq's own untouched checkpoint replaces it")
def probe_quantize_force_over_own_checkpoint(p: Probe) -> str:
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT))
    first = p.read_json(p.project / "q" / MARKER)
    p.check(first.get("kind") == "checkpoint", "no checkpoint marker")
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--force"))
    p.check((p.project / "q" / "model.safetensors").is_file(), "the replaced checkpoint has no weights")
    return "handled"


@case("data loss", "exit 2: `quantize --force` over tokq's checkpoint holding the user's README.md: refused")
def probe_quantize_force_over_checkpoint_with_user_file(p: Probe) -> str:
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT))
    p.own(p.project / "q" / "README.md", "my notes")
    p.own_tree(p.project / "q")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--force")
    return p.error(r, 2, "README.md")


@case("data loss", "exit 2: --out below a file is refused before the work")
def probe_quantize_out_below_a_file(p: Probe) -> str:
    p.own(p.project / "afile", "x")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "afile/q", *QUANT)
    return p.error(r, 2, "cannot be written", "choose another --out")


def _recipe(p: Probe, recipe: str, key: str) -> str:
    elsewhere = p.project / "elsewhere"
    p.own(elsewhere / "data.txt", "precious")
    p.gate_project(f'v = {{ path = "built/v", recipe = {{ {recipe} }} }}', owned=True)
    r = p.tokq("gate", "--out", "r", "--no-speed", "--threads", "1")
    return p.error(r, 2, f"[variants] v recipe key {key!r} is not", "tokq.toml:",
                   absent=(p.project / "built", p.project / "r"))


@case("data loss", "exit 2: recipe = { out = ELSEWHERE, force = true } refused at load, nothing built or removed")
def probe_recipe_out_force(p: Probe) -> str:
    return _recipe(p, f'method = "rtn", out = "{p.project / "elsewhere"}", force = true', "out")


@case("data loss", "exit 2: recipe with an unknown key (outdir) refused at load with tokq.toml:LINE")
def probe_recipe_unknown_key(p: Probe) -> str:
    return _recipe(p, 'method = "rtn", outdir = "x"', "outdir")


@case("data loss", "exit 2: recipe naming `name` (a quantize option the gate sets itself) is refused")
def probe_recipe_name_key(p: Probe) -> str:
    return _recipe(p, 'method = "rtn", name = "v"', "name")


@case("data loss", "exit 2: `data build-default --out MYDIR --force` over a user folder is refused")
def probe_build_default_force_over_user_folder(p: Probe) -> str:
    p.own(p.project / "mine" / "notes.txt", "mine")
    r = p.tokq("data", "build-default", "--out", "mine", "--force", "--model", "none")
    return p.error(r, 2, "exists and is not a tokq document set folder")


# --- files: writers on one folder, modes ------------------------------------------------------------------------

@case("files", "two `quantize --out q --name a|b` started at once: one exits 0, the other 2; one variant")
def probe_concurrent_quantize_same_out(p: Probe) -> str:
    toml = p.toml(p.project / "tokq.toml")
    args = ["quantize", "--model", p.shared.ck, "--out", "q", *QUANT]
    first, second = p.start(*args, "--name", "a"), p.start(*args, "--name", "b")
    results = [first.wait(), second.wait()]
    p.results += results
    codes = sorted(r.code if r.code is not None else -999 for r in results)
    if codes == [0, 0]:
        raise Wrong("both exited 0: two writers on one folder")
    if codes != [0, 2]:
        raise Unexpected(f"exit codes {codes}")
    winner, loser = (results[0], results[1]) if results[0].code == 0 else (results[1], results[0])
    name = "a" if winner is results[0] else "b"
    how = "lock" if "another tokq process" in loser.text else "exists"
    p.notes.append(f"the second was refused by the {how} check")
    cls = p.error(loser, 2, "another tokq process" if how == "lock" else "q")
    variants = tomllib.loads(toml.read_text())["variants"]
    p.check(variants == {name: {"path": "q"}}, f"tokq.toml records {variants}, expected only {name}")
    p.check((p.project / "q" / "model.safetensors").is_file(), "q has no weights")
    return cls


@case("files", "a real quantize is writing q (slowed 8 s) when a second starts: the second exits 2 at once")
def probe_concurrent_quantize_while_writing(p: Probe) -> str:
    toml = p.toml(p.project / "tokq.toml")
    args = ["quantize", "--model", str(p.shared.ck), "--out", "q", *QUANT]
    first = p.start(raw=[sys.executable, "-c", SLOW_QUANTIZE, *args, "--name", "a"])
    if not first.wait_for_line("quantizing ", p.timeout):
        p.results.append(first.wait())
        raise Unexpected("the first quantize never said `quantizing ...`")
    second = p.tokq(*args, "--name", "b")
    p.results.append(first.wait())
    p.ok(p.results[-1])
    cls = p.error(second, 2, f"another tokq process (pid {first.proc.pid}) is writing")
    variants = tomllib.loads(toml.read_text())["variants"]
    p.check(set(variants) == {"a"}, f"tokq.toml records {sorted(variants)}")
    p.check(second.seconds < 30, f"the second took {second.seconds:.0f} s to be refused")
    return cls


@case("files", "exit 2: `gate --out R` while another process holds R's lock: refused at once, naming its pid")
def probe_gate_out_locked(p: Probe) -> str:
    p.gate_project()
    lock = p.project / ".report.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    p.ignore.add(lock)
    try:
        if holder.stdout.readline().strip() != "locked":
            raise Unexpected("the lock holder did not start")
        r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
        return p.error(r, 2, f"another tokq process (pid {holder.pid}) is writing", absent=(p.project / "report",))
    finally:
        holder.kill()
        holder.wait()


def _modes(folder: Path) -> set[int]:
    return {x.stat().st_mode & 0o777 for x in folder.iterdir()}


@case("files", "umask 022: quantize --name writes q 0755, its files 0644, tokq.toml 0644")
def probe_umask_022_quantize(p: Probe) -> str:
    p.toml(p.project / "tokq.toml")
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--name", "int4", umask=0o022))
    q = p.project / "q"
    p.check(q.stat().st_mode & 0o777 == 0o755, f"q is {q.stat().st_mode & 0o777:o}")
    p.check(_modes(q) == {0o644}, f"q's files are {sorted(f'{m:o}' for m in _modes(q))}")
    mode = (p.project / "tokq.toml").stat().st_mode & 0o777
    p.check(mode == 0o644, f"tokq.toml is {mode:o}")
    return "handled"


@case("files", "umask 027: compare --report-dir: folder 0750, files 0640, baseline cache files 0640")
def probe_umask_027_compare_report(p: Probe) -> str:
    p.ok(p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--report-dir", "rep",
                umask=0o027))
    rep = p.project / "rep"
    p.check(rep.stat().st_mode & 0o777 == 0o750, f"the report folder is {rep.stat().st_mode & 0o777:o}")
    p.check(_modes(rep) == {0o640}, f"report files are {sorted(f'{m:o}' for m in _modes(rep))}")
    cache = [x for x in p.home.rglob("*") if x.is_file()]
    modes = {x.stat().st_mode & 0o777 for x in cache}
    p.check(bool(cache) and modes == {0o640}, f"cache files are {sorted(f'{m:o}' for m in modes)}")
    return "handled"


@case("files", "umask 022: gate --out: report folder 0755, files 0644, tokq.toml untouched")
def probe_umask_022_gate_report(p: Probe) -> str:
    p.gate_project(owned=True)
    p.ok(p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1", umask=0o022))
    rep = p.project / "report"
    p.check(rep.stat().st_mode & 0o777 == 0o755, f"the report folder is {rep.stat().st_mode & 0o777:o}")
    p.check(_modes(rep) == {0o644}, f"report files are {sorted(f'{m:o}' for m in _modes(rep))}")
    return "handled"


# --- tokq.toml: edited format-preserving, checked before the work -----------------------------------------------

def _record(p: Probe, text: str, *, name: str = "int4", out: str = "q", original_variants: dict | None = None,
            keep_lines: bool = True) -> str:
    toml = p.toml(p.project / "tokq.toml")
    toml.write_text(text)
    p.tomls_present.add(toml)
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", out, *QUANT, "--name", name))
    edited = toml.read_text()
    parsed = tomllib.loads(edited)
    original = tomllib.loads(text)
    p.check(parsed.get("variants", {}).get(name) == {"path": out},
            f"variants.{name} is {parsed.get('variants', {}).get(name)!r}")
    rest = {k: v for k, v in parsed["variants"].items() if k != name}
    want = original_variants if original_variants is not None else original.get("variants", {})
    p.check(rest == want, f"the other variants became {rest}")
    p.check({k: v for k, v in parsed.items() if k != "variants"}
            == {k: v for k, v in original.items() if k != "variants"}, "other tables changed")
    if keep_lines:
        lost = [line for line in text.splitlines() if line not in edited and not line.startswith("variants = {")]
        p.check(not lost, f"lines lost: {lost}")
    return "handled"


@case("tokq.toml", "exit 0: a comment after [variants]: the variant recorded, comments kept, file parses")
def probe_toml_comment_after_variants(p: Probe) -> str:
    return _record(p, '# my project\n[variants] # the checkpoints\nbase = "models/base"  # the reference\n\n'
                      '[gate]\nx = 1\n')


@case("tokq.toml", "exit 0: an inline `variants = { ... }`: the variant recorded, file parses")
def probe_toml_inline_variants(p: Probe) -> str:
    return _record(p, 'variants = { base = "models/base" }\n\n[gate]\nx = 1\n')


@case("tokq.toml", "exit 0: [variants.NAME] tables: the variant recorded, file parses")
def probe_toml_variant_tables(p: Probe) -> str:
    return _record(p, '[variants.base]\npath = "models/base"\n\n[gate]\nx = 1\n')


@case("tokq.toml", "exit 0: the same --name again replaces its entry in place, the comments around it kept")
def probe_toml_replace_variant(p: Probe) -> str:
    cls = _record(p, '[variants]\n# first\nint4 = "old"  # was here\nbase = "b"\n', original_variants={"base": "b"},
                  keep_lines=False)
    lines = (p.project / "tokq.toml").read_text().splitlines()
    p.check(lines[:2] == ["[variants]", "# first"] and lines[2].startswith("int4 = ") and lines[3] == 'base = "b"',
            f"the file became {lines}")
    return cls


@case("tokq.toml", "exit 0: a newline in --out is stored escaped and read back as the same path")
def probe_toml_newline_in_out(p: Probe) -> str:
    return _record(p, "[variants]\n", out="a\nb")


@case("tokq.toml", "exit 0: a quote, a backslash and non-ASCII in --out are stored escaped")
def probe_toml_quote_in_out(p: Probe) -> str:
    return _record(p, "[variants]\n", out='modèles/quote"d\\back')


def _bad_name(p: Probe, name: str) -> str:
    p.toml(p.project / "tokq.toml", "[variants]\n")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--name", name)
    return p.error(r, 2, "--name", "ASCII letters, digits", absent=(p.project / "q",))


@case("tokq.toml", "exit 2: a non-ASCII --name (int4é) is refused before the work, tokq.toml unchanged")
def probe_toml_non_ascii_name(p: Probe) -> str:
    return _bad_name(p, "int4é")


@case("tokq.toml", "exit 2: a --name holding a newline and a table header is refused before the work")
def probe_toml_newline_name(p: Probe) -> str:
    return _bad_name(p, "int4\n[gate]")


@case("tokq.toml", "exit 2: `variants = 5` then `quantize --name`: refused before the work, file unchanged")
def probe_toml_variants_5_quantize(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", "variants = 5\n")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--name", "int4")
    return p.error(r, 2, "variants = 5 must be a table", absent=(p.project / "q",))


@case("tokq.toml", "exit 2: an unparseable tokq.toml then `quantize --name`: refused before the work")
def probe_toml_unparseable_quantize(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", "[variants\n")
    p.tomls.clear()  # it never parsed: only that it is kept byte for byte counts (own)
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--name", "int4")
    return p.error(r, 2, "fix the file", absent=(p.project / "q",))


@case("tokq.toml", "exit 2: `variants = 5` then `tokq gate`: tokq.toml:1 error, no report folder")
def probe_toml_variants_5_gate(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", 'variants = 5\n[base]\nmodel = "m"\n[gate.quality]\nmax_kl = 0.05\n')
    r = p.tokq("gate", "--out", "report")
    return p.error(r, 2, "tokq.toml:1:", "variants must be a table", absent=(p.project / "report",))


@case("tokq.toml", "exit 2: `variants = 5` then `tokq score somevariant`: tokq.toml:LINE error")
def probe_toml_variants_5_score(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", "variants = 5\n")
    r = p.tokq("score", "somevariant", "--data", p.shared.docs, *SCORE)
    return p.error(r, 2, "tokq.toml:")


@case("tokq.toml", "exit 2: a rule of the wrong type (max_kl = \"low\") is a tokq.toml:LINE error")
def probe_toml_rule_wrong_type(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", '[base]\nmodel = "m"\n[variants]\nv = "v"\n[gate.quality]\nmax_kl = "low"\n')
    r = p.tokq("gate", "--out", "report")
    return p.error(r, 2, "tokq.toml:6:", "must be a number", absent=(p.project / "report",))


@case("tokq.toml", "exit 2: [bench] max_seconds = nan is a tokq.toml:LINE error")
def probe_toml_bench_nan(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", '[base]\nmodel = "m"\n[bench]\nmax_seconds = nan\n[gate.quality]\nmax_kl = 0.1\n')
    r = p.tokq("gate", "--out", "report")
    return p.error(r, 2, "tokq.toml:4:", "must be a finite number", absent=(p.project / "report",))


# --- injection: markup and mathtext in names and labels ----------------------------------------------------------

def _escaped_page(p: Probe, page_path: Path) -> str:
    page = page_path.read_text(encoding="utf-8")
    lowered = page.lower()
    p.check("<script" not in lowered, "report.html holds a raw <script")
    p.check("<img src=x" not in lowered and "onerror=alert(1)>" not in lowered, "report.html holds a raw <img onerror")
    p.check("&lt;script&gt;" in page, "the name is not in report.html (escaped)")
    p.check("Content-Security-Policy" in page, "report.html has no Content-Security-Policy")
    return page


def _junit_parses(p: Probe, path: Path) -> None:
    try:
        ET.parse(path)
    except (ET.ParseError, OSError) as exc:
        raise Wrong(f"junit.xml does not parse ({exc})") from None


@case("injection", "exit 2: --max-kl '<script>...=0.1' (a markup bucket) refused naming the flag, nothing written")
def probe_xss_bucket_cli(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE,
               "--max-kl", "<script>alert(1)</script>=0.1", "--report-dir", "r")
    return p.error(r, 2, "--max-kl", "bucket", absent=(p.project / "r",))


@case("injection", "exit 2: --min-top1 '\"><img src=x onerror=...>=0.5' refused naming the flag")
def probe_xss_bucket_cli_attribute(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE,
               "--min-top1", '"><img src=x onerror=alert(1)>=0.5', "--report-dir", "r")
    return p.error(r, 2, "--min-top1", "bucket", absent=(p.project / "r",))


@case("injection", "exit 2: --max-flip-rate 4K-8K=0.5 (flip rate has no position buckets) refused")
def probe_flip_rate_bucket_cli(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE,
               "--max-flip-rate", "4K-8K=0.5")
    return p.error(r, 2, "--max-flip-rate", "bucket")


@case("injection", "exit 2: a markup bucket under [compare.thresholds] in tokq.toml: refused with tokq.toml:3")
def probe_xss_bucket_toml_compare(p: Probe) -> str:
    p.toml(p.project / "tokq.toml",
           '[compare.thresholds]\nmin_top1 = 0.5\nmax_flip_rate = { "<script>alert(1)</script>" = 0.5 }\n')
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--report-dir", "r")
    return p.error(r, 2, "tokq.toml:3", "bucket", absent=(p.project / "r",))


@case("injection", "exit 2: a markup bucket under [gate.quality] in a PR's tokq.toml: refused with file:line")
def probe_xss_bucket_toml_gate(p: Probe) -> str:
    text = p.gate_project().read_text().replace("max_kl = 0.05", 'max_kl = { "<script>alert(1)</script>" = 0.5 }')
    p.own(p.project / "tokq.toml", text)
    line = text.splitlines().index('max_kl = { "<script>alert(1)</script>" = 0.5 }') + 1
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, f"tokq.toml:{line}", "bucket", absent=(p.project / "report",))


@case("injection", "exit 0: a model folder named with <script> and <img onerror>: report.html escapes it")
def probe_xss_model_folder_name(p: Probe) -> str:
    b = p.copy_ck(FOLDER_PAYLOAD, p.shared.ck)
    p.ok(p.tokq("compare", p.shared.ck, b, "--data", p.shared.docs, *COMPARE, "--report-dir", "rep"))
    _escaped_page(p, p.project / "rep" / "report.html")
    _junit_parses(p, p.project / "rep" / "junit.xml")
    md = (p.project / "rep" / "report.md").read_text()
    if "<script" in md.lower():
        p.notes.append("report.md holds the folder name's <script> raw (markdown; GitHub sanitizes it)")
    return "handled"


@case("injection", "exit 0 with the names escaped, or exit 2: gate variant named <script>...</script> in tokq.toml")
def probe_xss_variant_name_toml(p: Probe) -> str:
    p.gate_project('"<script>alert(1)</script>" = "base"', owned=True)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    if r.code == 2:
        return p.error(r, 2, "variants", absent=(p.project / "report",))
    p.ok(r)
    _escaped_page(p, p.project / "report" / "report.html")
    _junit_parses(p, p.project / "report" / "junit.xml")
    return "handled"


@case("injection", "exit 0: `tokq report` of a report.json whose names, buckets and texts hold markup: escaped")
def probe_xss_report_json(p: Probe) -> str:
    result = copy.deepcopy(p.shared.compare_report)
    result["a"]["name"] = result["b"]["name"] = result["kl_method"] = PAYLOAD
    result["thresholds"] = [{**t, "name": PAYLOAD, "bucket": PAYLOAD, "rule": PAYLOAD}
                            for t in result["thresholds"]]
    folder = p.project / "rep"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(result))
    p.ok(p.tokq("report", "rep"))
    _escaped_page(p, folder / "report.html")
    _junit_parses(p, folder / "junit.xml")
    return "handled"


@case("injection", "exit 0: B's folder named v$_$1 (mathtext) over an old report: the report is written")
def probe_dollar_model_folder(p: Probe) -> str:
    b = p.copy_ck("v$_$1", p.shared.ck)
    (p.project / "rep").mkdir()
    (p.project / "rep" / "report.json").write_text('{"old": true}')
    p.ok(p.tokq("compare", p.shared.ck, b, "--data", p.shared.docs, *COMPARE, "--report-dir", "rep"))
    p.check("v$_$1" in (p.project / "rep" / "report.html").read_text(), "v$_$1 is not in report.html")
    name = p.read_json(p.project / "rep" / "report.json").get("b", {}).get("name", "")
    p.check(str(name).endswith("v$_$1"), f"report.json names B {name!r}")
    return "handled"


@case("injection", "exit 0: gate variants named a$b$c and q$^$ (mathtext): drawn, named in report.html")
def probe_dollar_variant_names(p: Probe) -> str:
    p.gate_project('"a$b$c" = "base"\n"q$^$" = "base"', owned=True)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    if r.code == 2:
        return p.error(r, 2, "variants", absent=(p.project / "report",))
    p.ok(r)
    page = (p.project / "report" / "report.html").read_text()
    p.check("a$b$c" in page and "q$^$" in page, "a variant name is missing from report.html")
    return "handled"


# --- data folders ------------------------------------------------------------------------------------------------

def _data(p: Probe) -> Path:
    folder = p.project / "data"
    folder.mkdir()
    shutil.copy(p.shared.docs / "doc0.txt", folder / "ok.txt")
    return folder


def _score_skips(p: Probe, folder: Path, name: str, *needles: str, extra: tuple = ()) -> str:
    r = p.tokq("score", p.shared.ck, "--data", folder, *SCORE, *extra)
    p.ok(r)
    p.check(name in r.err, f"no warning names {name}")
    for needle in needles:
        p.check(needle in r.text, f"the warning does not say {needle!r}")
    p.check("overall" in r.out, "no overall score printed")
    return "handled"


@case("data folder", "exit 0: a FIFO named x.txt is skipped with a warning (never opened: no hang)")
def probe_fifo_txt(p: Probe) -> str:
    folder = _data(p)
    os.mkfifo(folder / "x.txt")
    return _score_skips(p, folder, "x.txt", "FIFO")


@case("data folder", "exit 2: --data naming a FIFO itself is refused, not opened")
def probe_fifo_as_data(p: Probe) -> str:
    os.mkfifo(p.project / "x.txt")
    r = p.tokq("score", p.shared.ck, "--data", "x.txt", *SCORE)
    return p.error(r, 2, "not a regular file")


@case("data folder", "exit 0: x.txt -> /dev/zero is skipped with a warning (a read never ends)")
def probe_dev_zero_txt(p: Probe) -> str:
    folder = _data(p)
    (folder / "x.txt").symlink_to("/dev/zero")
    return _score_skips(p, folder, "x.txt", "character device")


@case("data folder", "exit 0: a 32 MiB gzip bomb (32 KiB on disk) past --max-doc-mb 4 is skipped naming the flag")
def probe_gzip_bomb(p: Probe) -> str:
    folder = _data(p)
    member = gzip.compress(b"a " * (MIB // 2), compresslevel=9)
    (folder / "bomb.txt.gz").write_bytes(member * 32)
    cls = _score_skips(p, folder, "bomb.txt.gz", "--max-doc-mb", extra=("--max-doc-mb", "4"))
    return cls


@case("data folder", "exit 0: a .jsonl.gz of 32 MiB of short lines past --max-file-mb 8 is skipped naming the flag")
def probe_jsonl_gzip_bomb(p: Probe) -> str:
    folder = _data(p)
    line = (json.dumps({"text": "w1 w2 w3 w4 w5 w6 w7 w8"}) + "\n").encode()
    member = gzip.compress(line * (MIB // len(line)), compresslevel=9)
    (folder / "lines.jsonl.gz").write_bytes(member * 32)
    return _score_skips(p, folder, "lines.jsonl.gz", "--max-file-mb", extra=("--max-file-mb", "8"))


@case("data folder", "exit 0: an 8 MB single-line document with --max-tokens 512 is scored quickly")
def probe_big_single_line(p: Probe) -> str:
    from tests.test_quantize_cli import WORDS

    rng = random.Random(0)
    (p.project / "data").mkdir()
    (p.project / "data" / "big.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(2_000_000)))
    r = p.tokq("score", p.shared.ck, "--data", "data", "--window", "128", "--threads", "1", "--max-tokens", "512")
    p.ok(r)
    p.notes.append(f"{r.seconds:.1f} s, peak RSS {r.maxrss_mib:.0f} MiB")
    p.check(r.seconds < 60, f"took {r.seconds:.0f} s")
    return "handled"


@case("data folder", "exit 0: a .jsonl line holding a lone surrogate (\\ud800) is skipped with a warning")
def probe_lone_surrogate(p: Probe) -> str:
    folder = _data(p)
    (folder / "rows.jsonl").write_text('{"text": "bad \\ud800 here"}\n')
    return _score_skips(p, folder, "rows.jsonl#L1", "lone surrogate")


@case("data folder", "exit 2: the lone-surrogate .jsonl with `data inspect --strict`: one error line")
def probe_lone_surrogate_strict(p: Probe) -> str:
    folder = _data(p)
    (folder / "rows.jsonl").write_text('{"text": "w1 w2"}\n{"text": "\\udfff"}\n')
    r = p.tokq("data", "inspect", "data", "--model", "none", "--strict")
    return p.error(r, 2, "rows.jsonl#L2", "lone surrogate")


@case("data folder", "exit 0: a .jsonl line with a Latin-1 byte is skipped, the other lines read")
def probe_bad_utf8_line(p: Probe) -> str:
    folder = _data(p)
    good = (json.dumps({"text": "w1 w2 w3"}) + "\n").encode()
    (folder / "rows.jsonl").write_bytes(good + b'{"text": "caf\xe9"}\n' + good)
    return _score_skips(p, folder, "rows.jsonl#L2", "not UTF-8")


@case("data folder", "exit 0: a.txt -> b.txt -> a.txt is skipped as a symlink loop")
def probe_file_symlink_loop(p: Probe) -> str:
    folder = _data(p)
    (folder / "a.txt").symlink_to(folder / "b.txt")
    (folder / "b.txt").symlink_to(folder / "a.txt")
    return _score_skips(p, folder, "a.txt", "loop")


@case("data folder", "exit 0: sub -> . (a folder loop) is not followed, with a warning; the walk ends")
def probe_folder_symlink_loop(p: Probe) -> str:
    folder = _data(p)
    (folder / "sub").symlink_to(folder)
    return _score_skips(p, folder, "sub", "not followed")


@case("data folder", "exit 2: a folder of only a FIFO and a gzip bomb: no documents, one error line")
def probe_nothing_readable(p: Probe) -> str:
    folder = p.project / "data"
    folder.mkdir()
    os.mkfifo(folder / "x.txt")
    (folder / "bomb.txt.gz").write_bytes(gzip.compress(b"a " * (MIB // 2), compresslevel=9) * 8)
    r = p.tokq("score", p.shared.ck, "--data", "data", *SCORE, "--max-doc-mb", "1")
    return p.error(r, 2)


@case("data folder", "exit 2: a sparse 3 MiB .txt past --max-doc-mb 1 with --strict is refused naming the file")
def probe_oversized_strict(p: Probe) -> str:
    folder = _data(p)
    with (folder / "huge.txt").open("wb") as f:
        f.truncate(3 * MIB)
    r = p.tokq("score", p.shared.ck, "--data", "data", *SCORE, "--max-doc-mb", "1", "--strict")
    return p.error(r, 2, "huge.txt", "larger than 1 MiB")


@case("data folder", "exit 2: --max-doc-mb nan is refused (a cap that skips nothing)")
def probe_max_doc_mb_nan(p: Probe) -> str:
    r = p.tokq("data", "inspect", p.shared.docs, "--model", "none", "--max-doc-mb", "nan")
    return p.error(r, 2, "--max-doc-mb", "positive number of MiB")


# --- models and configs ------------------------------------------------------------------------------------------

def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _score_model(p: Probe, model: Path, *needles: str) -> str:
    r = p.tokq("score", model, "--data", p.shared.docs, *SCORE)
    return p.error(r, 2, *needles)


@case("models/configs", "exit 2: hidden_size 10^9 over 64-wide weights: refused before allocating (no 844 GB)")
def probe_config_hidden_size_huge(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, hidden_size=10**9, head_dim=16)
    cls = _score_model(p, m, "hidden_size = 1000000000", "do not belong together")
    p.notes.append(f"peak RSS {p.results[-1].maxrss_mib:.0f} MiB")
    return cls


@case("models/configs", "exit 2: num_attention_heads 0 is refused naming config.json")
def probe_config_heads_zero(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, num_attention_heads=0)
    return _score_model(p, m, "num_attention_heads = 0 must be at least 1")


@case("models/configs", "exit 2: vocab_size -5 is refused naming config.json")
def probe_config_vocab_negative(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, vocab_size=-5)
    return _score_model(p, m, "vocab_size = -5 must be at least 1")


@case("models/configs", "exit 2: num_hidden_layers 0 (weights for 3 layers) is refused")
def probe_config_layers_zero(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, num_hidden_layers=0)
    return _score_model(p, m, "num_hidden_layers = 0 must be at least 1")


@case("models/configs", "exit 2: num_hidden_layers 2 with weights for 3: refused (not a truncated model)")
def probe_config_fewer_layers_than_weights(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, num_hidden_layers=2)
    return _score_model(p, m, "the model does not use", "does not match the 3 layers")


@case("models/configs", "exit 2: num_hidden_layers 4000 with weights for 3: refused before allocating")
def probe_config_more_layers_than_weights(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, num_hidden_layers=4000)
    return _score_model(p, m, "weights missing", "does not match the 3 layers")


@case("models/configs", "exit 2: hidden_size 64.5 (truncated by int() once) is refused")
def probe_config_hidden_size_float(p: Probe) -> str:
    m = p.copy_ck()
    text = (m / "config.json").read_text()
    (m / "config.json").write_text(text.replace('"hidden_size": 64', '"hidden_size": 64.5'))
    return _score_model(p, m, "hidden_size", "is not an integer")


@case("models/configs", "exit 2: rms_norm_eps -1e-5 (every logit NaN) is refused")
def probe_config_negative_eps(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, rms_norm_eps=-1e-5)
    return _score_model(p, m, "rms_norm_eps", "must be a positive number")


def _rewrite_header(path: Path, header: bytes) -> None:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(struct.pack("<Q", len(header)) + header + data[8 + n:])


@case("models/configs", "exit 2: a safetensors header of valid JSON that is not an object ([]) is refused")
def probe_safetensors_header_list(p: Probe) -> str:
    m = p.copy_ck()
    _rewrite_header(m / "model.safetensors", b"[]")
    return _score_model(p, m, "model.safetensors is not a valid safetensors file")


@case("models/configs", "exit 2: a safetensors header nested 100000 deep is refused (no RecursionError)")
def probe_safetensors_header_nested(p: Probe) -> str:
    m = p.copy_ck()
    _rewrite_header(m / "model.safetensors", b"[" * 100_000 + b"]" * 100_000)
    return _score_model(p, m, "model.safetensors is not a valid safetensors file")


@case("models/configs", "exit 2: a stray model2.safetensors zeroing model.norm is refused (never silently read)")
def probe_stray_safetensors(p: Probe) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    m = p.copy_ck()
    norm = load_file(m / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": torch.zeros_like(norm)}, m / "model2.safetensors")
    return _score_model(p, m, "model2.safetensors", "remove the stray")


@case("models/configs", "exit 2: a stray tensor no module reads (vision_tower) is refused, not dropped")
def probe_stray_tensor(p: Probe) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    m = p.copy_ck()
    tensors = load_file(m / "model.safetensors")
    tensors["model.vision_tower.proj.weight"] = torch.ones(4, 4)
    save_file(tensors, m / "model.safetensors")
    return _score_model(p, m, "model.vision_tower.proj", "the model does not use")


@case("models/configs", "exit 2: a tokenizer of 301 tokens for a 211-row embedding is refused naming both sizes")
def probe_tokenizer_bigger_than_embedding(p: Probe) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    m = p.copy_ck()
    words = [f"v{i}" for i in range(300)]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(m))
    (p.project / "d").mkdir()
    (p.project / "d" / "doc.txt").write_text(" ".join(words[::-1]) + "\n")
    r = p.tokq("score", m, "--data", "d", *SCORE)
    return p.error(r, 2, "is outside the vocabulary", "the tokenizer holds 301 tokens, its embedding has 211 rows")


@case("models/configs", "exit 2: model.safetensors -> itself (a symlink loop in the checkpoint) is refused")
def probe_checkpoint_weights_symlink_loop(p: Probe) -> str:
    m = p.copy_ck()
    (m / "model.safetensors").unlink()
    os.symlink("model.safetensors", m / "model.safetensors")
    return _score_model(p, m, "model.safetensors cannot be read", "symlink loop")


@case("models/configs", "exit 2: config.json -> itself is refused as a loop, not as 'missing'")
def probe_checkpoint_config_symlink_loop(p: Probe) -> str:
    m = p.copy_ck()
    (m / "config.json").unlink()
    os.symlink("config.json", m / "config.json")
    return _score_model(p, m, "config.json cannot be read", "symlink loop")


@case("models/configs", "exit 2: a checkpoint folder that is a symlink to itself is refused as a loop")
def probe_checkpoint_folder_symlink_loop(p: Probe) -> str:
    os.symlink(p.project / "loop", p.project / "loop")
    return _score_model(p, p.project / "loop", "is a symlink that leads nowhere")


# --- CLI and verdicts --------------------------------------------------------------------------------------------

@case("CLI/verdicts", "exit 1: compare good vs a NaN model, no thresholds: FAIL saying non-finite (not PASS)")
def probe_compare_nan_no_thresholds(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.nan, "--data", p.shared.docs, *COMPARE, "--no-cache",
               "--json", "cmp.json")
    cls = p.verdict_fail(r, "non-finite")
    p.check(p.read_json(p.project / "cmp.json").get("passed") is False, "cmp.json says passed")
    return cls


@case("CLI/verdicts", "exit 1: compare good vs a NaN model with --max-kl 0.1: FAIL (was a TypeError)")
def probe_compare_nan_max_kl(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.nan, "--data", p.shared.docs, *COMPARE, "--no-cache",
               "--max-kl", "0.1", "--json", "cmp.json")
    cls = p.verdict_fail(r, "non-finite")
    p.check(p.read_json(p.project / "cmp.json").get("passed") is False, "cmp.json says passed")
    return cls


@case("CLI/verdicts", "exit 1: compare good vs an Inf model with --max-kl 0.1 --report-dir: FAIL, report says so")
def probe_compare_inf_report(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.inf, "--data", p.shared.docs, *COMPARE, "--no-cache",
               "--max-kl", "0.1", "--report-dir", "rep")
    cls = p.verdict_fail(r, "non-finite")
    p.check(p.read_json(p.project / "rep" / "report.json").get("passed") is False, "report.json says passed")
    return cls


@case("CLI/verdicts", "exit 1: compare with a NaN baseline A: FAIL naming model A")
def probe_compare_nan_baseline(p: Probe) -> str:
    r = p.tokq("compare", p.shared.nan, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--no-cache")
    return p.verdict_fail(r, "model A", "non-finite")


@case("CLI/verdicts", "exit 2: score of a NaN model: error saying non-finite; its --json still written")
def probe_score_nan(p: Probe) -> str:
    r = p.tokq("score", p.shared.nan, "--data", p.shared.docs, "--window", "128", "--threads", "1",
               "--dtype", "fp32", "--json", "score.json")
    cls = p.error(r, 2, "non-finite")
    result = p.read_json(p.project / "score.json")
    p.check(result.get("non_finite_tokens") == result.get("scored_tokens") and result.get("scored_tokens", 0) > 0,
            "score.json does not count the non-finite tokens")
    return cls


@case("CLI/verdicts", "exit 1: gate with a NaN variant: FAIL, a rule saying non-finite")
def probe_gate_nan_variant(p: Probe) -> str:
    p.toml(p.project / "tokq.toml",
           f'[base]\nmodel = "{p.shared.ck}"\ndtype = "fp32"\n\n[variants]\nbroken = "{p.shared.nan}"\n\n'
           f'[data.docs]\npath = "{p.shared.docs}"\nwindow = 128\n\n[gate.quality]\nmax_kl = 0.05\n')
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    cls = p.verdict_fail(r)
    report = p.read_json(p.project / "report" / "report.json")
    rules = report.get("variants", {}).get("broken", {}).get("rules", [])
    p.check(report.get("result") == "fail" and any(x.get("result") == "fail" and "non-finite" in str(x.get("rule"))
                                                   for x in rules), "no failed rule says non-finite")
    return cls


@case("CLI/verdicts", "exit 2: score --threads 100000 (segfaulted torch) is refused")
def probe_threads_huge_score(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, "--window", "64", "--threads", "100000")
    return p.error(r, 2, "--threads 100000")


@case("CLI/verdicts", "exit 2: quantize --threads 100000 is refused, nothing written")
def probe_threads_huge_quantize(p: Probe) -> str:
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", "--method", "rtn", "--threads", "100000")
    return p.error(r, 2, "--threads 100000", absent=(p.project / "q",))


@case("CLI/verdicts", "exit 2: score --seed 2**66 (was an internal error) is refused")
def probe_seed_huge_score(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, *SCORE, "--seed", str(2**66))
    return p.error(r, 2, f"--seed {2**66}")


@case("CLI/verdicts", "exit 2: gate --seed 2**66 is refused before the gate runs")
def probe_seed_huge_gate(p: Probe) -> str:
    p.gate_project(owned=True)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1", "--seed", str(2**66))
    return p.error(r, 2, f"--seed {2**66}", absent=(p.project / "report",))


@case("CLI/verdicts", "exit 2: compare --seed -1 (failed minutes in, in numpy) is refused at once")
def probe_seed_negative_compare(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--seed", "-1")
    return p.error(r, 2, "--seed -1")


@case("CLI/verdicts", "exit 2: score --json pointing at a folder is refused before the work, folder kept")
def probe_json_folder_score(p: Probe) -> str:
    p.own(p.project / "out" / "keep.txt", "mine")
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, *SCORE, "--json", "out")
    return p.error(r, 2, "--json out")


@case("CLI/verdicts", "exit 2: compare --json pointing at a folder is refused before the work")
def probe_json_folder_compare(p: Probe) -> str:
    (p.project / "out").mkdir()
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--json", "out")
    cls = p.error(r, 2, "--json out")
    p.check(r.seconds < 30, f"refused only after {r.seconds:.0f} s")
    return cls


@case("CLI/verdicts", "exit 2: quantize --json under a file is refused before the work, --out not written")
def probe_json_under_file_quantize(p: Probe) -> str:
    p.own(p.project / "file.txt", "x")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--json", "file.txt/rec.json")
    return p.error(r, 2, "--json file.txt/rec.json", absent=(p.project / "q",))


def _malformed(p: Probe, raw: bytes | None, is_folder: bool = False) -> str:
    folder = p.project / "report"
    p.own(folder / "report.md", "old\n")
    if is_folder:
        (folder / "report.json").mkdir()
    elif raw is not None:
        p.own(folder / "report.json", raw)
    r = p.tokq("report", "report")
    cls = p.error(r, 2, "report.json", "tokq compare --report-dir")
    names = sorted(x.name for x in folder.iterdir())
    p.check(set(names) <= {"report.md", "report.json"}, f"the folder now holds {names}")
    return cls


@case("CLI/verdicts", "exit 2: `tokq report` of a report.json that is not JSON: one line, folder unchanged")
def probe_report_not_json(p: Probe) -> str:
    return _malformed(p, b"{this is not json")


@case("CLI/verdicts", "exit 2: `tokq report` of a report.json that is a JSON list")
def probe_report_a_list(p: Probe) -> str:
    return _malformed(p, b"[1, 2]")


@case("CLI/verdicts", "exit 2: `tokq report` of a report.json nested 100000 deep (RecursionError once)")
def probe_report_deeply_nested(p: Probe) -> str:
    return _malformed(p, b"[" * 100_000 + b"]" * 100_000)


@case("CLI/verdicts", "exit 2: `tokq report` of a real compare report.json whose prefill is a string")
def probe_report_wrong_types(p: Probe) -> str:
    result = copy.deepcopy(p.shared.compare_report)
    result["prefill"] = "high"
    return _malformed(p, json.dumps(result).encode())


@case("CLI/verdicts", "exit 2: `tokq report` of a folder without report.json")
def probe_report_missing(p: Probe) -> str:
    return _malformed(p, None)


# --- neighbouring cases this probe adds (source "extra") ------------------------------------------------------

@extra("data loss", "exit 2: `quantize --force --out BASE` where BASE is the user's HF model folder: refused")
def probe_quantize_force_over_hf_model(p: Probe) -> str:
    base = Path(shutil.copytree(p.shared.ck, p.project / "base"))
    p.own_tree(base)
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "base", *QUANT, "--force")
    return p.error(r, 2, "exists and is not a tokq checkpoint folder")


@extra("data loss", "exit 2: --report-dir a symlink to a user folder that holds only a report.json: refused")
def probe_report_dir_symlink(p: Probe) -> str:
    p.own(p.project / "mine" / "report.json", '{"mine": 1}')
    (p.project / "link").symlink_to(p.project / "mine")
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--report-dir", "link")
    cls = p.error(r, 2, "symbolic link")
    p.check((p.project / "link").is_symlink(), "the symlink was replaced")
    return cls


@extra("data loss", "exit 2: `gate --out notes.txt` (a user's file) is refused, the file kept")
def probe_gate_out_user_file(p: Probe) -> str:
    p.gate_project(owned=True)
    p.own(p.project / "notes.txt", "mine")
    r = p.tokq("gate", "--out", "notes.txt", "--no-speed", "--threads", "1")
    return p.error(r, 2, "notes.txt")


@extra("data loss", "exit 2: `quantize --out . --force` in a project folder is refused")
def probe_quantize_out_dot_force(p: Probe) -> str:
    p.own(p.project / "src" / "main.py", "print(1)\n")
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", ".", *QUANT, "--force")
    return p.error(r, 2, "working directory")


@extra("data loss", "exit 2: `data build-default --out . --force` in a project folder is refused")
def probe_build_default_out_dot(p: Probe) -> str:
    p.own(p.project / "notes.txt", "mine")
    r = p.tokq("data", "build-default", "--out", ".", "--force", "--model", "none")
    return p.error(r, 2, "working directory")


@extra("files", "exit 0: quantize --force --out an existing empty folder uses it (it holds nothing to lose)")
def probe_quantize_force_into_empty_folder(p: Probe) -> str:
    (p.project / "q").mkdir()
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--force"))
    p.check((p.project / "q" / "model.safetensors").is_file(), "q has no weights")
    return "handled"


def _interrupt(p: Probe, args: list[str], sig: int, absent: tuple[Path, ...], codes: tuple[int, ...],
               script: str = SLOW_QUANTIZE, line: str = "quantizing ", rerun: list[str] | None = None) -> str:
    """Start the real CLI with one step slowed (`script`), send `sig` once it prints `line`, expect `codes`;
    then, with `rerun`, run the same command again: it must succeed."""
    run = p.start(raw=[sys.executable, "-c", script, *args])
    if not run.wait_for_line(line, p.timeout):
        p.results.append(run.wait())
        raise Unexpected(f"the command never said {line!r}")
    time.sleep(1)
    run.send(sig)
    r = run.wait()
    p.results.append(r)
    left = p.leftovers()
    if rerun is not None:
        p.ok(p.tokq(*rerun))
    if r.code == -signal.SIGTERM and left:
        raise Unclean(f"killed by SIGTERM, it left {left}" + (" (a rerun succeeded)" if rerun else ""))
    if r.timed_out:
        return "hang"
    if r.code == 0:
        raise Wrong("exit 0 after the signal")
    if r.code not in codes:
        raise Unexpected(f"exit {r.code}, expected one of {codes}: {r.first_line()}")
    if r.code == 130 and "aborted" not in r.err:
        raise Unclean("exit 130 without `aborted`")
    if "fix the recipe" in r.text:
        raise Unexpected("the interrupt is blamed on the recipe")
    for path in absent:
        if path.exists():
            raise Unclean(f"{p.rel(path)} was left after the signal")
    return "clean_error"


def _recipe_gate(p: Probe) -> list[str]:
    p.toml(p.project / "tokq.toml",
           f'[base]\nmodel = "{p.shared.ck}"\ndtype = "fp32"\n\n[variants]\n'
           f'rtn = {{ path = "built/rtn", recipe = {{ method = "rtn", group_size = 32 }} }}\n\n'
           f'[data.docs]\npath = "{p.shared.docs}"\nwindow = 128\n\n[gate.quality]\nmax_kl = 10.0\n')
    return ["gate", "--out", "r", "--no-speed", "--threads", "1"]


@case("files", "exit 130: Ctrl-C (SIGINT) while the gate builds a recipe variant: `aborted`, nothing half built")
def probe_sigint_gate_building_recipe(p: Probe) -> str:
    return _interrupt(p, _recipe_gate(p), signal.SIGINT, (p.project / "r", p.project / "built" / "rtn"), (130,))


@extra("files", "exit 130: a CI cancel (SIGTERM) while the gate builds a recipe variant: nothing half built")
def probe_sigterm_gate_building_recipe(p: Probe) -> str:
    return _interrupt(p, _recipe_gate(p), signal.SIGTERM, (p.project / "r", p.project / "built" / "rtn"),
                      (130, 143, -signal.SIGTERM))


@extra("files", "a CI cancel (SIGTERM) while quantize quantizes: no q, nothing left behind; a rerun works")
def probe_sigterm_quantize(p: Probe) -> str:
    args = ["quantize", "--model", str(p.shared.ck), "--out", "q", *QUANT, "--name", "a"]
    (p.project / "tokq.toml").write_text("[variants]\n")  # the rerun records `a`: only that it parses is checked
    p.toml(p.project / "tokq.toml")
    return _interrupt(p, args, signal.SIGTERM, (p.project / "q",), (130, 143, -signal.SIGTERM), rerun=args)


@extra("files", "a CI cancel (SIGTERM) while quantize writes q's files: no q, no temp folder left; a rerun works")
def probe_sigterm_quantize_while_saving(p: Probe) -> str:
    args = ["quantize", "--model", str(p.shared.ck), "--out", "q", *QUANT]
    return _interrupt(p, args, signal.SIGTERM, (p.project / "q",), (130, 143, -signal.SIGTERM),
                      script=SLOW_SAVE, line="weights written", rerun=args)


@extra("tokq.toml", "exit 0: a tokq.toml with CRLF line endings and comments: the variant recorded, file parses")
def probe_toml_crlf(p: Probe) -> str:
    return _record(p, '# mine\r\n[variants]\r\nbase = "b"  # the reference\r\n\r\n[gate]\r\nx = 1\r\n',
                   keep_lines=False)


@extra("tokq.toml", "exit 0: a dotted top-level key `variants.base = ...`: the variant recorded, file parses")
def probe_toml_dotted_variants(p: Probe) -> str:
    return _record(p, 'variants.base = "b"\n\n[gate]\nx = 1\n', keep_lines=False)


@extra("tokq.toml", "exit 2 or a recorded variant: `--name` in a tokq.toml where variants is an array of tables")
def probe_toml_variants_array_of_tables(p: Probe) -> str:
    p.toml(p.project / "tokq.toml", '[[variants]]\nbase = "b"\n')
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", "q", *QUANT, "--name", "int4")
    return p.error(r, 2, "tokq.toml", absent=(p.project / "q",))


@extra("injection", "exit 0: a document named <script>alert(1)<img src=x onerror=alert(1)>.txt: report escaped")
def probe_xss_document_name(p: Probe) -> str:
    data = p.project / "data"
    shutil.copytree(p.shared.docs, data)
    (data / "doc0.txt").rename(data / "<script>alert(1)<img src=x onerror=alert(1)>.txt")
    p.ok(p.tokq("compare", p.shared.ck, p.shared.ck, "--data", "data", *COMPARE, "--report-dir", "rep"))
    page = (p.project / "rep" / "report.html").read_text()
    p.check("<script" not in page.lower() and "<img src=x" not in page.lower(), "report.html holds raw markup")
    _junit_parses(p, p.project / "rep" / "junit.xml")
    return "handled"


@extra("injection", "exit 0 escaped, or exit 2: a [data.\"<script>...\"] set name in tokq.toml")
def probe_xss_data_set_name(p: Probe) -> str:
    text = p.gate_project().read_text().replace("[data.docs]", '[data."<script>alert(1)</script>"]')
    p.own(p.project / "tokq.toml", text)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    if r.code == 2:
        return p.error(r, 2, "data", absent=(p.project / "report",))
    p.ok(r)
    _escaped_page(p, p.project / "report" / "report.html")
    _junit_parses(p, p.project / "report" / "junit.xml")
    return "handled"


def _control_variant(p: Probe, key: str) -> str:
    p.gate_project(f'"{key}" = "base"', owned=True)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    if r.code == 2:
        return p.error(r, 2, absent=(p.project / "report",))
    p.ok(r)
    if "\x1b" in r.out + r.err:
        p.notes.append("the variant name's raw ESC reaches the terminal")
    _junit_parses(p, p.project / "report" / "junit.xml")
    page = (p.project / "report" / "report.html").read_text()
    p.check("\x00" not in page and "\x1b" not in page, "report.html holds a raw NUL or ESC")
    return "handled"


@extra("injection", "exit 0 with a junit.xml that parses, or exit 2: a variant name holding ESC (an ANSI colour)")
def probe_esc_in_variant_name(p: Probe) -> str:
    return _control_variant(p, "v\\u001b[31m")


@extra("injection", "exit 0 with a junit.xml that parses, or exit 2: a variant name holding NUL")
def probe_nul_in_variant_name(p: Probe) -> str:
    return _control_variant(p, "a\\u0000b")


@extra("injection", "exit 0: B's folder name holds ESC (an ANSI colour): junit.xml parses, report.html has no ESC")
def probe_esc_in_model_folder_name(p: Probe) -> str:
    b = p.copy_ck("m\x1b[31mred", p.shared.ck)
    p.ok(p.tokq("compare", p.shared.ck, b, "--data", p.shared.docs, *COMPARE, "--report-dir", "rep"))
    _junit_parses(p, p.project / "rep" / "junit.xml")
    p.check("\x1b" not in (p.project / "rep" / "report.html").read_text(), "report.html holds a raw ESC")
    return "handled"


@extra("injection", "exit 0 or a clean exit 2: `tokq report` of a real report.json whose numbers are NaN")
def probe_report_json_nan_numbers(p: Probe) -> str:
    result = copy.deepcopy(p.shared.compare_report)
    for t in result["thresholds"]:
        for key in ("value", "low", "high", "threshold"):
            if isinstance(t.get(key), (int, float)) and not isinstance(t.get(key), bool):
                t[key] = float("nan")
    (p.project / "rep").mkdir()
    (p.project / "rep" / "report.json").write_text(json.dumps(result))
    r = p.tokq("report", "rep")
    if r.code == 2:
        return p.error(r, 2, "report.json")
    p.ok(r)
    return "handled"


@extra("data folder", "exit 0: random bytes named x.txt.gz (not gzip) are skipped with a warning")
def probe_corrupt_gzip(p: Probe) -> str:
    folder = _data(p)
    (folder / "x.txt.gz").write_bytes(random.Random(0).randbytes(4096))
    return _score_skips(p, folder, "x.txt.gz")


@extra("data folder", "exit 0: a gzip cut in half (truncated download) is skipped with a warning")
def probe_truncated_gzip(p: Probe) -> str:
    folder = _data(p)
    data = gzip.compress((p.shared.docs / "doc1.txt").read_bytes() * 50)
    (folder / "cut.txt.gz").write_bytes(data[: len(data) // 2])
    return _score_skips(p, folder, "cut.txt.gz")


@extra("data folder", "exit 0: binary bytes (NUL) named x.txt are skipped as binary")
def probe_binary_txt(p: Probe) -> str:
    folder = _data(p)
    (folder / "x.txt").write_bytes(bytes(range(256)) * 64)
    return _score_skips(p, folder, "x.txt", "binary")


@extra("data folder", "exit 0: .jsonl lines without \"text\", or with a number or null there, are skipped")
def probe_jsonl_wrong_fields(p: Probe) -> str:
    folder = _data(p)
    (folder / "rows.jsonl").write_text('{"body": "w1 w2"}\n{"text": 5}\n{"text": null}\n[1, 2]\n"text"\n')
    return _score_skips(p, folder, "rows.jsonl#L1")


@extra("data folder", "exit 2: --data a dangling symlink is refused in one line")
def probe_data_dangling_symlink(p: Probe) -> str:
    (p.project / "data").symlink_to(p.project / "gone")
    r = p.tokq("score", p.shared.ck, "--data", "data", *SCORE)
    return p.error(r, 2, "data")


@extra("data folder", "exit 2: --data a symlink to itself is refused in one line (no hang)")
def probe_data_symlink_to_itself(p: Probe) -> str:
    (p.project / "data").symlink_to(p.project / "data")
    r = p.tokq("score", p.shared.ck, "--data", "data", *SCORE)
    return p.error(r, 2, "data")


@extra("data folder", "exit 2: --window 0 is refused")
def probe_window_zero(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, "--window", "0", "--threads", "1")
    return p.error(r, 2, "window must be")


@extra("data folder", "exit 2 or 0: score --window 10^9 (past max_position_embeddings 512): no huge allocation")
def probe_window_huge_score(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, "--window", str(10**9), "--threads", "1")
    p.notes.append(f"peak RSS {r.maxrss_mib:.0f} MiB")
    if r.code == 2:
        return p.error(r, 2, "--window")
    p.ok(r)
    return "handled"


@extra("data folder", "exit 2 or 0: compare --window 10^9 (past max_position_embeddings 512): no huge allocation")
def probe_window_huge_compare(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--window", str(10**9))
    p.notes.append(f"peak RSS {r.maxrss_mib:.0f} MiB")
    if r.code == 2:
        return p.error(r, 2, "--window")
    p.ok(r)
    return "handled"


@extra("data folder", "exit 2: score --stride 0 is refused")
def probe_stride_zero(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, "--window", "64", "--stride", "0", "--threads", "1")
    return p.error(r, 2, "stride must be")


@extra("models/configs", "exit 2: config.json that is not JSON is refused naming it")
def probe_config_not_json(p: Probe) -> str:
    m = p.copy_ck()
    (m / "config.json").write_text("{not json")
    return _score_model(p, m, "config.json")


@extra("models/configs", "exit 2: config.json that is a JSON list is refused naming it")
def probe_config_a_list(p: Probe) -> str:
    m = p.copy_ck()
    (m / "config.json").write_text("[1, 2]")
    return _score_model(p, m, "config.json")


@extra("models/configs", "exit 2: a checkpoint without config.json is refused naming it")
def probe_config_missing(p: Probe) -> str:
    m = p.copy_ck()
    (m / "config.json").unlink()
    return _score_model(p, m, "config.json")


@extra("models/configs", "exit 2: model_type \"gpt9\" (unknown architecture) is refused")
def probe_config_unknown_model_type(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, model_type="gpt9", architectures=["Gpt9ForCausalLM"])
    return _score_model(p, m, "Gpt9ForCausalLM", "is not supported")


@extra("models/configs", "exit 2: num_key_value_heads 0 is refused")
def probe_config_kv_heads_zero(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, num_key_value_heads=0)
    return _score_model(p, m, "num_key_value_heads")


@extra("models/configs", "exit 2: head_dim 10^6 over 64-wide weights is refused before allocating")
def probe_config_head_dim_huge(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, head_dim=10**6)
    cls = _score_model(p, m, "config.json")
    p.notes.append(f"peak RSS {p.results[-1].maxrss_mib:.0f} MiB")
    return cls


@extra("models/configs", "exit 2: model.safetensors cut in half (an interrupted download) is refused")
def probe_safetensors_truncated(p: Probe) -> str:
    m = p.copy_ck()
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) // 2])
    return _score_model(p, m, "model.safetensors")


@extra("models/configs", "exit 2: a safetensors header length of 2**60 is refused (no huge read)")
def probe_safetensors_header_length_huge(p: Probe) -> str:
    m = p.copy_ck()
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(struct.pack("<Q", 2**60) + data[8:])
    return _score_model(p, m, "model.safetensors")


@extra("models/configs", "exit 2: an empty (0-byte) model.safetensors is refused")
def probe_safetensors_empty(p: Probe) -> str:
    m = p.copy_ck()
    (m / "model.safetensors").write_bytes(b"")
    return _score_model(p, m, "model.safetensors")


@extra("models/configs", "exit 2: a tokenizer.json that is not JSON is refused naming the checkpoint")
def probe_tokenizer_corrupt(p: Probe) -> str:
    m = p.copy_ck()
    (m / "tokenizer.json").write_text("{not json")
    return _score_model(p, m, "tokenizer")


@extra("CLI/verdicts", "exit 2: compare of two different models with --max-kl nan (a rule nothing fails) refused")
def probe_max_kl_nan_cli(p: Probe) -> str:
    other = p.shared.root / "llama-b"
    r = p.tokq("compare", p.shared.ck, other, "--data", p.shared.docs, *COMPARE, "--max-kl", "nan")
    return p.error(r, 2, "--max-kl")


@extra("CLI/verdicts", "exit 2: [gate.quality] max_kl = nan in tokq.toml is refused with tokq.toml:LINE")
def probe_max_kl_nan_toml(p: Probe) -> str:
    text = p.gate_project(f'other = "{p.shared.root / "llama-b"}"').read_text().replace("max_kl = 0.05",
                                                                                        "max_kl = nan")
    p.own(p.project / "tokq.toml", text)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, "tokq.toml:", "max_kl", absent=(p.project / "report",))


@extra("CLI/verdicts", "exit 2: compare --resamples 0 is refused")
def probe_resamples_zero(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--resamples", "0")
    return p.error(r, 2, "--resamples")


@extra("CLI/verdicts", "exit 2: score --dtype fp64 is refused")
def probe_dtype_unknown(p: Probe) -> str:
    r = p.tokq("score", p.shared.ck, "--data", p.shared.docs, *SCORE, "--dtype", "fp64")
    return p.error(r, 2, "fp64")


@extra("CLI/verdicts", "exit 2: compare --kv-memory lots is refused")
def probe_kv_memory_garbage(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--kv-memory", "lots")
    return p.error(r, 2, "--kv-memory")


@extra("CLI/verdicts", "exit 2: gate --variant nosuch is refused naming the known variants")
def probe_gate_unknown_variant(p: Probe) -> str:
    p.gate_project(owned=True)
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1", "--variant", "nosuch")
    return p.error(r, 2, "nosuch", absent=(p.project / "report",))


# --- issue 34: verdicts no input can forge, and what is read before them -----------------------------------------

class FakeServer:
    """An OpenAI-compatible completions endpoint in this process that answers what a hostile server would:
    `answer(body) -> (status, headers, bytes)`, or a handler that trickles."""

    def __init__(self, answer):
        import http.server

        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {}, json.dumps({"data": [{"id": "m"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                outer.auth.append(self.headers.get("Authorization", ""))
                status, headers, raw = outer.answer(body)
                if raw is None:  # trickle: a byte every 0.5 s, for ever
                    self.send_response(200)
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    try:
                        for _ in range(100000):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.5)
                    except OSError:
                        return
                    return
                self._send(status, headers, raw)

            def _send(self, status, headers, raw):
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.answer, self.auth = answer, []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.host = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


def _lying_answer(lie: str):
    """prompt_logprobs for the sent ids, each position's alternatives made to lie the way `lie` says."""
    def answer(body):
        ids = body["prompt"]
        k = int(body.get("prompt_logprobs") or 5)
        rows = [None]
        for t in ids[1:]:
            alts = {str((t + j) % 200): {"logprob": -1.0 - j, "rank": j + 1} for j in range(k)}
            if lie == "positive":
                alts = {key: {**v, "logprob": 0.7} for key, v in alts.items()}  # raw logits, say
            elif lie == "mass":
                alts = {key: {**v, "logprob": -0.05} for key, v in alts.items()}
            elif lie == "nan":
                alts[str(t)] = {"logprob": float("nan"), "rank": 1}
            elif lie == "only-sampled":
                alts = {str(t): {"logprob": -0.5, "rank": 1}}
            rows.append(alts)
        text = json.dumps({"choices": [{"prompt_token_ids": ids, "prompt_logprobs": rows, "text": ""}]})
        return 200, {}, text.encode()  # json writes NaN as NaN, which Python's json (and tokq's client) reads
    return answer


def _url_compare(p: Probe, server: FakeServer, *extra_args, url: str | None = None) -> Result:
    side = f"url=http://{url or server.host}/v1#model=m&topk=5"
    return p.tokq("compare", p.shared.ck, side, "--data", p.shared.docs, *COMPARE, "--max-kl", "0.5",
                  "--json", "cmp.json", *extra_args)


@case("forged verdicts", "exit 2: a URL side answering positive log-probabilities is refused (was a PASS)")
def probe_url_positive_logprobs(p: Probe) -> str:
    server = FakeServer(_lying_answer("positive"))
    try:
        return p.error(_url_compare(p, server), 2, "> 0", absent=(p.project / "cmp.json",))
    finally:
        server.close()


@case("forged verdicts", "exit 2: a URL side whose top-k probabilities sum above 1 is refused (was a PASS)")
def probe_url_mass_above_one(p: Probe) -> str:
    server = FakeServer(_lying_answer("mass"))
    try:
        return p.error(_url_compare(p, server), 2, "sum to", absent=(p.project / "cmp.json",))
    finally:
        server.close()


@case("forged verdicts", "exit 2: a NaN log-probability from a URL side is refused (was read as -inf)")
def probe_url_nan_logprob(p: Probe) -> str:
    server = FakeServer(_lying_answer("nan"))
    try:
        return p.error(_url_compare(p, server), 2, "NaN", absent=(p.project / "cmp.json",))
    finally:
        server.close()


@case("forged verdicts", "exit 2: a URL side listing only the sampled token is refused (was top-1 0%)")
def probe_url_only_sampled(p: Probe) -> str:
    server = FakeServer(_lying_answer("only-sampled"))
    try:
        return p.error(_url_compare(p, server), 2, "alternatives", absent=(p.project / "cmp.json",))
    finally:
        server.close()


@case("forged verdicts", "exit 2: malformed JSON shapes from a URL side are one clean error each")
def probe_url_malformed_shapes(p: Probe) -> str:
    shapes = [[], {"choices": "x"}, {"choices": [{"prompt_logprobs": [None, ["a", 1]]}]},
              {"choices": [{"prompt_logprobs": [None, {"5": 3}]}]}, {"choices": [{"prompt_token_ids": ["a"]}]}]
    worst = "clean_error"
    for shape in shapes:
        server = FakeServer(lambda body, shape=shape: (200, {}, json.dumps(shape).encode()))
        try:
            r = _url_compare(p, server)
            if r.crashed():
                return "traceback"
            if r.code != 2 or "error:" not in r.err:
                raise Unexpected(f"shape {str(shape)[:40]}: exit {r.code}: {r.first_line()}")
        finally:
            server.close()
    return worst


@case("forged verdicts", "exit 2: a bad IPv6 URL side is one clean error")
def probe_url_bad_ipv6(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, "url=http://[::1/v1", "--data", p.shared.docs, *COMPARE)
    return p.error(r, 2, "malformed")


@case("forged verdicts", "handled: a URL with user:password never shows the password (errors, JSON, report)")
def probe_url_credentials_redacted(p: Probe) -> str:
    server = FakeServer(_lying_answer("positive"))
    try:
        r = _url_compare(p, server, url=f"alice:s3cret@{server.host}")
    finally:
        server.close()
    p.check("s3cret" not in r.out + r.err, "the password is printed")
    p.check(any(a.startswith("Basic ") for a in server.auth), "the credentials were not sent as basic auth")
    for path in p.project.rglob("*"):
        if path.is_file():
            p.check(b"s3cret" not in path.read_bytes(), f"{p.rel(path)} holds the password")
    return "handled"


@case("forged verdicts", "exit 2 within ~--timeout: a server trickling bytes cannot hang compare")
def probe_url_trickle_timeout(p: Probe) -> str:
    server = FakeServer(lambda body: (200, {}, None))
    try:
        r = _url_compare(p, server, "--timeout", "3")
    finally:
        server.close()
    p.check(r.seconds < 60, f"took {r.seconds:.0f} s")
    return p.error(r, 2, "timeout")


@case("forged verdicts", "exit 2: a gzip bomb answer is refused at the size cap (RSS stays low)")
def probe_url_gzip_bomb(p: Probe) -> str:
    bomb = gzip.compress(b"0" * (300 << 20), compresslevel=9)
    server = FakeServer(lambda body: (200, {"Content-Encoding": "gzip"}, bomb))
    try:
        r = _url_compare(p, server)
    finally:
        server.close()
    p.notes.append(f"peak RSS {r.maxrss_mib:.0f} MiB")
    p.check(r.maxrss_mib is None or r.maxrss_mib < 900, f"peak RSS {r.maxrss_mib} MiB")
    return p.error(r, 2, "larger than")


@case("forged verdicts", "exit 2: a variant that is a symlink to the base is refused (was a PASS)")
def probe_variant_symlink_to_base(p: Probe) -> str:
    (p.project / "alias").symlink_to(p.shared.ck)
    p.gate_project('v = "alias"')
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, "byte for byte", absent=(p.project / "report",))


@case("forged verdicts", "exit 2: a variant that is a byte copy of the base is refused (was a PASS)")
def probe_variant_copy_of_base(p: Probe) -> str:
    shutil.copytree(p.shared.ck, p.project / "copy")
    p.gate_project('v = "copy"')
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, "byte for byte", absent=(p.project / "report",))


@case("forged verdicts", "exit 2: max_kl = 1e308 (a rule no data could fail) is a config error")
def probe_rule_cannot_fail_toml(p: Probe) -> str:
    path = p.gate_project()
    path.write_text(path.read_text().replace("max_kl = 0.05", "max_kl = 1e308"))
    r = p.tokq("gate", "--out", "report", "--no-speed", "--threads", "1")
    return p.error(r, 2, "cannot fail", absent=(p.project / "report",))


@case("forged verdicts", "exit 2: compare --max-kl 1e308 is refused before scoring")
def probe_rule_cannot_fail_cli(p: Probe) -> str:
    r = p.tokq("compare", p.shared.ck, p.shared.ck, "--data", p.shared.docs, *COMPARE, "--max-kl", "1e308")
    return p.error(r, 2, "cannot fail")


@case("forged verdicts", "exit 2: min_tpot_speedup = 0 (a speed rule that cannot fail) is a config error")
def probe_speed_rule_cannot_fail(p: Probe) -> str:
    p.gate_project(extra="\n[gate.speed]\nmin_tpot_speedup = 0\n")
    r = p.tokq("gate", "--out", "report", "--threads", "1")
    return p.error(r, 2, "cannot fail", absent=(p.project / "report",))


@case("forged verdicts", "exit 2: a recipe hash copied from another build onto other weights is not trusted")
def probe_forged_recipe_hash(p: Probe) -> str:
    path = p.gate_project('v = { path = "built/v", recipe = { method = "rtn", group_size = 32 } }')
    p.ok(p.tokq("gate", "--out", "r1", "--no-speed", "--threads", "1"), 0)
    built = p.project / "built" / "v"
    record = (built / "tokq_quantization.json").read_bytes()
    forged = p.project / "forged"
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", forged, "--threads", 1, "--method", "rtn",
               "--group-size", 32, "--bits", 8)  # other weights than the recipe's 4-bit build
    p.ok(r, 0)
    shutil.rmtree(built)
    shutil.copytree(forged, built)
    (built / "tokq_quantization.json").write_bytes(record)  # the other build's record, hash and all
    r = p.tokq("gate", "--out", "r2", "--no-speed", "--threads", "1", "--config", path)
    return p.error(r, 2, "cannot be trusted", absent=(p.project / "r2",))


@case("forged verdicts", "exit 2: hidden_act banana is refused naming config.json")
def probe_config_hidden_act(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, hidden_act="banana")
    return _score_model(p, m, "hidden_act = 'banana' is not supported")


@case("forged verdicts", "exit 2: a RoPE scaling factor of 0 is refused (was used as 1)")
def probe_config_rope_factor_zero(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 0.0})
    return _score_model(p, m, "rope factor = 0.0")


@case("forged verdicts", "exit 2: tie_word_embeddings true over a distinct lm_head is refused (was dropped)")
def probe_config_tied_distinct_head(p: Probe) -> str:
    m = p.copy_ck()
    _edit_config(m, tie_word_embeddings=True)
    return _score_model(p, m, "tie_word_embeddings = true")


def _quantized_scales(p: Probe, fill) -> Path:
    from safetensors.torch import load_file, save_file

    out = p.root / "q"
    p.ok(p.tokq("quantize", "--model", p.shared.ck, "--out", out, *QUANT), 0)
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("weight_scale"))
    tensors[name] = fill(tensors[name])
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@case("forged verdicts", "exit 2: an int32 weight_scale is refused (was read)")
def probe_scale_int32(p: Probe) -> str:
    return _score_model(p, _quantized_scales(p, lambda s: (s * 1000).to(torch_int32())), "dtype torch.int32")


@case("forged verdicts", "exit 2: a negative weight_scale is refused (was read)")
def probe_scale_negative(p: Probe) -> str:
    return _score_model(p, _quantized_scales(p, lambda s: -s), "negative or not finite")


@case("forged verdicts", "exit 2: an all-zero weight_scale is refused (was read)")
def probe_scale_zero(p: Probe) -> str:
    return _score_model(p, _quantized_scales(p, lambda s: s * 0), "all zeros")


def torch_int32():
    import torch

    return torch.int32


@case("forged verdicts", "exit 2: --kv-cache-strategy tensor without --kv-cache is refused (was ignored)")
def probe_kv_strategy_without_kv_cache(p: Probe) -> str:
    r = p.tokq("quantize", "--model", p.shared.ck, "--out", p.root / "q", *QUANT, "--kv-cache-strategy", "tensor")
    return p.error(r, 2, "--kv-cache-strategy", absent=(p.root / "q",))


@case("forged verdicts", "handled: 1500 nested folders are walked without recursion (the deep one reported)")
def probe_deep_folders(p: Probe) -> str:
    folder = p.root / "deep"
    shutil.copytree(p.shared.docs, folder)
    cur = folder
    for _ in range(1500):
        cur = cur / "d"
        try:
            cur.mkdir()
        except OSError:
            break
    r = p.tokq("data", "inspect", folder)
    # rm walks without recursion; Python's os.walk and shutil.rmtree (the probe's own checks) would overflow
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    if r.crashed():
        return "traceback"
    p.ok(r, 0, "deeper than")
    return "handled"


@case("forged verdicts", "exit 2: tokq init --path FOLDER --force is refused (was a traceback)")
def probe_init_path_folder(p: Probe) -> str:
    (p.project / "afolder").mkdir()
    r = p.tokq("init", "--path", "afolder", "--force")
    return p.error(r, 2, "is a folder")


# ------------------------------------------------------------------------------------------------------------
# Running and reporting


def run_case(c: Case, root: Path, shared: Shared, timeout: float) -> dict:
    p = Probe(c.name, root, shared, timeout)
    cls, detail = None, ""
    start = time.perf_counter()
    try:
        cls = c.fn(p)
    except Wrong as exc:
        cls, detail = "silent_wrong", str(exc)
    except (Unexpected, Unclean) as exc:
        cls, detail = "other", f"{'unclean' if isinstance(exc, Unclean) else 'unexpected'}: {exc}"
    except Exception as exc:  # the probe's own code failed reading what tokq left: wrong content
        cls, detail = "silent_wrong", f"probe check raised {type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - start
    crashes = [why for r in p.results if (why := r.crashed())]
    logs = p.crash_logs()
    lost = p.lost()
    leftovers = p.leftovers()
    if lost:
        cls, detail = "data_lost", lost
    elif any(r.timed_out for r in p.results):
        cls, detail = "hang", f"ran past {timeout:.0f} s"
    elif crashes or logs:
        cls, detail = "traceback", "; ".join(crashes) or f"crash log {logs[0]}"
    elif cls in ("clean_error", "handled") and leftovers:
        cls, detail = ("other" if cls == "clean_error" else "silent_wrong"), f"left behind: {leftovers[:3]}"
    elif cls not in CLASSES:
        cls, detail = "other", f"probe returned {cls!r}"
    last = p.results[-1] if p.results else None
    roots = (root, shared.root)
    return {
        "name": c.name, "area": c.area, "source": c.source, "expect": c.expect, "class": cls,
        "detail": sanitize(detail, *roots),
        "exit_codes": [r.code for r in p.results],
        "commands": [sanitize(" ".join(a if a.isprintable() else repr(a) for a in r.argv[1:]), *roots)
                     if r.argv[1:2] != ["-c"] else "python -c <script> " + sanitize(" ".join(r.argv[3:]), *roots)
                     for r in p.results],
        "seconds": round(seconds, 2),
        "command_seconds": [round(r.seconds, 2) for r in p.results],
        "peak_rss_mib": max((r.maxrss_mib or 0 for r in p.results), default=None),
        "first_stderr_line": sanitize(last.first_line(), *roots)[:300] if last else "",
        "stderr_tail": sanitize(last.err[-1500:], *roots) if last and cls not in ("clean_error", "handled") else "",
        "notes": [sanitize(n, *roots) for n in p.notes],
    }


def table(records: list[dict]) -> list[dict]:
    rows = []
    for area in (*AREAS, "total"):
        chosen = [r for r in records if area in ("total", r["area"])]
        row = {"area": area, "probes": len(chosen)}
        row.update({k: sum(r["class"] == k for r in chosen) for k in CLASSES})
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    heads = ("area", "probes", "clean errors", "handled", "tracebacks", "hangs", "silent wrong", "data lost",
             "other")
    keys = ("area", "probes", *CLASSES)
    order = ("area", "probes", "clean_error", "handled", "traceback", "hang", "silent_wrong", "data_lost", "other")
    widths = [max(len(h), 14 if h == "area" else 0) for h in heads]
    print(" | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        assert set(keys) <= set(row)
        print(" | ".join(str(row[k]).ljust(w) for k, w in zip(order, widths, strict=True)))


def git_commit() -> dict:
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "tokq_dirty": bool(git("status", "--porcelain", "--", "tokq"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per command; past it: a hang")
    parser.add_argument("--only", nargs="+", default=None, help="run only the probes whose names contain these")
    parser.add_argument("--source", choices=("issue", "extra"), default=None,
                        help="run only the issue's cases or only the extra ones")
    parser.add_argument("--list", action="store_true", help="list the probes and exit")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/hostile-probe.json; with --only: none)")
    args = parser.parse_args()
    cases = [c for c in CASES if (not args.only or any(o in c.name for o in args.only))
             and args.source in (None, c.source)]
    if args.list:
        for c in CASES:
            print(f"{c.area:15s} {c.source:6s} {c.name:48s} {c.expect}")
        return
    load_start = os.getloadavg()
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="tokq-hostile-"))
    try:
        t0 = time.perf_counter()
        shared = build_shared(tmp / "shared", args.timeout)
        setup_seconds = time.perf_counter() - t0
        fixture_hash = {name: tree_hash(path) for name, path in
                        (("checkpoint", shared.ck), ("docs", shared.docs))}
        print(f"fixtures built in {setup_seconds:.0f} s; {len(cases)} probes", flush=True)
        records = []
        for i, c in enumerate(cases, 1):
            record = run_case(c, tmp / "probes" / f"{i:02d}", shared, args.timeout)
            records.append(record)
            codes = ",".join("T" if x is None else str(x) for x in record["exit_codes"])
            print(f"[{i:2d}/{len(cases)}] {c.name:46s} exit {codes:7s} {record['class']:12s} "
                  f"{record['seconds']:5.1f} s  {record['first_stderr_line'][:70]}", flush=True)
        fixtures_unchanged = all(tree_hash(path) == fixture_hash[name] for name, path in
                                 (("checkpoint", shared.ck), ("docs", shared.docs)))
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = table(records)
    print()
    print_table(rows)
    print()
    print(f"{'probe':48s} {'exit':8s} {'class':13s} first stderr line")
    for r in records:
        codes = ",".join("T" if x is None else str(x) for x in r["exit_codes"])
        print(f"{r['name']:48s} {codes:8s} {r['class']:13s} {r['first_stderr_line'][:100]}")
    off_target = [r for r in records if r["class"] not in ("clean_error", "handled")]
    if off_target:
        print("\nnot on target:")
        for r in off_target:
            print(f"  {r['name']} [{r['class']}]: {r['detail']}\n    " + "\n    ".join(r["commands"]))
    import torch

    from tokq import __version__

    report = {
        "benchmark": "hostile-probe", "tokq_version": __version__, **git_commit(),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "cpus": os.cpu_count(), "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "timeout_s": args.timeout, "setup_seconds": round(setup_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "shared_fixtures_unchanged": fixtures_unchanged,
        "classes": {
            "clean_error": "expected non-zero exit (2 bad input, 1 a broken model failing the check), one `error:` "
                           "line, the expected reason, nothing half written",
            "handled": "expected success (a skip with a warning, or correct content)",
            "traceback": "Traceback / internal error / exit 4 / signal / crash log",
            "hang": "ran past the timeout",
            "silent_wrong": "success where failure was due, or wrong content",
            "data_lost": "a user's file gone or changed, or tokq.toml unparseable",
            "other": "unclean error (not one line, or a leftover) or unexpected exit/reason",
        },
        "table": rows, "probes": records,
    }
    out = args.out or (None if args.only or args.source else RESULTS / "hostile-probe.json")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"\nwrote {out.resolve().relative_to(REPO) if out.resolve().is_relative_to(REPO) else out}")


if __name__ == "__main__":
    main()
