"""Every `tokq` command that README.md and docs/*.md show is run, in the order each page shows them, in one folder
per page: the zoo's models become tiny random checkpoints of the same architectures, `mydocs/` a folder of a few
word documents, and long windows and calibration sets small, so that a page's whole sequence runs in seconds.

A command is only left out with its reason in NOT_RUN (and the test of it named there); each one run must end with
an exit code that means it ran to an answer (RAN), not merely parse (tests/test_docs.py parses them all)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from tests.test_docs import ROOT, code_block_commands
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main

PAGES = [page for page in ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
         if code_block_commands(ROOT / page)]
# (page, first words of the command) -> why it is not run here, and where it is
NOT_RUN = {
    ("docs/documents.md", "models pull"): "copies a real model out of the zoo's packages: tests/test_zoo.py",
    ("docs/documents.md", "data build-default"): "reads the Debian doc packages: tests/test_default_set.py",
    ("docs/serving.md", "bench --base-url"): "needs a running server: tests/test_bench_serve.py starts tokq serve",
}
# Exit codes that mean "ran to an answer": a tiny random model may well fail a rule (1) or leave it undecided (3).
RAN = {"gate": (0, 1, 3), "compare": (0, 1, 3), "quantize": (0, 1)}
ZOO = ("smollm2-135m", "gemma3-270m")


def not_run(page: str, argv: list[str]) -> str | None:
    words = " ".join(argv[1:])
    return next((why for (p, start), why in NOT_RUN.items() if p == page and words.startswith(start)), None)


def smaller(argv: list[str], models: dict[str, str]) -> list[str]:
    """The command with zoo names made tiny checkpoints, windows 128 tokens and calibration 4 x 64 tokens."""
    out = [models.get(a, a) for a in argv[1:]]
    for i, a in enumerate(out[:-1]):
        if a == "--window":
            out[i + 1] = "128"
        if a == "--group-size":
            out[i + 1] = "32"  # the tiny models' K is 64 or 96
        if a == "--max-size-ratio":
            out[i + 1] = "0.8"  # a tiny model's embeddings are most of it: no mix goes below 0.65
    command = out[0]
    if command == "quantize":
        out += ["--num-samples", "4", "--seq-len", "64"]
        if "--calib" not in out and out[out.index("--method") + 1] not in ("rtn", "fp8"):
            out += ["--calib", "mydocs/"]  # not the default set (built from the Debian doc packages)
    if command in ("compare", "score", "sensitivity") and "--window" not in out:
        out += ["--window", "128"]
    if command == "sensitivity":
        out += ["--windows", "2"]
    return out


def tiny_starter(toml: Path, base: str) -> None:
    """`tokq init`'s starter made tiny: the tiny base, mydocs/ for the default set, 128-token windows, a small
    calibration, few probes, no speed rules (the speed experiment is tests/test_gate.py's)."""
    text = toml.read_text().replace('model = "smollm2-135m"', f'model = "{base}"')
    text = text.replace('builtin = "default"', 'path = "mydocs"').replace("window = 2048", "window = 128")
    text = re.sub(r"\[gate.speed\].*", "", text, flags=re.S)
    text = text.replace("group_size = 64 }", 'group_size = 32, calib = "mydocs", num_samples = 4, seq_len = 64 }')
    toml.write_text(text.replace("sample_windows = 16", "sample_windows = 3").replace("probe_repeats = 2", "probe_repeats = 4"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("zoo")
    out = {}
    for name, case in zip(ZOO, ("llama", "gemma3"), strict=True):
        make_hf_checkpoint(case, root / name, seed=0)
        save_word_tokenizer(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("page", PAGES)
def test_every_command_of_the_page_runs(page, models, tmp_path, monkeypatch):
    commands = code_block_commands(ROOT / page)
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOKQ_COMPILE", "0")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mydocs").mkdir()
    rng = random.Random(0)
    for i, n in enumerate((400, 300, 250, 350)):
        (tmp_path / "mydocs" / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    # `tokq compare fp16 int4` (docs/compare.md) names a tokq.toml variant: a project that defines one
    (tmp_path / "tokq.toml").write_text(f'[base]\nmodel = "{models["smollm2-135m"]}"\n\n[variants]\n'
                                        'int4 = { path = "int4" }\n\n'
                                        '[data.docs]\npath = "mydocs"\nwindow = 128\nsample_windows = 3\n\n'
                                        '[gate.quality]\nmax_kl = 10.0\n')
    assert main(["quantize", "--method", "rtn", "--model", models["smollm2-135m"], "--group-size", "32",
                 "--out", "int4"]) == 0
    ran = []
    for argv in commands:
        why = not_run(page, argv)
        if why:
            print(f"not run: {' '.join(argv)} ({why})")
            continue
        args = smaller(argv, models)
        if args[0] == "init":
            (tmp_path / "tokq.toml").unlink()
        code = main(args)
        if args[0] == "init":
            tiny_starter(tmp_path / "tokq.toml", models["smollm2-135m"])
        assert code in RAN.get(args[0], (0,)), (page, args, code)
        ran.append(args[0])
    assert ran, f"{page}: every command was left out"
    if page == "README.md":  # the front page shows the three uses and the CI set-up
        assert {"quantize", "compare", "init", "gate"} <= set(ran), ran
