"""`tokq gate`: compare and bench each variant against the base as tokq.toml says; one verdict; exit 0/1/2/3/4.

The work is `tokq.api.gate` (also `tokq.gate(...)` from Python); this module parses the options and prints the
verdict table: failing rules first, then inconclusive ones, each with its measured value, 95% interval and
threshold.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)
RESULT_STYLE = {"pass": "[green]pass[/]", "inconclusive": "[yellow]inconclusive[/]", "fail": "[bold red]FAIL[/]"}


def gate_cmd(
    config: Path = typer.Option(None, "--config", help="tokq.toml (default: $TOKQ_CONFIG or the nearest tokq.toml)."),
    variant: list[str] = typer.Option(None, "--variant", help="Gate only these variants (default: all in tokq.toml)."),
    data: str = typer.Option(None, "--data", help="A \\[data.NAME] set name, or a folder of documents (default: the "
                                                  "first set)."),
    report_dir: Path = typer.Option(Path("tokq_gate"), "--report-dir", "--out",
                                    help="Report folder (a report tokq wrote there is removed when the gate starts; "
                                         "--out is the same option)."),
    no_speed: bool = typer.Option(False, "--no-speed", help="Skip the bench and the speed rules."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of windows, bootstrap, probes and bench prompts."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request to a url variant may take in all, "
                                  "retries and a slowly sending server included."),
) -> None:
    """Gate the variants of tokq.toml on quality and speed against the base; exit 1 when a rule fails.

    Exit codes: 0 every rule passed; 1 a rule failed (a regression); 2 bad usage or input (tokq.toml, data,
    checkpoints: the error names the line and the fix); 3 inconclusive (the data could not decide, e.g. a noisy
    runner: rerun or lengthen the run, never read it as a pass); 4 internal error (a bug in tokq: the traceback
    is in the log file named, or printed with `tokq --debug gate`); 130 interrupted.
    """
    from tokq.api.gate import gate

    result = gate(config, variants=variant or None, data=data, report_dir=report_dir, no_speed=no_speed,
                  threads=threads, device=device, seed=seed, timeout=timeout)
    _print_verdict(result.report)
    console.print(f"report: {result.report_dir}", highlight=False)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def _print_verdict(report: dict) -> None:
    from tokq.reports.gate_report import ordered_rules

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
