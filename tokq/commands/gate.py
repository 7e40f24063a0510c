"""`tokq gate`: compare and bench each variant against the base as tokq.toml says; one verdict; exit 0/1/2/3/4.

For each variant (all of [variants], or --variant NAME): build it with `tokq quantize` when its checkpoint
is missing and it has a recipe; `tokq compare` it with the base on the data set (quality rules from
[gate.quality], baseline cache reused); then one paired speed experiment on the [bench] workload: base and
variant interleaved by blocks of steps in one process for [bench] max_seconds (engine.paired_bench), ratios
with bootstrap intervals (evalsuite.speed_stats), speed rules from [gate.speed] (evalsuite.gate_rules). The
verdict table lists failing rules first, then inconclusive ones, each with its measured value, 95% interval
and threshold; reports go to --out (report.json, report.md, report.html, junit.xml, written atomically; a
previous report tokq wrote there is removed when the gate starts, so an interrupted gate leaves none that
looks complete; a folder holding anything else is refused), and the Markdown is appended to
$GITHUB_STEP_SUMMARY when set. Quality numbers are seeded and identical on every rerun; speed is re-measured,
and a rule the run cannot decide is "inconclusive" (exit 3), never a pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import signal
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokq import __version__
from tokq.errors import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE

console = Console(stderr=True)
RESULT_STYLE = {"pass": "[green]pass[/]", "inconclusive": "[yellow]inconclusive[/]", "fail": "[bold red]FAIL[/]"}


def gate_cmd(
    config: Path = typer.Option(None, "--config", help="tokq.toml (default: $TOKQ_CONFIG or the nearest tokq.toml)."),
    variant: list[str] = typer.Option(None, "--variant", help="Gate only these variants (default: all in tokq.toml)."),
    data_set: str = typer.Option(None, "--data", help="Which \\[data.NAME] set (default: the first)."),
    out: Path = typer.Option(Path("tokq_gate"), "--out", help="Report folder (a report tokq wrote there is removed when the gate starts)."),
    no_speed: bool = typer.Option(False, "--no-speed", help="Skip the bench and the speed rules."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of windows, bootstrap, probes and bench prompts."),
) -> None:
    """Gate the variants of tokq.toml on quality and speed against the base; exit 1 when a rule fails.

    Exit codes: 0 every rule passed; 1 a rule failed (a regression); 2 bad usage or input (tokq.toml, data,
    checkpoints: the error names the line and the fix); 3 inconclusive (the data could not decide, e.g. a noisy
    runner: rerun or lengthen the run, never read it as a pass); 4 internal error (a bug in tokq: the traceback
    is in the log file named, or printed with `tokq --debug gate`); 130 interrupted.
    """
    from tokq.config import load_project
    from tokq.errors import ConfigError
    from tokq.project import find_config
    from tokq.runtime import setup_runtime

    runtime = setup_runtime(threads, device, seed)
    path = config or find_config()
    if path is None:
        raise ConfigError("no tokq.toml here or above: run `tokq init`, or pass --config PATH")
    project = load_project(Path(path))
    if no_speed and not project.quality:  # the speed rules are skipped: the gate would check nothing
        raise project.error("gate.quality", None, "holds no rule and --no-speed skips [gate.speed]: nothing would "
                                                  "be checked; add a quality rule or drop --no-speed")
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
    from tokq.outputs import REPORT, output_lock, remove_owned

    # From here on the run may take minutes: a CI cancel (SIGTERM) must unwind like Ctrl-C so no half-written
    # folder is left, and no other tokq process may write --out meanwhile.
    held = contextlib.ExitStack()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        held.enter_context(output_lock(out))
        # A stale report must not pass for this run's verdict: removed now, and only if tokq wrote it.
        remove_owned(out, REPORT)
        checkpoints = {name: _checkpoint(project, name, threads) for name in names}
        report = {"tokq_version": __version__, "command": "gate", "config": str(path),
                  "config_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "base": _display_name(project.base),
                  "base_checkpoint": str(base), "data": data.name, "runtime": runtime.to_json(),
                  "versions": _versions(), "context": _context(Path(path), base), "variants": {}}
        for name in names:
            report["variants"][name] = _gate_variant(project, name, checkpoints[name], base, data, runtime, seed,
                                                     no_speed)
        from tokq.evalsuite.gate_rules import overall_result

        report["result"] = overall_result([v["result"] for v in report["variants"].values()])
        report["passed"] = report["result"] == "pass"
        _print_verdict(report)
        from tokq.reports.gate_report import write_gate_report

        console.print(f"report: {write_gate_report(out, report)}", highlight=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
        held.close()
    if report["result"] == "fail":
        raise typer.Exit(EXIT_CHECK_FAILED)
    if report["result"] == "inconclusive":
        raise typer.Exit(EXIT_INCONCLUSIVE)


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("tokq", "torch", "triton", "transformers", "safetensors", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _display_name(model: str) -> str:
    """A zoo name as it is; a checkpoint path by its folder's name (reports name models, never absolute paths)."""
    return Path(model).name if ("/" in model or model.startswith(".")) else model


def _context(config: Path, base: Path) -> dict:
    """What a reviewer needs beside the numbers: the commit gated and the base model's true source."""
    import json
    import os
    import subprocess

    commit = os.environ.get("GITHUB_SHA") or os.environ.get("CI_COMMIT_SHA")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=config.parent, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    provenance = base / "provenance.json"
    source = None
    if provenance.is_file():
        try:
            source = json.loads(provenance.read_text()).get("source")
        except (OSError, ValueError):
            source = None
    return {"commit": commit, "base_source": source}


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _base_checkpoint(project) -> Path:
    """[base] model resolved up front: a missing base is a config error naming its line, before any work.
    load_project made a path absolute against tokq.toml's folder; a zoo name stays one (never a variant)."""
    from tokq.errors import ModelError
    from tokq.zoo import resolve_model

    try:
        return resolve_model(project.base, variants=False)
    except ModelError as exc:
        raise project.error("base", "model", f"= {project.base!r}: {exc}") from None


def _variant_target(project, name: str) -> Path:
    v = project.variants[name]
    return v.path or project.path.parent / "tokq_out" / name


def _check_variant(project, name: str) -> None:
    """Before any work: the checkpoint exists or can be built, and a recipe's checkpoint was built from a recipe."""
    from tokq.quantize.pipeline import recorded_recipe_sha256

    target = _variant_target(project, name)
    recipe = project.variants[name].recipe
    if not target.is_dir() and recipe is None:
        raise project.error("variants", name, f"points at {target}, which does not exist, and has no recipe to "
                                              "build it: quantize it first or add recipe = { method = ... }")
    if target.is_dir() and recipe is not None and recorded_recipe_sha256(target) is None:
        raise _foreign_checkpoint(project, name, target)


def _foreign_checkpoint(project, name: str, target: Path):
    return project.error("variants", name, f"has a recipe, but its checkpoint {target} was not built from a recipe "
                                           "by tokq gate (its tokq_quantization.json records no recipe hash), so "
                                           "nothing says it follows this one: delete the checkpoint so the gate "
                                           "rebuilds it from the recipe, or drop the recipe to gate it as it is")


def _checkpoint(project, name: str, threads: int | None) -> Path:
    """The variant's checkpoint; one with a recipe is built with `tokq quantize` when missing, reused when it
    records this recipe's hash (recipe table + base model content), rebuilt when it records another."""
    from tokq.outputs import output_lock

    target = _variant_target(project, name)
    recipe = project.variants[name].recipe
    if recipe is None:
        return target
    # Held from reading the recorded hash to the end of the build (the `tokq quantize` run in this process
    # takes it again): another gate building the same variant is refused, not raced.
    with output_lock(target, f"path for variant {name} in {project.path.name}"):
        return _from_recipe(project, name, recipe, target, threads)


def _from_recipe(project, name: str, recipe: dict, target: Path, threads: int | None) -> Path:
    from tokq.cli import main
    from tokq.commands.quantize import recipe_options
    from tokq.errors import EXIT_INTERNAL, EXIT_INTERRUPTED
    from tokq.evalsuite.baseline_cache import model_hash
    from tokq.quantize.pipeline import recipe_sha256, recorded_recipe_sha256

    base = _base_checkpoint(project)
    wanted = recipe_sha256(recipe, model_hash(base))
    recorded = recorded_recipe_sha256(target) if target.is_dir() else None
    if target.is_dir() and recorded is None:
        raise _foreign_checkpoint(project, name, target)
    if recorded == wanted:
        console.print(escape(f"variant {name}: {target} follows its recipe (sha256 {wanted[:12]}); reusing it"),
                      highlight=False, soft_wrap=True)
        return target
    args = ["quantize", "--model", str(base), "--out", str(target), "--recipe-sha256", wanted]
    options = recipe_options()
    for key, value in recipe.items():
        if key == "calib":  # a folder, relative to tokq.toml like every path in it
            value = Path(value).expanduser()
            value = value if value.is_absolute() else project.path.parent / value
        args += options[key].args(value)
    if threads:
        args += ["--threads", str(threads)]
    if recorded is not None:
        args.append("--force")  # save_quantized replaces the old checkpoint only once the new one is complete
        console.print(escape(f"variant {name}: the recipe or the base changed since {target} was built (recipe "
                             f"sha256 {recorded[:12]} -> {wanted[:12]}); rebuilding it (the old checkpoint stays "
                             "until the new one is complete)"), highlight=False, soft_wrap=True)
    console.print(escape(f"building variant {name}: tokq {' '.join(args)}"), highlight=False)
    code = main(args)
    if code in (EXIT_INTERNAL, EXIT_INTERRUPTED):  # a bug or a cancel, already reported: not the recipe's fault
        raise typer.Exit(code)
    if code != 0:
        raise project.error("variants", name, "has a recipe that failed (see above): fix the recipe")
    return target


def _gate_variant(project, name: str, checkpoint: Path, base: Path, data, runtime, seed: int,
                  no_speed: bool) -> dict:
    from tokq.commands.compare import compare_pair
    from tokq.evalsuite.gate_rules import overall_result, quality_thresholds, speed_verdicts
    from tokq.longctx.documents import read_limits

    console.print(f"[bold]gate {escape(name)}[/]: quality on {escape(f'[data.{data.name}]')}", highlight=False)
    quality = compare_pair(str(base), str(checkpoint), runtime, data=data.path, window=data.window,
                           stride=data.stride, max_tokens=data.max_tokens, sample_windows=data.sample_windows,
                           probe_max_context=data.probe_max_context, probe_depths=data.probe_depths,
                           probe_repeats=data.probe_repeats,
                           thresholds=quality_thresholds(project.quality), threshold_on=project.quality_on,
                           dtype=project.dtype, seed=seed,
                           limits=read_limits(data.max_doc_mb, data.max_file_mb))  # [data.NAME] read caps
    quality["a"]["name"], quality["b"]["name"] = _display_name(project.base), name  # names, never absolute paths
    rules = [{"kind": "quality", **t, "result": t.get("result") or (
        "pass" if t["passed"] else "inconclusive" if t.get("inconclusive") else "fail")} for t in quality["thresholds"]]
    bench = None
    if project.speed and not no_speed:
        console.print(f"[bold]gate {escape(name)}[/]: speed on the {escape('[bench]')} workload, paired and "
                      f"interleaved, {project.bench.max_seconds:g} s", highlight=False)
        bench = _bench(project, checkpoint, base, runtime, seed)
        from tokq.evalsuite.speed_stats import SpeedAnalysis

        analysis = bench.pop("_analysis")
        assert isinstance(analysis, SpeedAnalysis)
        rules += speed_verdicts(project.speed, analysis, bench["memory"])
    result = overall_result([r["result"] for r in rules])
    return {"checkpoint": str(checkpoint), "compare": quality, "bench": bench, "rules": rules, "result": result,
            "passed": result == "pass"}


def _bench(project, checkpoint: Path, base: Path, runtime, seed: int) -> dict:
    """The paired speed experiment (engine.paired_bench) on the [bench] workload and its analysis."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from tokq.engine.checkpoint import load_model
    from tokq.engine.paired_bench import SIDES, paired_engines, run_paired
    from tokq.engine.roofline import copy_bandwidth, decode_roofline
    from tokq.engine.workload import Workload
    from tokq.evalsuite.speed_stats import analyze
    from tokq.machine_load import LoadMonitor

    w = project.bench
    workload = Workload(w.prompt_len, w.gen_len, w.num_prompts or w.concurrency, w.gen_len_range,
                        w.arrival_rate or float("inf"), seed)
    compute = project.dtype if project.dtype != "auto" else ("fp16" if runtime.device.startswith("cuda") else "bf16")
    bandwidth = copy_bandwidth(runtime.device)["gbps_median"]
    models = {"base": load_model(base, dtype=compute, device=runtime.device),
              "variant": load_model(checkpoint, dtype=compute, device=runtime.device)}
    engines = paired_engines(models, workload, w.concurrency)
    monitor = LoadMonitor()
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("paired bench: pass 0", total=None)
        trace = run_paired(engines, workload, models["base"].config.vocab_size, budget_s=w.max_seconds,
                           block_steps=w.block_steps,
                           on_pass=lambda n, s: progress.update(task, description=f"paired bench: pass {n}, "
                                                                                  f"{s:.0f} s"))
    load = monitor.stop()
    analysis = analyze(trace, seed=seed)
    batch = min(workload.num_requests, w.concurrency)
    sides = {}
    for s in SIDES:
        engine = engines[s]
        roof = decode_roofline(models[s], engine.kv_spec.bytes_per_token, batch,
                               workload.prompt_len + workload.gen_len / 2, bandwidth)
        tpot = analysis.metrics[s]["mean_tpot_ms"] / 1e3
        weights = sum(t.numel() * t.element_size() for t in [*models[s].parameters(), *models[s].buffers()])
        sides[s] = {"metrics": analysis.metrics[s], "kernels": engine.kernel_names, "roofline": roof,
                    "roofline_fraction": roof["roofline_step_s"] / tpot if tpot > 0 else None,
                    "stalls": len(analysis.stalls[s])}
        sides[s]["memory"] = {"weights_bytes": weights, "kv_cache_bytes": engine.kv_cache_bytes}
    return {"workload": workload.to_json(), "max_seconds": w.max_seconds, "block_steps": w.block_steps,
            "copy_bandwidth_gbps": bandwidth, "seconds": trace.seconds, "passes": len(trace.passes),
            "stopped_by": trace.stopped_by, "machine_load": load, "analysis": analysis.to_json(),
            "base": sides["base"], "variant": sides["variant"],
            "memory": {s: sides[s]["memory"] for s in SIDES}, "_analysis": analysis}


RESULT_ORDER = {"fail": 0, "inconclusive": 1, "pass": 2}


def ordered_rules(report: dict) -> list[tuple[str, dict]]:
    """(variant, rule) pairs, failing first, then inconclusive, then passing: what a reviewer reads first."""
    rows = [(name, r) for name, v in report["variants"].items() for r in v["rules"]]
    return sorted(rows, key=lambda row: RESULT_ORDER[row[1]["result"]])


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _print_verdict(report: dict) -> None:
    table = Table(title=f"tokq gate: {report['result'].upper()}")
    for col in ("variant", "rule", "bucket", "measured [95% CI]", "threshold", "result"):
        table.add_column(col)
    for name, r in ordered_rules(report):
        value = _fmt(r.get("value"))
        if r.get("low") is not None or r.get("high") is not None:
            value += f" [{_fmt(r.get('low'))}, {_fmt(r.get('high'))}]"
        table.add_row(name, r["name"], r.get("bucket") or "overall", value, str(r["threshold"]),
                      RESULT_STYLE[r["result"]])
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    out.print(table)
    for name, r in ordered_rules(report):
        if r["result"] != "pass":
            out.print(f"{name}: {r['result'].upper()} {r['rule']}", highlight=False, markup=False)
