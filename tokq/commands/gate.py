"""`tokq gate`: compare and bench each variant against the base as tokq.toml says; one verdict; exit 0/1/2.

For each variant (all of [variants], or --variant NAME): build it with `tokq quantize` when its checkpoint
is missing and it has a recipe; `tokq compare` it with the base on the data set (quality rules from
[gate.quality], baseline cache reused); bench base and variant on the [bench] workload, alternating for
[bench] rounds (speed rules from [gate.speed], see evalsuite.gate_rules). The verdict table lists every
rule with its measured value (CI or range over rounds), threshold and result; reports go to --out
(report.json, report.md, report.html, junit.xml, written atomically; a previous report there is removed
when the gate starts, so an interrupted gate leaves none that looks complete), and the Markdown is
appended to $GITHUB_STEP_SUMMARY when set. Deterministic: seeded windows, bootstrap and probes give the
same quality numbers on every rerun; speed is re-measured, and its verdict flips only when the median
ratio sits at the threshold.
"""

from __future__ import annotations

import hashlib
import shutil
import signal
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokq import __version__
from tokq.errors import EXIT_CHECK_FAILED

console = Console(stderr=True)
RESULT_STYLE = {"pass": "[green]pass[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]FAIL[/]"}


def gate_cmd(
    config: Path = typer.Option(None, "--config", help="tokq.toml (default: $TOKQ_CONFIG or the nearest tokq.toml)."),
    variant: list[str] = typer.Option(None, "--variant", help="Gate only these variants (default: all in tokq.toml)."),
    data_set: str = typer.Option(None, "--data", help="Which [data.NAME] set (default: the first)."),
    out: Path = typer.Option(Path("tokq_gate"), "--out", help="Report folder (replaced when the gate starts)."),
    no_speed: bool = typer.Option(False, "--no-speed", help="Skip the bench and the speed rules."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of windows, bootstrap, probes and bench prompts."),
) -> None:
    """Gate the variants of tokq.toml on quality and speed against the base; exit 1 when a rule fails."""
    from tokq.config import load_project
    from tokq.errors import ConfigError
    from tokq.project import find_config
    from tokq.runtime import setup_runtime

    runtime = setup_runtime(threads, device, seed)
    path = config or find_config()
    if path is None:
        raise ConfigError("no tokq.toml here or above: run `tokq init`, or pass --config PATH")
    project = load_project(Path(path))
    names = list(variant or project.variants)
    for name in names:
        if name not in project.variants:
            raise ConfigError(f"{path}: variant {name!r} is not in [variants] (known: "
                              f"{', '.join(project.variants) or 'none'})")
    if not names:
        raise project.error("variants", None, "is empty: add the checkpoints (or recipes) to gate")
    if not project.data:
        raise ConfigError(f"{path}: add a [data.NAME] table with path = \"<your documents>\"")
    if data_set and data_set not in project.data:
        raise ConfigError(f"{path}: --data {data_set} is not a [data.NAME] table (known: {', '.join(project.data)})")
    data = project.data[data_set] if data_set else next(iter(project.data.values()))
    if not data.path.is_dir():
        raise project.error(f"data.{data.name}", "path", f"= {data.path} is not a folder: point it at your documents")
    base = _base_checkpoint(project)
    for name in names:
        _check_variant(project, name)
    from tokq.reports.folder import check_report_folder

    check_report_folder(out)

    # From here on the run may take minutes: a stale report must not pass for this run's verdict, and a
    # CI cancel (SIGTERM) must unwind like Ctrl-C so no half-written folder is left.
    if out.exists():
        shutil.rmtree(out)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        checkpoints = {name: _checkpoint(project, name, threads) for name in names}
        report = {"tokq_version": __version__, "command": "gate", "config": str(path),
                  "config_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "base": project.base,
                  "base_checkpoint": str(base), "data": data.name, "runtime": runtime.to_json(),
                  "versions": _versions(), "variants": {}}
        for name in names:
            report["variants"][name] = _gate_variant(project, name, checkpoints[name], base, data, runtime, seed,
                                                     no_speed)
        report["passed"] = all(v["passed"] for v in report["variants"].values())
        _print_verdict(report)
        from tokq.reports.gate_report import write_gate_report

        console.print(f"report: {write_gate_report(out, report)}", highlight=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not report["passed"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("tokq", "torch", "triton", "transformers", "safetensors", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _base_checkpoint(project) -> Path:
    """[base] model resolved up front: a missing base is a config error naming its line, before any work."""
    from tokq.errors import ModelError
    from tokq.zoo import resolve_model

    try:
        return resolve_model(project.base)
    except ModelError as exc:
        raise project.error("base", "model", f"= {project.base!r}: {exc}") from None


def _variant_target(project, name: str) -> Path:
    v = project.variants[name]
    return v.path or project.path.parent / "tokq_out" / name


def _check_variant(project, name: str) -> None:
    target = _variant_target(project, name)
    if not target.is_dir() and project.variants[name].recipe is None:
        raise project.error("variants", name, f"points at {target}, which does not exist, and has no recipe to "
                                              "build it: quantize it first or add recipe = { method = ... }")


def _checkpoint(project, name: str, threads: int | None) -> Path:
    """The variant's checkpoint, built from its recipe with `tokq quantize` when missing."""
    from tokq.cli import main

    target = _variant_target(project, name)
    if target.is_dir():
        return target
    args = ["quantize", "--model", project.base, "--out", str(target)]
    for key, value in project.variants[name].recipe.items():
        if key == "calib":  # a folder, relative to tokq.toml like every path in it
            value = Path(value).expanduser()
            value = value if value.is_absolute() else project.path.parent / value
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    if threads:
        args += ["--threads", str(threads)]
    console.print(escape(f"building variant {name}: tokq {' '.join(args)}"), highlight=False)
    if main(args) != 0:
        raise project.error("variants", name, "has a recipe that failed (see above): fix the recipe")
    return target


def _gate_variant(project, name: str, checkpoint: Path, base: Path, data, runtime, seed: int,
                  no_speed: bool) -> dict:
    from tokq.commands.compare import compare_pair
    from tokq.evalsuite.gate_rules import quality_thresholds, speed_verdicts

    console.print(f"[bold]gate {escape(name)}[/]: quality on {escape(f'[data.{data.name}]')}", highlight=False)
    quality = compare_pair(str(base), str(checkpoint), runtime, data=data.path, window=data.window,
                           stride=data.stride, max_tokens=data.max_tokens, sample_windows=data.sample_windows,
                           probe_max_context=data.probe_max_context,
                           thresholds=quality_thresholds(project.quality), threshold_on=project.quality_on,
                           dtype=project.dtype, seed=seed)
    quality["b"]["name"] = name
    rules = [{"kind": "quality", **t, "result": "pass" if t["passed"] else "fail"} for t in quality["thresholds"]]
    bench = None
    if project.speed and not no_speed:
        console.print(f"[bold]gate {escape(name)}[/]: speed on the {escape('[bench]')} workload, "
                      f"{project.bench.rounds} rounds", highlight=False)
        bench = _bench(project, name, checkpoint, base, runtime, seed)
        rules += speed_verdicts(project.speed, bench["base"], bench["variant"])
    return {"checkpoint": str(checkpoint), "compare": quality, "bench": bench, "rules": rules,
            "passed": all(r["passed"] for r in rules)}


def _bench(project, name: str, checkpoint: Path, base: Path, runtime, seed: int) -> dict:
    """Base and variant alternate for [bench] rounds on one workload; each round's row per side."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tokq.engine.checkpoint import load_model
    from tokq.engine.roofline import copy_bandwidth
    from tokq.engine.workload import Workload, bench_model

    w = project.bench
    workload = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range,
                        w.arrival_rate or float("inf"), seed)
    compute = project.dtype if project.dtype != "auto" else ("fp16" if runtime.device.startswith("cuda") else "bf16")
    bandwidth = copy_bandwidth(runtime.device)["gbps_median"]
    models = {"base": load_model(base, dtype=compute, device=runtime.device),
              "variant": load_model(checkpoint, dtype=compute, device=runtime.device)}
    prompts = workload.prompts(models["base"].config.vocab_size)
    rounds: dict[str, list[dict]] = {"base": [], "variant": []}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        for _ in range(w.rounds):
            for label, model in models.items():
                row = bench_model(label, model, workload, ["continuous"], dict(max_num_seqs=w.concurrency),
                                  bandwidth, prompts, progress)[0]
                rounds[label].append(row)
    return {"workload": workload.to_json(), "rounds": w.rounds, "copy_bandwidth_gbps": bandwidth, **rounds}


def _print_verdict(report: dict) -> None:
    table = Table(title=f"tokq gate: {'PASS' if report['passed'] else 'FAIL'}")
    for col in ("variant", "rule", "bucket", "measured [95% CI | range]", "threshold", "result"):
        table.add_column(col)
    for name, v in report["variants"].items():
        for r in v["rules"]:
            value = "-" if r.get("value") is None else f"{r['value']:.4g}"
            if r.get("low") is not None:
                value += f" [{r['low']:.4g}, {r['high']:.4g}]"
            table.add_row(name, r["name"], r.get("bucket") or "overall", value, str(r["threshold"]),
                          RESULT_STYLE[r["result"]])
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    out.print(table)
    for name, v in report["variants"].items():
        for r in v["rules"]:
            if r["result"] != "pass":
                out.print(f"{name}: {r['result'].upper()} {r['rule']}", highlight=False, markup=False)
