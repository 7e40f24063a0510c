"""The gate's report folder: report.json (source of truth), report.md (PR comment), report.html (plots), junit.xml.

Written by reports.folder: file by file into a temporary sibling renamed into place only when all four are
written, so an interrupted gate leaves no report that looks complete. `tokq report DIR` re-renders from
report.json.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from tokq.reports import plots
from tokq.reports.folder import write_report_folder
from tokq.reports.html import STYLE
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown


def _value(r: dict) -> str:
    if r.get("value") is None:
        return "-"
    text = f"{r['value']:.4g}"
    return text + (f" [{r['low']:.4g}, {r['high']:.4g}]" if r.get("low") is not None else "")


def _result(r: dict) -> str:
    return r.get("result") or ("pass" if r["passed"] else "fail")


def _median_round(rows: list[dict]) -> dict:
    """The round with the median TPOT: the speed table's representative row (every round is in report.json)."""
    ordered = sorted(rows, key=lambda row: row["metrics"]["tpot_mean_s"])
    return ordered[(len(ordered) - 1) // 2]


def gate_markdown(report: dict) -> str:
    verdict = "PASS" if report["passed"] else "FAIL"
    lines = [f"# tokq gate: **{verdict}**", "", f"Base `{report['base']}`, data set `{report['data']}`.", "",
             "| variant | rule | bucket | measured [95% CI; speed: range over rounds] | threshold | result |", "|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        for r in v["rules"]:
            shown = {"pass": "pass", "warn": "warn", "fail": "**FAIL**"}[_result(r)]
            lines.append(f"| {name} | {r['name']} | {r.get('bucket') or 'overall'} | {_value(r)} | {r['threshold']} | "
                         f"{shown} |")
    notes = [f"- {name}: {_result(r)} — {r['rule']}" for name, v in report["variants"].items() for r in v["rules"]
             if _result(r) != "pass"]
    if notes:
        lines += ["", *notes]
    for name, v in report["variants"].items():
        lines += ["", "<details><summary>" + html.escape(name) + ": quality details</summary>", "",
                  compare_markdown(v["compare"]), "</details>"]
    return "\n".join(lines) + "\n"


def gate_html(report: dict) -> str:
    variants = report["variants"]
    results = {name: v["compare"] for name, v in variants.items()}
    verdict = '<span class="pass">PASS</span>' if report["passed"] else '<span class="fail">FAIL</span>'
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>tokq gate</title><style>{STYLE}</style>"
             f"</head><body><h1>tokq gate: {verdict}</h1>",
             f"<p>Base <code>{html.escape(report['base'])}</code>, data set <code>{html.escape(report['data'])}</code>; "
             "quality rules fail when the 95% CI's unfavourable bound crosses the threshold.</p>",
             "<table><tr><th>variant</th><th>rule</th><th>bucket</th><th>measured [95% CI; speed: range over rounds]</th><th>threshold</th>"
             "<th>result</th></tr>"]
    for name, v in variants.items():
        for r in v["rules"]:
            result = _result(r)
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{r['name']}</td><td>{r.get('bucket') or 'overall'}</td>"
                         f"<td>{_value(r)}</td><td>{r['threshold']}</td><td class={result}>"
                         f"{result if result != 'fail' else 'FAIL'}</td></tr>")
    parts += ["</table>", "<ul>" + "".join(f"<li>{html.escape(name)}: {html.escape(r['rule'])}</li>"
                                           for name, v in variants.items() for r in v["rules"]) + "</ul>",
              "<h2>Quality by position</h2>",
              f'<img alt="KL by position bucket" src="{plots.metric_by_bucket(results, "kl", "KL(base‖variant)")}">',
              f'<img alt="top-1 by position bucket" src="{plots.metric_by_bucket(results, "top1", "top-1 agreement")}">',
              "<h2>Per document</h2>", f'<img alt="per-document KL" src="{plots.document_distribution(results)}">']
    benches = {name: v["bench"] for name, v in variants.items() if v.get("bench")}
    if benches:
        parts += _speed_section(benches, variants)
    for name, result in results.items():
        probes = result.get("probes")
        if probes:
            parts += [f"<h2>Retrieval probes: {html.escape(name)}</h2>",
                      f'<img alt="probe grid base" src="{plots.probe_grid(probes, "a", "base")}"> '
                      f'<img alt="probe grid {html.escape(name)}" src="{plots.probe_grid(probes, "b", name)}">']
    parts.append(f"<p class=ci>tokq {html.escape(report['tokq_version'])}</p></body></html>")
    return "\n".join(parts) + "\n"


def _speed_section(benches: dict[str, dict], variants: dict[str, dict]) -> list[str]:
    """The speed table (each side's median-TPOT round), the speedups over rounds and the TBT distributions."""
    parts = ["<h2>Speed</h2><p>Base and variant alternate on the same workload; the table shows each side's "
             "median-TPOT round, the plot every round's ratio.</p><table><tr><th>variant</th><th>model</th>"
             "<th>TTFT ms</th><th>TPOT ms</th><th>TBT p95 ms</th><th>out tok/s</th><th>weights+KV MiB</th>"
             "<th>roofline</th><th>kernels</th></tr>"]
    tbts: dict[str, list[float]] = {}
    for name, bench in benches.items():
        for side in ("base", "variant"):
            row = _median_round(bench[side])
            m = row["metrics"]
            label = "base" if side == "base" else name
            tbts.setdefault(label, [t * 1e3 for r in bench[side] for t in r["metrics"].get("tbt_samples_s", [])])
            kernels = ", ".join(row["kernels"]["linear"] + row["kernels"]["attention"])
            roof = row.get("roofline_fraction")
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(label)}</td>"
                         f"<td>{m['ttft_mean_s'] * 1e3:.1f}</td><td>{m['tpot_mean_s'] * 1e3:.2f}</td>"
                         f"<td>{m['tbt_p95_s'] * 1e3:.2f}</td><td>{m['output_tokens_per_s']:.1f}</td>"
                         f"<td>{(row['model_bytes'] + row['kv_cache_bytes']) / 2**20:.0f}</td>"
                         f"<td>{'-' if roof is None else f'{roof:.0%}'}</td><td>{html.escape(kernels)}</td></tr>")
    speed_rules = {name: [r for r in variants[name]["rules"] if r["kind"] == "speed"] for name in benches}
    parts += ["</table>", f'<img alt="speed ratios" src="{plots.speed_ratios(speed_rules)}">',
              f'<img alt="TBT distribution" src="{plots.tbt_distribution(tbts)}">']
    return parts


def write_gate_report(folder: Path, report: dict, step_summary: bool = True) -> Path:
    rules = [{**r, "name": f"{name}: {r['name']}"} for name, v in report["variants"].items() for r in v["rules"]]
    return write_report_folder(folder, {
        "report.json": lambda: json.dumps(report, indent=2, default=str) + "\n",
        "report.md": lambda: gate_markdown(report), "junit.xml": lambda: junit_xml("tokq gate", rules),
        "report.html": lambda: gate_html(report)}, step_summary)
