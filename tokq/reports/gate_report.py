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
from tokq.reports.html import quality_details, render_page
from tokq.reports.junit import junit_xml
from tokq.reports.markdown import compare_markdown, probes_line


def _value(r: dict) -> str:
    if r.get("value") is None:
        return "-"
    text = f"{r['value']:.4g}"
    if r.get("low") is None and r.get("high") is None:
        return text
    return text + f" [{_num(r.get('low'))}, {_num(r.get('high'))}]"


def _result(r: dict) -> str:
    return r.get("result") or ("pass" if r["passed"] else "fail")


RESULT_ORDER = {"fail": 0, "inconclusive": 1, "pass": 2}
SHOWN = {"pass": "pass", "inconclusive": "**INCONCLUSIVE**", "fail": "**FAIL**"}
# the speed table: (label, metric in speed_stats, format)
SPEED_COLUMNS = [("mean TTFT ms", "mean_ttft_ms", "{:.1f}"), ("median TTFT ms", "median_ttft_ms", "{:.1f}"),
                 ("mean TPOT ms", "mean_tpot_ms", "{:.2f}"), ("p99 ITL ms", "p99_itl_ms", "{:.2f}"),
                 ("mean E2EL ms", "mean_e2el_ms", "{:.0f}"), ("output tok/s", "output_throughput", "{:.1f}")]


def ordered_rules(report: dict) -> list[tuple[str, dict]]:
    """(variant, rule) pairs: failing first, then inconclusive, then passing (what a reviewer reads first)."""
    rows = [(name, r) for name, v in report["variants"].items() for r in v["rules"]]
    return sorted(rows, key=lambda row: RESULT_ORDER[_result(row[1])])


def _verdict(report: dict) -> str:
    return (report.get("result") or ("pass" if report["passed"] else "fail")).upper()


def _context_lines(report: dict) -> list[str]:
    """Commit, hardware, threads, and the base's true source (zoo bases are dequantized GGUF files)."""
    ctx = report.get("context", {})
    runtime = report.get("runtime", {})
    lines = [f"Base `{report['base']}`, data set `{report['data']}`; commit `{ctx.get('commit') or 'unknown'}`; "
             f"{runtime.get('hardware') or runtime.get('machine', '?')}, {runtime.get('device', '?')}, "
             f"{runtime.get('threads', '?')} threads; tokq {report.get('tokq_version', '?')}."]
    if ctx.get("base_source"):
        lines.append(f"The base is not a true 16-bit model: {ctx['base_source']}. Its numbers are a baseline for "
                     "this comparison, not a 16-bit reference.")
    return lines


def _speed_markdown(report: dict) -> list[str]:
    benches = {name: v["bench"] for name, v in report["variants"].items() if v.get("bench")}
    if not benches:
        return []
    lines = ["", "### Speed", "", "| variant | side | " + " | ".join(c[0] for c in SPEED_COLUMNS)
             + " | weights MiB | stalls |", "|---" * (len(SPEED_COLUMNS) + 4) + "|"]
    for name, bench in benches.items():
        for side in ("base", "variant"):
            m = bench[side]["metrics"]
            cells = [fmt.format(m[key]) if m.get(key) is not None else "-" for _, key, fmt in SPEED_COLUMNS]
            lines.append(f"| {name} | {'base' if side == 'base' else name} | " + " | ".join(cells)
                         + f" | {_weights_mib(bench[side])} | {bench[side]['stalls']} |")
    for name, bench in benches.items():
        load = bench.get("machine_load") or {}
        http = bench.get("over") == "http"
        how = (f"{bench['passes']} paired blocks of requests over HTTP ({bench['urls']['variant']})" if http
               else f"{bench['passes']} paired passes")
        blocks = f", blocks of {bench['block_steps']} steps" if bench.get("block_steps") else ""
        lines.append(f"\n{name}: {how} in {bench['seconds']:.0f} s (budget {bench['max_seconds']:g} s{blocks}); "
                     f"{'client ' if http else ''}load average {load.get('load_average_start')} → "
                     f"{load.get('load_average_end')}, steal {load.get('steal_fraction')}.")
        for warning in bench["analysis"].get("warnings", []):
            lines.append(f"\n{name}: warning: {warning}")
    return lines


def _weights_mib(side: dict) -> str:
    """A side's weight bytes in MiB; "-" for a side measured over HTTP (an endpoint reports no byte counts)."""
    memory = side.get("memory")
    return f"{memory['weights_bytes'] / 2**20:.0f}" if memory else "-"


def _documents_markdown(report: dict) -> list[str]:
    lines = ["", "### Per document (prefill path)", "", "| variant | document | tokens | KL | top-1 | ΔNLL |",
             "|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        for d in v["compare"]["prefill"]["documents"]:
            if not d.get("tokens"):
                continue
            lines.append(f"| {name} | {d['doc_id']} | {d['tokens']} | {_num(d.get('kl'))} | {_num(d.get('top1'))} | "
                         f"{_num(d.get('delta_nll'))} |")
    return lines


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def gate_markdown(report: dict) -> str:
    lines = [f"# tokq gate: **{_verdict(report)}**", "", *_context_lines(report), ""]
    lines += ["| variant | rule | bucket | measured [95% CI] | threshold | result |", "|---|---|---|---|---|---|"]
    for name, r in ordered_rules(report):
        lines.append(f"| {name} | {r['name']} | {r.get('bucket') or 'overall'} | {_value(r)} | {r['threshold']} | "
                     f"{SHOWN[_result(r)]} |")
    notes = [f"- {name}: {_result(r)} — {r['rule']}" for name, r in ordered_rules(report) if _result(r) != "pass"]
    if notes:
        lines += ["", *notes]
    for name, v in report["variants"].items():  # judged far from its calibration documents: say so beside the verdict
        for d in (v["compare"].get("calibration_distance") or {}).values():
            if d.get("warning"):
                lines.append(f"\n{name}: warning: {d['warning']}")
    lines += _speed_markdown(report)
    lines += _documents_markdown(report)
    for name, v in report["variants"].items():
        if v.get("search"):
            section = _search_section(name, v["search"], plot=False)
            lines += ["", f"## Mixed-precision search: {name}", "", section["line"], "",
                      "| frontier point | MiB | predicted KL | held-out KL [95% CI] | verdict |", "|---|---|---|---|---|",
                      *("| " + " | ".join(row) + " |" for row in section["rows"])]
    for name, v in report["variants"].items():
        lines += ["", "<details><summary>" + html.escape(name) + ": quality details</summary>", "",
                  compare_markdown(v["compare"]), "</details>"]
    return "\n".join(lines) + "\n"


GATE_PAGE = """\
<!doctype html><html><head>{{ head }}<title>tokq gate</title><style>{{ style }}</style></head><body>\
<h1>tokq gate: <span class={{ css }}>{{ verdict }}</span></h1>
{% for line in context %}
<p>{{ line }}</p>
{% endfor %}
<p>Quality and speed rules alike pass when their whole 95% interval meets the threshold, fail when the whole \
interval misses it, and are inconclusive when it holds the threshold.</p>
<table><tr><th>variant</th><th>rule</th><th>bucket</th><th>measured [95% CI]</th><th>threshold</th><th>result</th></tr>
{% for r in rules %}
<tr><td>{{ r.variant }}</td><td>{{ r.name }}</td><td>{{ r.bucket }}</td><td>{{ r.value }}</td><td>{{ r.threshold }}\
</td><td class={{ r.result }}>{{ r.shown }}</td></tr>
{% endfor %}
</table>
<ul>{% for r in rules %}<li>{{ r.variant }}: {{ r.rule }}</li>{% endfor %}</ul>
<h2>Quality by position</h2>
<img alt="KL by position bucket" src="{{ kl_plot }}">
<img alt="top-1 by position bucket" src="{{ top1_plot }}">
<h2>Per document</h2>
<img alt="per-document KL" src="{{ documents_plot }}">
{% if speed %}
<h2>Speed</h2><p>Base and variant play the same workload in one process, interleaved by blocks of steps; each side's \
metrics come from its own clock, stalls excluded (counted below).</p><table><tr><th>variant</th><th>side</th>\
{% for column in speed_columns %}<th>{{ column }}</th>{% endfor %}\
<th>weights MiB</th><th>stalls</th><th>roofline</th><th>kernels</th></tr>
{% for row in speed.rows %}
<tr>{% for cell in row %}<td>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}
</table>
<img alt="speed ratios" src="{{ speed.ratios_plot }}">
<img alt="decode step times" src="{{ speed.steps_plot }}">
{% endif %}
{% for s in searches %}
<h2>Mixed-precision search: {{ s.name }}</h2>
<p>{{ s.line }}</p>
<img alt="size/quality frontier {{ s.name }}" src="{{ s.plot }}">
<table><tr><th>frontier point</th><th>MiB</th><th>predicted KL</th><th>held-out KL [95% CI]</th><th>verdict</th></tr>
{% for e in s.rows %}<tr>{% for cell in e %}<td>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}</table>
{% endfor %}
{% for d in details %}
<h2>Quality details: {{ d.name }}</h2>
{{ d.html }}
{% endfor %}
{% for p in probes %}
<h2>Retrieval probes: {{ p.name }}</h2>
<p>{{ p.line }}</p>
<img alt="probe grid base" src="{{ p.grid_base }}"> <img alt="probe grid {{ p.name }}" src="{{ p.grid_variant }}">
{% endfor %}
<p class=ci>tokq {{ version }}</p></body></html>
"""


def _rule_row(name: str, r: dict) -> dict:
    result = _result(r)
    return {"variant": name, "name": r["name"], "bucket": r.get("bucket") or "overall", "value": _value(r),
            "threshold": r["threshold"], "result": result, "shown": result if result == "pass" else result.upper(),
            "rule": r["rule"]}


def gate_html(report: dict) -> str:
    """The gate's page, rendered with autoescaping (reports.html): every name and text in it is the user's."""
    variants = report["variants"]
    results = {name: v["compare"] for name, v in variants.items()}
    verdict = _verdict(report)
    css = {"PASS": "pass", "FAIL": "fail", "INCONCLUSIVE": "inconclusive"}[verdict]
    rules = [_rule_row(name, r) for name, r in ordered_rules(report)]
    kl_plot = _bucket_plot(report, results, "kl", "KL(base‖variant)")
    top1_plot = _bucket_plot(report, results, "top1", "top-1 agreement")
    documents_plot = plots.document_distribution(results)
    benches = {name: v["bench"] for name, v in variants.items() if v.get("bench")}
    speed = _speed_section(benches, variants) if benches else None
    probes = [{"name": name, "line": probes_line(result["probes"]),
               "grid_base": plots.probe_grid(result["probes"], "a", "base"),
               "grid_variant": plots.probe_grid(result["probes"], "b", name)}
              for name, result in results.items() if result.get("probes")]
    searches = [_search_section(name, v["search"]) for name, v in variants.items() if v.get("search")]
    # the context lines are Markdown: their code spans' backticks are dropped, their text escaped by the template
    return render_page(GATE_PAGE, css=css, verdict=verdict,
                       context=[line.replace("`", "") for line in _context_lines(report)], rules=rules,
                       kl_plot=kl_plot, top1_plot=top1_plot, documents_plot=documents_plot, speed=speed,
                       speed_columns=[c[0] for c in SPEED_COLUMNS], probes=probes, searches=searches,
                       details=[{"name": name, "html": quality_details(result)} for name, result in results.items()],
                       version=report["tokq_version"])


def _search_section(name: str, search: dict, plot: bool = True) -> dict:
    """A `target = "gate"` variant's search: the frontier plot and one row per build judged on held-out documents."""
    frontier = search["frontier"]
    rows = []
    for e in search.get("evaluations", []):
        point, kl = frontier[e["index"]], e.get("kl") or {}
        shown = "n/a" if kl.get("value") is None else (
            f"{kl['value']:.4f} [{_num(kl.get('low'))}, {_num(kl.get('high'))}]")
        rows.append([point["label"], f"{point['bytes'] / 2**20:.2f}", f"{point['predicted_kl']:.4f}", shown,
                     e["result"]])
    docs = search.get("documents", {})
    chosen = search.get("chosen")
    line = (f"searched on {docs.get('choice', '?')} choice + {docs.get('held_out', '?')} held-out documents that the "
            f"gate's windows ({docs.get('gate_windows', '?')} documents) do not use, each rule judged at "
            f"{search.get('margin', 1):.0%} of its distance from no loss; chosen: "
            + ("none passed" if chosen is None else frontier[chosen]["label"]) + (f". {search['note']}"
                                                                                  if search.get("note") else ""))
    return {"name": name, "line": line, "plot": plots.mix_frontier(search) if plot else None, "rows": rows}


def _bucket_plot(report: dict, results: dict, metric: str, label: str) -> str:
    """The metric by position bucket with the thresholds of the rules on it (the first variant's, shared by all)."""
    thresholds = {r.get("bucket"): r["threshold"] for _, r in ordered_rules(report)
                  if r["kind"] == "quality" and r.get("metric") == metric}
    return plots.metric_by_bucket(results, metric, label, thresholds=thresholds)


def _speed_section(benches: dict[str, dict], variants: dict[str, dict]) -> dict:
    """The speed table's rows (each side's metrics over the paired experiment), the ratios with their intervals
    against the thresholds, and the decode step-time distributions."""
    rows: list[list] = []
    steps: dict[str, list[float]] = {}
    for name, bench in benches.items():
        for side in ("base", "variant"):
            row = bench[side]
            m = row["metrics"]
            label = "base" if side == "base" else name
            steps.setdefault(label, bench["analysis"].get("decode_step_ms", {}).get(side, []))
            roof = row.get("roofline_fraction")
            rows.append([name, label, *(fmt.format(m[key]) if m.get(key) is not None else "-"
                                        for _, key, fmt in SPEED_COLUMNS),
                         _weights_mib(row), row["stalls"],
                         "-" if roof is None else f"{roof:.0%}",
                         ", ".join(row["kernels"]["linear"] + row["kernels"]["attention"] + row["kernels"].get("decode", []))
                         if row.get("kernels")
                         else f"over HTTP: {row.get('url')}"])
    speed_rules = {name: [r for r in variants[name]["rules"] if r["kind"] == "speed"] for name in benches}
    return {"rows": rows, "ratios_plot": plots.speed_ratios(speed_rules), "steps_plot": plots.tbt_distribution(steps)}


def write_gate_report(folder: Path, report: dict, step_summary: bool = True) -> Path:
    rules = [{**r, "name": f"{name}: {r['name']}"} for name, v in report["variants"].items() for r in v["rules"]]
    return write_report_folder(folder, {
        "report.json": lambda: json.dumps(report, indent=2, default=str) + "\n",
        "report.md": lambda: gate_markdown(report), "junit.xml": lambda: junit_xml("tokq gate", rules),
        "report.html": lambda: gate_html(report)}, step_summary, "tokq gate")
