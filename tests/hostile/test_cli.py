"""Hostile command-line input and verdict edge cases: models whose logits are NaN or Inf, out-of-range --threads
and --seed, a --json target that cannot be written, Ctrl-C while a gate builds a variant, and tokq.toml tables of
the wrong type. Each ends in a clean verdict or a one-line error with its exit code, never a traceback."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.hostile.conftest import write_word_docs
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.cli import main


def run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def poison(path: Path, value: float) -> None:
    """Set every weight of one decoder layer's attention output projection to `value` (nan or inf), as a broken
    quantization or a bad checkpoint would: every token after it sees non-finite activations."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    name = next(k for k in tensors if k.endswith("layers.0.self_attn.o_proj.weight"))
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, value in (("good", None), ("nan", float("nan")), ("inf", float("inf"))):
        make_hf_checkpoint("llama", root / name, seed=0)
        save_word_tokenizer(root / name)
        if value is not None:
            poison(root / name, value)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_word_docs(tmp_path_factory.mktemp("docs"), (400, 300, 250))


COMPARE = ("--window", "128", "--threads", "1", "--dtype", "fp32", "--no-probes", "--decode-tokens", "16",
           "--resamples", "100", "--no-cache")


@pytest.mark.parametrize("broken", ["nan", "inf"])
@pytest.mark.parametrize("thresholds", [(), ("--max-kl", "0.1")], ids=["no-thresholds", "max-kl"])
def test_compare_with_a_non_finite_model_fails(capsys, models, docs, tmp_path, broken, thresholds):
    """Hostile: B's weights hold NaN/Inf, so its logits are non-finite; without thresholds compare said PASS,
    with --max-kl it crashed with a TypeError. A model that produces non-finite logits is a broken build: exit 1."""
    out = tmp_path / "cmp.json"
    code, text = run(capsys, "compare", models["good"], models[broken], "--data", docs, *COMPARE, *thresholds,
                     "--json", out)
    assert code == 1, text
    assert "non-finite" in text and "Traceback" not in text and "internal error" not in text
    result = json.loads(out.read_text())
    assert result["passed"] is False


def test_compare_with_a_non_finite_baseline_fails(capsys, models, docs, tmp_path):
    """Hostile: A (the baseline) produces NaN logits: every delta is NaN and no rule could be decided; the verdict
    must still block, naming model A."""
    code, text = run(capsys, "compare", models["nan"], models["good"], "--data", docs, *COMPARE)
    assert code == 1, text
    assert "model A" in text and "non-finite" in text and "Traceback" not in text


@pytest.mark.parametrize("broken", ["nan", "inf"])
def test_score_of_a_non_finite_model_fails(capsys, models, docs, tmp_path, broken):
    """Hostile: `tokq score` of a model whose NLL is NaN/inf printed a table of nan and exited 0."""
    out = tmp_path / "score.json"
    code, text = run(capsys, "score", models[broken], "--data", docs, "--window", "128", "--threads", "1",
                     "--dtype", "fp32", "--json", out)
    assert code == 2, text
    err = " ".join(text.split())
    assert "error:" in err and "non-finite" in err and "Traceback" not in err
    result = json.loads(out.read_text())  # the record is still written, saying what went wrong
    assert result["non_finite_tokens"] == result["scored_tokens"] > 0


def _nan_project(models: dict[str, Path], docs: Path, folder: Path, speed: bool) -> Path:
    path = folder / "tokq.toml"
    path.write_text(f'''[base]
model = "{models['good']}"
dtype = "fp32"

[variants]
broken = "{models['nan']}"

[data.docs]
path = "{docs}"
window = 128

[bench]
prompt_len = 12
gen_len = 4
concurrency = 2
max_seconds = 1

[gate.quality]
max_kl = 0.05
''' + ("\n[gate.speed]\nmax_memory_ratio = 1.5\n" if speed else ""))
    return path


@pytest.mark.parametrize("speed", [False, True], ids=["quality-only", "with-speed"])
def test_gate_with_a_nan_variant_fails(capsys, models, docs, tmp_path, speed):
    """Hostile: a gated variant whose logits are NaN must fail the gate (exit 1), not pass, be inconclusive,
    or crash the speed experiment."""
    out = tmp_path / "report"
    code = main(["gate", "--config", str(_nan_project(models, docs, tmp_path, speed)), "--out", str(out),
                 "--threads", "1"])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert code == 1, text
    report = json.loads((out / "report.json").read_text())
    rules = report["variants"]["broken"]["rules"]
    assert report["result"] == "fail" and any(r["result"] == "fail" and "non-finite" in r["rule"] for r in rules)


# --threads and --seed: validated before torch sees them.

@pytest.fixture()
def thread_calls(monkeypatch) -> list[int]:
    """torch.set_num_threads, recorded instead of called: 100000 threads would take the test process down."""
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    return calls


COMMANDS = {
    "score": lambda tmp: ["score", tmp / "missing", "--data", tmp],
    "quantize": lambda tmp: ["quantize", "--method", "rtn", "--model", tmp / "missing", "--out", tmp / "q"],
    "gate": lambda tmp: ["gate", "--config", tmp / "missing.toml", "--out", tmp / "report"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("threads", ["100000", "0", "-4"])
def test_threads_out_of_range_is_refused(capsys, tmp_path, thread_calls, command, threads):
    """Hostile: `--threads 100000` segfaulted in torch.set_num_threads; 0 and negative counts make no sense."""
    code, text = run(capsys, *COMMANDS[command](tmp_path), "--threads", threads)
    assert code == 2 and f"--threads {threads}" in text and "Traceback" not in text, text
    assert thread_calls == []


def test_threads_within_range_reach_torch(capsys, tmp_path, thread_calls):
    """The bound is generous: as many threads as 4x the CPUs are passed on to torch."""
    most = 4 * (os.cpu_count() or 1)
    code, text = run(capsys, *COMMANDS["score"](tmp_path), "--threads", most)
    assert code == 2 and "--threads" not in text and thread_calls == [most]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("seed", [str(2**66), str(2**63), "-1"])
def test_seed_out_of_range_is_refused(capsys, tmp_path, command, seed):
    """Hostile: `--seed 2**66` was an internal error (torch.manual_seed overflow, exit 4); `--seed -1` passed
    torch and failed later in numpy's default_rng, minutes into a gate."""
    code, text = run(capsys, *COMMANDS[command](tmp_path), "--seed", seed)
    assert code == 2 and f"--seed {seed}" in text and "internal error" not in text, text


def test_largest_seed_is_accepted(capsys, tmp_path):
    """2**63 - 1, the largest seed every generator tokq uses takes, is not refused."""
    code, text = run(capsys, *COMMANDS["score"](tmp_path), "--seed", str(2**63 - 1))
    assert code == 2 and "--seed" not in text and "does not exist" in text, text


# --json PATH: a target that cannot be written is refused before any work, by every command that has --json.

JSON_COMMANDS = {
    "score": lambda tmp: ["score", tmp / "missing", "--data", tmp],
    "compare": lambda tmp: ["compare", tmp / "missing", tmp / "missing2", "--data", tmp],
    "bench": lambda tmp: ["bench", tmp / "missing"],
    "quantize": lambda tmp: ["quantize", "--method", "rtn", "--model", tmp / "missing", "--out", tmp / "q"],
    "kernels list": lambda tmp: ["kernels", "list", tmp / "missing"],
    "kv-calc": lambda tmp: ["kv-calc", tmp / "missing", "--context", "64"],
    "models list": lambda tmp: ["models", "list"],
    "models pull": lambda tmp: ["models", "pull", "no-such-model"],
    "data inspect": lambda tmp: ["data", "inspect", tmp / "missing"],
    "data build-default": lambda tmp: ["data", "build-default", "--out", tmp],  # exists, not a set: refused
}


def _json_target(tmp_path: Path, kind: str) -> Path:
    if kind == "folder":
        (tmp_path / "out").mkdir()
        return tmp_path / "out"
    (tmp_path / "file.txt").write_text("x")
    return tmp_path / "file.txt" / "result.json"  # a folder that cannot be created: a file is in the way


@pytest.mark.parametrize("kind", ["folder", "under-a-file"])
@pytest.mark.parametrize("command", sorted(JSON_COMMANDS))
def test_json_target_that_cannot_be_written_is_refused_first(capsys, tmp_path, command, kind):
    """Hostile: `--json DIR` (or a path under a file) was only found out after the work, as an internal error
    (IsADirectoryError, exit 4) or hidden behind another error; now it is the first check, exit 2."""
    target = _json_target(tmp_path, kind)
    code, text = run(capsys, *JSON_COMMANDS[command](tmp_path), "--json", target)
    text = " ".join(text.split())
    assert code == 2 and f"--json {target}" in text and "internal error" not in text, text


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes into read-only folders")
def test_json_into_a_read_only_folder_is_refused(capsys, tmp_path):
    """Hostile: --json into a folder the user cannot write."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        code, text = run(capsys, "models", "list", "--json", folder / "x.json")
    finally:
        folder.chmod(0o700)
    assert code == 2 and "--json" in text and "cannot be written" in " ".join(text.split())


def test_json_where_no_file_can_be_created_is_refused(capsys, tmp_path, monkeypatch):
    """Hostile: --json into a folder where no file can be created (a read-only mount; root bypasses chmod, so
    the failure is simulated): refused before the work with the OS's reason."""
    import tempfile

    def refuse(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    code, text = run(capsys, "score", tmp_path / "missing", "--data", tmp_path, "--json", tmp_path / "x.json")
    text = " ".join(text.split())
    assert code == 2 and "--json" in text and "cannot be written (Read-only file system)" in text, text


def test_json_into_a_new_folder_is_created_at_the_end(capsys, tmp_path):
    """A --json path in folders that do not exist yet is fine: they are created when the JSON is written."""
    target = tmp_path / "a" / "b" / "models.json"
    code, _ = run(capsys, "models", "list", "--json", target)
    assert code == 0 and "models" in json.loads(target.read_text())


def test_json_check_creates_nothing(capsys, tmp_path):
    """The early check leaves no folder (or probe file) behind when the command then fails."""
    target = tmp_path / "a" / "b" / "score.json"
    code, _ = run(capsys, "score", tmp_path / "missing", "--data", tmp_path, "--json", target)
    assert code == 2 and not (tmp_path / "a").exists() and sorted(p.name for p in tmp_path.iterdir()) == []


# Ctrl-C while the gate builds a variant from its recipe.

def _recipe_project(models: dict[str, Path], docs: Path, folder: Path) -> Path:
    path = folder / "tokq.toml"
    path.write_text(f'''[base]
model = "{models['good']}"
dtype = "fp32"

[variants]
rtn = {{ path = "built/rtn", recipe = {{ method = "rtn", group_size = 32 }} }}

[data.docs]
path = "{docs}"
window = 128

[gate.quality]
max_kl = 10.0
''')
    return path


# the recipe build walks the model streamed (quantization/streamed.py): reading a block, quantizing, assembling
@pytest.mark.parametrize("where", ["tokq.quantization.streamed._materialize_block",
                                   "tokq.quantization.pipeline.quantize_model",
                                   "tokq.quantization.streamed._write_assembled"])
def test_ctrl_c_while_building_a_recipe_is_an_interrupt(capsys, models, docs, tmp_path, monkeypatch, where):
    """Hostile: Ctrl-C while the gate runs `tokq quantize` for a recipe must exit 130 ("aborted"), not 2 with
    "fix the recipe"; and nothing half-built is left."""
    import importlib

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: Python raises KeyboardInterrupt at the next bytecode
        time.sleep(5)
        raise AssertionError("SIGINT was not delivered")

    module, _, name = where.rpartition(".")
    monkeypatch.setattr(importlib.import_module(module), name, interrupted)
    # Python's own Ctrl-C handler, as in a terminal: a test run started in the background (nohup, `&` in a script)
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(["gate", "--config", str(_recipe_project(models, docs, tmp_path)), "--out", str(tmp_path / "r"),
                     "--threads", "1"])
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert code == 130 and "aborted" in err and "fix the recipe" not in err and "error:" not in err, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "built" / "rtn").exists()


# tokq.toml tables and values of the wrong type: a file:line ConfigError, exit 2, never a traceback.

BASE = '[base]\nmodel = "m"\n'
RULE = '[gate.quality]\nmax_kl = 0.05\n'
WRONG_TYPES = {
    "variants = 5": ("variants = 5\n" + BASE + RULE, 1, "variants must be a table"),
    "variants = []": ("variants = [\"a\"]\n" + BASE + RULE, 1, "variants must be a table"),
    "data = 5": ("data = 5\n" + BASE + RULE, 1, "data must be a table"),
    "base = 'x'": ("base = \"x\"\n" + RULE, 1, "base must be a table"),
    "bench = []": ("bench = []\n" + BASE + RULE, 1, "bench must be a table"),
    "gate = 'x'": ("gate = \"x\"\n" + BASE, 1, "gate must be a table"),
    "compare = 5": ("compare = 5\n" + BASE + RULE, 1, "compare must be a table"),
    "[gate] quality = 5": (BASE + "[gate]\nquality = 5\n", 4, "[gate] quality must be a table"),
    "[gate] speed = []": (BASE + RULE + "[gate]\nspeed = []\n", 6, "[gate] speed must be a table"),
    "[compare] thresholds = 5": (BASE + RULE + "[compare]\nthresholds = 5\n", 6, "[compare] thresholds must be a table"),
    "model = 5": ("[base]\nmodel = 5\n" + RULE, 2, "[base] model = 5 must be a non-empty string"),
    "dtype = []": (BASE + "dtype = []\n" + RULE, 3, "[base] dtype = [] must be a non-empty string"),
    "variant = 5": (BASE + "[variants]\na = 5\n" + RULE, 4, "[variants] a must be a path string or a table"),
    "variant path = 5": (BASE + "[variants]\na = { path = 5 }\n" + RULE, 4, "a = 5 must be a non-empty string"),
    "recipe = []": (BASE + "[variants]\na = { recipe = [1] }\n" + RULE, 4, "recipe must be a table"),
    "recipe method = []": (BASE + "[variants]\na = { recipe = { method = [\"rtn\"] } }\n" + RULE, 4,
                           "recipe method = ['rtn'] must be a string"),
    "recipe group_size = {}": (BASE + "[variants]\na = { recipe = { method = \"rtn\", group_size = { x = 1 } } }\n"
                               + RULE, 4, "recipe group_size = {'x': 1} must be an integer"),
    "recipe calib = 5": (BASE + "[variants]\na = { recipe = { method = \"awq\", calib = 5 } }\n" + RULE, 4,
                         "recipe calib = 5 must be a folder path"),
    "data.x = 5": (BASE + "[data]\nx = 5\n" + RULE, 4, "[data] x must be a table"),
    "data path = 5": (BASE + "[data.x]\npath = 5\n" + RULE, 4, "[data.x] path = 5 must be a non-empty string"),
    "data window = 'big'": (BASE + "[data.x]\npath = \"d\"\nwindow = \"big\"\n" + RULE, 5, "must be an integer"),
    "data window = 1.5": (BASE + "[data.x]\npath = \"d\"\nwindow = 1.5\n" + RULE, 5, "must be an integer"),
    "bench value = {}": (BASE + "[bench]\nprompt_len = { a = 1 }\n" + RULE, 4, "must be an integer"),
    "bench max_seconds = inf": (BASE + "[bench]\nmax_seconds = inf\n" + RULE, 4, "must be a finite number"),
    "bench max_seconds = nan": (BASE + "[bench]\nmax_seconds = nan\n" + RULE, 4, "must be a finite number"),
    "bench gen_len_range = nan": (BASE + "[bench]\ngen_len_range = nan\n" + RULE, 4, "must be a finite number"),
    "bench arrival_rate = nan": (BASE + "[bench]\narrival_rate = nan\n" + RULE, 4, "must be a finite number"),
    "rule = 'low'": (BASE + "[gate.quality]\nmax_kl = \"low\"\n", 4, "max_kl = 'low' must be a number"),
    "rule = [0.1]": (BASE + "[gate.quality]\nmax_kl = [0.1]\n", 4, "must be a number"),
    "rule = true": (BASE + "[gate.quality]\nmax_kl = true\n", 4, "must be a number"),
    "rule = date": (BASE + "[gate.quality]\nmax_kl = 1979-05-27\n", 4, "must be a number"),
    "speed rule = {}": (BASE + "[gate.speed]\nmin_tpot_speedup = { overall = 1.2 }\n", 4, "must be a number"),
    "bucket rule = 'x'": (BASE + "[gate.quality]\nmax_kl = { overall = \"x\" }\n", 4, "must be a number"),
    "ci = 5": (BASE + "[gate.quality]\nci = 5\nmax_kl = 0.1\n", 4, "ci = 5 must be"),
    "compare threshold = 'x'": (BASE + RULE + "[compare.thresholds]\nmax_kl = \"x\"\n", 6, "must be a number"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_typed_tokq_toml_is_a_config_error(capsys, tmp_path, case):
    """Hostile: a table or value of the wrong type in tokq.toml (`variants = 5`, a rule that is a string, ...)."""
    text, line, message = WRONG_TYPES[case]
    path = tmp_path / "tokq.toml"
    path.write_text(text)
    code, out = run(capsys, "gate", "--config", path, "--out", tmp_path / "report")
    out = " ".join(out.split())
    assert code == 2 and f"{path}:{line}: " in out and message in out and "Traceback" not in out, out


@pytest.mark.parametrize("text,args", [
    ("variants = 5\n", ["score", "somevariant"]),
    ("variants = 5\n", ["kv-calc", "somevariant", "--context", "64"]),
    ("variants = [\"a\"]\n", ["score", "a"]),
    ("[variants]\na = 5\n", ["score", "a"]),
    ("compare = 5\n", ["compare", "a", "b"]),
    ("[compare]\nthresholds = 5\n", ["compare", "a", "b"]),
    ("[compare.thresholds]\nmax_kl = [1]\n", ["compare", "a", "b"]),
], ids=["score-variants-5", "kv-calc-variants-5", "score-variants-list", "score-variant-5", "compare-5",
        "compare-thresholds-5", "compare-threshold-list"])
def test_commands_reading_tokq_toml_refuse_wrong_types(capsys, tmp_path, monkeypatch, text, args):
    """Hostile: score / compare / kv-calc look variants and [compare.thresholds] up in tokq.toml themselves;
    `variants = 5` there was a TypeError (exit 4) instead of a file:line error."""
    path = tmp_path / "tokq.toml"
    path.write_text(text)
    monkeypatch.setenv("TOKQ_CONFIG", str(path))
    code, out = run(capsys, *args)
    out = " ".join(out.split())
    assert code == 2 and f"{path}:" in out and "internal error" not in out, out


def test_quantize_name_into_a_wrong_typed_variants_table_is_refused(capsys, tmp_path, monkeypatch, models):
    """Hostile: `tokq quantize --name x` with `variants = 5` in tokq.toml appended a second [variants] table,
    leaving a file that no longer parses; now it is refused before quantizing, and the file is untouched."""
    path = tmp_path / "tokq.toml"
    path.write_text("variants = 5\n")
    monkeypatch.setenv("TOKQ_CONFIG", str(path))
    code, out = run(capsys, "quantize", "--method", "rtn", "--model", models["good"], "--out", tmp_path / "q",
                    "--name", "x", "--threads", "1")
    assert code == 2 and f"{path}:1" in " ".join(out.split()) and path.read_text() == "variants = 5\n", out
    assert not (tmp_path / "q").exists()
