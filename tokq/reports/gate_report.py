"""The gate's report folder: report.json (source of truth), report.md (PR comment), report.html (plots), junit.xml.

Written through a temporary sibling folder renamed into place: an interrupted gate leaves no report that
looks complete. `render_gate(folder)` re-renders from report.json (`tokq report DIR`).
"""

from __future__ import annotations

import html
import json
import os
from pathlib import Path

from tokq.paths import atomic_directory
from tokq.reports import plots
from tokq.reports.html import STYLE
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown


def _value(r: dict) -> str:
    if r.get("value") is None:
        return "-"
    text = f"{r['value']:.4g}"
    return text + (f" [{r['low']:.4g}, {r['high']:.4g}]" if r.get("low") is not None else "")


def gate_markdown(report: dict) -> str:
    verdict = "PASS" if report["passed"] else "FAIL"
    lines = [f"# tokq gate: **{verdict}**", "", f"Base `{report['base']}`, data set `{report['data']}`.", "",
             "| variant | rule | bucket | measured [95% CI] | threshold | result |", "|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        for r in v["rules"]:
            lines.append(f"| {name} | {r['name']} | {r.get('bucket') or 'overall'} | {_value(r)} | {r['threshold']} | "
                         f"{'pass' if r['passed'] else '**FAIL**'} |")
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
             "<table><tr><th>variant</th><th>rule</th><th>bucket</th><th>measured [95% CI]</th><th>threshold</th>"
             "<th>result</th></tr>"]
    for name, v in variants.items():
        for r in v["rules"]:
            cls = "pass" if r["passed"] else "fail"
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{r['name']}</td><td>{r.get('bucket') or 'overall'}</td>"
                         f"<td>{_value(r)}</td><td>{r['threshold']}</td><td class={cls}>"
                         f"{'pass' if r['passed'] else 'FAIL'}</td></tr>")
    parts += ["</table><h2>Quality by position</h2>",
              f'<img alt="KL by position bucket" src="{plots.metric_by_bucket(results, "kl", "KL(base‖variant)")}">',
              f'<img alt="top-1 by position bucket" src="{plots.metric_by_bucket(results, "top1", "top-1 agreement")}">',
              "<h2>Per document</h2>", f'<img alt="per-document KL" src="{plots.document_distribution(results)}">']
    benches = {name: v["bench"] for name, v in variants.items() if v.get("bench")}
    if benches:
        parts.append("<h2>Speed</h2><table><tr><th>variant</th><th>model</th><th>TTFT ms</th><th>TPOT ms</th>"
                     "<th>TBT p95 ms</th><th>out tok/s</th><th>weights+KV MiB</th><th>kernels</th></tr>")
        tbts = {}
        for name, rows in benches.items():
            for row in rows:
                m = row["metrics"]
                label = "base" if row["variant"] == "base" else name
                tbts[label] = [t * 1e3 for t in m.get("tbt_samples_s", [])]
                kernels = ", ".join(row["kernels"]["linear"] + row["kernels"]["attention"])
                parts.append(f"<tr><td>{html.escape(name)}</td><td>{html.escape(label)}</td>"
                             f"<td>{m['ttft_mean_s'] * 1e3:.1f}</td><td>{m['tpot_mean_s'] * 1e3:.2f}</td>"
                             f"<td>{m['tbt_p95_s'] * 1e3:.2f}</td><td>{m['output_tokens_per_s']:.1f}</td>"
                             f"<td>{(row['model_bytes'] + row['kv_cache_bytes']) / 2**20:.0f}</td>"
                             f"<td>{html.escape(kernels)}</td></tr>")
        parts += ["</table>", f'<img alt="TBT distribution" src="{plots.tbt_distribution(tbts)}">']
    for name, result in results.items():
        probes = result.get("probes")
        if probes:
            parts += [f"<h2>Retrieval probes: {html.escape(name)}</h2>",
                      f'<img alt="probe grid base" src="{plots.probe_grid(probes, "a")}"> '
                      f'<img alt="probe grid {html.escape(name)}" src="{plots.probe_grid(probes, "b")}">']
    parts.append(f"<p class=ci>tokq {html.escape(report['tokq_version'])}</p></body></html>")
    return "\n".join(parts) + "\n"


def write_gate_report(folder: Path, report: dict) -> Path:
    rules = [{**r, "name": f"{name}: {r['name']}"} for name, v in report["variants"].items() for r in v["rules"]]
    files = {"report.json": json.dumps(report, indent=2, default=str) + "\n", "report.md": gate_markdown(report),
             "report.html": gate_html(report), "junit.xml": junit_xml("tokq gate", rules)}
    with atomic_directory(Path(folder)) as tmp:
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(files["report.md"])
    return Path(folder) / "report.html"
