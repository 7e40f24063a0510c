"""`tokq gate`: compare and bench each variant against the base as tokq.toml says; one verdict; exit 0/1/2.

For each variant (all of [variants], or --variant NAME): build it with `tokq quantize` when its checkpoint
is missing and it has a recipe; `tokq compare` it with the base on the data set (quality rules from
[gate.quality], baseline cache reused); bench base and variant on the [bench] workload (speed rules from
[gate.speed]). The verdict table lists every rule with its measured value (and CI), threshold and result;
reports go to --out (report.json, report.md, report.html, junit.xml, written atomically), and the
Markdown is appended to $GITHUB_STEP_SUMMARY when set. Deterministic: seeded windows, bootstrap and
probes give the same quality verdict on every rerun; speed is re-measured (ratios of one run).
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq import __version__
from tokq.errors import EXIT_CHECK_FAILED

console = Console(stderr=True)


def gate_cmd(
    config: Path = typer.Option(None, "--config", help="tokq.toml (default: $TOKQ_CONFIG or the nearest tokq.toml)."),
    variant: list[str] = typer.Option(None, "--variant", help="Gate only these variants (default: all in tokq.toml)."),
    data_set: str = typer.Option(None, "--data", help="Which [data.NAME] set (default: the first)."),
    out: Path = typer.Option(Path("tokq_gate"), "--out", help="Report folder (replaced atomically)."),
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
        raise ConfigError(f"{path}: [variants] is empty: add the checkpoints (or recipes) to gate")
    if not project.data:
        raise ConfigError(f"{path}: add a [data.NAME] table with path = \"<your documents>\"")
    data = project.data[data_set] if data_set else next(iter(project.data.values()))
    if data_set and data_set not in project.data:
        raise ConfigError(f"{path}: --data {data_set} is not a [data.NAME] table (known: {', '.join(project.data)})")
    if not data.path.is_dir():
        raise ConfigError(f"{path}: [data.{data.name}] path {data.path} is not a folder: point it at your documents")
    checkpoints = {name: _checkpoint(project, name, threads) for name in names}

    report = {"tokq_version": __version__, "command": "gate", "config": str(path), "base": project.base,
              "data": data.name, "runtime": runtime.to_json(), "variants": {}}
    for name in names:
        report["variants"][name] = _gate_variant(project, name, checkpoints[name], data, runtime, seed, no_speed)
    report["passed"] = all(v["passed"] for v in report["variants"].values())
    _print_verdict(report)
    from tokq.reports.gate_report import write_gate_report

    console.print(f"report: {write_gate_report(out, report)}")
    if not report["passed"]:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _checkpoint(project, name: str, threads: int | None) -> Path:
    """The variant's checkpoint, built from its recipe with `tokq quantize` when missing."""
    from tokq.cli import main
    from tokq.errors import ConfigError

    v = project.variants[name]
    target = v.path or project.path.parent / "tokq_out" / name
    if target.is_dir():
        return target
    if v.recipe is None:
        raise ConfigError(f"{project.path}: variant {name!r} points at {target}, which does not exist, and has no "
                          "recipe to build it: quantize it first or add recipe = { method = ... }")
    args = ["quantize", "--model", project.base, "--out", str(target)]
    for key, value in v.recipe.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    if threads:
        args += ["--threads", str(threads)]
    console.print(f"building variant {name}: tokq {' '.join(args)}")
    if main(args) != 0:
        raise ConfigError(f"{project.path}: variant {name!r}'s recipe failed (see above): fix the recipe")
    return target


def _gate_variant(project, name: str, checkpoint: Path, data, runtime, seed: int, no_speed: bool) -> dict:
    from tokq.commands.compare import compare_pair
    from tokq.evalsuite.gate_rules import quality_thresholds, speed_verdicts

    quality = compare_pair(project.base, str(checkpoint), runtime, data=data.path, window=data.window,
                           stride=data.stride, max_tokens=data.max_tokens, sample_windows=data.sample_windows,
                           thresholds=quality_thresholds(project.quality), dtype=project.dtype, seed=seed)
    quality["b"]["name"] = name
    rules = [{"kind": "quality", **t} for t in quality["thresholds"]]
    speed_rows = None
    if project.speed and not no_speed:
        speed_rows = _bench(project, checkpoint, runtime, seed)
        rules += speed_verdicts(project.speed, speed_rows[0], speed_rows[1])
    return {"checkpoint": str(checkpoint), "compare": quality, "bench": speed_rows, "rules": rules,
            "passed": all(r["passed"] for r in rules)}


def _bench(project, checkpoint: Path, runtime, seed: int) -> list[dict]:
    from tokq.engine.checkpoint import load_model
    from tokq.engine.roofline import copy_bandwidth
    from tokq.engine.workload import Workload, bench_model
    from tokq.zoo import resolve_model

    w = project.bench
    workload = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range,
                        w.arrival_rate or float("inf"), seed)
    compute = project.dtype if project.dtype != "auto" else ("fp16" if runtime.device.startswith("cuda") else "bf16")
    bandwidth = copy_bandwidth(runtime.device)["gbps_median"]
    rows = []
    for label, source in (("base", resolve_model(project.base)), ("variant", checkpoint)):
        model = load_model(source, dtype=compute, device=runtime.device)
        prompts = workload.prompts(model.config.vocab_size)
        rows += bench_model(label, model, workload, ["continuous"], dict(max_num_seqs=w.concurrency), bandwidth,
                            prompts)
        del model
    return rows


def _print_verdict(report: dict) -> None:
    table = Table(title=f"tokq gate: {'PASS' if report['passed'] else 'FAIL'}")
    for col in ("variant", "rule", "bucket", "measured [95% CI]", "threshold", "result"):
        table.add_column(col)
    for name, v in report["variants"].items():
        for r in v["rules"]:
            value = "-" if r.get("value") is None else f"{r['value']:.4g}"
            if r.get("low") is not None:
                value += f" [{r['low']:.4g}, {r['high']:.4g}]"
            result = "[green]pass[/]" if r["passed"] else "[bold red]FAIL[/]"
            table.add_row(name, r["name"], r.get("bucket") or "overall", value, str(r["threshold"]), result)
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    out.print(table)
